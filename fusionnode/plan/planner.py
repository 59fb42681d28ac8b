"""The planner's search: the best asymmetric DP x PP plan for a model on a cluster.

A FlashFlex-style search over OP-Fence device groupings, priced by plan/evaluate.py:

1. coarsen the OP-DAG into a chain of blocks at cheap cuts (fence.coarsen);
2. group the worker devices by bandwidth (fence.fence_levels) and, for every grouping and a
   sensible set of pipeline counts, build candidate pipelines three ways: whole groups packed into
   pipelines ("pack"), the group path cut into equal-speed chunks ("chunk"), and the group path
   dealt round-robin so each pipeline spans every group ("stripe");
3. price each (plan/evaluate.py: the split DP of plan/split.py per pipeline and micro-batch size,
   the batch shared between pipelines to minimise the slowest);
4. improve the best configurations by local search (drop / move / swap devices), consider the
   anchors (even grids, DT-FM; plan/anchors.py) and pick the number of optimizer hosts
   (plan/hosts.py).

`fusionnode.plan.exhaustive.exhaustive_plan` enumerates device subsets, pipelines, orders, splits
and micro-batch sizes for tiny instances: the reference the planner is tested against.
"""

from __future__ import annotations

import dataclasses
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
from fusionnode.plan.estimator import PLAN_KEEP_FLOOR, Estimator
from fusionnode.plan.evaluate import (
    SMALL_CLUSTER,
    Context,
    Evaluated,
    build_plan,
    evaluate_config,
    make_context,
    pipe_time,
    ring_variant,
)
from fusionnode.plan.hosts import HOST_COUNT_MULTIPLIERS, choose_hosts, host_sets
from fusionnode.plan.plan import Plan
from fusionnode.plan.syncprice import SyncPrice

log = logging.getLogger(__name__)

MAX_PIPELINE_COUNTS = 8  # pipeline counts tried per grouping
TRIM_SPEED_RATIO = 0.5  # only try dropping devices slower than this x the pipeline's fastest
LOCAL_SEARCH_MOVES = 3000  # most candidate moves evaluated by the local search
LOCAL_SEARCH_STARTS = 3  # local search from this many of the best constructed configurations


RING_SIMULATED = 6  # ring variants the planner simulates against its choice on large clusters


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
        return pipe_time(ctx.options(p, True, share), share, ctx.micro_batches)[0]

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
    keep_floor: float = PLAN_KEEP_FLOOR,
    robust: bool = True,
    sync: SyncPrice | None = None,
    dp_sync: str | None = None,
) -> Plan:
    """The best plan the search finds for training `graph` on `cluster` (raises PlanError if none fits).
    `compress`: whether the job compresses its links (AdaTopK), so the plan may count on it;
    `with_anchors`: also consider every even grid and DT-FM's layout (plan/anchors.py);
    `keep_floor`: the smallest AdaTopK keep ratio the plan may count on;
    `robust`: on clusters above SMALL_CLUSTER (and up to anchors.DTFM_MAX_WORKERS) workers, choose
    the candidate with the best worse ratio under the simulator and DT-FM's cost model
    (anchors.robust_choice; with dp_sync "auto" or "ring" over the ring variants too; not under a
    round sync mode, which DT-FM's model cannot price), else the fastest simulated;
    `sync`: how the replicas' data-parallel sync is paid (every step by default, or per round of
    H steps under --sync diloco|sparseloco: plan/syncprice.py);
    `dp_sync`: how the pipelines synchronise: "hosts" (optimizer hosts; the default with `offload`),
    "ring" (ring all-reduce among the replicas of each stage; the default without) or "auto" (with
    `offload`: the plan takes the ring wherever it is faster than the hosts; `Plan.dp_sync` says which)."""
    dp_sync = dp_sync or ("hosts" if offload else "ring")
    if dp_sync not in ("hosts", "ring", "auto") or (dp_sync == "ring") == offload:
        raise ConfigError(
            f"dp_sync {dp_sync!r} with offload {offload}: hosts|auto need offload, ring does not"
        )
    t0 = time.perf_counter()
    ctx = make_context(
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
        sync,
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
    own: list[Evaluated] = []  # the search's best per pipeline count (clusters above SMALL_CLUSTER)
    for hs in candidates:
        ctx.hosts = hs
        ctx._host_terms = None
        found = _constructive(
            ctx, levels, counts, LOCAL_SEARCH_STARTS if small and local_search else 1, per_count=not small
        )
        for ev in found:
            if small and local_search:
                ev = _local_search(ctx, ev, [])
            if best is None or ev.step_s < best.step_s:
                best = ev
        own.extend(found[1:])
    found_anchors: list[Evaluated] = []
    if with_anchors:  # even grids and DT-FM's layouts: the plan must be at least as fast
        from fusionnode.plan.anchors import anchors

        ctx.hosts, ctx._host_terms = list(candidates[0]), None
        found_anchors = anchors(ctx, graph=None if small else graph, ring=dp_sync != "hosts")
        if found_anchors and (best is None or found_anchors[0].step_s < best.step_s):
            best = found_anchors[0]
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
    if (
        with_anchors and not small
    ):  # small clusters: the closed form is checked against the exhaustive optimum
        from fusionnode.plan.anchors import DTFM_MAX_WORKERS, SIMULATED, by_simulation, robust_choice
        from fusionnode.plan.grid import even_grids

        ctx.hosts, ctx._host_terms = list(best.hosts), None
        # DT-FM's cost model all-reduces float32 gradients every step: it cannot price a round sync
        # mode's amortised exchange, so under --sync diloco|sparseloco the simulator alone chooses
        if robust and len(workers) <= DTFM_MAX_WORKERS and not est.sync.rounds:
            best, figures = robust_choice(graph, ctx, [best, *own], found_anchors, dp_sync)
            log.info("robust choice: %s", {k: round(v, 3) for k, v in figures.items()})
        else:  # the simulator alone (DT-FM's model is too slow to score every grid of 1,000 workers)
            shortlist = [best, *found_anchors[:SIMULATED], *even_grids(ctx)[:SIMULATED]]
            best = by_simulation(graph, ctx, shortlist)
            if dp_sync != "hosts":
                best = choose_dp_sync(
                    graph, ctx, best, found_anchors, keep_hosts=dp_sync == "auto", simulated=True
                )
    elif dp_sync != "hosts":
        best = choose_dp_sync(
            graph, ctx, best, found_anchors, keep_hosts=dp_sync == "auto", simulated=not small
        )
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


def _constructive(
    ctx: Context, levels: list, counts: list[int], keep: int, per_count: bool = False
) -> list[Evaluated]:
    """The `keep` best configurations built from every grouping, pipeline count and builder (fastest
    first); with `per_count`, followed by the best of every other pipeline count."""
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
    if per_count:
        counts_seen = {len(o.pipelines) for o in out}
        for ev in found:
            if len(ev.pipelines) not in counts_seen:
                counts_seen.add(len(ev.pipelines))
                out.append(ev)
    return out


def choose_dp_sync(
    graph: OpGraph,
    ctx: Context,
    best: Evaluated,
    others: Sequence[Evaluated],
    keep_hosts: bool,
    simulated: bool,
) -> Evaluated:
    """The data-parallel sync priced both ways: `best` and `others` (the anchors and grids it was chosen
    among) with a ring all-reduce among the replicas of each stage (evaluate.ring_variant); the
    fastest of those, or `best` as it is when `keep_hosts` and its optimizer hosts are faster. Fastest
    by the closed form, or with `simulated` by the event simulator among the RING_SIMULATED fastest
    rings by the closed form (as the hosts' choice was made on large clusters)."""
    rings = sorted(
        (r for r in (ring_variant(ctx, e) for e in [best, *others]) if r is not None), key=lambda e: e.step_s
    )
    if not rings:
        return best
    pool = ([best] if keep_hosts else []) + rings[: RING_SIMULATED if simulated else 1]
    if simulated:
        from fusionnode.plan.anchors import by_simulation

        return by_simulation(graph, ctx, pool)
    return min(pool, key=lambda e: e.step_s)


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
