"""A worker that lies on purpose, for tests and `fusionnode bench verify` (a debug hook: only with
``FUSIONNODE_DEBUG=1`` does a worker read it, from ``<state dir>/debug_lie``, a JSON object).

Kinds of lie (``kind``), applied to what the stage sends (its activations on a non-last stage, the
gradients of its inputs on the last one; ``on`` = "act" | "grad" | "both" chooses otherwise):

- ``scale``: multiply by ``factor`` (1.01 = a 1% scaling),
- ``noise``: add Gaussian noise of ``sigma`` times the tensor's RMS,
- ``stale``: send what it sent for the same micro-batch one step earlier (fresh when it has none),
- ``other``: send another micro-batch's tensors (the previous micro-batch of the step: someone
  else's plausible work, as a copy of another replica's tensors would be),
- ``random_pseudo_gradient``: replace its parameter gradients (``--sync step``), or its round's
  pseudo-gradients (``--sync diloco|sparseloco``), by random ones of ``norm`` times the same norm
  (a data-parallel contribution: spot-checked under step, scored under the rounds: verify/contrib.py).

- ``update``: under ``--sync diloco|sparseloco``, scale the inner optimizer's update of its stage's
  parameters by ``factor`` (on ``fraction`` of its inner steps): what it sends is honest for the
  parameters it holds, only the step between them is wrong (the transition check: verify/inner.py).

``fraction`` (0..1] of the micro-batches are lied on, drawn with the liar's own ``seed``; the liar
commits to what it actually sends (a smarter liar than one whose digests disagree with its
neighbours'), so only the recompute can catch it.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

import torch

DEBUG_LIE_FILE = "debug_lie"  # in the state dir
KINDS = ("scale", "noise", "stale", "other", "random_pseudo_gradient", "update")


@dataclass
class Liar:
    kind: str
    factor: float = 1.01
    sigma: float = 0.01
    fraction: float = 1.0
    on: str = "auto"
    seed: int = 0
    stage: int | None = None  # lie only as this (global) stage; None: as every stage held
    norm: float = 1.0  # random_pseudo_gradient: its norm as a multiple of the honest one's
    lied: int = 0  # micro-batches lied on so far
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _history: dict[tuple[int, str, int], dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"debug_lie: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"debug_lie: fraction must be in (0, 1], got {self.fraction!r}")
        if self.on not in ("auto", "act", "grad", "both"):
            raise ValueError(f"debug_lie: on must be auto, act, grad or both, got {self.on!r}")
        self._rng = random.Random(self.seed)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Liar:
        known = {"kind", "factor", "sigma", "fraction", "on", "seed", "stage", "norm"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"debug_lie: unknown field(s) {unknown}")
        return cls(**raw)

    @classmethod
    def read(cls, state_dir: Any) -> Liar | None:
        """The liar configured in `state_dir` (None when there is no debug_lie file)."""
        try:
            with open(os.path.join(state_dir, DEBUG_LIE_FILE), encoding="utf-8") as f:
                text = f.read().strip()
        except FileNotFoundError:
            return None
        return cls.from_dict(json.loads(text)) if text else None

    def lies_on(self, kind: str, is_last: bool) -> bool:
        if self.kind in ("random_pseudo_gradient", "update"):
            return False
        if self.on == "auto":
            return kind == ("grad" if is_last else "act")
        return self.on == "both" or self.on == kind

    def tamper(
        self, kind: str, stage: int, step: int, mb: int, is_last: bool, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """What the liar sends instead of `tensors` (its honest `kind` message of micro-batch `mb`)."""
        honest = {n: t.detach().clone() for n, t in tensors.items()}
        prev = self._history.get((step - 1, kind, mb))
        other = self._history.get((step, kind, mb - 1))
        self._history[(step, kind, mb)] = honest
        for key in [k for k in self._history if k[0] < step - 1]:
            del self._history[key]
        if (self.stage is not None and stage != self.stage) or not self.lies_on(kind, is_last):
            return tensors
        if self._rng.random() >= self.fraction:
            return tensors
        out = {}
        for name, t in tensors.items():
            if not t.is_floating_point():
                out[name] = t
            elif self.kind == "scale":
                out[name] = t * self.factor
            elif self.kind == "noise":
                rms = t.float().pow(2).mean().sqrt()
                gen = torch.Generator().manual_seed(self._rng.getrandbits(62))
                out[name] = t + self.sigma * rms * torch.randn(t.shape, generator=gen).to(t.device, t.dtype)
            elif self.kind == "stale":
                out[name] = prev[name] if prev is not None and name in prev else t
            else:  # other
                out[name] = other[name] if other is not None and name in other else t
        if any(out[n] is not tensors[n] for n in tensors):
            self.lied += 1
        return out

    def scale_update(self, params: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
        """For ``update``: the inner step just applied to `params` (from `before`), scaled by
        `factor` in place, on `fraction` of the steps."""
        if self._rng.random() >= self.fraction:
            return
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(before[name] + self.factor * (p.detach() - before[name]))
        self.lied += 1

    def pseudo_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """For ``random_pseudo_gradient``: a random tensor of `norm` times the norm of `grad`."""
        gen = torch.Generator().manual_seed(self._rng.getrandbits(62))
        r = torch.randn(grad.shape, generator=gen).to(grad.device, grad.dtype)
        return r * (self.norm * grad.norm() / r.norm().clamp_min(1e-12))


__all__ = ["DEBUG_LIE_FILE", "KINDS", "Liar"]
