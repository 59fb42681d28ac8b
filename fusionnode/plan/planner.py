"""Asymmetric DP x PP planner (FlashFlex-style search over OP-Fence device groupings).

Search, all under the estimator's cost model (fusionnode/plan/estimator.py):

1. coarsen the OP-DAG into a chain of blocks at cheap cuts (fence.coarsen);
2. group the worker devices by bandwidth (fence.fence_levels) and, for every grouping and a
   sensible set of pipeline counts, build candidate pipelines three ways: whole groups packed into
   pipelines ("pack"), the group path cut into equal-speed chunks ("chunk"), and the group path
   dealt round-robin so each pipeline spans every group ("stripe");
3. for each pipeline (devices in order) and micro-batch size, split the chain exactly with the
   min-max DP (O(S n^2), vectorised): stage k costs compute + its outgoing link, under memory
   limits; AdaTopK ratios are re-chosen from the split's bottleneck and the DP re-run;
4. share the global batch between pipelines to minimise the slowest (bisection on step time);
5. improve the best configuration by local search (drop / move / swap devices) and pick the
   number of optimizer hosts.

`fusionnode.plan.exhaustive.exhaustive_plan` enumerates device subsets, pipelines, orders, splits
and micro-batch sizes for tiny instances: the reference the planner is tested against.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from fusionnode.errors import ConfigError, PlanError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan import fence
from fusionnode.plan.cluster import Cluster
from fusionnode.plan.estimator import (
    DEFAULT_EFFICIENCY,
    K_MIN,
    LINK_TARGET_FRACTION,
    OPTIMIZER_BYTES_FACTOR,
    Q8_WIRE_FACTOR,
    TOPK_WIRE_FACTOR,
    USABLE_MEMORY_FRACTION,
    Chain,
    Estimator,
    PipelineCost,
)
from fusionnode.plan.plan import OptimizerHost, PipelinePlan, Plan, Prediction, StagePlan

log = logging.getLogger(__name__)

DP_ITERATIONS = 3  # split DP re-runs with AdaTopK targets from the previous split
DP_ITERATIONS_LARGE = 2  # the same on clusters larger than SMALL_CLUSTER
REFINE_PASSES = 4  # coordinate-descent passes of refine_split over a pipeline's boundaries
SYNC_CAP_FRACTIONS = (0.75, 0.5, 0.25)  # sync caps (x the fastest split's sync) the DP is re-run with
MAX_PIPELINE_COUNTS = 8  # pipeline counts tried per grouping
TRIM_SPEED_RATIO = 0.5  # only try dropping devices slower than this x the pipeline's fastest
LOCAL_SEARCH_MOVES = 3000  # most candidate moves evaluated by the local search
HOST_COUNT_MULTIPLIERS = (1, 2, 4, 8, 16)  # optimizer host counts tried, x the minimum by RAM
HOST_SPREAD_MAX = 16  # the search spreads the optimizer over at most this x the minimum host count
SMALL_CLUSTER = 8  # up to this many workers: DP at every micro-batch size, then local search
LOCAL_SEARCH_STARTS = 3  # local search from this many of the best constructed configurations


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


# ------------------------------------------------------------------------------------------------
# pipelines, shares, whole configurations
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Option:
    """One way to run a pipeline: a split at micro-batch size u, with its sync time."""

    cost: PipelineCost
    sync_s: float

    @property
    def u(self) -> int:
        return self.cost.micro_batch_size

    def time(self, samples: int) -> float:
        if samples <= 0:
            return 0.0
        return self.cost.pipeline_time(-(-samples // self.u)) + self.sync_s

    def capacity(self, tau: float) -> int:
        """Most samples this option runs within tau seconds."""
        return self.cost.capacity(tau - self.sync_s) * self.u


@dataclasses.dataclass
class Context:
    est: Estimator
    chain: Chain
    batch: int
    hosts: list[tuple[int, float]]
    workers: list[int]
    micro_batches: int | None = None  # fixed by the user, else chosen
    sizes: list[int] = dataclasses.field(default_factory=list)
    exhaustive_sizes: bool = False  # run the split DP at every micro-batch size (small instances)
    _splits: dict = dataclasses.field(default_factory=dict)
    _host_terms: tuple | None = None
    evaluations: int = 0

    def _key(self, devices: tuple[int, ...], u: int) -> tuple:
        """Pipelines of identical devices on identical links split identically: cache by that."""
        est = self.est
        spf = est.seconds_per_flop_all()
        cap = est.capacities()
        links = tuple(est.link(a, b) for a, b in itertools.pairwise(devices))
        return (tuple(float(spf[d]) for d in devices), tuple(float(cap[d]) for d in devices), links, u)

    def split(self, devices: tuple[int, ...], u: int) -> PipelineCost | None:
        key = self._key(devices, u)
        if key not in self._splits:
            self.evaluations += 1
            its = DP_ITERATIONS if self.exhaustive_sizes else DP_ITERATIONS_LARGE
            self._splits[key] = best_split(self.est, self.chain, devices, u, its)
        cost = self._splits[key]
        if cost is None or cost.devices == devices:
            return cost
        return dataclasses.replace(cost, devices=devices)

    def refine(self, cost: PipelineCost, multi: bool, samples: int) -> PipelineCost:
        """refine_split for a pipeline running `samples` samples, cached like the splits."""
        if cost.stages < 2:
            return cost
        key = ("refine", tuple(self.hosts), multi, *self._key(cost.devices, cost.micro_batch_size))
        key = (*key, cost.split, samples)
        if key not in self._splits:
            self._splits[key] = refine_split(
                self.est, self.chain, cost, lambda c: Option(c, self.sync(c, multi)).time(samples)
            )
        c = self._splits[key]
        return c if c.devices == cost.devices else dataclasses.replace(c, devices=cost.devices)

    def reprice(self, cost: PipelineCost, u: int) -> PipelineCost | None:
        """The same split at another micro-batch size (AdaTopK ratios re-chosen)."""
        key = ("reprice", *self._key(cost.devices, u), cost.split)
        if key not in self._splits:
            c = self.est.evaluate(self.chain, cost.devices, cost.split, u)
            self._splits[key] = c if c.fits else None
        c = self._splits[key]
        if c is None or c.devices == cost.devices:
            return c
        return dataclasses.replace(c, devices=cost.devices)

    def sync_terms(self, multi: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """Per device (fixed seconds, seconds per parameter byte) of a stage's sync; None when the
        sync depends on the pipeline (offload off)."""
        if not self.est.offload:
            return None
        key = tuple(self.hosts)
        if self._host_terms is None or self._host_terms[0] != key:
            bw = self.est.cluster.bandwidth_bps
            lat = self.est.cluster.latency_s
            n = bw.shape[0]
            fixed = np.zeros(n)
            per_byte = np.zeros(n)
            for h, share in self.hosts:
                if share <= 0:
                    continue
                mask = np.arange(n) != h
                fixed[mask] += 2.0 * lat[mask, h]
                per_byte[mask] += 2.0 * share * 8.0 / bw[mask, h]
            self._host_terms = (key, fixed, per_byte)
        return self._host_terms[1], self._host_terms[2]

    def sync(self, cost: PipelineCost, multi: bool) -> float:
        """The pipeline's data-parallel sync (Estimator.stage_sync_time, vectorised over hosts)."""
        terms = self.sync_terms(multi)
        if terms is None:
            outside = self.est.outside_bandwidth(cost.devices, self.workers)
            return max(
                self.est.stage_sync_time(d, p, self.hosts, multi, float(o))
                for d, p, o in zip(cost.devices, cost.param_bytes, outside, strict=True)
            )
        fixed, per_byte = terms
        return max(
            (float(fixed[d] + p * per_byte[d]) if p > 0 else 0.0)
            for d, p in zip(cost.devices, cost.param_bytes, strict=True)
        )

    def sync_variants(self, base: PipelineCost, multi: bool) -> list[PipelineCost]:
        """Splits that trade a slower bottleneck for a shorter sync: the DP re-run with every
        stage's sync capped at SYNC_CAP_FRACTIONS of the base split's sync."""
        terms = self.sync_terms(multi)
        if terms is None:
            return []
        y0 = self.sync(base, multi)
        if y0 <= 0:
            return []
        key = ("sync", tuple(self.hosts), *self._key(base.devices, base.micro_batch_size), base.split)
        if key not in self._splits:
            out = []
            for frac in SYNC_CAP_FRACTIONS:
                split = split_dp(
                    self.est,
                    self.chain,
                    base.devices,
                    base.micro_batch_size,
                    max(base.compute_s),
                    y0 * frac,
                    terms,
                )
                if split is not None and tuple(split) != base.split:
                    c = self.est.evaluate(self.chain, base.devices, split, base.micro_batch_size)
                    if c.fits:
                        out.append(c)
            self._splits[key] = out
        return [
            c if c.devices == base.devices else dataclasses.replace(c, devices=base.devices)
            for c in self._splits[key]
        ]

    def options(self, devices: tuple[int, ...], multi: bool, share_hint: int | None = None) -> list[Option]:
        """Options of a pipeline over these devices (in order); [] if none fits.

        With the micro-batch count free: the split DP runs at a reference size (about four
        micro-batches per stage), the split is re-priced at nearby sizes, and the DP runs again
        at the best of them."""
        hint = share_hint or self.batch
        s = len(devices)
        if self.micro_batches is not None:
            sizes = sorted({max(1, -(-b // self.micro_batches)) for b in (hint, max(1, hint // 2), hint * 2)})
            out = []
            for u in (x for x in sizes if x <= self.batch):
                cost = self.split(devices, u)
                if cost is not None:
                    out.extend(
                        Option(c, self.sync(c, multi)) for c in [cost, *self.sync_variants(cost, multi)]
                    )
            return out
        if self.exhaustive_sizes:
            base = self.sizes
        else:
            ref = max(1, hint // (4 * s))
            i0 = max(0, min(len(self.sizes) - 1, int(math.log2(ref))))
            base = self.sizes[max(0, i0 - 2) : i0 + 3]
        u0 = base[len(base) // 2] if not self.exhaustive_sizes else None
        costs: dict[int, PipelineCost] = {}
        dp_sizes = base if u0 is None else [u0]
        for u in dp_sizes:
            c = self.split(devices, u)
            if c is not None:
                costs[u] = c
        if u0 is not None:
            ref_cost = costs.get(u0)
            if ref_cost is None:  # the reference size does not fit: try the smallest
                u0 = base[0]
                ref_cost = self.split(devices, u0)
                if ref_cost is None:
                    return []
                costs[u0] = ref_cost
            for u in base:
                if u not in costs:
                    c = self.reprice(ref_cost, u)
                    if c is not None:
                        costs[u] = c
            best_u = min(costs, key=lambda u: Option(costs[u], 0.0).time(hint))
            if best_u != u0:
                c = self.split(devices, best_u)
                if c is not None and c.bottleneck_s < costs[best_u].bottleneck_s:
                    costs[best_u] = c
        out = []
        for u, c in sorted(costs.items()):
            refined = self.refine(c, multi, hint)
            if refined is not c:
                out.append(Option(refined, self.sync(refined, multi)))
            out.append(Option(c, self.sync(c, multi)))
            if self.exhaustive_sizes or u == u0:
                out.extend(Option(v, self.sync(v, multi)) for v in self.sync_variants(c, multi))
        return out


def _pipe_time(opts: Sequence[Option], samples: int, fixed_m: int | None) -> tuple[float, Option | None]:
    best, arg = math.inf, None
    for o in opts:
        if fixed_m is not None and -(-samples // o.u) > fixed_m:
            continue
        t = o.time(samples)
        if t < best:
            best, arg = t, o
    return best, arg


@dataclasses.dataclass(frozen=True)
class Evaluated:
    step_s: float
    pipelines: tuple[tuple[int, ...], ...]  # used pipelines (device orders)
    shares: tuple[int, ...]
    choices: tuple[Option, ...]
    hosts: tuple[tuple[int, float], ...]


def evaluate_config(ctx: Context, pipelines: Sequence[tuple[int, ...]]) -> Evaluated | None:
    """Best batch shares for these pipelines; None if they cannot run the batch at all."""
    pipes = [p for p in pipelines if p]
    if not pipes:
        return None
    multi = len(pipes) > 1
    hint = max(1, ctx.batch // len(pipes))
    opts = [ctx.options(p, multi, hint) for p in pipes]
    live = [i for i, o in enumerate(opts) if o]
    if not live:
        return None
    fixed_m = ctx.micro_batches
    # all options of all live pipelines as arrays, for a vectorised capacity(tau)
    flat = [(k, o) for k, i in enumerate(live) for o in opts[i]]
    owner = np.array([k for k, _ in flat])
    uu = np.array([o.u for _, o in flat], dtype=float)
    tt = np.array([o.cost.period_s for _, o in flat])
    ff = np.array([o.cost.fill_s for _, o in flat])
    yy = np.array([o.sync_s for _, o in flat])
    mcap = np.full(len(flat), np.inf) if fixed_m is None else np.full(len(flat), float(fixed_m))
    starts = np.searchsorted(owner, np.arange(len(live)))

    def capacities(tau: float) -> np.ndarray:
        left = tau - yy - ff
        m = np.where(left >= -1e-12 * ff, np.floor(np.maximum(left, 0.0) / tt * (1 + 1e-12)) + 1, 0.0)
        per = np.minimum(np.maximum(m, 0.0), mcap) * uu
        return np.maximum.reduceat(per, starts)

    # bisection on the step time tau: the smallest tau whose capacities cover the batch
    hi = min(_pipe_time(opts[i], ctx.batch, fixed_m)[0] for i in live)
    if not math.isfinite(hi):
        hi = 1.0
        while capacities(hi).sum() < ctx.batch:
            hi *= 2
            if hi > 1e12:
                return None
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if capacities(mid).sum() >= ctx.batch:
            hi = mid
        else:
            lo = mid
    capv = capacities(hi)
    caps = {i: int(min(ctx.batch, capv[k])) for k, i in enumerate(live)}
    surplus = sum(caps.values()) - ctx.batch
    for i in sorted(live, key=lambda i: -caps[i]):  # trim the surplus, biggest shares first
        take = min(surplus, caps[i])
        caps[i] -= take
        surplus -= take
    used = [i for i in live if caps[i] > 0]
    # second pass: re-evaluate with the real pipeline count (sync of a single pipeline is 0 off-load)
    if len(used) != len(pipes):
        return evaluate_config(ctx, [pipes[i] for i in used]) if len(used) < len(pipes) else None
    choices, times = [], []
    for i in used:
        t, o = _pipe_time(opts[i], caps[i], fixed_m)
        if o is None:
            return None
        choices.append(o)
        times.append(t)
    total_params = float(ctx.chain.params[-1])
    step = max(max(times), ctx.est.host_bound(total_params, ctx.hosts, len(used))) + ctx.est.step_overhead_s
    return Evaluated(
        step_s=step,
        pipelines=tuple(pipes[i] for i in used),
        shares=tuple(caps[i] for i in used),
        choices=tuple(choices),
        hosts=tuple(ctx.hosts),
    )


# ------------------------------------------------------------------------------------------------
# optimizer hosts
# ------------------------------------------------------------------------------------------------
def host_candidates(cluster: Cluster, workers: Sequence[int]) -> list[tuple[int, float]]:
    """(device, median bandwidth to the workers) of optimizer-role devices, best connected first
    (ties: more RAM)."""
    cands = [i for i, d in enumerate(cluster.devices) if d.is_optimizer]
    w = np.asarray(workers, dtype=int)
    bw = cluster.bandwidth_bps
    out = []
    for i in cands:
        others = w[w != i]
        med = float(np.median(np.minimum(bw[i, others], bw[others, i]))) if len(others) else 0.0
        out.append((i, med))
    return sorted(out, key=lambda x: (-x[1], -cluster.devices[x[0]].ram_gb, x[0]))


def choose_hosts(
    cluster: Cluster,
    workers: Sequence[int],
    total_param_bytes: float,
    multiplier: int = 1,
    spread: bool = False,
) -> list[tuple[int, float]]:
    """(device index, share) for the optimizer state (OPTIMIZER_BYTES_FACTOR x param bytes), shares
    proportional to RAM: the fewest best-connected hosts that fit, times `multiplier`; with
    `spread`, every host at least half as well connected as the best (up to HOST_SPREAD_MAX x)."""
    need = total_param_bytes * OPTIMIZER_BYTES_FACTOR
    cands = host_candidates(cluster, workers)
    if not cands:
        raise PlanError("offload is on but no device has the 'optimizer' role; add one or use --offload off")
    chosen: list[int] = []
    room = 0.0
    for i, _ in cands:
        if room >= need:
            break
        chosen.append(i)
        room += cluster.devices[i].ram_gb * 1e9 * USABLE_MEMORY_FRACTION
    if room < need:
        raise PlanError(
            f"optimizer state needs {need / 1e9:.1f} GB of host RAM, the optimizer-role devices have "
            f"{room / 1e9:.1f} GB; add RAM-rich optimizer hosts or use --offload off"
        )
    k = len(chosen) * multiplier
    if spread:
        good = sum(1 for _, med in cands if med >= 0.5 * cands[0][1])
        k = max(len(chosen), min(good, len(chosen) * HOST_SPREAD_MAX))
    picked = [i for i, _ in cands[: min(len(cands), k)]]
    ram = np.array([cluster.devices[i].ram_gb for i in picked])
    return [(i, float(r / ram.sum())) for i, r in zip(picked, ram, strict=False)]


def host_sets(
    cluster: Cluster, workers: Sequence[int], total_param_bytes: float, first: list[tuple[int, float]]
) -> list[list[tuple[int, float]]]:
    """The optimizer host sets a whole search is run once for: `first`, then `choose_hosts` at every
    HOST_COUNT_MULTIPLIERS multiple (duplicates dropped)."""
    sets = [list(first)]
    for mult in HOST_COUNT_MULTIPLIERS:
        hs = choose_hosts(cluster, workers, total_param_bytes, mult)
        if hs not in sets:
            sets.append(hs)
    return sets


def assign_param_names(graph: OpGraph, hosts: Sequence[tuple[int, float]]) -> list[list[str]]:
    """Shard parameter names over hosts by bytes (greedy: the host furthest below its share)."""
    sizes: dict[str, float] = {}
    for node in graph.nodes:
        for name in node.param_names:
            if name not in sizes:
                sizes[name] = node.param_bytes / max(1, len(node.param_names))
    total = sum(sizes.values()) or 1.0
    heap = [(-share * total, k) for k, (_, share) in enumerate(hosts)]
    heapq.heapify(heap)
    out: list[list[str]] = [[] for _ in hosts]
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        room, k = heapq.heappop(heap)
        out[k].append(name)
        heapq.heappush(heap, (room + size, k))
    return [sorted(x) for x in out]


# ------------------------------------------------------------------------------------------------
# candidate generation
# ------------------------------------------------------------------------------------------------
def _pipeline_counts(n_workers: int, min_stages: int, blocks: int) -> list[int]:
    hi = max(1, n_workers // max(1, min_stages))
    lo = max(1, -(-n_workers // blocks)) if n_workers > blocks else 1
    counts = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512}
    counts |= {hi, max(1, hi // 2), lo}
    vals = sorted(c for c in counts if lo <= c <= hi)
    if len(vals) > MAX_PIPELINE_COUNTS:
        pick = np.linspace(0, len(vals) - 1, MAX_PIPELINE_COUNTS).round().astype(int)
        vals = sorted({vals[i] for i in pick})
    return vals


def _speed(cluster: Cluster, d: int) -> float:
    return cluster.devices[d].tflops


def _split_groups(cluster: Cluster, groups: list[list[int]], count: int) -> list[list[int]]:
    """Halve the largest groups (in their order) until there are at least `count`."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[k]) < 2:
            break
        g = groups.pop(k)
        groups[k:k] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups


def _pack(cluster: Cluster, groups: list[list[int]], count: int) -> list[list[int]]:
    groups = _split_groups(cluster, groups, count)
    bins: list[list[int]] = [[] for _ in range(count)]
    load = [0.0] * count
    for g in sorted(groups, key=lambda g: -sum(_speed(cluster, d) for d in g)):
        k = min(range(count), key=lambda i: load[i])
        bins[k].append(g)  # type: ignore[arg-type]
        load[k] += sum(_speed(cluster, d) for d in g)
    return [fence.order_devices(cluster, b) for b in bins if b]  # type: ignore[arg-type]


def _chunk(cluster: Cluster, order: list[int], count: int) -> list[list[int]]:
    speeds = np.array([_speed(cluster, d) for d in order])
    edges = np.concatenate([[0.0], np.cumsum(speeds)])
    cuts = np.searchsorted(edges, np.linspace(0, edges[-1], count + 1)[1:-1])
    parts = np.split(np.arange(len(order)), cuts)
    return [[order[i] for i in p] for p in parts if len(p)]


def _stripe(order: list[int], count: int) -> list[list[int]]:
    return [order[k::count] for k in range(count) if order[k::count]]


def _trim(ctx: Context, pipe: list[int], share: int) -> tuple[int, ...]:
    """Drop the slowest devices while that helps this pipeline (or while it is longer than the chain)."""
    cluster = ctx.est.cluster
    cur = tuple(pipe)
    while len(cur) > ctx.chain.blocks:
        slow = min(cur, key=lambda d: (_speed(cluster, d), -d))
        cur = tuple(d for d in cur if d != slow)
    fastest = max(_speed(cluster, d) for d in cur)
    if min(_speed(cluster, d) for d in cur) >= TRIM_SPEED_RATIO * fastest:
        return cur

    def score(p: tuple[int, ...]) -> float:
        return _pipe_time(ctx.options(p, True, share), share, ctx.micro_batches)[0]

    best = score(cur)
    while len(cur) > 1:  # drop the slowest kind of device at once
        slowest = min(_speed(cluster, d) for d in cur)
        if slowest >= TRIM_SPEED_RATIO * fastest:
            break
        nxt = tuple(d for d in cur if _speed(cluster, d) > slowest)
        if not nxt:
            break
        t = score(nxt)
        if t < best * (1 - 1e-9) or not math.isfinite(best):
            cur, best = nxt, t
        else:
            break
    return cur


def _signature(pipes: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(sorted(tuple(p) for p in pipes))


def _local_search(ctx: Context, start: Evaluated, idle: list[int]) -> Evaluated:
    best = start
    moves = 0
    improved = True
    while improved and moves < LOCAL_SEARCH_MOVES:
        improved = False
        pipes = [list(p) for p in best.pipelines]
        unused = [d for d in ctx.workers if all(d not in p for p in pipes)]
        cands: list[list[list[int]]] = []
        for a, p in enumerate(pipes):
            for i in range(len(p)):
                if len(p) > 1:  # drop a device
                    cands.append([*pipes[:a], p[:i] + p[i + 1 :], *pipes[a + 1 :]])
                if i + 1 < len(p):  # swap neighbours
                    q = p.copy()
                    q[i], q[i + 1] = q[i + 1], q[i]
                    cands.append([*pipes[:a], q, *pipes[a + 1 :]])
                for b in range(len(pipes)):  # move to another pipeline (at its best end)
                    if b == a or len(p) == 1:
                        continue
                    rest = p[:i] + p[i + 1 :]
                    for pos in (0, len(pipes[b])):
                        new = [x.copy() for x in pipes]
                        new[a] = rest
                        new[b] = [*pipes[b][:pos], p[i], *pipes[b][pos:]]
                        cands.append(new)
                new = [x.copy() for x in pipes]  # split off as its own pipeline
                if len(p) > 1:
                    new[a] = p[:i] + p[i + 1 :]
                    new.append([p[i]])
                    cands.append(new)
            for d in unused:  # add an idle device at each position
                for pos in range(len(p) + 1):
                    cands.append([*pipes[:a], [*p[:pos], d, *p[pos:]], *pipes[a + 1 :]])
        for d in unused:
            cands.append([*pipes, [d]])
        # two idle devices at once (a single one may not pay for the extra stage)
        for a, p in enumerate(pipes):
            for d1, d2 in itertools.permutations(unused, 2):
                for i in range(len(p) + 1):
                    for j in range(i, len(p) + 1):
                        q = [*p[:i], d1, *p[i:j], d2, *p[j:]]
                        cands.append([*pipes[:a], q, *pipes[a + 1 :]])
        for c in cands:
            moves += 1
            ev = evaluate_config(ctx, [tuple(x) for x in c if x])
            if ev is not None and ev.step_s < best.step_s * (1 - 1e-9):
                best = ev
                improved = True
                break
            if moves >= LOCAL_SEARCH_MOVES:
                break
    return best


def _workers(cluster: Cluster) -> list[int]:
    return [i for i, d in enumerate(cluster.devices) if d.is_worker]


def _check_fits(
    graph: OpGraph, cluster: Cluster, est: Estimator, workers: Sequence[int], chain: Chain
) -> None:
    need = float(chain.params[-1]) * est.param_factor()
    have = float(sum(est.capacity(d) for d in workers))
    if need > have:
        extra = "" if est.offload else "; --offload on would need about half"
        raise PlanError(
            f"model {graph.model_name!r} needs {need / 1e9:.2f} GB for weights and gradients"
            f"{'' if est.offload else ' and optimizer state'} but the {len(workers)} workers of cluster "
            f"{cluster.name!r} have {have / 1e9:.2f} GB usable ({USABLE_MEMORY_FRACTION:.0%} of memory_gb){extra}"
        )
    blocks = np.diff(chain.params) * est.param_factor()
    biggest = float(blocks.max())
    top = max(est.capacity(d) for d in workers)
    if biggest > top:
        raise PlanError(
            f"the largest indivisible block of {graph.model_name!r} needs {biggest / 1e9:.2f} GB, the largest "
            f"worker has {top / 1e9:.2f} GB usable; a device with at least {biggest / 1e9 / USABLE_MEMORY_FRACTION:.2f} "
            "memory_gb would fit"
        )


def _validate_inputs(graph: OpGraph, batch_size: int, micro_batches: int | None) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size must be a positive integer, got {batch_size!r}")
    if micro_batches is not None and micro_batches < 1:
        raise ConfigError(f"micro-batches must be >= 1, got {micro_batches!r}")
    if graph.num_nodes == 0:
        raise ConfigError(f"model {graph.model_name!r} has no operators")


def _context(
    graph: OpGraph,
    cluster: Cluster,
    batch_size: int,
    micro_batches: int | None,
    offload: bool,
    efficiency: float | None,
    estimator: Estimator | None,
    max_blocks: int,
    compress: bool = True,
    keep_floor: float = K_MIN,
) -> Context:
    _validate_inputs(graph, batch_size, micro_batches)
    est = estimator or Estimator(
        cluster,
        DEFAULT_EFFICIENCY if efficiency is None else efficiency,
        offload=offload,
        compress=compress,
        keep_floor=keep_floor,
    )
    chain = Chain.from_graph(graph, fence.coarsen(graph, max_blocks))
    workers = _workers(cluster)
    _check_fits(graph, cluster, est, workers, chain)
    hosts = choose_hosts(cluster, workers, float(chain.params[-1]), spread=True) if est.offload else []
    return Context(
        est=est,
        chain=chain,
        batch=batch_size,
        hosts=hosts,
        workers=workers,
        micro_batches=micro_batches,
        sizes=micro_batch_sizes(batch_size),
        exhaustive_sizes=len(workers) <= SMALL_CLUSTER,
    )


def plan(
    graph: OpGraph,
    cluster: Cluster,
    batch_size: int,
    *,
    micro_batches: int | None = None,
    seq_len: int | None = None,
    offload: bool = True,
    efficiency: float | None = None,
    estimator: Estimator | None = None,
    max_blocks: int = fence.MAX_BLOCKS,
    local_search: bool = True,
    compress: bool = True,
    with_anchors: bool = True,
    keep_floor: float = K_MIN,
) -> Plan:
    """The best plan the search finds for training `graph` on `cluster` (raises PlanError if none fits).
    `compress`: whether the job compresses its links (AdaTopK), so the plan may count on it;
    `with_anchors`: also consider every even grid and DT-FM's layout (plan/anchors.py);
    `keep_floor`: the smallest AdaTopK keep ratio the plan may count on."""
    t0 = time.perf_counter()
    ctx = _context(
        graph,
        cluster,
        batch_size,
        micro_batches,
        offload,
        efficiency,
        estimator,
        max_blocks,
        compress,
        keep_floor,
    )
    est, chain = ctx.est, ctx.chain
    workers = ctx.workers
    need = float(chain.params[-1]) * est.param_factor()
    top = sorted((est.capacity(d) for d in workers), reverse=True)
    min_stages = next((k + 1 for k in range(len(top)) if sum(top[: k + 1]) >= need), len(top))
    levels = fence.fence_levels(cluster, workers)
    counts = _pipeline_counts(len(workers), min_stages, chain.blocks)
    small = len(workers) <= SMALL_CLUSTER
    candidates = [list(ctx.hosts)]
    if small and est.offload:  # small clusters: the whole search once per optimizer host set
        candidates = host_sets(cluster, workers, float(chain.params[-1]), ctx.hosts)
    best: Evaluated | None = None
    for hs in candidates:
        ctx.hosts = hs
        ctx._host_terms = None
        found = _constructive(ctx, levels, counts, LOCAL_SEARCH_STARTS if small and local_search else 1)
        for ev in found:
            if small and local_search:
                ev = _local_search(ctx, ev, [])
            if best is None or ev.step_s < best.step_s:
                best = ev
    shortlist: list[Evaluated] = []
    if with_anchors:  # even grids and DT-FM's layout: the plan must be at least as fast
        from fusionnode.plan.anchors import SIMULATED, anchors, shallow_grids
        from fusionnode.plan.grid import even_grids

        ctx.hosts, ctx._host_terms = list(candidates[0]), None
        shortlist = anchors(ctx)
        if shortlist and (best is None or shortlist[0].step_s < best.step_s):
            best = shortlist[0]
        if not small:  # candidates to simulate against the choice
            shortlist = shortlist[:SIMULATED] + even_grids(ctx)[:SIMULATED] + shallow_grids(graph, ctx)
    if best is None:
        raise PlanError(
            f"no pipeline of cluster {cluster.name!r} fits {graph.model_name!r} at batch {batch_size}: "
            f"the weights{'' if est.offload else ', grads and optimizer state'} need {need / 1e9:.2f} GB "
            f"across at most {chain.blocks} stages, plus activations of at least one sample per stage; "
            f"{'' if est.offload else 'use --offload on, '}a smaller model or sequence, or devices with more memory"
        )
    ctx.hosts = list(best.hosts)
    ctx._host_terms = None
    best = _best_hosts(ctx, best)
    if shortlist and not small:  # small clusters: the closed form is checked against the exhaustive optimum
        from fusionnode.plan.anchors import by_simulation

        best = by_simulation(graph, ctx, [best, *shortlist])
    log.info(
        "planned %s on %s: %d pipelines, step %.3fs, %d split evaluations, %.2fs",
        graph.model_name,
        cluster.name,
        len(best.pipelines),
        best.step_s,
        ctx.evaluations,
        time.perf_counter() - t0,
    )
    return build_plan(graph, ctx, best, seq_len, strategy="fusion")


def _constructive(ctx: Context, levels: list, counts: list[int], keep: int) -> list[Evaluated]:
    """The `keep` best configurations built from every grouping, pipeline count and builder."""
    cluster = ctx.est.cluster
    seen: set[tuple[tuple[int, ...], ...]] = set()
    found: list[Evaluated] = []
    for grouping in levels:
        order = fence.order_devices(cluster, grouping)
        for count in counts:
            share = max(1, ctx.batch // count)
            builders: list[Callable[[], list[list[int]]]] = [
                lambda g=grouping, c=count: _pack(cluster, g, c),
                lambda o=order, c=count: _chunk(cluster, o, c),
                lambda o=order, c=count: _stripe(o, c),
            ]
            for build in builders:
                pipes = build()
                if len(pipes) != count:
                    continue
                pipes_t = [_trim(ctx, p, share) for p in pipes]
                sig = _signature(pipes_t)
                if sig in seen:
                    continue
                seen.add(sig)
                ev = evaluate_config(ctx, pipes_t)
                if ev is not None:
                    found.append(ev)
    found.sort(key=lambda e: e.step_s)
    out: list[Evaluated] = []
    for ev in found:  # distinct configurations only
        if all(_signature(ev.pipelines) != _signature(o.pipelines) for o in out):
            out.append(ev)
        if len(out) >= keep:
            break
    return out


def _best_hosts(ctx: Context, ev: Evaluated) -> Evaluated:
    """Re-price the chosen pipelines with other optimizer host counts; keep the fastest."""
    if not ctx.est.offload:
        return ev
    best = ev
    tried = {tuple(ctx.hosts)}
    total = float(ctx.chain.params[-1])
    for mult in HOST_COUNT_MULTIPLIERS:
        hosts = choose_hosts(ctx.est.cluster, ctx.workers, total, mult)
        if tuple(hosts) in tried:
            continue
        tried.add(tuple(hosts))
        trial = dataclasses.replace(ctx, hosts=hosts, _splits=ctx._splits, _host_terms=None)
        cand = evaluate_config(trial, ev.pipelines)
        if cand is not None and cand.step_s < best.step_s * (1 - 1e-9):
            best = cand
    ctx.hosts = list(best.hosts)
    return best


# ------------------------------------------------------------------------------------------------
# from an evaluated configuration to a Plan
# ------------------------------------------------------------------------------------------------
def build_plan(graph: OpGraph, ctx: Context, ev: Evaluated, seq_len: int | None, strategy: str) -> Plan:
    cluster = ctx.est.cluster
    bounds = ctx.chain.bounds
    pipes = []
    memory: dict[str, float] = {}
    for devices, share, opt in zip(ev.pipelines, ev.shares, ev.choices, strict=False):
        c = opt.cost
        stages = []
        for k, d in enumerate(devices):
            dev_id = cluster.devices[d].id
            stages.append(
                StagePlan(
                    devices=(dev_id,),
                    lo=int(bounds[c.split[k]]),
                    hi=int(bounds[c.split[k + 1]]),
                    keep_ratio=float(c.ratios[k]),
                    compute_s=float(c.compute_s[k]),
                    comm_s=float(c.comm_s[k]),
                    memory_bytes=float(c.memory_bytes[k]),
                )
            )
            memory[dev_id] = float(c.memory_bytes[k])
        m = -(-share // opt.u)
        pipes.append(
            PipelinePlan(
                stages=tuple(stages),
                micro_batches=m,
                micro_batch_size=opt.u,
                batch_share=int(share),
                time_s=float(opt.time(share)),
            )
        )
    names = assign_param_names(graph, ev.hosts) if ev.hosts else []
    hosts = tuple(
        OptimizerHost(cluster.devices[h].id, float(share), tuple(nm))
        for (h, share), nm in zip(ev.hosts, names, strict=False)
    )
    seq = graph.seq_len if seq_len is None else seq_len
    tokens = ctx.batch * (seq if seq > 0 else 1)
    p = Plan(
        model=graph.model_name,
        batch_size=ctx.batch,
        seq_len=seq,
        num_nodes=graph.num_nodes,
        pipelines=tuple(pipes),
        offload=ctx.est.offload,
        optimizer_hosts=hosts,
        prediction=Prediction(
            step_time_s=float(ev.step_s),
            tokens_per_s=float(tokens / ev.step_s) if ev.step_s > 0 else 0.0,
            device_memory_bytes=tuple(sorted(memory.items())),
        ),
        strategy=strategy,
        cluster=cluster.name,
    )
    p.validate(graph)
    return p


def evaluate_plan(graph: OpGraph, cluster: Cluster, p: Plan, estimator: Estimator | None = None) -> float:
    """The cost model's step time for an existing plan, with the plan's own keep-ratios."""
    est = estimator or Estimator(cluster, offload=p.offload)
    bounds = sorted({0, graph.num_nodes} | {s.lo for pl in p.pipelines for s in pl.stages})
    chain = Chain.from_graph(graph, bounds)
    pos = {b: i for i, b in enumerate(bounds)}
    hosts = [(cluster.index(h.device), h.share) for h in p.optimizer_hosts]
    workers = _workers(cluster)
    multi = len(p.pipelines) > 1
    times = []
    for pl in p.pipelines:
        devs = [cluster.index(s.devices[0]) for s in pl.stages]
        split = [pos[s.lo] for s in pl.stages] + [chain.blocks]
        ratios = [s.keep_ratio for s in pl.stages]
        cost = est.evaluate(chain, devs, split, pl.micro_batch_size, ratios=ratios)
        ctx = Context(est, chain, p.batch_size, hosts, workers)
        times.append(cost.pipeline_time(pl.micro_batches) + ctx.sync(cost, multi))
    return (
        max(max(times), est.host_bound(float(chain.params[-1]), hosts, len(p.pipelines)))
        + est.step_overhead_s
    )
