"""The norm floor of `--sync step` (issue 20, verify/contrib.py), on an optimizer host's store: the
replicas' gradients of a step, held apart by (name, replica), are combined as

    g(name) = sum_r n_r s_r g_r / sum_r n_r s_r,   s_r = min(1, clip x m / |g_r|)

where |g_r| is replica r's gradient norm over the names of the shard it completed and m the lower
median of the positive ones (verify.contrib.clip_scales: a replica sending zeros scales nobody
down; with two replicas a tiny nonzero one still bounds the other, see SECURITY.md): a replica whose gradient is more than `clip`
times the median is scaled down, the others weigh their samples as without the floor (the bits
may differ in the last place: the sum runs in replica order rather than in arrival order)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusionnode.verify.contrib import clip_scales


def floor_mean(
    apart: dict[str, dict[str, tuple[Tensor, int]]], clip: float
) -> tuple[dict[str, Tensor], dict[str, float], dict[str, float]]:
    """(the weighted mean per name, the weight sum per name, each replica's floor scale)."""
    sq: dict[str, float] = {}
    for reps in apart.values():
        for r, (g, _n) in reps.items():
            sq[r] = sq.get(r, 0.0) + float(g.double().pow(2).sum())
    order = sorted(sq)
    scales = dict(zip(order, clip_scales([math.sqrt(sq[r]) for r in order], clip), strict=True))
    mean: dict[str, Tensor] = {}
    weight: dict[str, float] = {}
    for name, reps in apart.items():
        total = sum(n * scales[r] for r, (_g, n) in reps.items())
        if not total > 0:
            continue
        acc = torch.zeros_like(next(iter(reps.values()))[0])
        for r in sorted(reps):
            g, n = reps[r]
            acc.add_(g, alpha=n * scales[r] / total)
        mean[name], weight[name] = acc, total
    return mean, weight, scales


__all__ = ["floor_mean"]
