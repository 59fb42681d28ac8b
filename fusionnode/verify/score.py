"""Scoring data-parallel contributions: per-step gradients and (later) pseudo-gradients alike.

A contribution is a dict of tensors by parameter name: a replica's gradient of one step, or its
pseudo-gradient (the parameter change of its inner steps, DiLoCo/SparseLoCo) - ``score_contributions``
and ``robust_aggregate`` take either, and the caller says which way a contribution moves the
parameters (``step_size``: the learning rate for a gradient, 1 for a pseudo-gradient given as
``before - after``).

- ``score_contributions``: the loss change each contribution alone brings on a held-out batch the
  replica did not see (Templar's Gauntlet): ``loss(params) - loss(params - step_size x contribution)``,
  evaluated where the whole model runs (the driver or a verifier it picks). Positive helps.
- ``weights_from_scores``: contributions that do not help (score <= ``min_gain``) get weight 0, the
  others equal weight (scores are noisy: their size is not used as a weight).
- ``robust_aggregate``: the floor under any weighting - a coordinate-wise trimmed mean, or clipping
  each contribution's norm to a multiple of the median norm, so one liar's scale cannot dominate.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

Contribution = Mapping[str, torch.Tensor]
DEFAULT_TRIM = 0.2  # fraction cut from each end per coordinate (trimmed mean)
DEFAULT_CLIP_MULT = 2.0  # clip each contribution's norm to this multiple of the median norm


def flat_norm(c: Contribution) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in c.values()))


def trimmed_mean(contribs: Sequence[Contribution], trim: float = DEFAULT_TRIM) -> dict[str, torch.Tensor]:
    """Coordinate-wise mean after dropping the `trim` fraction of largest and smallest values
    (at least one each side when there are 3 or more contributions and trim > 0)."""
    n = len(contribs)
    if n == 0:
        raise ValueError("no contribution to aggregate")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    k = math.floor(trim * n)
    if trim > 0 and n >= 3:
        k = max(k, 1)
    out = {}
    for name in contribs[0]:
        stacked = torch.stack([c[name].float() for c in contribs])
        if k:
            stacked = stacked.sort(dim=0).values[k : n - k]
        out[name] = stacked.mean(dim=0)
    return out


def median_clipped_mean(
    contribs: Sequence[Contribution], mult: float = DEFAULT_CLIP_MULT, weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """Weighted mean after scaling each contribution down to at most `mult` x the median norm."""
    if not contribs:
        raise ValueError("no contribution to aggregate")
    norms = [flat_norm(c) for c in contribs]
    med = statistics.median(norms)
    w = list(weights) if weights is not None else [1.0] * len(contribs)
    if len(w) != len(contribs) or any(x < 0 for x in w):
        raise ValueError("weights must be one non-negative number per contribution")
    total = sum(w)
    if total <= 0:
        raise ValueError("every contribution has weight 0")
    out: dict[str, torch.Tensor] = {}
    for c, nrm, wi in zip(contribs, norms, w, strict=True):
        if wi == 0:
            continue
        scale = min(1.0, mult * med / nrm) if nrm > 0 else 1.0
        for name, t in c.items():
            add = t.float() * (scale * wi / total)
            out[name] = out[name] + add if name in out else add
    return out


def robust_aggregate(
    contribs: Sequence[Contribution],
    method: str = "median_clip",
    *,
    weights: Sequence[float] | None = None,
    trim: float = DEFAULT_TRIM,
    mult: float = DEFAULT_CLIP_MULT,
) -> dict[str, torch.Tensor]:
    """The aggregate of the contributions by `method` ("trimmed_mean" | "median_clip"); contributions
    with weight 0 are left out first."""
    if weights is not None:
        kept = [(c, w) for c, w in zip(contribs, weights, strict=True) if w > 0]
        if not kept:
            raise ValueError("every contribution has weight 0")
        contribs, weights = [c for c, _ in kept], [w for _, w in kept]
    if method == "trimmed_mean":
        return trimmed_mean(contribs, trim)
    if method == "median_clip":
        return median_clipped_mean(contribs, mult, weights)
    raise ValueError(f"unknown aggregation {method!r}: trimmed_mean or median_clip")


def score_contributions(
    loss_fn: Callable[[Mapping[str, torch.Tensor]], float],
    params: Mapping[str, torch.Tensor],
    contribs: Sequence[Contribution],
    step_size: float,
) -> list[float]:
    """Each contribution's loss improvement on a held-out batch: `loss_fn(params) -
    loss_fn(params - step_size x contribution)` (`loss_fn` evaluates the whole model on a batch
    none of the replicas trained on)."""
    base = loss_fn(params)
    scores = []
    for c in contribs:
        moved = {n: (p - step_size * c[n].to(p.dtype)) if n in c else p for n, p in params.items()}
        scores.append(base - loss_fn(moved))
    return scores


def weights_from_scores(scores: Sequence[float], min_gain: float = 0.0) -> list[float]:
    """1 for a contribution whose score exceeds `min_gain`, 0 otherwise (non-finite scores: 0)."""
    return [1.0 if math.isfinite(s) and s > min_gain else 0.0 for s in scores]


@dataclass(frozen=True)
class Judgement:
    scores: list[float]  # loss improvement of each contribution on the held-out batch
    weights: list[float]  # 1 kept, 0 dropped
    aggregate: dict[str, torch.Tensor]  # robust aggregate of the kept contributions


def judge_contributions(
    loss_fn: Callable[[Mapping[str, torch.Tensor]], float],
    params: Mapping[str, torch.Tensor],
    contribs: Sequence[Contribution],
    step_size: float,
    *,
    method: str = "median_clip",
    min_gain: float = 0.0,
) -> Judgement:
    """The one entry point for data-parallel contributions, per-step gradients (`step_size` = the
    learning rate) and pseudo-gradients (`step_size` = 1, or the outer learning rate) alike: score
    each on the held-out batch, drop those that do not help, aggregate the rest robustly. When none
    helps (a bad held-out batch, late in training) every one is kept: the robust aggregate is then
    the floor."""
    scores = score_contributions(loss_fn, params, contribs, step_size)
    weights = weights_from_scores(scores, min_gain)
    if not any(weights):
        weights = [1.0] * len(contribs)
    return Judgement(scores, weights, robust_aggregate(contribs, method, weights=weights))


__all__ = [
    "DEFAULT_CLIP_MULT",
    "DEFAULT_TRIM",
    "Judgement",
    "flat_norm",
    "judge_contributions",
    "median_clipped_mean",
    "robust_aggregate",
    "score_contributions",
    "trimmed_mean",
    "weights_from_scores",
]
