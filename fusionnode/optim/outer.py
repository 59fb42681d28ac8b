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

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fusionnode.errors import ConfigError
from fusionnode.sync import SyncConfig


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
