"""DT-FM's cost model (Yuan et al., NeurIPS 2022, sec. 3), re-implemented: the second opinion
every plan is scored under besides the planner's own estimator and simulator.

DT-FM prices a data x pipeline layout by its communication alone, with every transfer's delay and
bandwidth taken from the device pair that makes it:

* data-parallel cost: in each group of D devices that hold the same layers, device i all-reduces
  its gradients of G bytes with every other member j, ``2 * (delay_ij + G * 8 / (bw_ij * D))``
  summed over j; the cost is the slowest device of the slowest group;
* pipeline cost: between consecutive stages, each pipeline sends its whole batch share's
  activations (A bytes) once forward (and their gradients once back, hence the factor 2):
  ``delay + A * 8 / bw`` per boundary; the boundaries of all pipelines run side by side, so a
  boundary costs its slowest pipeline's transfer, and the pipeline cost is the sum over boundaries;
* total ``DP + 2 * PP``.

DT-FM compares layouts of one fixed shape on identical GPUs, so it drops compute. To score plans of
different shapes and devices on one scale, `dtfm_step_time` adds each pipeline's 1F1B compute time
without communication, ``(m + S - 1) * max_k c_k`` (c_k: stage k's forward + backward seconds per
micro-batch from the estimator's device speeds), the slowest pipeline's; communication is not
overlapped with it, as in DT-FM's model. For plans that are not grids (pipelines of different
lengths or cuts), the same formulas apply per device: a device's DP group is every device holding
any of its parameters, with G the bytes they share, and boundary k of the pipeline cost is the k-th
boundary of each pipeline (pipelines with fewer boundaries add nothing to it).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from fusionnode.graph.dag import OpGraph
from fusionnode.plan.cluster import Cluster
from fusionnode.plan.estimator import Estimator
from fusionnode.plan.plan import Plan

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DtfmCost:
    """A plan's step under DT-FM's cost model, in seconds."""

    step_s: float  # compute + dp + 2 * pp
    compute_s: float
    dp_s: float
    pp_s: float  # one direction; the step counts it twice


def dp_edge_costs(cluster: Cluster, grad_bytes: float, group: int) -> np.ndarray:
    """[i, j] seconds device i spends all-reducing G bytes with j in a group of `group` devices."""
    bw = cluster.bandwidth_bps
    return 2.0 * (cluster.latency_s + grad_bytes * 8.0 / (bw * max(1, group)))


def pp_edge_costs(cluster: Cluster, act_bytes: float) -> np.ndarray:
    """[i, j] seconds to send A bytes of activations from i to j."""
    return cluster.latency_s + act_bytes * 8.0 / cluster.bandwidth_bps


def dtfm_step_time(
    graph: OpGraph, cluster: Cluster, plan: Plan, estimator: Estimator | None = None
) -> DtfmCost:
    """Score `plan` under DT-FM's cost model (module docstring)."""
    est = estimator or Estimator(cluster, offload=plan.offload)
    cut = np.asarray(graph.cut_bytes(), dtype=float)
    pparams = np.asarray(graph.prefix_param_bytes(), dtype=float)
    pflops = np.asarray(graph.prefix_flops(), dtype=float)
    spf = est.seconds_per_flop_all()
    lat, bw = cluster.latency_s, cluster.bandwidth_bps
    # compute: 1F1B without communication, slowest pipeline
    compute = 0.0
    for pl in plan.pipelines:
        u = pl.micro_batch_size
        worst = max(
            float(pflops[st.hi] - pflops[st.lo]) * u * float(spf[cluster.index(st.devices[0])])
            for st in pl.stages
        )
        compute = max(compute, (pl.micro_batches + len(pl.stages) - 1) * worst)
    # pipeline: sum over boundary index of the slowest pipeline's transfer of its share
    depth = max(len(pl.stages) for pl in plan.pipelines)
    pp = 0.0
    for k in range(depth - 1):
        worst = 0.0
        for pl in plan.pipelines:
            if k + 1 >= len(pl.stages):
                continue
            a = cluster.index(pl.stages[k].devices[0])
            b = cluster.index(pl.stages[k + 1].devices[0])
            nbytes = float(cut[pl.stages[k].hi]) * pl.batch_share
            worst = max(worst, float(lat[a, b] + nbytes * 8.0 / bw[a, b]))
        pp += worst
    # data parallel: per device, all-reduce with every device sharing its parameters
    held = [(cluster.index(st.devices[0]), st.lo, st.hi) for pl in plan.pipelines for st in pl.stages]
    dp = 0.0
    for i, lo, hi in held:
        shares = []
        for j, lo2, hi2 in held:
            if j == i:
                continue
            a, b = max(lo, lo2), min(hi, hi2)
            if a < b and pparams[b] > pparams[a]:
                shares.append((j, float(pparams[b] - pparams[a])))
        if not shares:
            continue
        group = len(shares) + 1
        t = sum(2.0 * (lat[i, j] + g * 8.0 / (bw[i, j] * group)) for j, g in shares)
        dp = max(dp, float(t))
    return DtfmCost(step_s=compute + dp + 2.0 * pp, compute_s=compute, dp_s=dp, pp_s=pp)
