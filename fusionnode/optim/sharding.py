"""Which optimizer host holds which parameter: balanced by bytes, the same answer on every peer."""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from torch import Tensor

from fusionnode.errors import ConfigError


def param_bytes(params: Mapping[str, Tensor]) -> dict[str, int]:
    """Bytes each parameter occupies on an optimizer host (its fp32 master; state scales with it)."""
    return {n: p.numel() * 4 for n, p in params.items()}


def shard_params(sizes: Mapping[str, int], hosts: list[str]) -> dict[str, str]:
    """Assign each parameter name to a host, greedy longest-processing-time on bytes.

    Deterministic whatever the input order: names are taken by decreasing size (then name),
    hosts are considered in sorted order, and each name goes to the least loaded host (ties:
    the smallest host id). LPT's largest load is at most 4/3 of the optimum.
    """
    unique = sorted(set(hosts))
    if not unique:
        raise ConfigError("no optimizer host to shard parameters over")
    for name, size in sizes.items():
        if size < 0:
            raise ConfigError(f"parameter {name!r} has negative size {size}")
    heap = [(0, h) for h in unique]
    heapq.heapify(heap)
    out: dict[str, str] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, host = heapq.heappop(heap)
        out[name] = host
        heapq.heappush(heap, (load + sizes[name], host))
    return out


def shard_loads(assignment: Mapping[str, str], sizes: Mapping[str, int]) -> dict[str, int]:
    """Total bytes per host of an assignment."""
    loads: dict[str, int] = {}
    for name, host in assignment.items():
        loads[host] = loads.get(host, 0) + sizes[name]
    return loads
