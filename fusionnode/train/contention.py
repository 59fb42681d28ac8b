"""Peers that share one machine's cores, as the rebalancer prices them (issue 18).

`rebalance.predict_step_s` takes each peer's measured speed as its own. Peers of one machine (a
LocalSwarm, several `fusionnode join` on one box: `swarm_cluster.shared_hosts`, from their DHT
records) are not independent: with N of them holding stages on C < N cores, each computes at about
C/N of what it would with a core to itself, and its measured speed was measured at the current
layout's N. A layout that leaves some of them idle gives the others their cores back.

Measured (`fusionnode bench faults --scenario straggler --pipelines 2 --pinned --offload off`, 2-core
host, gpt2-tiny 16 x 128, load ~1-2): 2 pipelines of one stage (2 busy processes) 18.7k tokens/s;
2 + 1 stages or 1 x 3 (3 busy) 14.1-14.2k; 2 x 2 (4 busy) 10.8k. Per process the stages' compute
time rose with the busy count as C/N says (one stage on 8 sequences: 0.076 s with 2 busy, the 2 x 2
halves 0.04-0.09 s with 4), which the per-peer model missed: after a 4x straggler of a pinned 2 x 2
it re-split only the straggler's pipeline (2 + 1 stages, 3 busy: 0.75 of 2 x 1).

So, where peers share a machine, a candidate layout is priced with each shared peer's speed scaled
by (C/N under the candidate) / (C/N under the current layout), and the candidates include the
pipelines consolidated onto fewer of their own peers (the fastest k of each, k down to 1), the rest
left idle as spares. Consolidating is offered only when the plan holds a clear straggler
(`swarm_cluster.OUTLIER`): a healthy user-laid-out job keeps its peers. Memory is not priced here
(as in the rest of the rebalancer): a peer that cannot hold its new stage refuses it, and the
placement lays the job out again.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_COMBOS = 256  # consolidated layouts priced per check at most (pipelines x their peer counts)


@dataclass(frozen=True)
class SharedHosts:
    """Which peers share a machine: `of` peer -> machine key (peers alone on theirs left out),
    `cores` machine key -> its cores."""

    of: Mapping[str, str]
    cores: Mapping[str, int]

    def any_shared(self, peers: Iterable[str]) -> bool:
        return any(p in self.of for p in peers)

    def factors(self, layouts: Sequence[Any]) -> dict[str, float]:
        """Each shared peer's share of a core under `layouts`: min(1, cores / peers of its machine
        that hold a stage) (a peer holding no stage gets what it would with one)."""
        busy: dict[str, int] = {}
        for p in {p for lay in layouts for p in lay.peers}:
            if p in self.of:
                busy[self.of[p]] = busy.get(self.of[p], 0) + 1
        out = {}
        for p, key in self.of.items():
            n = busy.get(key, 0) + (0 if any(p in lay.peers for lay in layouts) else 1)
            out[p] = min(1.0, max(1, self.cores.get(key, 1)) / max(1, n))
        return out


def shared_hosts_of(records: Sequence[Any], ids: Sequence[str]) -> SharedHosts:
    """`SharedHosts` of the CPU peers among `ids` from their DHT records (`swarm_cluster.shared_hosts`;
    a machine's cores: the largest `cpu_count` its peers report)."""
    from fusionnode.train.swarm_cluster import shared_hosts

    by_id = {r.peer_id: r for r in records}
    of = shared_hosts([r for r in records if r.peer_id in set(ids)], [i for i in ids if i in by_id])
    cores: dict[str, int] = {}
    for p, key in of.items():
        cores[key] = max(cores.get(key, 1), int(getattr(by_id[p].device, "cpu_count", 1) or 1))
    return SharedHosts(of, cores)


def rescaled(
    speeds: Mapping[str, float], hosts: SharedHosts, current: Sequence[Any], candidate: Sequence[Any]
) -> dict[str, float]:
    """`speeds` (measured under `current`) as the shared peers would run under `candidate`."""
    now, then = hosts.factors(current), hosts.factors(candidate)
    return {p: v * then[p] / now[p] if p in now else v for p, v in speeds.items()}


def job_step_s(
    layouts: Sequence[Any],
    flops: Sequence[Sequence[float]],
    speeds: Mapping[str, float],
    micro_batches: Sequence[int],
    hosts: SharedHosts,
    current: Sequence[Any],
) -> float:
    """The predicted step (its slowest pipeline) of `layouts` at the speeds the shared peers would
    have there, `speeds` being measured under `current`."""
    from fusionnode.train.rebalance import predict_step_s

    sp = rescaled(speeds, hosts, current, layouts)
    return max(predict_step_s(lay, f, sp, m) for lay, f, m in zip(layouts, flops, micro_batches, strict=True))


def has_straggler(speeds: Mapping[str, float], peers: Sequence[str]) -> bool:
    from fusionnode.train.swarm_cluster import outliers

    return bool(outliers(dict(speeds), list(peers)))


def consolidations(current: Sequence[Any], flops: Sequence[Sequence[float]], speeds: Mapping[str, float]):
    """Every pipeline on the fastest k of its own peers (k = 1 .. its peers; bounds weighted by
    their speeds), over all pipelines together (at most MAX_COMBOS combinations, fewest peers
    first): the layouts that leave peers of a shared machine idle."""
    from fusionnode.train.rebalance import Layout, weighted_bounds

    options = []
    for lay, f in zip(current, flops, strict=True):
        ranked = sorted(lay.peers, key=lambda p: -speeds[p])
        opts = []
        for k in range(1, min(len(ranked), len(f)) + 1):
            ps = [p for p in lay.peers if p in ranked[:k]]  # the pipeline's own order kept
            opts.append(Layout(tuple(ps), weighted_bounds(f, [speeds[p] for p in ps])))
        options.append(opts)
    for n, combo in enumerate(itertools.product(*options)):
        if n >= MAX_COMBOS:
            return
        yield tuple(combo)


def best_on_shared_hosts(
    current: Sequence[Any],
    proposed: Sequence[Any],
    flops: Sequence[Sequence[float]],
    speeds: Mapping[str, float],
    micro_batches: Sequence[int],
    hosts: SharedHosts,
) -> tuple[tuple[Any, ...], float]:
    """(layouts, predicted step) of the best of: the current layouts, the re-split's `proposed`, and
    (when the plan holds a clear straggler) the consolidations, all priced with the shared peers'
    cores (`job_step_s`). Ties keep the earlier: current, then proposed."""
    in_plan = [p for lay in current for p in lay.peers]

    def price(lays: Sequence[Any]) -> float:
        return job_step_s(lays, flops, speeds, micro_batches, hosts, current)

    best, best_s = tuple(current), price(current)
    pool = [tuple(proposed)]
    if has_straggler(speeds, in_plan):
        pool += list(consolidations(current, flops, speeds))
    for lays in pool:
        t = price(lays)
        if t < best_s * (1.0 - 1e-9):
            best, best_s = lays, t
    return best, best_s


__all__ = [
    "SharedHosts",
    "best_on_shared_hosts",
    "consolidations",
    "job_step_s",
    "rescaled",
    "shared_hosts_of",
]
