"""Event-driven simulation of one training step of a Plan, independent of the closed form.

Per pipeline: every stage runs its 1F1B sequence (min(S - k - 1, m) warm-up forwards, then one
forward / one backward, then the remaining backwards), one op at a time; an op starts when the
stage is free and its input has arrived. Sends are asynchronous (a stage computes on while its
output travels). Each stage-to-stage link is full duplex: each direction carries one transfer at a
time (FIFO by request time), forward activations one way and backward gradients the other; a
transfer occupies its direction for its serialisation time and arrives one latency later. The last micro-batch may be
partial (its times scale with its size). After its last backward a stage pushes its gradients to
every optimizer host and pulls the parameters back (to all hosts at once, as the runtime's push
tasks do); each host's own link is a FIFO resource shared by all stages of all pipelines. With a ring plan (dp_sync "ring") each set of stages holding the same parameters all-reduces once
its last member is done (plan/dpsync.py). Otherwise without offload, the data-parallel
exchange of the estimator is used after the stage's last backward. Step time = the last finish,
plus the estimator's fixed per-step overhead (the runtime's RPC rounds).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
from collections.abc import Sequence

import numpy as np

from fusionnode.graph.dag import OpGraph
from fusionnode.plan.cluster import Cluster
from fusionnode.plan.dpsync import ring_finish
from fusionnode.plan.estimator import Q8_WIRE_FACTOR, Chain, Estimator, wire_bytes
from fusionnode.plan.plan import Plan
from fusionnode.plan.syncprice import SyncPrice

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SimResult:
    step_time_s: float
    pipeline_finish_s: tuple[float, ...]  # last backward of each pipeline (before sync)
    sync_finish_s: tuple[float, ...]  # each pipeline's last stage sync done
    stage_busy_s: tuple[tuple[float, ...], ...]  # compute seconds per stage, per pipeline
    link_busy_s: tuple[
        tuple[float, ...], ...
    ]  # serialisation seconds per link (both directions), per pipeline


def one_f_one_b(stages: int, k: int, m: int) -> list[tuple[str, int]]:
    """The op order of stage k: [("F", i) | ("B", i)]."""
    warm = min(stages - k - 1, m)
    ops: list[tuple[str, int]] = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        ops.append(("F", f))
        f += 1
        ops.append(("B", b))
        b += 1
    ops.extend(("B", i) for i in range(b, m))
    return ops


def simulate_pipeline(
    fwd: Sequence[Sequence[float]],
    bwd: Sequence[Sequence[float]],
    act_ser: Sequence[Sequence[float]],
    grad_ser: Sequence[Sequence[float]],
    latency: Sequence[float],
) -> tuple[list[float], list[float], list[float]]:
    """fwd[k][i], bwd[k][i]: compute seconds of stage k on micro-batch i; act_ser[k][i],
    grad_ser[k][i]: serialisation seconds on link k (k -> k+1) of the activation / its gradient;
    latency[k]: link k's latency. -> (last-backward time per stage, compute busy, link busy)."""
    s = len(fwd)
    m = len(fwd[0]) if s else 0
    ops = [one_f_one_b(s, k, m) for k in range(s)]
    ptr = [0] * s
    running = [False] * s
    act_in = [[k == 0] * m for k in range(s)]
    grad_in = [[False] * m for _ in range(s)]
    f_done = [[False] * m for _ in range(s)]
    # one FIFO per link direction: index 2k carries activations k -> k+1, 2k+1 gradients k+1 -> k
    link_busy = [False] * max(0, 2 * (s - 1))
    link_q: list[list[tuple[float, int, str, int]]] = [[] for _ in range(max(0, 2 * (s - 1)))]
    finish = [0.0] * s
    busy = [0.0] * s
    lbusy = [0.0] * max(0, s - 1)
    events: list[tuple[float, int, str, int, int]] = []
    seq = 0

    def push(t: float, kind: str, a: int, b: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, a, b))
        seq += 1

    def try_stage(k: int, now: float) -> None:
        if running[k] or ptr[k] >= len(ops[k]):
            return
        op, i = ops[k][ptr[k]]
        if op == "F" and not act_in[k][i]:
            return
        if op == "B" and not (grad_in[k][i] if k < s - 1 else f_done[k][i]):
            return
        running[k] = True
        dur = fwd[k][i] if op == "F" else bwd[k][i]
        busy[k] += dur
        push(now + dur, "F" if op == "F" else "B", k, i)

    def try_link(q: int, now: float) -> None:
        if link_busy[q] or not link_q[q]:
            return
        _, _, what, i = heapq.heappop(link_q[q])
        k = q // 2
        ser = act_ser[k][i] if what == "act" else grad_ser[k][i]
        link_busy[q] = True
        lbusy[k] += ser
        push(now + ser, "free", q, 0)
        push(now + ser + latency[k], "arrive_" + what, k, i)

    for k in range(s):
        try_stage(k, 0.0)
    qseq = 0
    while events:
        now, _, kind, k, i = heapq.heappop(events)
        touched_stages: list[int] = []
        touched_links: list[int] = []
        if kind in ("F", "B"):
            running[k] = False
            ptr[k] += 1
            touched_stages.append(k)
            if kind == "F":
                f_done[k][i] = True
                if k < s - 1:
                    heapq.heappush(link_q[2 * k], (now, qseq, "act", i))
                    qseq += 1
                    touched_links.append(2 * k)
            else:
                finish[k] = now
                if k > 0:
                    heapq.heappush(link_q[2 * (k - 1) + 1], (now, qseq, "grad", i))
                    qseq += 1
                    touched_links.append(2 * (k - 1) + 1)
        elif kind == "free":
            link_busy[k] = False
            touched_links.append(k)
        elif kind == "arrive_act":
            act_in[k + 1][i] = True
            touched_stages.append(k + 1)
        elif kind == "arrive_grad":
            grad_in[k][i] = True
            touched_stages.append(k)
        for j in touched_links:
            try_link(j, now)
        for j in touched_stages:
            try_stage(j, now)
    if any(p < len(o) for p, o in zip(ptr, ops, strict=False)):
        raise RuntimeError("simulated 1F1B schedule deadlocked")  # a bug, never an input error
    return finish, busy, lbusy


def simulate(
    graph: OpGraph,
    cluster: Cluster,
    plan: Plan,
    estimator: Estimator | None = None,
    sync: SyncPrice | None = None,
) -> SimResult:
    """Simulate one step of `plan`; returns the step time and per-resource busy times. Under a
    round sync mode (`sync`, or the estimator's) the optimizer hosts' links carry a round's
    pseudo-gradients and updates, and each stage's part of it counts 1/H per step."""
    est = estimator or Estimator(cluster, offload=plan.offload, sync=sync)
    price = est.sync
    bounds = sorted({0, graph.num_nodes} | {s.lo for pl in plan.pipelines for s in pl.stages})
    chain = Chain.from_graph(graph, bounds)
    pos = {b: i for i, b in enumerate(bounds)}
    hosts = [(cluster.index(h.device), h.share) for h in plan.optimizer_hosts]
    workers = [i for i, d in enumerate(cluster.devices) if d.is_worker]
    multi = len(plan.pipelines) > 1
    pipe_finish, sync_finish, busy_all, lbusy_all = [], [], [], []
    pending: list[tuple[float, int, float]] = []  # (ready time, stage device, param bytes)
    ring = plan.dp_sync == "ring" and multi
    layout, stage_done = [], []  # for the replicas' ring all-reduce (plan/dpsync.py)
    for pl in plan.pipelines:
        devs = [cluster.index(st.devices[0]) for st in pl.stages]
        split = [pos[st.lo] for st in pl.stages] + [chain.blocks]
        s = len(devs)
        u = pl.micro_batch_size
        sizes = [u] * pl.micro_batches
        sizes[-1] = pl.batch_share - u * (pl.micro_batches - 1) if pl.batch_share > 0 else u
        sizes = [max(1, x) for x in sizes]
        spf = est.seconds_per_flop_all()
        fwd, bwd, act, grad, lat = [], [], [], [], []
        for k in range(s):
            lo, hi = split[k], split[k + 1]
            per = float(chain.flops[hi] - chain.flops[lo]) * spf[devs[k]] / 3.0  # fwd share of fwd+bwd
            fwd.append([per * x for x in sizes])
            bwd.append([2.0 * per * x for x in sizes])
            if k < s - 1:
                bw, la = est.link(devs[k], devs[k + 1])
                x = float(chain.cut[hi])
                r = pl.stages[k].keep_ratio
                act.append([wire_bytes(x * n, r) * 8.0 / bw for n in sizes])
                # the runtime's AdaTopK quantises gradients (q8) on a link that compresses
                grad.append([x * n * (Q8_WIRE_FACTOR if r < 1.0 else 1.0) * 8.0 / bw for n in sizes])
                lat.append(la)
        finish, busy, lbusy = simulate_pipeline(fwd, bwd, act, grad, lat)
        busy_all.append(tuple(busy))
        lbusy_all.append(tuple(lbusy))
        pipe_finish.append(max(finish))
        params = [float(chain.params[split[k + 1]] - chain.params[split[k]]) for k in range(s)]
        if ring:  # whatever the estimator's offload says: the plan's replicas sync by ring
            layout.append((devs, split))
            stage_done.append(list(finish))
            sync_finish.append(math.nan)
        elif est.offload:
            for k in range(s):
                pending.append((finish[k], devs[k], params[k]))
            sync_finish.append(math.nan)
        else:
            outside = est.outside_bandwidth(devs, workers)
            done = [
                finish[k] + est.stage_sync_time(devs[k], params[k], [], multi, float(outside[k]))
                for k in range(s)
            ]
            sync_finish.append(max(done))
    if est.offload and pending:
        # each host's link is a FIFO shared by every stage's push + pull; a stage talks to hosts in turn
        host_free = {h: 0.0 for h, _ in hosts}
        host_bw = {}
        for h, _ in hosts:
            dev = cluster.devices[h]
            row = np.delete(cluster.bandwidth_bps[h], h)
            host_bw[h] = (
                dev.uplink_gbps * 1e9 if dev.uplink_gbps > 0 else (float(row.max()) if len(row) else math.inf)
            )
        done_at: dict[int, float] = {}
        for ready, d, p in sorted(pending):
            t = ready
            for h, share in hosts:  # a stage pushes to (and pulls from) all its hosts at once
                if h == d or share <= 0 or p <= 0:
                    continue
                nbytes = price.round_bytes(p * share)
                bw, la = est.link(d, h)
                own = price.per_step(2.0 * (la + nbytes * 8.0 / bw))
                start = max(ready, host_free[h])
                host_free[h] = start + price.per_step(2.0 * nbytes * 8.0 / host_bw[h])
                t = max(t, start + own, host_free[h])
            done_at[d] = t
        for p_i, pl in enumerate(plan.pipelines):
            s = len(pl.stages)
            sync_finish[p_i] = max(done_at[cluster.index(st.devices[0])] for st in pl.stages)
    if ring:
        sync_finish = ring_finish(cluster.bandwidth_bps, cluster.latency_s, chain.params, layout, stage_done)
    for p_i in range(len(sync_finish)):
        if math.isnan(sync_finish[p_i]):
            sync_finish[p_i] = pipe_finish[p_i]
    step = max(sync_finish) + est.step_overhead_s
    return SimResult(
        step_time_s=float(step),
        pipeline_finish_s=tuple(pipe_finish),
        sync_finish_s=tuple(float(x) for x in sync_finish),
        stage_busy_s=tuple(busy_all),
        link_busy_s=tuple(lbusy_all),
    )
