"""The training job's specification (`JobSpec`) and the learning-rate schedule every trainer shares.

A `JobSpec` fully determines a training trajectory together with the data: the local
reference trainer and the distributed driver both read the same fields and call the same
`lr_at`, so the two can be compared step by step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from fusionnode.errors import ConfigError
from fusionnode.optim.optimizers import (  # noqa: F401  (the trainers' optimizer constants live with the math)
    ADAMW_BETAS,
    ADAMW_EPS,
    SGD_MOMENTUM,
    decays_by_shape,
    warmup_cosine_lr,
)

logger = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "sgd")

DEFAULT_MODEL = "gpt2-tiny"
DEFAULT_STEPS = 200  # optimizer steps
DEFAULT_BATCH_SIZE = 16  # sequences per step
DEFAULT_LR = 3e-3  # peak learning rate
DEFAULT_WARMUP_STEPS = 20  # steps of linear warmup
DEFAULT_MIN_LR_RATIO = 0.1  # final lr = lr * ratio at the end of the cosine decay
DEFAULT_WEIGHT_DECAY = 0.1  # decoupled (AdamW) / L2 (SGD); applied to tensors with dim >= 2 only
DEFAULT_GRAD_CLIP = 1.0  # global L2 norm
DEFAULT_SAVE_EVERY = 100  # steps between checkpoints (0 = only at the end)


DEFAULT_TEXT_FIELD = "text"
# fields added after job ids were first derived: left out of the id while at their default, so the
# ids of earlier jobs (and their checkpoints) stay what they were
DEFAULT_LORA_ALPHA = 16.0
DEFAULT_LORA_TARGETS = "q_proj,v_proj"
LATER_FIELD_DEFAULTS: dict[str, Any] = {
    "init_from": None,
    "tokenizer": None,
    "text_field": DEFAULT_TEXT_FIELD,
    "lora_rank": 0,
    "lora_alpha": DEFAULT_LORA_ALPHA,
    "lora_targets": DEFAULT_LORA_TARGETS,
}

JOB_ID_HEX_CHARS = 12  # length of a derived job id

# Fields that do not change the numbers a run produces (where it writes, how it ships tensors).
NON_TRAJECTORY_FIELDS = frozenset({"steps", "save_dir", "save_every", "metrics_out", "compress", "job_id"})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float))) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class JobSpec:
    """Everything that defines one training job. Invalid values raise `ConfigError` at construction."""

    model: str = DEFAULT_MODEL  # a bundled model name or "pkg.mod:factory"
    data: str | None = None  # a text file or a directory of text files; None = default corpus
    steps: int = DEFAULT_STEPS
    batch_size: int = DEFAULT_BATCH_SIZE  # sequences per optimizer step (all replicas together)
    micro_batches: int = 1  # the step's batch is split into this many equal micro-batches
    seq_len: int | None = None  # tokens per sequence; None = the model's context length
    seed: int = 0
    optimizer: str = "adamw"
    lr: float = DEFAULT_LR
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    min_lr_ratio: float = DEFAULT_MIN_LR_RATIO
    weight_decay: float = DEFAULT_WEIGHT_DECAY
    grad_clip: float | None = DEFAULT_GRAD_CLIP
    save_dir: str | None = None
    save_every: int = DEFAULT_SAVE_EVERY
    metrics_out: str | None = None
    compress: str = "none"  # parsed by fusionnode.compress
    job_id: str = ""  # derived from the other fields when empty
    init_from: str | None = None  # a local HF checkpoint directory the initial weights come from
    tokenizer: str | None = None  # a Hugging Face tokenizer.json; None = byte-level tokens
    text_field: str = DEFAULT_TEXT_FIELD  # the text field of jsonl / parquet records
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank on lora_targets, the base frozen
    lora_alpha: float = DEFAULT_LORA_ALPHA  # adapter scale = lora_alpha / lora_rank
    lora_targets: str = DEFAULT_LORA_TARGETS  # comma-separated linear layer names (name suffixes)

    def __post_init__(self) -> None:
        self._validate()
        if not self.job_id:
            object.__setattr__(self, "job_id", derive_job_id(self))

    def _validate(self) -> None:
        def bad(field: str, why: str) -> ConfigError:
            return ConfigError(f"job spec: {field}={getattr(self, field)!r}: {why}")

        if not isinstance(self.model, str) or not self.model:
            raise bad("model", "must be a non-empty string")
        if self.data is not None and (not isinstance(self.data, str) or not self.data):
            raise bad("data", "must be a path or null")
        for name in ("steps", "batch_size", "micro_batches"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise bad(name, "must be an integer >= 1")
        if self.batch_size % self.micro_batches:
            raise bad(
                "micro_batches", f"batch_size {self.batch_size} is not divisible into {self.micro_batches}"
            )
        if self.seq_len is not None and (not _is_int(self.seq_len) or self.seq_len < 1):
            raise bad("seq_len", "must be an integer >= 1 or null")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise bad("seed", "must be an integer in [0, 2**63)")
        if self.optimizer not in OPTIMIZERS:
            raise bad("optimizer", f"must be one of {', '.join(OPTIMIZERS)}")
        if not _is_number(self.lr) or self.lr <= 0:
            raise bad("lr", "must be a finite number > 0")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise bad("warmup_steps", "must be an integer >= 0")
        if not _is_number(self.min_lr_ratio) or not 0 <= self.min_lr_ratio <= 1:
            raise bad("min_lr_ratio", "must be in [0, 1]")
        if not _is_number(self.weight_decay) or self.weight_decay < 0:
            raise bad("weight_decay", "must be a finite number >= 0")
        if self.grad_clip is not None and (not _is_number(self.grad_clip) or self.grad_clip <= 0):
            raise bad("grad_clip", "must be a finite number > 0 or null")
        if self.save_dir is not None and (not isinstance(self.save_dir, str) or not self.save_dir):
            raise bad("save_dir", "must be a path or null")
        if not _is_int(self.save_every) or self.save_every < 0:
            raise bad("save_every", "must be an integer >= 0 (0 = only at the end)")
        if self.metrics_out is not None and (not isinstance(self.metrics_out, str) or not self.metrics_out):
            raise bad("metrics_out", "must be a path or null")
        if not isinstance(self.compress, str) or not self.compress:
            raise bad("compress", "must be a non-empty string")
        for name in ("init_from", "tokenizer"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(name, "must be a path or null")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise bad("text_field", "must be a non-empty string")
        if not _is_int(self.lora_rank) or self.lora_rank < 0:
            raise bad("lora_rank", "must be an integer >= 0 (0 = no LoRA, train every parameter)")
        if not _is_number(self.lora_alpha) or self.lora_alpha <= 0:
            raise bad("lora_alpha", "must be a finite number > 0")
        if not isinstance(self.lora_targets, str) or not self.lora_targets.strip(", "):
            raise bad("lora_targets", "must name at least one linear layer, e.g. q_proj,v_proj")
        if not isinstance(self.job_id, str) or len(self.job_id) > 64:
            raise bad("job_id", "must be a string of at most 64 characters")
        if self.job_id and not all(c.isalnum() or c in "-_." for c in self.job_id):
            raise bad("job_id", "may contain only letters, digits, '-', '_' and '.'")

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch."""
        return self.batch_size // self.micro_batches

    def to_dict(self) -> dict[str, Any]:
        """A JSON- and msgpack-able dict with every field (including the derived job id); fields added
        later (LATER_FIELD_DEFAULTS) are left out while at their default, so peers and checkpoints of
        an earlier version still read the specs of jobs that do not use them."""
        return {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if not (k in LATER_FIELD_DEFAULTS and v == LATER_FIELD_DEFAULTS[k])
        }

    @classmethod
    def from_dict(cls, raw: Any) -> JobSpec:
        """Build from `to_dict()` output (or user JSON); unknown keys or wrong types raise `ConfigError`."""
        if not isinstance(raw, dict):
            raise ConfigError(f"job spec must be a mapping, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in raw if k not in known)
        if unknown:
            raise ConfigError(f"job spec: unknown field(s): {', '.join(unknown)}")
        values = dict(raw)
        for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "lora_alpha"):
            # JSON has one number type; accept integers where a float is expected.
            if _is_int(values.get(name)):
                values[name] = float(values[name])
        return cls(**values)

    def replace(self, **changes: Any) -> JobSpec:
        """A copy with some fields changed; the job id is re-derived unless given."""
        changes.setdefault("job_id", "")
        return dataclasses.replace(self, **changes)


def derive_job_id(spec: JobSpec) -> str:
    """A short, stable id: a hash of every other field."""
    fields = {
        k: v
        for k, v in dataclasses.asdict(spec).items()
        if k != "job_id" and not (k in LATER_FIELD_DEFAULTS and v == LATER_FIELD_DEFAULTS[k])
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return f"job-{digest[:JOB_ID_HEX_CHARS]}"


def trajectory_mismatch(a: JobSpec, b: JobSpec) -> list[str]:
    """Names of the fields that differ between `a` and `b` and change the numbers a run produces."""
    return [
        f.name
        for f in dataclasses.fields(JobSpec)
        if f.name not in NON_TRAJECTORY_FIELDS and getattr(a, f.name) != getattr(b, f.name)
    ]


def lr_at(step: int, spec: JobSpec) -> float:
    """Learning rate for optimizer step `step` (0-based: the rate of the (step+1)-th update).

    The one schedule (`fusionnode.optim.optimizers.warmup_cosine_lr`, whose steps count from 1)
    with the trainers' shape: lr * (step + 1) / warmup_steps for step < warmup_steps, lr at
    step == warmup_steps (one step held at the peak), then a half cosine down to
    lr * min_lr_ratio at step == steps - 1; min_lr beyond that.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return warmup_cosine_lr(step + 1, spec.lr, spec.warmup_steps, spec.steps, spec.min_lr_ratio, hold_steps=1)


def weight_decay_for(name: str, ndim: int, spec: JobSpec) -> float:
    """Weight decay for one parameter: matrices (embeddings, linear weights) decay; biases and norms do not."""
    del name  # the rule is by shape; the name is accepted so that callers can log it
    return spec.weight_decay if decays_by_shape(ndim) else 0.0


def resolve_seq_len(spec: JobSpec) -> int:
    """The sequence length a job trains on: `spec.seq_len`, or the model's context length when unset."""
    from fusionnode.models import model_info

    info = model_info(spec.model)
    if spec.seq_len is None:
        return int(info.seq_len)
    if spec.seq_len > info.seq_len:
        raise ConfigError(f"seq_len {spec.seq_len} exceeds the context length {info.seq_len} of {spec.model}")
    return spec.seq_len
