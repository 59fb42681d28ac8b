"""Optimizer hosts: which devices hold a job's optimizer state, and which parameters each owns.

Optimizer-role devices, best connected first, enough of them for the state (shares by RAM); the
host sets a search is run for; parameter names sharded over the hosts by bytes."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from fusionnode.errors import PlanError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan.cluster import Cluster
from fusionnode.plan.estimator import OPTIMIZER_BYTES_FACTOR, USABLE_MEMORY_FRACTION

HOST_COUNT_MULTIPLIERS = (1, 2, 4, 8, 16)  # optimizer host counts tried, x the minimum by RAM
HOST_SPREAD_MAX = 16  # the search spreads the optimizer over at most this x the minimum host count


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
