"""`fusionnode` command line: argument parsing only; the work happens in the modules it calls."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from fusionnode import __version__
from fusionnode.availability import parse_percent
from fusionnode.config import (
    DEFAULT_HEARTBEAT,
    DEFAULT_LISTEN,
    DEFAULT_PROBE_INTERVAL,
    DEFAULT_RECORD_TTL,
    DEFAULT_STARTUP_TIMEOUT,
    NodeConfig,
    add_network_arguments,
    default_state_dir,
    network_options,
    parse_rate,
    parse_roles,
    parse_size,
)
from fusionnode.errors import FusionNodeError
from fusionnode.messages import describe_availability, format_event, format_plan, next_steps
from fusionnode.sync import add_sync_args, sync_from_args
from fusionnode.term import Progress, format_peers, print_peers, print_status

__all__ = ["Progress", "build_parser", "format_peers", "main"]

logger = logging.getLogger("fusionnode")

BENCHMARKS = {
    "wire": "fusionnode.bench.wire",
    "codec": "fusionnode.bench.codec",
    "adatopk": "fusionnode.bench.adatopk",
    "plan": "fusionnode.bench.plan",
    "optim": "fusionnode.bench.optim",
    "pipeline": "fusionnode.bench.pipeline",
    "testbed": "fusionnode.bench.testbed",
    "memory": "fusionnode.bench.memory",
    "faults": "fusionnode.bench.faults",
    "sync": "fusionnode.bench.sync",  # issue 19
}


def _state_dir_arg(p: argparse.ArgumentParser) -> None:
    from fusionnode.settings import add_config_argument

    add_config_argument(p)
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"the node's identity, cache and control socket (default: {default_state_dir()}; "
        "env FUSIONNODE_STATE_DIR)",
    )


def _add_train_job_args(p: argparse.ArgumentParser) -> None:
    from fusionnode.train import spec as S

    p.add_argument(
        "--model",
        default=None,
        help="bundled model (gpt2-tiny ... gpt2-xl, llama-tiny, qwen2-tiny, llama-1b, llama-7b, mistral-7b), "
        "a Hugging Face config.json or the directory holding one (llama, qwen2, mistral, gpt2), or "
        f"'package.module:factory' (default: the --init-from directory if given, else {S.DEFAULT_MODEL})",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from the weights of this local Hugging Face checkpoint (config.json + *.safetensors, "
        "sharded or not); nothing is downloaded (default: none, random initialisation from --seed)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="a Hugging Face tokenizer.json (see `fusionnode tokenizer train`); its vocabulary must fit "
        "the model's (default: byte-level tokens, 256 ids)",
    )
    p.add_argument(
        "--text-field",
        default=S.DEFAULT_TEXT_FIELD,
        help="the field holding the text in .jsonl / .parquet --data files (default %(default)s)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="train LoRA adapters of rank R on --lora-targets with every other parameter frozen; only the "
        "adapters' gradients go to the optimizer hosts (default 0: no LoRA, train every parameter)",
    )
    p.add_argument(
        "--lora-alpha",
        type=float,
        default=S.DEFAULT_LORA_ALPHA,
        help="LoRA scale numerator: the update is B @ A * alpha / rank (default %(default)s)",
    )
    p.add_argument(
        "--lora-targets",
        default=S.DEFAULT_LORA_TARGETS,
        help="comma-separated names of the linear layers to adapt, matched as module-name suffixes, e.g. "
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (Llama) or c_attn,c_proj,c_fc (GPT-2) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="a text file or directory of text files (default: the Python "
        "standard library's source, present on every machine)",
    )
    p.add_argument(
        "--steps",
        type=_int_at_least(1),
        default=S.DEFAULT_STEPS,
        help="optimizer steps (default %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=_int_at_least(1),
        default=S.DEFAULT_BATCH_SIZE,
        help="sequences per step (default %(default)s)",
    )
    p.add_argument(
        "--micro-batches",
        type=_int_at_least(1),
        default=4,
        help="micro-batches per step in the pipeline (default %(default)s)",
    )
    p.add_argument(
        "--seq-len",
        type=_int_at_least(1),
        default=None,
        help="tokens per sequence (default: the model's context)",
    )
    p.add_argument(
        "--seed",
        type=_int_at_least(0),
        default=0,
        help="seed of the model's initialisation and the data order (default %(default)s)",
    )
    p.add_argument(
        "--optimizer", choices=S.OPTIMIZERS, default="adamw", help="the optimizer (default %(default)s)"
    )
    p.add_argument(
        "--lr", type=_float_above(0), default=S.DEFAULT_LR, help="peak learning rate (default %(default)s)"
    )
    p.add_argument(
        "--warmup-steps",
        type=_int_at_least(0),
        default=S.DEFAULT_WARMUP_STEPS,
        help="steps of linear learning-rate warm-up before the cosine decay (default %(default)s)",
    )
    p.add_argument(
        "--weight-decay",
        type=_float_at_least(0),
        default=S.DEFAULT_WEIGHT_DECAY,
        help="decoupled weight decay on matrices (default %(default)s)",
    )
    p.add_argument(
        "--grad-clip",
        type=_float_at_least(0),
        default=S.DEFAULT_GRAD_CLIP,
        help="clip the gradients' global norm to this; 0 = off (default %(default)s)",
    )
    p.add_argument(
        "--save",
        dest="save_dir",
        default=None,
        metavar="DIR",
        help="write checkpoints under DIR (default: none are written)",
    )
    p.add_argument(
        "--save-every",
        type=_int_at_least(0),
        default=S.DEFAULT_SAVE_EVERY,
        help="steps between checkpoints; 0 = only at the end (default %(default)s)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last complete checkpoint in --save (default: start afresh)",
    )
    p.add_argument(
        "--metrics-out",
        default=None,
        help="write one JSON record per step (and events) to this file (default: none)",
    )
    p.add_argument(
        "--compress",
        type=_compress_arg,
        default="none",
        help="activations and their gradients between stages: none, fp16, topk:RATIO, or adatopk "
        "(ratio chosen per link from its measured bandwidth; default %(default)s)",
    )


def _int_at_least(lo: int) -> Any:
    """An argparse type: an integer >= lo."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value

    parse.__name__ = f"whole number >= {lo}"  # how config errors name it: "expected a whole number >= 1"
    return parse


def _float_bound(lo: float, strict: bool) -> Any:
    op = ">" if strict else ">="

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            value = float("nan")
        if not (value > lo if strict else value >= lo) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a number {op} {lo:g}, got {text!r}")
        return value

    parse.__name__ = f"number {op} {lo:g}"
    return parse


def _float_above(lo: float) -> Any:
    """An argparse type: a finite number > lo."""
    return _float_bound(lo, strict=True)


def _float_at_least(lo: float) -> Any:
    """An argparse type: a finite number >= lo."""
    return _float_bound(lo, strict=False)


def _compress_arg(text: str) -> str:
    """An argparse type for --compress: checked here, so a bad value never reaches the workers."""
    from fusionnode.compress.policy import parse_compress

    try:
        parse_compress(text)
    except FusionNodeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


_compress_arg.__name__ = "compression setting"  # "expected a compression setting" in config errors


def _spec_from_args(args: argparse.Namespace) -> Any:
    from fusionnode.train.spec import DEFAULT_MODEL, JobSpec

    init_from = os.path.abspath(args.init_from) if args.init_from else None
    model = args.model or init_from or DEFAULT_MODEL
    if os.path.exists(model):  # a Hugging Face config: pin the path so the daemon reads the same file
        model = os.path.abspath(model)
    return JobSpec(
        model=model,
        init_from=init_from,
        tokenizer=os.path.abspath(args.tokenizer) if args.tokenizer else None,
        text_field=args.text_field,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
        data=args.data,
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        seq_len=args.seq_len,
        seed=args.seed,
        optimizer=args.optimizer,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip or None,
        save_dir=os.path.abspath(args.save_dir) if args.save_dir else None,
        save_every=args.save_every,
        compress=args.compress,
        metrics_out=os.path.abspath(args.metrics_out) if args.metrics_out else None,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusionnode",
        description="Contribute a GPU (or CPU) to a decentralized training swarm, and train models on it.",
    )
    parser.add_argument("--version", action="version", version=f"fusionnode {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("FUSIONNODE_LOG_LEVEL", "WARNING"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="how much to log on stderr (default %(default)s; env FUSIONNODE_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "join",
        help="run a daemon that joins (or starts) a swarm",
        description="Run a FusionNode daemon. The first peer starts a swarm and prints the "
        "address others dial; later peers pass it to --initial-peers.",
    )
    _state_dir_arg(p)
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddrs of peers already in the swarm, as their READY line or `fusionnode status` "
        "prints them (/ip4/1.2.3.4/tcp/31337/p2p/Qm...; default: none, this peer starts a swarm)",
    )
    p.add_argument(
        "--listen",
        action="append",
        default=None,
        metavar="MADDR",
        help=f"where to accept peers (default {DEFAULT_LISTEN}; a second daemon on the same host needs "
        "another port: /ip4/0.0.0.0/tcp/0 picks a free one, /ip4/127.0.0.1/tcp/0 a loopback one)",
    )
    p.add_argument(
        "--announce",
        action="append",
        default=[],
        metavar="MADDR",
        help="addresses to advertise instead of the listening ones (default: the listening ones)",
    )
    add_network_arguments(p)
    p.add_argument(
        "--role", default="worker,optimizer", help="roles offered: worker, optimizer (default: both)"
    )
    p.add_argument(
        "--max-memory", default=None, help="memory offered to the swarm, e.g. 12GB (default: what is free)"
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="do not measure links (for metered connections; default: measure them)",
    )
    p.add_argument(
        "--probe-interval",
        type=float,
        default=DEFAULT_PROBE_INTERVAL,
        help="seconds between link probes (default %(default)s)",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=DEFAULT_HEARTBEAT,
        help="seconds between advertisements (default %(default)s)",
    )
    p.add_argument(
        "--record-ttl",
        type=float,
        default=DEFAULT_RECORD_TTL,
        help="seconds an advertisement lives (default %(default)s)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT,
        help="seconds to wait for the libp2p daemon and the DHT (default %(default)s)",
    )
    p.add_argument(
        "--egress-limit",
        default=None,
        metavar="RATE",
        help="cap this peer's outgoing tensor traffic, e.g. 8Mbit, 100Mbit, 1Gbit (user-space token "
        "bucket; for tests and for sharing a metered uplink; default: no cap)",
    )
    p.add_argument(
        "--when",
        choices=["always", "idle"],
        default="always",
        help="idle: contribute only while the machine's owner is not using it (yield within seconds, "
        "come back after --idle-grace); always: whenever the daemon runs (default)",
    )
    p.add_argument(
        "--schedule",
        default=None,
        metavar="HH:MM-HH:MM[,...]",
        help="contribute only inside these local-time windows, e.g. 22:00-07:00 (default: at any time)",
    )
    p.add_argument(
        "--max-util",
        default=None,
        metavar="PERCENT",
        help="cap this peer's compute, e.g. 80%% (default: no cap)",
    )
    p.add_argument(
        "--idle-grace",
        type=float,
        default=60.0,
        help="seconds the owner must stay idle before contributing again (default %(default)s)",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="enable debug hooks (a compute slow-down read from <state-dir>/debug_slow, for tests; "
        "default: off)",
    )
    p.add_argument(
        "--swarm-key",
        default=None,
        metavar="FILE",
        help="join a private swarm: speak only to peers holding this secret (or $FUSIONNODE_SWARM_KEY_FILE; "
        "create one with `fusionnode keygen`; default: none, a public swarm)",
    )
    p.add_argument(
        "--dashboard",
        default=None,
        metavar="HOST:PORT",
        help="serve the read-only dashboard and /metrics here, e.g. 127.0.0.1:8080 (port 0 = random; "
        "default: no dashboard)",
    )
    p.add_argument(
        "--dashboard-actions",
        action="store_true",
        help="let the dashboard pause/resume this node and cancel its jobs, for whoever holds the token "
        "printed at start (default: off, read-only)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads for this peer's compute (default %(default)s)"
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="measure the device again instead of using the cache (default: use the cache)",
    )

    p = _command(
        sub,
        "peers",
        "list the swarm's peers as the local daemon sees them",
        "List the peers the local daemon sees: device, memory, speed, measured links, roles, "
        "availability and how fresh each record is.",
    )
    _state_dir_arg(p)
    _json_arg(p)

    p = _command(
        sub,
        "status",
        "the local daemon, the swarm and running jobs",
        "Show the local daemon (peer id, addresses, device, availability, whether the swarm is "
        "private), the peers it sees, the stages it serves and the jobs it drives.",
    )
    _state_dir_arg(p)
    _json_arg(p)

    for name, text, desc in (
        (
            "pause",
            "stop contributing for now (in-flight work finishes, stages are released)",
            "Stop contributing until `fusionnode resume`: steps in flight finish, this peer's stages "
            "are released (their jobs re-plan without it) and it advertises itself as paused.",
        ),
        (
            "resume",
            "contribute again after a pause",
            "Lift a `fusionnode pause`. If --schedule or --when idle still keep the peer paused, "
            "says so and until when, and exits with status 1.",
        ),
    ):
        p = _command(sub, name, text, desc)
        _state_dir_arg(p)

    p = _command(
        sub,
        "leave",
        "ask the local daemon to leave the swarm gracefully",
        "Ask the local daemon to leave: it finishes steps in flight, withdraws its record from the "
        "DHT and exits.",
    )
    _state_dir_arg(p)

    p = _command(
        sub,
        "cancel",
        "cancel a job the local daemon drives (its stages are released)",
        "Cancel a training job that the local daemon drives: its `train` call ends with the job "
        "cancelled and its workers and optimizer hosts release the job's stages and shards.",
    )
    _state_dir_arg(p)
    p.add_argument("job", help="the job id (as `fusionnode status` shows it)")

    p = sub.add_parser(
        "train",
        help="train a model on the swarm (this peer drives), or --local in this process",
        description="Start a training job. The local daemon becomes the job's driver and uses "
        "the swarm's workers; --local runs the same job in this process, no swarm.",
    )
    _state_dir_arg(p)
    _add_train_job_args(p)
    p.add_argument(
        "--local",
        action="store_true",
        help="single process, no swarm: the reference trajectory (default: train on the swarm)",
    )
    p.add_argument(
        "--stages",
        type=_int_at_least(1),
        default=None,
        help="pipeline stages; refused if the swarm has fewer workers (default: one per available worker)",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        default=None,
        metavar="PEER_ID",
        help="use exactly these worker peer ids, in order (default: any available workers)",
    )
    p.add_argument(
        "--replicas",
        type=_int_at_least(1),
        default=1,
        help="data-parallel pipelines; they synchronise through optimizer hosts (default %(default)s)",
    )
    p.add_argument(
        "--shares",
        default=None,
        help="samples of each step's batch per pipeline, e.g. 4,12 (sets --replicas; default: an even split)",
    )
    p.add_argument(
        "--offload",
        choices=["auto", "on", "off"],
        default="auto",
        help="optimizer state on optimizer hosts (on), on each worker (off), or on whenever a peer offers "
        "the optimizer role (auto, the default); offloaded jobs survive failed workers",
    )
    p.add_argument(
        "--planner",
        choices=["simple", "fusion", "even", "memory"],
        default="simple",
        help="how to lay the job over the swarm: simple (one pipeline, balanced contiguous stages; default), "
        "fusion (OP-Fence + asymmetric DP x PP over measured devices and links), or a baseline "
        "(even layers, memory-proportional)",
    )
    p.add_argument(
        "--rebalance-every",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help="every N steps, re-plan if measured stage times promise a faster layout (needs "
        "--offload on; 0 = never, the default)",
    )
    p.add_argument(
        "--rebalance-gain",
        type=_float_at_least(0),
        default=0.25,
        help="predicted speed-up a re-plan must promise, counting the cost of moving (default %(default)s)",
    )
    p.add_argument(
        "--lease",
        type=_float_above(0),
        default=None,
        metavar="SECONDS",
        help="how long a worker keeps its stage when this driver goes silent (default 60)",
    )
    p.add_argument(
        "--optimizer-hosts",
        type=_int_at_least(1),
        default=1,
        help="optimizer hosts to shard the state over, with --offload (default %(default)s)",
    )
    add_sync_args(p)  # issue 19: --sync, --inner-steps, --outer-lr, ...
    p.add_argument("--dump-grads", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--json",
        action="store_true",
        help="print progress and the result as JSON lines (default: a progress line and a summary)",
    )

    p = _command(
        sub,
        "plan",
        "plan a job over a cluster file (offline) and print it",
        "Plan a job over a cluster file (or the live swarm with --swarm) and print the pipelines, "
        "their stages and the predicted step time; nothing is trained. Its defaults describe "
        "capacity planning (gpt2-xl, batch 512), not `train`'s (gpt2-tiny, batch 16).",
    )
    _add_plan_args(p, "plan")
    p = _command(
        sub,
        "simulate",
        "simulate a plan's throughput against the baselines",
        "Plan a job over a cluster file, then simulate its throughput against the even-split and "
        "memory-split baselines; nothing is trained.",
    )
    _add_plan_args(p, "simulate")

    p = _command(
        sub,
        "bench",
        "run a benchmark and print its figures",
        "Run one of the benchmarks the README quotes and print its figures; "
        "`fusionnode bench NAME --help` lists its options.",
    )
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark: %(choices)s")
    p.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)"
    )

    p = _command(
        sub,
        "demo",
        "start a local swarm, train gpt2-tiny on it, and show the result",
        "Start a local swarm of real daemons on loopback, train gpt2-tiny over all of them with live "
        "progress, print a summary with a text sample, and stop every process it started.",
    )
    from fusionnode.demo import DEFAULT_DEMO_STEPS, add_demo_arguments

    add_demo_arguments(p)
    _add_train_job_args(p)
    p.set_defaults(steps=DEFAULT_DEMO_STEPS, compress="adatopk", save_every=0)

    p = _command(
        sub,
        "keygen",
        "create a private swarm key file (mode 0600) to share with your peers",
        "Create a private swarm key: peers started with --swarm-key FILE speak only to peers holding "
        "the same key. Refuses to overwrite an existing file unless --force.",
    )
    p.add_argument("--out", required=True, help="where to write the key (required)")
    p.add_argument(
        "--force", action="store_true", help="overwrite an existing file or directory (default: refuse)"
    )

    p = _command(
        sub,
        "config",
        "show the effective configuration and where each value comes from",
        "`fusionnode config show COMMAND [FLAGS...]` prints the options COMMAND would run with and "
        "where each value came from: a flag, a FUSIONNODE_* environment variable, the config file, "
        "or the built-in default.",
    )
    p.add_argument("action", choices=["show"], help="what to do: show")
    _json_arg(p)
    p.add_argument(
        "target", nargs=argparse.REMAINDER, help="COMMAND [FLAGS...] to show it for (default: join)"
    )

    p = _command(
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
        "--tokens", type=_int_at_least(1), default=200, help="tokens to generate (default %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=_float_at_least(0),
        default=DEFAULT_TEMPERATURE,
        help="sampling temperature; 0 = always the likeliest token (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=_int_at_least(0), default=0, help="seed of the sampling (default %(default)s)"
    )

    p = _command(
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

    p = _command(
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
        type=_int_at_least(257),
        default=4096,
        help="ids in the vocabulary (default %(default)s)",
    )
    t.add_argument("--out", required=True, help="where to write tokenizer.json")
    return parser


def _command(sub: Any, name: str, text: str, description: str) -> argparse.ArgumentParser:
    """A subcommand with its one-line help (in `fusionnode --help`) and its description."""
    return sub.add_parser(name, help=text, description=description)


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text (default: text)")


def _add_plan_args(p: argparse.ArgumentParser, which: str) -> None:
    from fusionnode.plan import commands

    (commands.add_plan_arguments if which == "plan" else commands.add_simulate_arguments)(p)


def _node_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> NodeConfig:
    try:
        return NodeConfig(
            state_dir=(args.state_dir or default_state_dir()).expanduser().resolve(),
            listen=tuple(args.listen or [DEFAULT_LISTEN]),
            initial_peers=tuple(args.initial_peers),
            announce=tuple(args.announce),
            roles=parse_roles(args.role),
            max_memory_bytes=parse_size(args.max_memory) if args.max_memory else None,
            startup_timeout_s=args.startup_timeout,
            heartbeat_s=args.heartbeat,
            record_ttl_s=args.record_ttl,
            probe=not args.no_probe,
            probe_interval_s=args.probe_interval,
            torch_threads=args.threads,
            dashboard=args.dashboard,
            dashboard_actions=args.dashboard_actions,
            swarm_key_file=args.swarm_key,
            when=args.when,
            schedule=args.schedule,
            max_util_percent=parse_percent(args.max_util) if args.max_util else None,
            idle_grace_s=args.idle_grace,
            egress_limit_bps=parse_rate(args.egress_limit) if args.egress_limit else None,
            reprofile=args.reprofile,
            network=network_options(args),
        )
    except FusionNodeError as exc:
        parser.error(str(exc))
        raise  # unreachable


def _control_path(args: argparse.Namespace) -> Path:
    return (args.state_dir or default_state_dir()).expanduser().resolve() / "control.sock"


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# ---- commands --------------------------------------------------------------------------------
def cmd_join(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from fusionnode.node import run_node

    config = _node_config(args, parser)
    if args.debug:
        os.environ["FUSIONNODE_DEBUG"] = "1"
    torch.set_num_threads(max(1, config.torch_threads))
    return _run(run_node(config))


def cmd_peers(args: argparse.Namespace) -> int:
    from fusionnode import control

    res = _run(control.call(_control_path(args), "peers"))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print_peers(res["peers"], res.get("self"))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from fusionnode import control

    res = _run(control.call(_control_path(args), "status"))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print_status(res)
    return 0


def cmd_leave(args: argparse.Namespace) -> int:
    from fusionnode import control

    res = _run(control.call(_control_path(args), "leave"))
    print(f"peer {res['peer_id']} is leaving the swarm")
    return 0


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        spec = _spec_from_args(args)
    except FusionNodeError as exc:
        parser.error(str(exc))
    if args.resume and not spec.save_dir:
        parser.error("--resume needs --save DIR (where the checkpoints are)")
    if args.offload == "off" and args.rebalance_every:
        parser.error(
            "--rebalance-every moves stages between workers, which needs the optimizer state on "
            "optimizer hosts: use --offload on (or auto), or leave --rebalance-every out"
        )
    if args.offload == "off" and (args.replicas > 1 or args.shares):
        parser.error("several pipelines synchronise through optimizer hosts: use --offload on (or auto)")
    try:
        sync = sync_from_args(args)
    except FusionNodeError as exc:
        parser.error(str(exc))
    if args.local and (sync.rounds or args.replicas > 1 or args.shares):
        return _train_local_replicas(spec, sync, args, _parse_shares(args.shares, parser))
    if args.local:
        return _train_local(spec, args)

    params = {
        "spec": spec.to_dict(),
        "resume": args.resume,
        "stages": args.stages,
        "peers": args.peers,
        "replicas": args.replicas,
        "offload": args.offload,
        "optimizer_hosts": args.optimizer_hosts,
        "planner": args.planner,
        "rebalance_every": args.rebalance_every,
        "rebalance_gain": args.rebalance_gain,
        "lease_s": args.lease,
        "shares": _parse_shares(args.shares, parser),
        "sync": sync.to_dict(),
        "dump_grads": os.path.abspath(args.dump_grads) if args.dump_grads else None,
    }
    progress = Progress(spec.steps)

    async def go() -> dict[str, Any]:
        return await follow_job(_control_path(args), params, progress, as_json=args.json)

    try:
        result = _run(go())
    finally:
        progress.close()
    if args.json:
        print(json.dumps({"result": result}))
    else:
        print_train_summary(result)
    return 0


def _parse_shares(text: str | None, parser: argparse.ArgumentParser) -> list[int] | None:
    if not text:
        return None
    try:
        shares = [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"--shares {text!r}: expected comma-separated integers such as 4,12")
    if min(shares) < 1:
        parser.error("--shares: every share must be at least 1")
    return shares


async def follow_job(
    control_path: Path, params: dict[str, Any], progress: Progress, *, as_json: bool = False
) -> dict[str, Any]:
    """Runs a training job through the daemon at `control_path` (it drives), showing the plan, the
    progress and any failure or re-plan as they happen; returns the job's result."""
    from fusionnode import control

    async for obj in control.call_stream(control_path, "train", params, timeout=None):
        if "event" not in obj:
            return obj["result"]
        ev = obj["event"]
        if as_json:
            print(json.dumps(ev), flush=True)
        elif ev.get("type") == "step":
            progress.update(ev)
        elif ev.get("type") == "plan":
            progress.print("\n".join(format_plan(ev)))
        else:
            progress.print(f"  {format_event(ev)}")
    raise FusionNodeError("the driver closed the job without a result")


def print_train_summary(result: dict[str, Any]) -> None:
    s = result.get("summary") or {}
    print(
        f"job {result['job']}: {result['steps']} steps, loss {s.get('first_loss', float('nan')):.4f} -> "
        f"{result['loss']:.4f} (validation {result['val_loss']:.4f}), {result['tokens_per_s']:.0f} tokens/s"
    )
    if result.get("checkpoint"):
        print(f"checkpoint: {result['checkpoint']}")
        print(next_steps(result["checkpoint"]))
    if result.get("metrics_out"):
        print(f"metrics:    {result['metrics_out']}")
    print("sample:\n" + result.get("sample", ""))


def _train_local(spec: Any, args: argparse.Namespace) -> int:
    import torch

    from fusionnode.train.local import train_local

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    progress = Progress(spec.steps)

    def show(rec: dict[str, Any]) -> None:
        tokens_per_s = rec.get("tokens", 0) / max(rec.get("step_time_s", 0.0), 1e-9)
        progress.update({"wire_bytes": 0, "tokens_per_s": tokens_per_s, **rec})

    res = train_local(spec, progress=show, resume=args.resume)
    print(
        f"local: {len(res.losses)} steps, loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f} "
        f"(validation {res.val_loss:.4f}), {res.tokens_per_s:.0f} tokens/s"
    )
    if res.checkpoint:
        print(f"checkpoint: {res.checkpoint}")
        print(next_steps(res.checkpoint))
    return 0


def _train_local_replicas(spec: Any, sync: Any, args: argparse.Namespace, shares: list[int] | None) -> int:
    """`train --local` with several replicas or a round sync mode: the in-process reference."""
    import torch

    from fusionnode.train.replicas import train_local_replicas

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    progress = Progress(spec.steps)

    def show(rec: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps({"type": "step", **rec}), flush=True)
            return
        tokens_per_s = rec.get("tokens", 0) / max(rec.get("step_time_s", 0.0), 1e-9)
        progress.update({"tokens_per_s": tokens_per_s, **rec})

    try:
        res = train_local_replicas(spec, sync, replicas=args.replicas, shares=shares, progress=show)
    finally:
        progress.close()
    print(
        f"local x{res.replicas} --sync {sync.mode} (H={sync.inner_steps}): {len(res.losses)} steps, "
        f"{res.rounds} rounds, loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f} (validation "
        f"{res.val_loss:.4f}), sync bytes {res.bytes_up:,} up, {res.bytes_down:,} down"
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    mod = importlib.import_module(BENCHMARKS[args.name])
    return int(mod.main(args.bench_args) or 0)


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


def main(argv: list[str] | None = None) -> int:
    from fusionnode import settings

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    subs = settings.subparsers(parser)
    cmd = next((a for a in argv if a in subs), None)
    if cmd and cmd != "config":
        try:
            settings.layered_defaults(parser, argv, cmd)
        except FusionNodeError as exc:
            subs[cmd].error(str(exc))
    args = parser.parse_args(argv)
    try:
        rc = _dispatch(args, subs[args.command])
        sys.stdout.flush()  # here, where a closed pipe can still be handled
        return rc
    except BrokenPipeError:  # `fusionnode status | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # what a shell reports for a process killed by SIGPIPE


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs the parsed command; `parser` is the command's own parser, so its errors show its usage."""
    from fusionnode import settings

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # hivemind sets its logger's level from $HIVEMIND_LOGLEVEL (default INFO) when first imported,
    # which happens later (and in the processes it forks): set the variable, not only the level
    hivemind_level = "DEBUG" if args.log_level == "DEBUG" else "ERROR"
    os.environ.setdefault("HIVEMIND_LOGLEVEL", hivemind_level)
    logging.getLogger("hivemind").setLevel(hivemind_level)
    try:
        if args.command == "join":
            return cmd_join(args, parser)
        if args.command == "peers":
            return cmd_peers(args)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "leave":
            return cmd_leave(args)
        if args.command == "cancel":
            from fusionnode import control

            res = _run(control.call(_control_path(args), "cancel", {"job": args.job}, timeout=None))
            print(f"job {res['job']}: {res['state']}")
            return 0
        if args.command in ("pause", "resume"):
            from fusionnode import control

            res = _run(control.call(_control_path(args), args.command, timeout=None))
            print(describe_availability(args.command, res))
            return 0 if args.command == "pause" or res.get("availability") != "paused" else 1
        if args.command == "train":
            return cmd_train(args, parser)
        if args.command in ("plan", "simulate"):
            from fusionnode.plan import commands

            return int((commands.run_plan if args.command == "plan" else commands.run_simulate)(args) or 0)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "demo":
            from fusionnode.demo import run_demo

            return run_demo(args)
        if args.command == "keygen":
            from fusionnode.security import write_swarm_key

            key = write_swarm_key(Path(args.out), overwrite=args.force)
            print(
                f"wrote swarm key {args.out} (fingerprint {key.fingerprint}); give it to your peers over a "
                "trusted channel and start each with --swarm-key"
            )
            return 0
        if args.command == "config":
            if args.target and args.target[0] in ("-h", "--help"):
                parser.print_help()
                return 0
            if args.target and args.target[0] not in settings.subparsers(build_parser()):
                parser.error(
                    f"config show: {args.target[0]!r} is not a command; name one, e.g. "
                    "`fusionnode config show join --max-memory 8GB`"
                )
            print(settings.show_config(build_parser, args.target or ["join"], as_json=args.json))
            return 0
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "tokenizer":
            return cmd_tokenizer(args)
    except FusionNodeError as exc:
        print(f"fusionnode {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fusionnode {args.command}: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
