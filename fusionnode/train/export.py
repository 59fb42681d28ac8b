"""Export a training checkpoint (one `model.safetensors`, or a Hugging Face directory), and load a model back."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from fusionnode.errors import ConfigError
from fusionnode.train.checkpoint import (
    MANIFEST_FILE,
    MODEL_FILE,
    Checkpoint,
    load_checkpoint,
    read_checkpoint,
    unique_tensors,
)
from fusionnode.train.local import build_job_model
from fusionnode.train.spec import JobSpec

logger = logging.getLogger(__name__)

META_SPEC = "fusionnode.spec"  # JSON of the JobSpec
META_STEP = "fusionnode.step"
META_ALIASES = "fusionnode.aliases"  # JSON {alias: stored name} for tied weights


def open_checkpoint(path: str | Path) -> Checkpoint | None:
    """The checkpoint at `path`: one `step-*` directory (as `train` and `demo` print it), or the
    directory given to --save (its newest complete checkpoint); None if there is none."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file():
        return read_checkpoint(path)
    return load_checkpoint(path)


def export_checkpoint(checkpoint_dir: str | Path, out_path: str | Path, *, overwrite: bool = False) -> Path:
    """Write a checkpoint's parameters (see `open_checkpoint`) to `out_path` (a .safetensors file)
    with the job spec, step and tied-weight aliases in its metadata. Returns the path written; an
    existing file is replaced only with `overwrite`."""
    ckpt = open_checkpoint(checkpoint_dir)
    if ckpt is None:
        raise ConfigError(f"{checkpoint_dir}: no complete checkpoint to export")
    stored, aliases = unique_tensors(ckpt.params)
    out = Path(out_path)
    if out.is_dir():
        out = out / MODEL_FILE
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} already exists; pass --force to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    metadata = {
        META_SPEC: json.dumps(ckpt.spec.to_dict()),
        META_STEP: str(ckpt.step),
        META_ALIASES: json.dumps(aliases),
    }
    save_file(stored, str(tmp), metadata=metadata)
    os.replace(tmp, out)
    logger.info("exported %s (step %d) to %s", ckpt.path, ckpt.step, out)
    return out


def export_hf(
    checkpoint_dir: str | Path, out_dir: str | Path, *, adapters_only: bool = False, overwrite: bool = False
) -> Path:
    """Write the newest complete checkpoint as a Hugging Face directory (config.json, model.safetensors
    and, when the job used one, its tokenizer.json) that AutoModelForCausalLM.from_pretrained loads.
    A LoRA job's adapters are merged into the weights, or with `adapters_only` written alone in
    PEFT's layout (adapter_model.safetensors + adapter_config.json). A directory that already holds
    files is written into only with `overwrite`."""
    target = Path(out_dir).expanduser()
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ConfigError(f"{target} already holds files; pass --force to write into it")
    from fusionnode.models.hf_checkpoint import save_hf_checkpoint
    from fusionnode.models.lora import merge_lora, peft_adapter

    spec, model = load_job_from_checkpoint(checkpoint_dir)
    if adapters_only:
        tensors, config = peft_adapter(model, spec.init_from or spec.model)
        out = Path(out_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out
    out = save_hf_checkpoint(merge_lora(model), out_dir)
    if spec.tokenizer:
        shutil.copyfile(spec.tokenizer, out / "tokenizer.json")
    logger.info("exported %s as a Hugging Face checkpoint to %s", checkpoint_dir, out)
    return out


def load_model_from_checkpoint(path: str | Path) -> nn.Module:
    """A model with trained weights, from a checkpoint directory or an exported .safetensors file."""
    return load_job_from_checkpoint(path)[1]


def load_job_from_checkpoint(path: str | Path) -> tuple[JobSpec, nn.Module]:
    """(job spec, model with trained weights) from a checkpoint directory or an exported file."""
    path = Path(path)
    if path.is_file():
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        if META_SPEC not in metadata:
            raise ConfigError(f"{path}: not a FusionNode export (no {META_SPEC} metadata)")
        spec = JobSpec.from_dict(json.loads(metadata[META_SPEC]))
        stored = load_file(str(path))
        params = dict(stored)
        for alias, name in json.loads(metadata.get(META_ALIASES, "{}")).items():
            params[alias] = stored[name]
    else:
        ckpt = open_checkpoint(path)
        if ckpt is None:
            raise ConfigError(f"{path}: no complete checkpoint and not an exported model file")
        spec, params = ckpt.spec, ckpt.params
    model = build_job_model(spec.replace(init_from=None, job_id=spec.job_id))  # weights come next
    model.load_state_dict(params, strict=True)
    model.eval()
    return spec, model
