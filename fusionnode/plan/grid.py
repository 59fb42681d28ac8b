"""Even grids: the plain data x pipeline layout every planner is measured against.

An even grid of k pipelines takes the workers in the cluster file's order, gives each pipeline
s = floor(workers / k) consecutive devices (leftovers idle), splits the chain's blocks (about one
transformer layer each, fence.coarsen) evenly by count over the s stages, gives every pipeline an
equal share of the batch, and runs the micro-batch size that is fastest for it. `even_grids`
returns one per pipeline count that fits in memory, priced under the planner's cost model (the
estimator in `ctx`, with its compression setting); the planner keeps the best of them as a
candidate, so its plan is never slower than any even grid under its own model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from fusionnode.errors import PlanError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan import fence
from fusionnode.plan.cluster import Cluster
from fusionnode.plan.evaluate import Context, Evaluated, Option, build_plan, make_context, pipe_time
from fusionnode.plan.plan import Plan
from fusionnode.plan.shared import host_groups, shared_host_bound

log = logging.getLogger(__name__)


def even_split(blocks: int, stages: int) -> list[int]:
    """Chain positions [0, ..., blocks] cutting `blocks` into `stages` non-empty parts, as equal
    in count as integers allow (the larger parts first)."""
    if not 1 <= stages <= blocks:
        raise ValueError(f"cannot split {blocks} blocks into {stages} stages")
    base, extra = divmod(blocks, stages)
    out = [0]
    for k in range(stages):
        out.append(out[-1] + base + (1 if k < extra else 0))
    return out


def grid_counts(n_workers: int, blocks: int, batch: int) -> list[int]:
    """Every pipeline count k whose pipelines have between 1 and `blocks` stages."""
    return [k for k in range(1, min(n_workers, batch) + 1) if 1 <= n_workers // k <= blocks]


def grid_pipelines(workers: Sequence[int], count: int) -> list[tuple[int, ...]]:
    s = len(workers) // count
    return [tuple(workers[k * s : (k + 1) * s]) for k in range(count)]


def price_grid(
    ctx: Context, pipes: Sequence[tuple[int, ...]], splits: Sequence[Sequence[int]]
) -> Evaluated | None:
    """The step time of fixed pipelines with fixed splits and equal shares (best micro-batch size per
    pipeline), under ctx's estimator; None if a pipeline does not fit at any micro-batch size."""
    est, chain, batch = ctx.est, ctx.chain, ctx.batch
    count = len(pipes)
    shares = [batch // count + (1 if k < batch % count else 0) for k in range(count)]
    multi = count > 1
    choices, times = [], []
    for devs, split, share in zip(pipes, splits, shares, strict=True):
        sizes = ctx.sizes if ctx.micro_batches is None else [max(1, -(-share // ctx.micro_batches))]
        opts = []
        for u in sizes:
            if u > share:
                continue
            cost = est.evaluate(chain, devs, split, u)
            if cost.fits:
                opts.append(Option(cost, ctx.sync(cost, multi)))
            elif u > 1:
                break  # larger micro-batches only need more memory
        t, opt = pipe_time(opts, share, ctx.micro_batches)
        if opt is None:
            return None
        choices.append(opt)
        times.append(t)
    shared = shared_host_bound(
        est, [(o.cost, -(-x // o.u)) for o, x in zip(choices, shares, strict=True)], ctx.hosts
    )
    step = (
        max(max(times), est.host_bound(float(chain.params[-1]), ctx.hosts, count), shared)
        + est.step_overhead_s
    )
    return Evaluated(step, tuple(tuple(p) for p in pipes), tuple(shares), tuple(choices), tuple(ctx.hosts))


def even_grids(ctx: Context) -> list[Evaluated]:
    """Every even grid that fits, fastest first; where devices share a machine of fewer cores
    (plan/shared.py), also the grids over the workers with each such machine's fastest `cores`
    devices only (the others idle: N busy peers on C < N cores each get C/N of one)."""
    out = []
    blocks = ctx.chain.blocks
    for workers in dict.fromkeys([tuple(ctx.workers), within_cores(ctx.est.cluster, ctx.workers)]):
        for k in grid_counts(len(workers), blocks, ctx.batch):
            pipes = grid_pipelines(list(workers), k)
            s = len(pipes[0])
            ev = price_grid(ctx, pipes, [even_split(blocks, s)] * k)
            if ev is not None:
                out.append(ev)
    out.sort(key=lambda e: e.step_s)
    return out


def within_cores(cluster: Cluster, workers: Sequence[int]) -> tuple[int, ...]:
    """`workers` (in order) with each shared machine's devices cut to its fastest `cores`."""
    of, cores = host_groups(cluster)
    keep = set(workers)
    for h, c in enumerate(cores):
        mine = sorted((d for d in workers if of[d] == h), key=lambda d: -cluster.devices[d].tflops)
        keep -= set(mine[c:])
    return tuple(d for d in workers if d in keep)


def best_even_grid(ctx: Context) -> Evaluated | None:
    grids = even_grids(ctx)
    return grids[0] if grids else None


def grid_plan(
    graph: OpGraph,
    cluster: Cluster,
    batch_size: int,
    *,
    micro_batches: int | None = None,
    seq_len: int | None = None,
    offload: bool = True,
    efficiency: float | None = None,
    compress: bool = False,
) -> Plan:
    """The best even grid under the planner's cost model (the layout the issue's "even grid" names
    and `fusionnode bench plan` compares with), as a plan: `fusionnode train --planner grid`, the
    testbed's "even-grid" configuration. `compress`: price the links with AdaTopK."""
    ctx = make_context(
        graph, cluster, batch_size, micro_batches, offload, efficiency, None, fence.MAX_BLOCKS, compress
    )
    ev = best_even_grid(ctx)
    if ev is None:
        raise PlanError(
            f"no even grid of cluster {cluster.name!r} fits {graph.model_name!r} at batch {batch_size}"
        )
    return build_plan(graph, ctx, ev, seq_len, strategy="grid")


def grid_shape(ev: Evaluated) -> tuple[int, int]:
    """(pipelines, stages per pipeline) of an even grid."""
    return len(ev.pipelines), int(np.max([len(p) for p in ev.pipelines]))
