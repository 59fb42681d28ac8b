"""The exhaustive reference planner: the optimum under the cost model by brute force, for tiny
instances only (the planner's tests and `fusionnode bench plan` measure the planner against it)."""

from __future__ import annotations

import itertools
import math

import numpy as np

from fusionnode.errors import ConfigError, PlanError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan.cluster import Cluster
from fusionnode.plan.evaluate import Context, Evaluated, Option, build_plan, make_context
from fusionnode.plan.hosts import host_sets
from fusionnode.plan.plan import Plan

# ------------------------------------------------------------------------------------------------
# exhaustive reference (tiny instances only)
# ------------------------------------------------------------------------------------------------
EXHAUSTIVE_MAX_DEVICES = 6
EXHAUSTIVE_MAX_BLOCKS = 16


def _all_splits(n: int, s: int) -> list[list[int]]:
    return [[0, *c, n] for c in itertools.combinations(range(1, n), s - 1)]


def exhaustive_plan(
    graph: OpGraph,
    cluster: Cluster,
    batch_size: int,
    *,
    offload: bool = True,
    efficiency: float | None = None,
) -> Plan:
    """The optimum under the cost model by brute force: every subset of workers, partition into
    pipelines, order, contiguous split, micro-batch size and batch share. Tiny instances only."""
    ctx = make_context(graph, cluster, batch_size, None, offload, efficiency, None, max(graph.num_nodes, 1))
    est, chain = ctx.est, ctx.chain
    if len(ctx.workers) > EXHAUSTIVE_MAX_DEVICES or chain.blocks > EXHAUSTIVE_MAX_BLOCKS:
        raise ConfigError(
            f"exhaustive_plan is for <= {EXHAUSTIVE_MAX_DEVICES} workers and <= {EXHAUSTIVE_MAX_BLOCKS} nodes"
        )
    candidates = (
        host_sets(cluster, ctx.workers, float(chain.params[-1]), ctx.hosts)
        if est.offload
        else [list(ctx.hosts)]
    )
    best: Evaluated | None = None
    for hs in candidates:
        ctx.hosts = hs
        ctx._host_terms = None
        cand = _exhaustive_search(ctx, batch_size)
        if cand is not None and (best is None or cand.step_s < best.step_s * (1 - 1e-12)):
            best = cand
    if best is None:
        raise PlanError(f"no plan fits {graph.model_name!r} on cluster {cluster.name!r}")
    return build_plan(graph, ctx, best, None, strategy="exhaustive")


def _exhaustive_search(ctx: Context, batch_size: int) -> Evaluated | None:
    est, chain = ctx.est, ctx.chain
    B = batch_size
    # per ordered tuple and "multi" flag: best time for each share b in 0..B
    table: dict[tuple[tuple[int, ...], bool], tuple[np.ndarray, list]] = {}

    def best_times(devs: tuple[int, ...], multi: bool) -> tuple[np.ndarray, list]:
        key = (devs, multi)
        if key in table:
            return table[key]
        t = np.full(B + 1, np.inf)
        t[0] = 0.0
        arg: list = [None] * (B + 1)
        if len(devs) <= chain.blocks:
            for u in ctx.sizes:
                for split in _all_splits(chain.blocks, len(devs)):
                    cost = est.evaluate(chain, devs, split, u)
                    if not cost.fits:
                        continue
                    opt = Option(cost, ctx.sync(cost, multi))
                    for b in range(1, B + 1):
                        v = opt.time(b)
                        if v < t[b]:
                            t[b], arg[b] = v, opt
        table[key] = (t, arg)
        return table[key]

    best: Evaluated | None = None
    workers = ctx.workers
    for r in range(1, len(workers) + 1):
        for subset in itertools.combinations(workers, r):
            for parts in _set_partitions(list(subset)):
                if len(parts) > B:
                    continue
                multi = len(parts) > 1
                # every ordering of every part
                per_part = []
                for part in parts:
                    bt = None
                    for perm in itertools.permutations(part):
                        t, arg = best_times(perm, multi)
                        if bt is None:
                            bt = (t.copy(), [(perm, a) for a in arg])
                        else:
                            better = t < bt[0]
                            for b in np.nonzero(better)[0]:
                                bt[0][b] = t[b]
                                bt[1][b] = (perm, arg[b])
                    per_part.append(bt)
                # min-max share allocation (every part gets >= 1 sample): DP over parts
                g = np.full(B + 1, np.inf)
                g[0] = 0.0
                choice: list[list[int]] = []
                for t, _ in per_part:
                    ng = np.full(B + 1, np.inf)
                    ch = [0] * (B + 1)
                    for tot in range(1, B + 1):
                        for b in range(1, tot + 1):
                            v = max(g[tot - b], t[b])
                            if v < ng[tot]:
                                ng[tot], ch[tot] = v, b
                    g = ng
                    choice.append(ch)
                if not math.isfinite(g[B]):
                    continue
                step = (
                    max(float(g[B]), est.host_bound(float(chain.params[-1]), ctx.hosts, len(parts)))
                    + est.step_overhead_s
                )
                if best is None or step < best.step_s * (1 - 1e-12):
                    shares, tot = [], B
                    for ch in reversed(choice):
                        shares.append(ch[tot])
                        tot -= ch[tot]
                    shares.reverse()
                    pipes, opts = [], []
                    for (_, args), b in zip(per_part, shares, strict=False):
                        perm, opt = args[b]
                        pipes.append(perm)
                        opts.append(opt)
                    best = Evaluated(step, tuple(pipes), tuple(shares), tuple(opts), tuple(ctx.hosts))
    return best


def _set_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
        yield [[first], *part]
