"""A job's simple layout, as pure functions of its OP-DAG and the workers: contiguous stages balanced
by FLOPs (`balanced_bounds`), pipelines of them over the workers with the batch shared among them
(`layout`), the tensors that cross a cut (`crossing_names`, `tensor_spec`) and a stage's activation
memory (`activation_bytes`). `train/placement.py` turns a layout into stage assignments; the
planner's layouts come from fusionnode.plan. Split from train/placement.py.
"""

from __future__ import annotations

import itertools
from typing import Any

from fusionnode.errors import ConfigError, PlanError
from fusionnode.runtime.schedule import DEFAULT_SCHEDULE, peak_in_flight
from fusionnode.train.state import Pipeline

ACT_INFLIGHT_FACTOR = 3  # activation memory estimate: saved tensors ~ this many times the stage's outputs


def balanced_bounds(flops: list[float], n_stages: int) -> list[int]:
    """Contiguous split of nodes into n_stages ranges of about equal flops; every range non-empty."""
    n = len(flops)
    if n_stages < 1 or n_stages > n:
        raise PlanError(f"cannot split {n} operators into {n_stages} stages")
    weights = flops if sum(flops) else [1.0] * n
    total = sum(weights)
    bounds, acc, k = [0], 0.0, 1
    for i, w in enumerate(weights):
        acc += w
        # cut after node i once the prefix reaches k/n_stages of the total, leaving a node for each later stage
        if k < n_stages and acc >= total * k / n_stages and n - (i + 1) >= n_stages - k:
            bounds.append(i + 1)
            k += 1
    while len(bounds) < n_stages:  # degenerate weights: single nodes at the end
        bounds.append(n - (n_stages - len(bounds)))
    bounds.append(n)
    return bounds


def crossing_names(graph: Any, cut: int) -> list[str]:
    """Names of tensors produced before node `cut` and consumed at or after it."""
    last: dict[int, int] = {}
    for e in graph.edges:
        last[e.src] = max(last.get(e.src, -1), e.dst)
    return [graph.nodes[src].name for src in sorted(last) if src < cut <= last[src]]


def tensor_spec(graph: Any, name: str) -> dict[str, Any]:
    for node in graph.nodes:
        if node.name == name:
            return {"shape": list(node.out_shape), "dtype": node.out_dtype}
    raise PlanError(f"tensor {name!r} is not in the OP-DAG")


def divisor_at_most(n: int, m: int) -> int:
    return next(k for k in range(min(m, n), 0, -1) if n % k == 0)


def layout(
    spec: Any,
    flops: list[float],
    workers: list[str],
    n_stages: int,
    replicas: int,
    shares: list[int] | None = None,
    bounds: list[int] | None = None,
) -> list[Pipeline]:
    """`replicas` pipelines of `n_stages` stages each over the first workers; the batch is shared
    evenly, or by `shares` (samples per replica, summing to the batch size); the operators are
    split to balance FLOPs, or at `bounds` (n_stages + 1 operator indices from 0 to the count)."""
    if replicas < 1 or n_stages < 1:
        raise PlanError("need at least one pipeline of at least one stage")
    if replicas * n_stages > len(workers):
        raise PlanError(
            f"{replicas} pipeline(s) x {n_stages} stage(s) need {replicas * n_stages} workers; "
            f"the swarm has {len(workers)} available"
        )
    if shares is None:
        if spec.batch_size % replicas:
            raise ConfigError(f"batch size {spec.batch_size} does not split evenly into {replicas} replicas")
        shares = [spec.batch_size // replicas] * replicas
    if len(shares) != replicas or sum(shares) != spec.batch_size or min(shares) < 1:
        raise ConfigError(
            f"batch shares {shares} must be {replicas} positive numbers summing to the batch "
            f"size {spec.batch_size}"
        )
    # a pipeline of one stage (a pure data-parallel replica) has no bubble to fill: its share may be
    # any size, run in the most equal micro-batches that divide it (at most the job's count)
    bad = [n for n in shares if n % spec.micro_batches and n_stages > 1]
    if bad:
        raise ConfigError(f"batch shares {bad} do not split into {spec.micro_batches} equal micro-batches")
    if bounds is None:
        bounds = balanced_bounds(flops, n_stages)
    elif (
        len(bounds) != n_stages + 1
        or bounds[0] != 0
        or bounds[-1] != len(flops)
        or any(b <= a for a, b in itertools.pairwise(bounds))
    ):
        raise ConfigError(
            f"bounds {bounds} must be {n_stages + 1} increasing operator indices from 0 to {len(flops)}"
        )
    out, first = [], 0
    for r in range(replicas):
        out.append(
            Pipeline(
                r,
                workers[r * n_stages : (r + 1) * n_stages],
                bounds,
                int(shares[r]),
                divisor_at_most(int(shares[r]), spec.micro_batches),
                first,
            )
        )
        first += n_stages
    return out


def activation_bytes(graph: Any, pipe: Pipeline, i: int) -> int:
    """Estimated activation memory of stage `i` of `pipe` (saved tensors of the micro-batches in
    flight at once under the schedule): it scales with the pipeline's micro-batch size."""
    lo, hi = pipe.bounds[i], pipe.bounds[i + 1]
    act_bytes = sum(node.out_bytes for node in graph.nodes[lo:hi]) * pipe.mb_size
    in_flight = peak_in_flight(DEFAULT_SCHEDULE, len(pipe.peers), i, pipe.micro_batches)
    return int(act_bytes * in_flight * ACT_INFLIGHT_FACTOR)
