"""Pipeline schedules (runtime/schedule.py), alone: each is a pure sequence of passes."""

from __future__ import annotations

import pytest

from fusionnode.runtime.schedule import (
    BACKWARD,
    DEFAULT_SCHEDULE,
    FORWARD,
    SCHEDULES,
    Op,
    peak_in_flight,
    schedule,
)


def seq(name: str, n: int, pos: int, m: int) -> str:
    return " ".join(f"{op.kind[0].upper()}{op.mb}" for op in schedule(name, n, pos, m))


def test_1f1b_fills_alternates_and_drains():
    assert seq("1f1b", 4, 0, 6) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert seq("1f1b", 4, 2, 6) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5"
    assert seq("1f1b", 4, 3, 3) == "F0 B0 F1 B1 F2 B2"  # the last stage never waits
    assert seq("1f1b", 4, 0, 2) == "F0 F1 B0 B1"  # fewer micro-batches than stages
    assert seq("1f1b", 1, 0, 2) == "F0 B0 F1 B1"


def test_gpipe_forwards_everything_first():
    assert seq("gpipe", 3, 1, 3) == "F0 F1 F2 B0 B1 B2"


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [0, 1, 2, 4, 7])
def test_every_schedule_is_valid(name, n, m):
    """Each micro-batch forwarded once, then backwarded once, in micro-batch order both ways."""
    for pos in range(n):
        ops = list(schedule(name, n, pos, m))
        assert all(isinstance(op, Op) for op in ops)
        fwd = [op.mb for op in ops if op.kind == FORWARD]
        bwd = [op.mb for op in ops if op.kind == BACKWARD]
        assert fwd == list(range(m)) and bwd == list(range(m))
        for mb in range(m):
            assert ops.index(Op(FORWARD, mb)) < ops.index(Op(BACKWARD, mb))


def test_peak_in_flight():
    assert [peak_in_flight("1f1b", 4, pos, 8) for pos in range(4)] == [4, 3, 2, 1]
    assert [peak_in_flight("1f1b", 4, pos, 2) for pos in range(4)] == [2, 2, 2, 1]
    assert peak_in_flight("gpipe", 4, 3, 8) == 8
    assert peak_in_flight("1f1b", 3, 0, 0) == 0


def test_bad_arguments_are_refused():
    assert DEFAULT_SCHEDULE in SCHEDULES
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule("interleaved", 2, 0, 2)
    with pytest.raises(ValueError, match="outside a pipeline"):
        list(schedule("1f1b", 2, 2, 2))
    with pytest.raises(ValueError, match="at least one stage"):
        list(schedule("gpipe", 0, 0, 2))
