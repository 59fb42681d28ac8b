"""The commands about a trained model: `generate`, `export` and `tokenizer train`.

`generate` samples from a checkpoint, `export` writes a safetensors file or a Hugging Face
directory, `tokenizer train` learns a BPE for `train --tokenizer`."""

from __future__ import annotations

import argparse
from typing import Any

from fusionnode.cli.args import command, float_at_least, int_at_least


def add_model_commands(sub: Any) -> None:
    """generate, export, tokenizer (in `fusionnode --help`'s order)."""
    p = command(
        sub,
        "generate",
        "sample text from a checkpoint",
        "Sample text from a trained model: a checkpoint (the --save directory or one of its step-* "
        "directories) or a file written by `fusionnode export`.",
    )
    from fusionnode.train.generate import DEFAULT_TEMPERATURE

    p.add_argument(
        "--checkpoint",
        required=True,
        help="the --save directory (its newest checkpoint), one step-* directory in it, or an "
        "exported .safetensors file; the job's tokenizer is used when it had one (required)",
    )
    p.add_argument("--prompt", default="def ", help="text to continue (default %(default)r)")
    p.add_argument(
        "--tokens", type=int_at_least(1), default=200, help="tokens to generate (default %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=float_at_least(0),
        default=DEFAULT_TEMPERATURE,
        help="sampling temperature; 0 = always the likeliest token (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int_at_least(0), default=0, help="seed of the sampling (default %(default)s)"
    )

    p = command(
        sub,
        "export",
        "export a checkpoint's model as one safetensors file or a Hugging Face directory",
        "Write a checkpoint's parameters as one .safetensors file with the job spec in its metadata "
        "(read back by `fusionnode generate --checkpoint`), or with --format hf as a directory that "
        "transformers' AutoModelForCausalLM.from_pretrained loads.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="the --save directory (its newest checkpoint) or one step-* directory in it (required)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="the .safetensors file (or a directory for it) with --format safetensors; the directory "
        "to write with --format hf (required)",
    )
    p.add_argument(
        "--force", action="store_true", help="overwrite an existing file or directory (default: refuse)"
    )
    p.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default="safetensors",
        help="safetensors: one file with the job spec in its metadata (read back by `generate`); hf: "
        "config.json + model.safetensors (+ tokenizer.json) for transformers' "
        "AutoModelForCausalLM.from_pretrained (GPT-2 and Llama-family models; default %(default)s)",
    )
    p.add_argument(
        "--lora",
        choices=["merged", "adapters"],
        default="merged",
        help="for a LoRA job with --format hf: merged writes the base with the adapters folded in; "
        "adapters writes only adapter_model.safetensors + adapter_config.json in PEFT's layout "
        "(default %(default)s)",
    )

    p = command(
        sub,
        "tokenizer",
        "train a byte-level BPE tokenizer on your own corpus",
        "`fusionnode tokenizer train --data ... --vocab-size N --out tokenizer.json` learns a byte-level "
        "BPE for `train --tokenizer`.",
    )
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    tsub.required = True
    t = tsub.add_parser(
        "train",
        help="learn a byte-level BPE from --data and write its tokenizer.json",
        description="Train a byte-level BPE (Hugging Face tokenizers) on the training split of a corpus; "
        "it round-trips any text byte for byte. Use the result with --tokenizer.",
    )
    t.add_argument(
        "--data",
        default=None,
        help="the corpus, as for `train --data` (default: the Python standard library's source)",
    )
    t.add_argument(
        "--text-field",
        default="text",
        help="the field holding the text in .jsonl / .parquet files (default %(default)s)",
    )
    t.add_argument(
        "--vocab-size",
        type=int_at_least(257),
        default=4096,
        help="ids in the vocabulary (default %(default)s)",
    )
    t.add_argument("--out", required=True, help="where to write tokenizer.json")


def cmd_generate(args: argparse.Namespace) -> int:
    from fusionnode.train.export import load_job_from_checkpoint
    from fusionnode.train.generate import generate
    from fusionnode.train.tokenizer import load_tokenizer

    spec, model = load_job_from_checkpoint(args.checkpoint)
    tokenizer = load_tokenizer(spec.tokenizer)
    print(generate(model, args.prompt, args.tokens, args.temperature, seed=args.seed, tokenizer=tokenizer))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from fusionnode.train.export import export_checkpoint, export_hf

    out = (
        export_hf(args.checkpoint, args.out, adapters_only=args.lora == "adapters", overwrite=args.force)
        if args.format == "hf"
        else export_checkpoint(args.checkpoint, args.out, overwrite=args.force)
    )
    print(f"wrote {out}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from fusionnode.train.data import stream_files
    from fusionnode.train.dataset import iter_documents, split_documents
    from fusionnode.train.tokenizer import train_bpe

    files, _source = stream_files(args.data)
    docs = split_documents(iter_documents(files, args.text_field), validation=False)
    out = train_bpe(docs, args.vocab_size, args.out)
    print(f"wrote {out}")
    return 0
