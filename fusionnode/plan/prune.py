"""Leaving poorly connected devices out: a layout's worst-linked data-parallel groups dropped.

DT-FM's scheduler (plan/dtfm.py) must use every device: its shape is D replicas x S stages with
D * S = the worker count, layers split evenly. Where a few sites hang on slow, far links (DT-FM's
worldwide setting: Tokyo and Seoul, 0.3-0.7 Gbit/s and 96-238 ms to the rest), every pipeline
crosses them, twice per micro-batch, and the 1F1B pipeline waits on their round trip. The planner
may leave them idle: `pruned_layouts` takes a grid-shaped layout (equal pipelines; its stage k's
devices across the pipelines form data-parallel group k), and

* drops groups greedily, each time the one whose removal makes the cheapest open-loop path through
  the rest (dtfm.open_loop_path over bottleneck matchings, as DT-FM chains its groups), down to
  half the stages; two link prices rank them: DT-FM's (a pipeline's whole batch share of
  activations per boundary) and one micro-batch's (latency-dominated, what 1F1B's round trip waits on);
* re-chains each kept set along the cheapest path under each price, devices of consecutive groups
  joined by their bottleneck matching;
* splits the layers so the stages hold equal parameter bytes as nearly as blocks allow
  (`param_split`; the slowest group's all-reduce sets the data-parallel time under both the
  simulator's ring and DT-FM's model, and the even split by block count leaves the embedding's stage
  15% heavier), falling back to the even split where that does not fit;
* prices each with the batch split evenly and the best micro-batch size (grid.price_grid).

The full set re-chained and re-split is among the candidates too. The planner scores them all
under both cost models with its other candidates (anchors.robust_choice); nothing here decides.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from fusionnode.plan.dtfm import HELD_KARP_MAX, bottleneck_matching, open_loop_path
from fusionnode.plan.dtfm_cost import pp_edge_costs
from fusionnode.plan.estimator import Chain
from fusionnode.plan.evaluate import Context, Evaluated
from fusionnode.plan.grid import even_split, price_grid

MIN_STAGES = 3  # pruned layouts keep at least this many stages (and at least half the original)


def param_split(chain: Chain, stages: int) -> list[int]:
    """Chain positions cutting the blocks into `stages` non-empty stages whose largest parameter
    bytes is as small as contiguous blocks allow (binary search on that maximum, greedy fill)."""
    blocks = chain.blocks
    if not 1 <= stages <= blocks:
        raise ValueError(f"cannot split {blocks} blocks into {stages} stages")
    prefix = np.asarray(chain.params, dtype=float)

    def cuts(limit: float) -> list[int] | None:
        out = [0]
        for k in range(stages - 1):
            b = int(np.searchsorted(prefix, prefix[out[-1]] + limit, side="right")) - 1
            b = min(max(b, out[-1] + 1), blocks - (stages - 1 - k))
            out.append(b)
        out.append(blocks)
        heaviest = max(prefix[b] - prefix[a] for a, b in itertools.pairwise(out))
        return out if heaviest <= limit * (1 + 1e-12) else None

    lo, hi = float(prefix[-1]) / stages, float(prefix[-1])
    best = cuts(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        got = cuts(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    assert best is not None  # the whole model as the limit always splits
    return best


def _link_weights(ctx: Context, groups: Sequence[np.ndarray], nbytes: float) -> tuple[np.ndarray, dict]:
    """Group-to-group bottleneck matching costs for transfers of `nbytes`, and the matchings."""
    cost = pp_edge_costs(ctx.est.cluster, nbytes)
    s = len(groups)
    w = np.zeros((s, s))
    matches: dict[tuple[int, int], np.ndarray] = {}
    for a in range(s):
        for b in range(a + 1, s):
            c = np.maximum(cost[np.ix_(groups[a], groups[b])], cost[np.ix_(groups[b], groups[a])].T)
            w[a, b], matches[(a, b)] = bottleneck_matching(c)
            w[b, a] = w[a, b]
    return w, matches


def _lanes(groups: Sequence[np.ndarray], path: Sequence[int], matches: dict) -> list[tuple[int, ...]]:
    """Pipelines along `path` (group indices), consecutive groups joined by their matching."""
    lanes = [[int(v)] for v in groups[path[0]]]
    for prev, nxt in itertools.pairwise(path):
        if prev < nxt:
            col = matches[(prev, nxt)]
            step = {int(groups[prev][r]): int(groups[nxt][col[r]]) for r in range(len(col))}
        else:
            col = matches[(nxt, prev)]
            step = {int(groups[prev][col[r]]): int(groups[nxt][r]) for r in range(len(col))}
        for lane in lanes:
            lane.append(step[lane[-1]])
    return [tuple(lane) for lane in lanes]


def cheapest_subsets(w: np.ndarray, floor: int) -> list[tuple[int, ...]]:
    """For each size from len(w) - 1 down to `floor`: the groups whose cheapest open-loop path is
    cheapest among all sets of that size (exact: Held-Karp over every subset); none beyond
    HELD_KARP_MAX groups."""
    g = w.shape[0]
    out: list[tuple[int, ...]] = []
    if g > HELD_KARP_MAX:
        return out
    full = 1 << g
    dp = np.full((full, g), np.inf)
    for j in range(g):
        dp[1 << j, j] = 0.0
    pop = np.array([bin(m).count("1") for m in range(full)])
    for mask in range(1, full):  # masks in increasing order: every subset before its supersets
        row = dp[mask]
        if not np.isfinite(row).any():
            continue
        for nxt in range(g):
            if mask >> nxt & 1:
                continue
            val = float(np.min(row + w[:, nxt]))
            if val < dp[mask | 1 << nxt, nxt]:
                dp[mask | 1 << nxt, nxt] = val
    best = dp.min(axis=1)
    for size in range(g - 1, floor - 1, -1):
        masks = np.nonzero(pop == size)[0]
        m = int(masks[np.argmin(best[masks])])
        out.append(tuple(j for j in range(g) if m >> j & 1))
    return out


def pruned_layouts(ctx: Context, ev: Evaluated) -> list[Evaluated]:
    """`ev` re-chained and re-split by parameters, with 0 .. S - max(MIN_STAGES, S / 2) of its
    data-parallel groups left out (module docstring); [] unless `ev` is a grid of >= 2 pipelines
    of >= MIN_STAGES stages."""
    pipes = ev.pipelines
    d, s = len(pipes), len(pipes[0])
    if d < 2 or s < MIN_STAGES or any(len(p) != s for p in pipes):
        return []
    groups = [np.asarray([p[k] for p in pipes], dtype=int) for k in range(s)]
    chain = ctx.chain
    cuts = [float(chain.cut[b]) for b in range(1, chain.blocks)]
    per_sample = sum(cuts) / len(cuts) if cuts else 0.0
    u = max(o.u for o in ev.choices)
    prices = [per_sample * ctx.batch / d, per_sample * u]  # DT-FM's (a whole share), one micro-batch's
    weights = [_link_weights(ctx, groups, nbytes) for nbytes in prices]
    floor = max(MIN_STAGES, math.ceil(s / 2))
    kept_sets: list[tuple[int, ...]] = [tuple(range(s))]
    for w, _ in weights:
        for kept in cheapest_subsets(w, floor):
            if kept not in kept_sets:
                kept_sets.append(kept)
    out: list[Evaluated] = []
    seen: set = set()
    for kept in kept_sets:
        sub = [groups[g] for g in kept]
        for w, matches in weights:
            idx = list(kept)
            _, path = open_loop_path(w[np.ix_(idx, idx)])
            sub_matches = {
                (i, j): matches[(idx[i], idx[j])] for i in range(len(idx)) for j in range(i + 1, len(idx))
            }
            lanes = _lanes(sub, path, sub_matches)
            key = tuple(lanes)
            if key in seen:
                continue
            seen.add(key)
            n = len(kept)
            for split in (param_split(chain, n), even_split(chain.blocks, n)):
                priced = price_grid(ctx, lanes, [split] * d)
                if priced is not None:
                    out.append(dataclasses.replace(priced, origin="pruned"))
                    break
    return out
