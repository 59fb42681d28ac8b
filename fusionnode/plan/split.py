"""Stage split: the min-max DP that cuts a chain of blocks over one pipeline's devices.

For devices in order at one micro-batch size, stage k costs its compute plus its outgoing link,
under memory limits; AdaTopK ratios are re-chosen from the split's bottleneck and the DP re-run
(`best_split`); a coordinate descent moves single boundaries against any objective
(`refine_split`). O(S n^2), vectorised over the chain."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from fusionnode.plan.estimator import (
    K_MIN,
    LINK_TARGET_FRACTION,
    Q8_WIRE_FACTOR,
    TOPK_WIRE_FACTOR,
    Chain,
    Estimator,
    PipelineCost,
)

DP_ITERATIONS = 3  # split DP re-runs with AdaTopK targets from the previous split
DP_ITERATIONS_LARGE = 2  # the same on large clusters (more than plan.evaluate.SMALL_CLUSTER workers)
REFINE_PASSES = 4  # coordinate-descent passes of refine_split over a pipeline's boundaries


def micro_batch_sizes(batch: int) -> list[int]:
    """Micro-batch sizes the planner and the exhaustive reference consider: powers of two <= batch."""
    out, u = [], 1
    while u <= max(1, batch):
        out.append(u)
        u *= 2
    return out


# ------------------------------------------------------------------------------------------------
# the split DP
# ------------------------------------------------------------------------------------------------
def _link_cost_vector(
    x: np.ndarray, bw: float, lat: float, target: float, k_min: float = K_MIN
) -> np.ndarray:
    """estimator.link_comm for each dense size in x (both directions), with the AdaTopK ratio of
    estimator.choose_ratio at `target` seconds per direction (math.inf: dense)."""
    dense = lat + x * 8.0 / bw
    if not math.isfinite(target):
        return 2.0 * dense
    avail = target - lat
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(avail <= 0, k_min, np.clip(avail * bw / 8.0 / (x * TOPK_WIRE_FACTOR), k_min, 1.0))
    r = np.where((dense <= target) | (x <= 0), 1.0, r)
    act = np.where(r >= 1.0, x, x * r * TOPK_WIRE_FACTOR)
    grad = np.where(r >= 1.0, x, x * Q8_WIRE_FACTOR)
    return 2.0 * lat + (act + grad) * 8.0 / bw


_MATRIX_CACHE: dict[tuple[int, int, int], tuple[np.ndarray, ...]] = {}


def _range_matrices(chain: Chain, param_factor: int, u: int) -> tuple[np.ndarray, ...]:
    """[i, j] matrices over chain positions: i < j, forward flops, worker param bytes, activation
    bytes in flight per micro-batch of range [i, j). Cached for the chain's lifetime."""
    key = (id(chain), param_factor, u)
    hit = _MATRIX_CACHE.get(key)
    if hit is not None and hit[0] is chain:
        return hit[1:]
    F, P, A, X = chain.flops, chain.params, chain.acts, chain.cut
    n = chain.blocks
    valid = np.arange(n + 1)[:, None] < np.arange(n + 1)[None, :]
    mats = (
        valid,
        F[None, :] - F[:, None],
        (P[None, :] - P[:, None]) * param_factor,
        (A[None, :] - A[:, None] + X[:, None]) * u,
    )
    if len(_MATRIX_CACHE) > 64:
        _MATRIX_CACHE.clear()
    _MATRIX_CACHE[key] = (chain, *mats)  # type: ignore[assignment]
    return mats


def split_dp(
    est: Estimator,
    chain: Chain,
    devices: Sequence[int],
    u: int,
    target: float = math.inf,
    sync_cap: float = math.inf,
    sync_terms: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[int] | None:
    """Exact min-max split of the chain over devices in this order (each gets >= 1 block): stage
    time = compute + outgoing link (AdaTopK at LINK_TARGET_FRACTION of target), within memory, and with
    every stage's sync time (fixed[d] + param bytes * per_byte[d]) at most sync_cap."""
    s, n = len(devices), chain.blocks
    if s > n:
        return None
    spf = est.seconds_per_flop_all()
    cap = est.capacities()
    X = chain.cut
    valid_shape, dflops, dparam, dact = _range_matrices(chain, est.param_factor(), u)
    f = None
    args = []
    for k, d in enumerate(devices):
        cost = dflops * (u * spf[d])
        if k < s - 1:
            bw, lat = est.link(d, devices[k + 1])
            cost = (
                cost
                + _link_cost_vector(
                    X * u,
                    bw,
                    lat,
                    LINK_TARGET_FRACTION * target if est.compress else math.inf,
                    est.keep_floor,
                )[None, :]
            )
        ok = valid_shape & (dparam + dact * (s - k) <= cap[d])
        if sync_terms is not None and math.isfinite(sync_cap):
            raw = dparam / est.param_factor()
            ok &= (raw <= 0) | (sync_terms[0][d] + raw * sync_terms[1][d] <= sync_cap)
        cost = np.where(ok, cost, np.inf)
        if k == 0:
            f = cost[0].copy()
            args.append(np.zeros(n + 1, dtype=int))
        else:
            m = np.maximum(f[:, None], cost)
            args.append(np.argmin(m, axis=0))
            f = m[args[-1], np.arange(n + 1)]
    assert f is not None
    if not math.isfinite(f[n]):
        return None
    split = [n]
    for k in range(s - 1, 0, -1):
        split.append(int(args[k][split[-1]]))
    split.append(0)
    return split[::-1]


def best_split(
    est: Estimator, chain: Chain, devices: Sequence[int], u: int, iterations: int = DP_ITERATIONS
) -> PipelineCost | None:
    """DP dense, then again with AdaTopK targets from the previous split; best fitting result."""
    best: PipelineCost | None = None
    target = math.inf
    tried: set[tuple[int, ...]] = set()
    for _ in range(iterations):
        split = split_dp(est, chain, devices, u, target)
        if split is None or tuple(split) in tried:
            break
        tried.add(tuple(split))
        cost = est.evaluate(chain, devices, split, u)
        if cost.fits and (best is None or cost.bottleneck_s < best.bottleneck_s):
            best = cost
        target = max(cost.compute_s)
    return best


def refine_split(
    est: Estimator, chain: Chain, cost: PipelineCost, price: Callable[[PipelineCost], float]
) -> PipelineCost:
    """Coordinate descent on the split's boundaries (each moved by one block at a time) towards a
    lower `price` (the pipeline's time for its samples, sync included). The DP minimises the
    slowest stage, which ignores the pipeline's fill (every stage and link once, there and back):
    with few micro-batches a split that moves work away from a slow link's side can be faster."""
    best, t_best = cost, price(cost)
    s = cost.stages
    for _ in range(REFINE_PASSES):
        improved = False
        for k in range(1, s):
            for delta in (-1, 1):
                split = list(best.split)
                split[k] += delta
                if not split[k - 1] < split[k] < split[k + 1]:
                    continue
                c = est.evaluate(chain, best.devices, split, best.micro_batch_size)
                if not c.fits:
                    continue
                t = price(c)
                if t and t < t_best * (1 - 1e-9):
                    best, t_best, improved = c, t, True
        if not improved:
            break
    return best
