"""Pipeline schedules: the order of forward and backward passes one stage runs in a step.

A schedule is a pure function ``(num_stages, pos, micro_batches) -> iterator of Op``: for the
stage at position `pos` of a pipeline of `num_stages` stages, the sequence of
``Op("forward" | "backward", micro-batch)`` it runs in one step. Every micro-batch is
forwarded once and then backwarded once. Schedules are registered by name in `SCHEDULES`
(``schedule(name, ...)`` picks one), so another one can be added beside 1F1B; the worker runs
the sequence, and `peak_in_flight` says how many micro-batches' activations a stage keeps
at once under it (what a stage's memory estimate counts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal, NamedTuple

FORWARD: Literal["forward"] = "forward"
BACKWARD: Literal["backward"] = "backward"


class Op(NamedTuple):
    """One pass of one micro-batch through a stage."""

    kind: Literal["forward", "backward"]
    mb: int


Schedule = Callable[[int, int, int], Iterator[Op]]


def _check(num_stages: int, pos: int, micro_batches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {num_stages}")
    if not 0 <= pos < num_stages:
        raise ValueError(f"stage position {pos} is outside a pipeline of {num_stages} stages")
    if micro_batches < 0:
        raise ValueError(f"micro_batches must be >= 0, got {micro_batches}")


def one_f_one_b(num_stages: int, pos: int, micro_batches: int) -> Iterator[Op]:
    """1F1B (PipeDream-Flush): forward `num_stages - pos - 1` micro-batches to fill the
    pipeline, then alternate one forward and one backward, then drain the backwards. A stage
    keeps at most ``min(num_stages - pos, micro_batches)`` micro-batches in flight."""
    _check(num_stages, pos, micro_batches)
    warmup = min(num_stages - pos - 1, micro_batches)
    f = b = 0
    for _ in range(warmup):
        yield Op(FORWARD, f)
        f += 1
    while f < micro_batches:
        yield Op(FORWARD, f)
        f += 1
        yield Op(BACKWARD, b)
        b += 1
    while b < micro_batches:
        yield Op(BACKWARD, b)
        b += 1


def gpipe(num_stages: int, pos: int, micro_batches: int) -> Iterator[Op]:
    """GPipe: every forward, then every backward in the same order; every micro-batch's
    activations are kept until the backwards start."""
    _check(num_stages, pos, micro_batches)
    for mb in range(micro_batches):
        yield Op(FORWARD, mb)
    for mb in range(micro_batches):
        yield Op(BACKWARD, mb)


SCHEDULES: dict[str, Schedule] = {"1f1b": one_f_one_b, "gpipe": gpipe}
DEFAULT_SCHEDULE = "1f1b"  # what the workers run and the planners' memory estimates assume


def schedule(name: str, num_stages: int, pos: int, micro_batches: int) -> Iterator[Op]:
    """The sequence of passes of the stage at `pos` under the schedule called `name`."""
    fn = SCHEDULES.get(name)
    if fn is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {sorted(SCHEDULES)}")
    return fn(num_stages, pos, micro_batches)


def peak_in_flight(name: str, num_stages: int, pos: int, micro_batches: int) -> int:
    """The most micro-batches the stage at `pos` holds between their forward and backward."""
    held = peak = 0
    for op in schedule(name, num_stages, pos, micro_batches):
        held += 1 if op.kind == FORWARD else -1
        peak = max(peak, held)
    return peak
