"""Devices that share one machine's CPU cores: a lower bound on the step time.

The estimator treats every device as independent. Peers of one machine are not: a swarm run on one
host (`fusionnode demo`, a LocalSwarm, several `fusionnode join` on one box) has N peers, each with
one compute thread, on C cores. Then
- at most min(C, N) of them compute at once, so whatever the layout the step takes at least the
  host's compute per step over min(C, N); a pipeline's bubbles cost nothing there (an idle stage
  leaves its core to a busy one), which the per-device model misses, while data-parallel replicas
  that it rates faster run on the same cores;
- bytes between two of its peers cross loopback: the probe's figure for such a link is what one core
  moves (TLS, copies), and moving them takes that core from the compute.
So the bound is, per host, (its stages' compute + the transfers between its own devices: stage
links, optimizer-host sync, ring all-reduce) per step over min(cores, its devices in the plan).
Cluster documents mark such devices with `host` and `cores` (protocol/CLUSTER.md); without them
the bound is 0 and nothing changes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from fusionnode.plan.cluster import Cluster
from fusionnode.plan.estimator import Estimator, PipelineCost


@functools.lru_cache(maxsize=16)
def host_groups(cluster: Cluster) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(host index per device, -1 where it does not share a host; cores per host index)."""
    names: dict[str, int] = {}
    cores: list[int] = []
    of = []
    for d in cluster.devices:
        if d.host and d.cores > 0:
            if d.host not in names:
                names[d.host] = len(cores)
                cores.append(d.cores)
            h = names[d.host]
            cores[h] = max(cores[h], d.cores)
            of.append(h)
        else:
            of.append(-1)
    return tuple(of), tuple(cores)


def shared_host_bound(
    est: Estimator,
    pipelines: Sequence[tuple[PipelineCost, int]],
    hosts: Sequence[tuple[int, float]] = (),
    ring: bool = False,
) -> float:
    """Seconds per step the busiest shared host needs at least (0 when no device shares a host).

    `pipelines`: each pipeline's cost and micro-batch count; `hosts`: the optimizer hosts (device,
    share) when the optimizer is offloaded; `ring`: the replicas all-reduce among themselves."""
    of, cores = host_groups(est.cluster)
    if not cores:
        return 0.0
    bw = est.cluster.bandwidth_bps
    busy = [0.0] * len(cores)
    synced: dict[int, float] = {}  # a device's loopback ring all-reduce seconds per step
    active: list[set[int]] = [set() for _ in cores]
    multi = len(pipelines) > 1
    for cost, m in pipelines:
        devs = cost.devices
        for k, d in enumerate(devs):
            h = of[d]
            if h < 0:
                continue
            active[h].add(d)
            busy[h] += cost.compute_s[k] * m
            if k + 1 < len(devs) and of[devs[k + 1]] == h:
                busy[h] += cost.comm_s[k] * m  # a loopback stage link, both directions
            p = cost.param_bytes[k]
            if p <= 0:
                continue
            if est.offload:
                for dev, share in hosts:
                    if dev != d and share > 0 and of[dev] == h:
                        active[h].add(dev)  # the host's optimizer runs there too
                        nbytes = est.sync.round_bytes(p * share)
                        busy[h] += est.sync.per_step(2.0 * nbytes * 8.0 / float(bw[d, dev]))
            elif ring and multi:
                mates = [o for o, _ in pipelines if o is not cost]
                k_ring = len(pipelines)
                peers = [o.devices[min(k, o.stages - 1)] for o in mates]
                same = [x for x in peers if of[x] == h]
                if same:
                    slowest = min(float(bw[d, x]) for x in same)
                    t = 2.0 * (k_ring - 1) / k_ring * p * 8.0 / slowest
                    busy[h] += t
                    synced[d] = synced.get(d, 0.0) + t
    bound = max(
        (b / min(c, len(a)) for b, c, a in zip(busy, cores, active, strict=True) if a),
        default=0.0,
    )
    return max(
        bound,
        contended_path(
            pipelines, of, [max(1.0, len(a) / c) for c, a in zip(cores, active, strict=True)], synced
        ),
    )


def contended_path(
    pipelines: Sequence[tuple[PipelineCost, int]],
    of: Sequence[int],
    slow: Sequence[float],
    synced: Mapping[int, float] | None = None,
) -> float:
    """The longest step of the pipelines with a device on an over-subscribed machine (`slow[h]` =
    its devices in the plan / its cores > 1; each such device computes at 1 / slow[h] of its speed:
    N busy peers on C < N cores each get about C/N of one): the 1F1B path, (m + stages - 1) x its
    slowest stage's compute per micro-batch, then its replicas' ring all-reduce (`synced`: a
    device's loopback ring seconds per step) at the same core share. (Optimizer-host transfers are
    not added: measured once, 4 peers of a 2-core machine with offload on, the layout this term
    chose with them, one worker hosting the whole optimizer, ran 0.64x the two-host layout it
    replaced; the host's share of the cores is not modelled well enough to price them here.)

    On such a machine the sync is CPU work (copies, TLS, the sums) on the cores the other peers
    compute on, so it does not hide behind them, and the machine's total over its cores (above)
    assumes a pipeline's fill and drain cost nothing. Measured on a 2-core host (bench faults,
    gpt2-tiny 16 x 128, offload off; 2 x 1, 1 x 3 and 2 x 2 in 5 runs each, issue-18-s8t4.md): a
    step's pipeline phase is the path of the measured stage compute plus the largest stage's link
    time within 0.016 s in all 15; a 2 x 2's link time (4 busy) is 1.6-2.7x a 2 x 1's (2 busy) for
    half the bytes per ring, at least the core share of 2 on each ring. The sends between stages
    are left to the total above: 1 x 3's, the only link time it has, were 3-5% of its step."""
    synced = synced or {}
    path = 0.0
    for cost, m in pipelines:
        devs = cost.devices
        over = [slow[of[d]] if of[d] >= 0 else 1.0 for d in devs]
        if max(over) <= 1.0:
            continue
        worst = max(c * f for c, f in zip(cost.compute_s, over, strict=True))
        sync = max(synced.get(d, 0.0) * f for d, f in zip(devs, over, strict=True))
        path = max(path, (m + len(devs) - 1) * worst + sync)
    return path
