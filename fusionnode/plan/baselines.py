"""Baseline placements, priced by the same cost model as the planner.

Both baselines take the worker devices in the order the cluster file lists them, form pipelines of
S = min(workers, chain blocks) consecutive devices (one pipeline over all devices when the model
has at least as many blocks as there are devices; otherwise floor(workers / S) data-parallel
replicas, leftovers idle), give every pipeline an equal share of the batch, send activations dense
(no AdaTopK), and use the micro-batch size that is fastest for them. They differ in the split:

* `even_plan`: blocks (layers) split evenly by count -- the "even split of layers" baseline;
* `memory_plan`: blocks split in proportion to device memory -- exo / Petals style placement.

`contiguous_split_plan` is the runtime's simple path: one pipeline over given device ids, split
evenly by node count or FLOPs at cheap cuts, no cluster and no prediction.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from fusionnode.errors import ConfigError, PlanError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan import fence
from fusionnode.plan.cluster import Cluster
from fusionnode.plan.estimator import Chain
from fusionnode.plan.evaluate import Evaluated, Option, build_plan, make_context, pipe_time
from fusionnode.plan.plan import PipelinePlan, Plan, StagePlan
from fusionnode.plan.shared import shared_host_bound

log = logging.getLogger(__name__)


def _proportional_split(n_blocks: int, weights: Sequence[float]) -> list[int]:
    """Split n_blocks into len(weights) non-empty contiguous parts proportional to weights."""
    s = len(weights)
    w = np.asarray(weights, dtype=float)
    cum = np.cumsum(w) / w.sum()
    split = [0]
    for k in range(s - 1):
        b = round(cum[k] * n_blocks)
        b = max(split[-1] + 1, min(b, n_blocks - (s - 1 - k)))
        split.append(int(b))
    split.append(n_blocks)
    return split


def _baseline(
    graph: OpGraph,
    cluster: Cluster,
    batch_size: int,
    weight: str,
    micro_batches: int | None,
    seq_len: int | None,
    offload: bool,
    efficiency: float | None,
    compress: bool = False,
) -> Plan:
    ctx = make_context(
        graph, cluster, batch_size, micro_batches, offload, efficiency, None, fence.MAX_BLOCKS, compress
    )
    est, chain = ctx.est, ctx.chain
    workers = ctx.workers
    s = min(len(workers), chain.blocks)
    count = max(1, min(len(workers) // s, batch_size))
    pipes = [tuple(workers[k * s : (k + 1) * s]) for k in range(count)]
    shares = [batch_size // count + (1 if k < batch_size % count else 0) for k in range(count)]
    multi = count > 1
    choices, times = [], []
    for devs, share in zip(pipes, shares, strict=False):
        if weight == "even":
            split = _proportional_split(chain.blocks, [1.0] * s)
        else:
            split = _proportional_split(chain.blocks, [cluster.devices[d].memory_gb for d in devs])
        opts = []
        sizes = ctx.sizes if micro_batches is None else [max(1, -(-share // micro_batches))]
        for u in sizes:
            cost = est.evaluate(chain, devs, split, u)
            if cost.fits:
                opts.append(Option(cost, ctx.sync(cost, multi)))
        t, opt = pipe_time(opts, share, micro_batches)
        if opt is None:
            worst = max(
                (
                    (m - est.capacity(d)) / 1e9
                    for devs_cost in [est.evaluate(chain, devs, split, 1)]
                    for m, d in zip(devs_cost.memory_bytes, devs_cost.devices, strict=False)
                ),
                default=0.0,
            )
            raise PlanError(
                f"the {weight}-split baseline does not fit on cluster {cluster.name!r}: a stage is "
                f"{worst:.2f} GB over its device's memory even at micro-batch size 1"
            )
        choices.append(opt)
        times.append(t)
    shared = shared_host_bound(
        est, [(o.cost, -(-x // o.u)) for o, x in zip(choices, shares, strict=True)], ctx.hosts
    )
    step = (
        max(max(times), est.host_bound(float(chain.params[-1]), ctx.hosts, count), shared)
        + est.step_overhead_s
    )
    ev = Evaluated(step, tuple(pipes), tuple(shares), tuple(choices), tuple(ctx.hosts))
    return build_plan(graph, ctx, ev, seq_len, strategy=weight)


def even_plan(
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
    """Layers split evenly over devices in file order (see the module docstring); `compress`:
    price the links with AdaTopK (the baseline split itself never changes)."""
    return _baseline(
        graph, cluster, batch_size, "even", micro_batches, seq_len, offload, efficiency, compress
    )


def memory_plan(
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
    """Layers split in proportion to device memory, devices in file order (exo / Petals style)."""
    return _baseline(
        graph, cluster, batch_size, "memory", micro_batches, seq_len, offload, efficiency, compress
    )


def contiguous_split_plan(
    graph: OpGraph,
    device_ids: Sequence[str],
    batch_size: int,
    micro_batches: int,
    seq_len: int | None = None,
    by: str = "flops",
) -> Plan:
    """One pipeline over device_ids in order, nodes split evenly by "flops" or "nodes" (count),
    at the cheap cuts of fence.coarsen; micro_batch_size = ceil(batch_size / micro_batches)."""
    if not device_ids:
        raise ConfigError("contiguous_split_plan needs at least one device id")
    if len(set(device_ids)) != len(device_ids):
        raise ConfigError(f"device ids repeat: {list(device_ids)}")
    if batch_size < 1 or micro_batches < 1:
        raise ConfigError(f"batch size and micro-batches must be >= 1, got {batch_size}, {micro_batches}")
    if by not in ("flops", "nodes"):
        raise ConfigError(f"split by {by!r}: expected 'flops' or 'nodes'")
    bounds = fence.coarsen(graph)
    s = len(device_ids)
    if s > len(bounds) - 1:
        raise PlanError(
            f"{s} devices but {graph.model_name!r} can be cut into at most {len(bounds) - 1} stages"
        )
    chain = Chain.from_graph(graph, bounds)
    key = chain.flops if by == "flops" else chain.bounds.astype(float)
    total = float(key[-1]) or 1.0
    split = [0]
    for k in range(1, s):
        target = total * k / s
        b = int(np.argmin(np.abs(key - target)))
        b = max(split[-1] + 1, min(b, chain.blocks - (s - k)))
        split.append(b)
    split.append(chain.blocks)
    mbs = math.ceil(batch_size / micro_batches)
    stages = tuple(
        StagePlan(devices=(dev,), lo=int(bounds[split[k]]), hi=int(bounds[split[k + 1]]))
        for k, dev in enumerate(device_ids)
    )
    p = Plan(
        model=graph.model_name,
        batch_size=batch_size,
        seq_len=graph.seq_len if seq_len is None else seq_len,
        num_nodes=graph.num_nodes,
        pipelines=(
            PipelinePlan(
                stages=stages,
                micro_batches=math.ceil(batch_size / mbs),
                micro_batch_size=mbs,
                batch_share=batch_size,
            ),
        ),
        strategy="contiguous",
    )
    p.validate(graph)
    return p
