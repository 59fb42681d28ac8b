"""Low-communication data parallelism: the sync modes and their outer optimizers.

With `--sync step` (the default) the replicas' gradients are combined after every step, as before.
With `--sync diloco` or `--sync sparseloco` each replica runs `inner_steps` (H) steps of its own
inner AdamW from the shared parameters θ, then sends its pseudo-gradient Δr = θ − θr (start of the
round minus its end). The outer step combines them:

DiLoCo (Douillard et al. 2023), on the token-weighted mean Δ = Σ w_r Δ̂r / Σ w_r of the decoded
pseudo-gradients Δ̂r, Nesterov SGD exactly as torch.optim.SGD(nesterov=True) computes it:
    buf <- Δ on the first round, else momentum * buf + Δ
    u   <- outer_lr * (Δ + momentum * buf)
    θ   <- θ − u

SparseLoCo (Sarfi et al. 2025): each replica keeps an error-feedback accumulator
(`compress.pseudograd.ErrorFeedbackAccumulator`) and sends a chunk-wise top-k, 2-bit quantised form
of it; the outer step is a plain averaged descent on what was sent:
    θ <- θ − outer_lr * Σ w_r ĉr / Σ w_r

The weights w_r are the tokens each replica actually processed in the round. Sums run over the
replicas in replica order, so that any process that holds the same inputs computes the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from fusionnode.errors import ConfigError

SYNC_MODES = ("step", "diloco", "sparseloco")
DEFAULT_SYNC = "step"
DEFAULT_INNER_STEPS = 15  # H for the low-communication modes when the user gives none (SparseLoCo's range)
DEFAULT_OUTER_LR = {"diloco": 0.7, "sparseloco": 1.0}  # DiLoCo paper; SparseLoCo's plain averaged step
DEFAULT_OUTER_MOMENTUM = 0.9  # DiLoCo paper
DEFAULT_TOPK_DENSITY = 1 / 64  # SparseLoCo keeps 1-3% per chunk
DEFAULT_CHUNK = 4096  # elements per top-k chunk (SparseLoCo: 64x64 blocks)
DEFAULT_EF_DECAY = 0.95  # error-feedback decay β (SparseLoCo)
# codecs a pseudo-gradient may travel in, per sync mode (the first is the default)
SYNC_CODECS: dict[str, tuple[str, ...]] = {
    "step": ("raw",),
    "diloco": ("raw", "fp16", "q8"),
    "sparseloco": ("ctopk2",),
}


@dataclass(frozen=True)
class SyncConfig:
    """How the data-parallel replicas synchronise. Invalid values raise ConfigError naming the option."""

    mode: str = DEFAULT_SYNC  # "step", "diloco" or "sparseloco"
    inner_steps: int = 1  # H: inner steps per round (1 for "step")
    outer_lr: float | None = None  # None = DEFAULT_OUTER_LR[mode]
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM  # diloco only
    codec: str | None = None  # pseudo-gradient codec; None = SYNC_CODECS[mode][0]
    topk_density: float = DEFAULT_TOPK_DENSITY  # sparseloco: kept share of each chunk
    chunk: int = DEFAULT_CHUNK  # sparseloco: elements per chunk
    ef_decay: float = DEFAULT_EF_DECAY  # sparseloco: error-feedback decay β

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ConfigError(
                f"--sync {self.mode!r}: unknown sync mode; expected one of {', '.join(SYNC_MODES)}"
            )
        if (
            isinstance(self.inner_steps, bool)
            or not isinstance(self.inner_steps, int)
            or self.inner_steps < 1
        ):
            raise ConfigError(f"--inner-steps {self.inner_steps!r}: must be an integer >= 1")
        if self.mode == "step" and self.inner_steps != 1:
            raise ConfigError(
                f"--inner-steps {self.inner_steps}: --sync step synchronises every step; "
                "use --sync diloco or sparseloco for rounds of several steps"
            )
        if self.outer_lr is None:
            object.__setattr__(self, "outer_lr", DEFAULT_OUTER_LR.get(self.mode, 1.0))
        if not (
            isinstance(self.outer_lr, (int, float)) and math.isfinite(self.outer_lr) and self.outer_lr > 0
        ):
            raise ConfigError(f"--outer-lr {self.outer_lr!r}: must be a finite number > 0")
        object.__setattr__(self, "outer_lr", float(self.outer_lr))
        if not (isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1):
            raise ConfigError(f"--outer-momentum {self.outer_momentum!r}: must lie in [0, 1)")
        if self.codec is None:
            object.__setattr__(self, "codec", SYNC_CODECS[self.mode][0])
        if self.codec not in SYNC_CODECS[self.mode]:
            raise ConfigError(
                f"--sync-codec {self.codec!r}: unknown for --sync {self.mode}; "
                f"expected one of {', '.join(SYNC_CODECS[self.mode])}"
            )
        if not (isinstance(self.topk_density, (int, float)) and 0 < self.topk_density <= 1):
            raise ConfigError(f"--topk-density {self.topk_density!r}: must lie in (0, 1]")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or not 1 <= self.chunk <= 65536:
            raise ConfigError(f"--chunk {self.chunk!r}: must be an integer in [1, 65536]")
        if not (isinstance(self.ef_decay, (int, float)) and 0 <= self.ef_decay <= 1):
            raise ConfigError(f"--ef-decay {self.ef_decay!r}: must lie in [0, 1]")

    @property
    def rounds(self) -> bool:
        """Whether replicas train alone between syncs (diloco, sparseloco)."""
        return self.mode != "step"

    @property
    def k_per_chunk(self) -> int:
        """Elements kept per full chunk: ceil(density * chunk), at least 1."""
        return max(1, min(self.chunk, math.ceil(self.topk_density * self.chunk - 1e-9)))

    def round_closes(self, step: int, total_steps: int) -> bool:
        """Whether the round containing `step` ends after it (every H steps, and at the last step)."""
        return (step + 1) % self.inner_steps == 0 or step + 1 == total_steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> SyncConfig:
        if not raw:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(f"sync settings must be a map, got {type(raw).__name__}")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown sync settings {sorted(unknown)}")
        return cls(**raw)


def weighted_mean(tensors: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Σ w_r t_r / Σ w_r in float32, summed in the order given (replica order)."""
    if len(tensors) != len(weights) or not tensors:
        raise ValueError("weighted_mean needs one weight per tensor and at least one tensor")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {list(weights)}")
    acc = torch.zeros_like(tensors[0], dtype=torch.float32)
    for t, w in zip(tensors, weights, strict=True):
        acc.add_(t.to(torch.float32), alpha=float(w) / total)
    return acc


class NesterovOuter:
    """DiLoCo's outer optimizer on named fp32 tensors: returns the update u; the caller subtracts it.

    Keeping the update apart from the parameters lets the owner of θ (an optimizer host) send u to
    the workers, which subtract the same u from their copy of θ.
    """

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.buf: dict[str, Tensor] = {}
        self.rounds = 0  # outer steps taken

    def update(self, delta: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """u for the mean pseudo-gradient `delta` (torch.optim.SGD nesterov=True semantics)."""
        out: dict[str, Tensor] = {}
        mu = self.momentum
        for name, d in delta.items():
            d = d.to(torch.float32)
            if mu > 0:
                buf = self.buf.get(name)
                if buf is None:
                    buf = d.clone()
                    self.buf[name] = buf
                else:
                    buf.mul_(mu).add_(d)
                step = d.add(buf, alpha=mu)
            else:
                step = d.clone()
            out[name] = step.mul_(self.lr)
        self.rounds += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "rounds": self.rounds, "buf": dict(self.buf)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.lr = float(state["lr"])
        self.momentum = float(state["momentum"])
        self.rounds = int(state["rounds"])
        self.buf = {k: v.clone() for k, v in state["buf"].items()}


class AveragedOuter:
    """SparseLoCo's outer step: u = lr * Δ (no state; the workers' accumulators carry the memory)."""

    def __init__(self, lr: float) -> None:
        self.lr = float(lr)
        self.rounds = 0

    def update(self, delta: Mapping[str, Tensor]) -> dict[str, Tensor]:
        self.rounds += 1
        return {name: d.to(torch.float32).mul(self.lr) for name, d in delta.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "rounds": self.rounds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.lr = float(state["lr"])
        self.rounds = int(state["rounds"])


def make_outer(cfg: SyncConfig) -> NesterovOuter | AveragedOuter:
    """The outer optimizer of a low-communication sync mode."""
    if cfg.mode == "diloco":
        return NesterovOuter(cfg.outer_lr, cfg.outer_momentum)
    if cfg.mode == "sparseloco":
        return AveragedOuter(cfg.outer_lr)
    raise ConfigError(f"--sync {cfg.mode} has no outer optimizer")
