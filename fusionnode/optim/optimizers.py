"""Optimizer math on named fp32 tensors: AdamW and SGD, vectorised with torch._foreach_*.

The same `FlatOptimizer` runs on an optimizer host (over the fp32 masters of its shard, with
gradients aggregated from many contributors) and on a worker with `--offload off` (through
`make_local_optimizer`, over the worker's own parameters), so both paths give identical results.

The math follows torch.optim.AdamW / torch.optim.SGD (foreach implementation, torch 2.x):

AdamW, per parameter p with gradient g and its own step count t (incremented on every update):
    p <- p * (1 - lr * wd)                          (decoupled weight decay, decayed params only)
    m <- m + (1 - b1) * (g - m);  v <- b2 * v + (1 - b2) * g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
SGD (weight decay is *coupled* L2, as in torch.optim.SGD):
    g <- g + wd * p;  buf <- momentum * buf + g  (buf = g on the first update)
    p <- p - lr * (g + momentum * buf if nesterov else buf)
Gradient clipping (optional) scales every gradient by min(1, max_norm / (||g||_2 + 1e-6)), with
the norm over all gradients of the step, as torch.nn.utils.clip_grad_norm_ does.

Weight decay applies to a parameter when its name is in `OptimizerConfig.decay_names` (if that is
given), else when its tensor has at least `decay_min_ndim` dimensions (default 2: matrices and
embeddings decay, biases and norm gains do not; set 0 to decay everything).

Parameters that receive no gradient in a step are not touched and their step count does not
advance (torch.optim skips parameters whose .grad is None in the same way).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fusionnode.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_BETAS = (0.9, 0.95)
DEFAULT_EPS = 1e-8
DEFAULT_DECAY_MIN_NDIM = 2  # tensors with at least this many dimensions get weight decay
CLIP_EPS = 1e-6  # added to the global norm before dividing, as torch.nn.utils.clip_grad_norm_
OPTIMIZER_NAMES = ("adamw", "sgd")
ADAMW_BETAS = DEFAULT_BETAS  # the training jobs' AdamW (local reference trainer, workers, hosts)
ADAMW_EPS = DEFAULT_EPS
SGD_MOMENTUM = 0.9  # the training jobs' SGD momentum


def decays_by_shape(ndim: int) -> bool:
    """The training jobs' weight-decay rule: matrices (embeddings, linear weights) decay; biases and
    norm gains do not."""
    return ndim >= DEFAULT_DECAY_MIN_NDIM


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of one optimizer; `lr` is the base rate (the schedule may override per step)."""

    name: str = "adamw"  # "adamw" or "sgd"
    lr: float = 3e-4
    betas: tuple[float, float] = DEFAULT_BETAS  # adamw only
    eps: float = DEFAULT_EPS  # adamw only
    weight_decay: float = 0.0  # adamw: decoupled; sgd: coupled L2 (as torch.optim)
    momentum: float = 0.0  # sgd only
    nesterov: bool = False  # sgd only
    grad_clip: float | None = None  # max global L2 norm of the gradients; None = off
    decay_min_ndim: int = DEFAULT_DECAY_MIN_NDIM
    decay_names: frozenset[str] | None = None  # if given, exactly these names decay

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise ConfigError(f"unknown optimizer {self.name!r}; expected one of {OPTIMIZER_NAMES}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr must be a finite number >= 0, got {self.lr}")
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ConfigError(f"betas must lie in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ConfigError(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0 or self.momentum < 0:
            raise ConfigError("weight_decay and momentum must be >= 0")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("nesterov needs momentum > 0")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"grad_clip must be > 0 or None, got {self.grad_clip}")
        object.__setattr__(self, "betas", (float(b1), float(b2)))
        if self.decay_names is not None:
            object.__setattr__(self, "decay_names", frozenset(self.decay_names))

    def decays(self, name: str, tensor: Tensor) -> bool:
        """Whether weight decay applies to the parameter `name`."""
        if self.decay_names is not None:
            return name in self.decay_names
        return tensor.dim() >= self.decay_min_ndim

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable form (for checkpoint manifests)."""
        out = asdict(self)
        out["betas"] = list(self.betas)
        out["decay_names"] = None if self.decay_names is None else sorted(self.decay_names)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> OptimizerConfig:
        kw = dict(obj)
        kw["betas"] = tuple(kw.get("betas", DEFAULT_BETAS))
        if kw.get("decay_names") is not None:
            kw["decay_names"] = frozenset(kw["decay_names"])
        return cls(**kw)


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup to `lr` over `warmup_steps`, `hold_steps` steps at `lr`, then cosine decay to
    `lr * min_lr_ratio` at `total_steps` (see `warmup_cosine_lr`)."""

    lr: float
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr_ratio: float = 0.1
    hold_steps: int = 0

    def __post_init__(self) -> None:
        if self.lr < 0 or self.warmup_steps < 0 or self.total_steps < 1 or self.hold_steps < 0:
            raise ConfigError(
                "LRSchedule needs lr >= 0, warmup_steps >= 0, total_steps >= 1, hold_steps >= 0"
            )
        if self.warmup_steps > self.total_steps:
            raise ConfigError("warmup_steps must not exceed total_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio must lie in [0, 1]")


def warmup_cosine_lr(
    step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float, hold_steps: int = 0
) -> float:
    """THE learning-rate schedule (every trainer and `lr_at` call it): the rate of optimizer step
    `step`, numbered from 1 (step <= 0: nothing applied yet, 0.0).

    Warmup: lr * step / warmup_steps for step <= warmup_steps. Then lr for `hold_steps` steps
    (never past total_steps). Then a half cosine from lr down to lr * min_lr_ratio, reached at
    step == total_steps, and lr * min_lr_ratio after it.
    """
    if step <= 0:
        return 0.0
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if step <= min(warmup_steps + hold_steps, total_steps):
        return lr
    min_lr = lr * min_lr_ratio
    start = warmup_steps + hold_steps
    span = total_steps - start
    progress = 1.0 if span <= 0 else min(1.0, (step - start) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, cfg: LRSchedule) -> float:
    """Learning rate of `step` under `cfg` (steps are numbered from 1; step <= 0 gives 0)."""
    return warmup_cosine_lr(step, cfg.lr, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio, cfg.hold_steps)


def clip_coefficient(sq_norm: float, max_norm: float) -> float:
    """min(1, max_norm / (sqrt(sq_norm) + 1e-6)): the factor a global-norm clip multiplies by.

    With parameters sharded over several hosts, the caller sums each host's squared norm
    (ParameterStore.pending_grad_sq_norm) and passes the result to every host's apply().
    """
    return min(1.0, max_norm / (math.sqrt(sq_norm) + CLIP_EPS))


class FlatOptimizer:
    """AdamW or SGD over a fixed set of named tensors, updated in place.

    The tensors given are the masters: they are updated in place (pass clones to keep the
    originals). State (exp_avg/exp_avg_sq or momentum_buffer) is allocated up front as zeros,
    which is numerically the same as torch.optim's lazy initialisation. Not thread-safe: the
    caller serialises calls (ParameterStore does).
    """

    def __init__(self, params: Mapping[str, Tensor], cfg: OptimizerConfig) -> None:
        self.cfg = cfg
        self.params: dict[str, Tensor] = dict(params)
        for name, p in self.params.items():
            if not p.is_floating_point():
                raise ConfigError(f"parameter {name!r} is not floating point ({p.dtype})")
        self.steps: dict[str, int] = dict.fromkeys(self.params, 0)
        self.state: dict[str, dict[str, Tensor]] = {}
        for kind in self._state_kinds():
            self.state[kind] = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self._decay = {n: cfg.decays(n, p) for n, p in self.params.items()}

    def _state_kinds(self) -> tuple[str, ...]:
        if self.cfg.name == "adamw":
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if self.cfg.momentum > 0 else ()

    @staticmethod
    def grad_sq_norm(grads: Mapping[str, Tensor]) -> float:
        """Sum of squared L2 norms of the gradients: each tensor's norm in fp32, the squares summed in
        fp64, so that any partition of the tensors (stages, hosts) adds up to the same total to rounding."""
        gs = [grads[name] for name in sorted(grads) if grads[name].numel() > 0]
        if not gs:
            return 0.0
        norms = torch._foreach_norm(gs, 2)
        return float(torch.stack(norms).double().pow(2).sum())

    def step(
        self, grads: Mapping[str, Tensor], lr: float | None = None, *, clip_coef: float | None = None
    ) -> float:
        """Update the parameters named in `grads` (others untouched); returns the pre-clip global norm.

        `clip_coef` overrides the local clip factor (used for a norm taken over several shards);
        when None and `cfg.grad_clip` is set, the norm is taken over `grads` here.
        """
        lr = self.cfg.lr if lr is None else float(lr)
        names = [n for n in grads if n in self.params]
        unknown = set(grads) - set(names)
        if unknown:
            raise KeyError(f"gradients for unknown parameters: {sorted(unknown)[:5]}")
        if not names:
            return 0.0
        gs = [grads[n] for n in names]
        norm = math.nan
        if clip_coef is None and self.cfg.grad_clip is not None:
            norm = math.sqrt(self.grad_sq_norm(grads))
            clip_coef = min(1.0, self.cfg.grad_clip / (norm + CLIP_EPS))
        if clip_coef is not None:
            gs = torch._foreach_mul(gs, clip_coef)
        for n in names:
            self.steps[n] += 1
        if self.cfg.name == "adamw":
            self._adamw(names, gs, lr)
        else:
            self._sgd(names, gs, lr)
        return norm

    def _adamw(self, names: list[str], gs: list[Tensor], lr: float) -> None:
        b1, b2 = self.cfg.betas
        ps = [self.params[n] for n in names]
        ms = [self.state["exp_avg"][n] for n in names]
        vs = [self.state["exp_avg_sq"][n] for n in names]
        wd = self.cfg.weight_decay
        if wd != 0:
            decayed = [p for n, p in zip(names, ps, strict=True) if self._decay[n]]
            if decayed:
                torch._foreach_mul_(decayed, 1 - lr * wd)
        torch._foreach_lerp_(ms, gs, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, 1 - b2)
        steps = [self.steps[n] for n in names]
        step_size = [-(lr / (1 - b1**t)) for t in steps]
        bc2_sqrt = [(1 - b2**t) ** 0.5 for t in steps]
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, self.cfg.eps)
        torch._foreach_addcdiv_(ps, ms, denom, step_size)

    def _sgd(self, names: list[str], gs: list[Tensor], lr: float) -> None:
        ps = [self.params[n] for n in names]
        wd = self.cfg.weight_decay
        if wd != 0:
            gs = [
                torch.add(g, p, alpha=wd) if self._decay[n] else g
                for n, g, p in zip(names, gs, ps, strict=True)
            ]
        if self.cfg.momentum > 0:
            bufs = [self.state["momentum_buffer"][n] for n in names]
            torch._foreach_mul_(bufs, self.cfg.momentum)
            torch._foreach_add_(bufs, gs)
            gs = torch._foreach_add(gs, bufs, alpha=self.cfg.momentum) if self.cfg.nesterov else bufs
        torch._foreach_add_(ps, gs, alpha=-lr)

    def state_dict(self) -> dict[str, Any]:
        """{"config": json, "steps": {name: int}, "state": {kind: {name: Tensor}}} (tensors not copied)."""
        return {"config": self.cfg.to_json(), "steps": dict(self.steps), "state": self.state}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore steps and state in place; names and shapes must match exactly."""
        steps = sd["steps"]
        if set(steps) != set(self.params):
            raise ConfigError("optimizer state names do not match the parameters")
        state = sd["state"]
        if set(state) != set(self._state_kinds()):
            raise ConfigError(f"optimizer state kinds {sorted(state)} != {sorted(self._state_kinds())}")
        for kind, tensors in state.items():
            for n, p in self.params.items():
                t = tensors[n]
                if t.shape != p.shape:
                    raise ConfigError(
                        f"state {kind}/{n} has shape {tuple(t.shape)}, expected {tuple(p.shape)}"
                    )
        for kind, tensors in state.items():
            for n in self.params:
                self.state[kind][n].copy_(tensors[n])
        self.steps = {n: int(steps[n]) for n in self.params}


class LocalOptimizer:
    """The `--offload off` path: FlatOptimizer math on a worker's own parameters, reading `.grad`.

    fp32 parameters are updated in place; others get an fp32 master copy that is cast back after
    each step.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], cfg: OptimizerConfig) -> None:
        self.params = dict(params)
        self._cast_back = {n for n, p in self.params.items() if p.dtype != torch.float32}
        masters = {n: (p.data.float() if n in self._cast_back else p.data) for n, p in self.params.items()}
        self.opt = FlatOptimizer(masters, cfg)

    def step(self, lr: float | None = None) -> float:
        """Apply one update from the parameters' `.grad` (None = skipped); returns the pre-clip norm."""
        grads = {n: p.grad.float() for n, p in self.params.items() if p.grad is not None}
        with torch.no_grad():
            norm = self.opt.step(grads, lr)
            for n in self._cast_back.intersection(grads):
                self.params[n].data.copy_(self.opt.params[n])
        return norm

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.opt.load_state_dict(sd)


def make_local_optimizer(params: Mapping[str, nn.Parameter], cfg: OptimizerConfig) -> LocalOptimizer:
    """An optimizer over a worker's own parameters with the same math as the optimizer hosts."""
    return LocalOptimizer(params, cfg)


def job_optimizer_config(spec: Mapping[str, Any], names: dict[str, dict[str, Any]]) -> OptimizerConfig:
    """A training job's optimizer: the reference trainer's math (betas ADAMW_BETAS, eps ADAMW_EPS,
    momentum SGD_MOMENTUM, decay by `decays_by_shape`) for the named parameters, from the job
    spec's optimizer fields ("optimizer", "lr", "weight_decay", as JobSpec.to_dict writes them)."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"job spec must be a mapping, got {type(spec).__name__}")
    missing = [k for k in ("optimizer", "lr", "weight_decay") if k not in spec]
    if missing:
        raise ConfigError(f"job spec: missing field(s) {', '.join(missing)}")
    name, lr, wd = spec["optimizer"], spec["lr"], spec["weight_decay"]
    for field_name, v in (("lr", lr), ("weight_decay", wd)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ConfigError(f"job spec: {field_name} must be a finite number, got {v!r:.40}")
    if not isinstance(name, str):
        raise ConfigError(f"job spec: optimizer must be a name, got {name!r:.40}")
    decay = frozenset(n for n, s in names.items() if wd > 0 and decays_by_shape(len(s["shape"])))
    return OptimizerConfig(
        name=name,
        lr=float(lr),
        betas=ADAMW_BETAS,
        eps=ADAMW_EPS,
        weight_decay=float(wd),
        momentum=SGD_MOMENTUM if name == "sgd" else 0.0,
        decay_names=decay,
    )
