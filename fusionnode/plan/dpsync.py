"""Data-parallel sync by ring all-reduce among the replicas of each stage (the optimizer on the workers).

The runtime's ring (runtime/allreduce.py) joins, for every set of parameters, the stage of each
pipeline that holds them, in pipeline order; each member sends 2 (k - 1) / k of the set's bytes
(reduce-scatter, then all-gather) over 2 (k - 1) hops. Priced on the measured links:

    t_ring = 2 (k - 1) / k * bytes * 8 / (slowest link of the ring) + 2 (k - 1) * (slowest latency)

A ring starts when the last of its members has finished its backward pass; a device in several rings
(pipelines cut differently) runs them one after another. The optimizer hosts' alternative is the
estimator's (plan/estimator.py); plan/evaluate.py `ring_variant` prices a layout both ways.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ring_groups(
    params: np.ndarray, pipelines: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> list[tuple[tuple[int, ...], tuple[int, ...], float]]:
    """The rings of a layout: (device of each pipeline, stage index of each pipeline, parameter bytes)
    per set of blocks the same stages hold. `params`: prefix parameter bytes per chain block;
    `pipelines`: (devices, split) of each, split[k]..split[k + 1] the blocks of stage k."""
    blocks = len(params) - 1
    per_block = np.diff(np.asarray(params, dtype=float))
    stage_of = []
    for _devices, split in pipelines:
        idx = np.searchsorted(np.asarray(split[1:], dtype=int), np.arange(blocks), side="right")
        stage_of.append(idx)
    groups: dict[tuple[int, ...], float] = {}
    for b in range(blocks):
        key = tuple(int(s[b]) for s in stage_of)
        groups[key] = groups.get(key, 0.0) + float(per_block[b])
    out = []
    for stages, nbytes in groups.items():
        devs = tuple(int(p[0][k]) for p, k in zip(pipelines, stages, strict=True))
        out.append((devs, stages, nbytes))
    return out


def ring_time(
    bandwidth_bps: np.ndarray, latency_s: np.ndarray, devices: Sequence[int], nbytes: float
) -> float:
    """Seconds of one ring all-reduce of `nbytes` among `devices` (in ring order)."""
    k = len(devices)
    if k < 2 or nbytes <= 0:
        return 0.0
    links = [(devices[i], devices[(i + 1) % k]) for i in range(k)]
    slowest = min(float(bandwidth_bps[a, b]) for a, b in links)
    latency = max(float(latency_s[a, b]) for a, b in links)
    return 2.0 * (k - 1) / k * nbytes * 8.0 / slowest + 2.0 * (k - 1) * latency


def ring_finish(
    bandwidth_bps: np.ndarray,
    latency_s: np.ndarray,
    params: np.ndarray,
    pipelines: Sequence[tuple[Sequence[int], Sequence[int]]],
    stage_done: Sequence[Sequence[float]],
) -> list[float]:
    """When each pipeline's last ring finishes, given when each stage finished its backward pass
    (`stage_done[p][k]`); rings of one device run in the order they become ready."""
    if len(pipelines) < 2:
        return [max(d) for d in stage_done]
    rings = ring_groups(params, pipelines)
    ready = [max(stage_done[p][k] for p, k in enumerate(stages)) for _devs, stages, _b in rings]
    free: dict[int, float] = {}
    finish = [max(d) for d in stage_done]
    for i in sorted(range(len(rings)), key=lambda i: ready[i]):
        devs, stages, nbytes = rings[i]
        start = max([ready[i], *(free.get(d, 0.0) for d in devs)])
        end = start + ring_time(bandwidth_bps, latency_s, devs, nbytes)
        for d in devs:
            free[d] = end
        for p, _k in enumerate(stages):
            finish[p] = max(finish[p], end)
    return finish


def ring_sync_s(
    bandwidth_bps: np.ndarray,
    latency_s: np.ndarray,
    params: np.ndarray,
    pipelines: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> float:
    """The closed form's sync: the busiest device's rings back to back (all stages ready together)."""
    if len(pipelines) < 2:
        return 0.0
    busy: dict[int, float] = {}
    for devs, _stages, nbytes in ring_groups(params, pipelines):
        t = ring_time(bandwidth_bps, latency_s, devs, nbytes)
        for d in set(devs):
            busy[d] = busy.get(d, 0.0) + t
    return max(busy.values(), default=0.0)
