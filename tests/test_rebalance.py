"""The rebalancing decision, speeds, bans and blame: pure functions, no network."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionnode.plan.cluster import load_cluster_dict
from fusionnode.plan.estimator import Estimator
from fusionnode.train.rebalance import (
    Bans,
    Layout,
    blame,
    calibrate_cluster,
    decide,
    fill_speeds,
    measured_speeds,
    predict_step_s,
    weighted_bounds,
)
from fusionnode.wire.job import ErrorCode, Failure

FLOPS = [1.0] * 40  # 40 equal operators


def test_measured_speed_is_flops_over_compute_time():
    sp = measured_speeds(FLOPS, [("a", 0, 10, 2.0), ("a", 0, 10, 3.0), ("b", 10, 40, 3.0), ("c", 0, 5, 0.0)])
    assert sp == {"a": pytest.approx(20 / 5.0), "b": pytest.approx(10.0)}


def test_unmeasured_peers_get_the_advertised_figure_in_measured_units():
    sp = fill_speeds({"a": 10.0, "b": 20.0}, {"a": 1.0, "b": 2.0, "c": 4.0}, ["a", "b", "c", "d"])
    assert sp == {"a": 10.0, "b": 20.0, "c": 40.0, "d": 20.0}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.1, 10.0), min_size=3, max_size=30),
    st.lists(st.floats(0.1, 10.0), min_size=1, max_size=5),
)
def test_weighted_bounds_cover_everything_and_beat_the_even_split(flops, speeds):
    if len(speeds) > len(flops):
        speeds = speeds[: len(flops)]
    b = weighted_bounds(flops, speeds)
    assert b[0] == 0 and b[-1] == len(flops) and len(b) == len(speeds) + 1
    assert all(y > x for x, y in itertools.pairwise(b))
    peers = [f"p{i}" for i in range(len(speeds))]
    sp = dict(zip(peers, speeds, strict=True))
    k = len(speeds)
    even = tuple(round(i * len(flops) / k) for i in range(k + 1))
    if all(y > x for x, y in itertools.pairwise(even)):
        t_w = predict_step_s(Layout(tuple(peers), b), flops, sp, 4)
        t_e = predict_step_s(Layout(tuple(peers), even), flops, sp, 4)
        assert t_w <= t_e * (1 + 1e-6)


def test_a_slow_peer_gets_less_work():
    b = weighted_bounds(FLOPS, [1.0, 0.25, 1.0, 1.0])
    sizes = [y - x for x, y in itertools.pairwise(b)]
    assert sizes[1] < min(sizes[0], sizes[2], sizes[3])
    assert abs(sizes[1] * 4 - sizes[0]) <= 4


def test_a_4x_straggler_triggers_a_replan_that_recovers_most_throughput():
    cur = Layout(("a", "b", "c", "d"), (0, 10, 20, 30, 40))
    speeds = {"a": 1.0, "b": 0.25, "c": 1.0, "d": 1.0, "e": 1.0}
    d = decide(cur, FLOPS, speeds, 4, spares=["e"], steps_left=50, move_cost_s=1.0)
    assert d.adopt and d.layout is not None
    assert "b" not in d.layout.peers  # the spare replaces the straggler
    healthy = predict_step_s(cur, FLOPS, {**speeds, "b": 1.0}, 4)
    assert d.candidate_s <= healthy * 1.0001
    # without a spare: keep the slow peer with little work, or drop it
    d2 = decide(cur, FLOPS, speeds, 4, steps_left=50, move_cost_s=1.0)
    assert d2.adopt and d2.candidate_s < 0.5 * d2.current_s


def test_hysteresis_small_gains_and_expensive_moves_are_not_adopted():
    cur = Layout(("a", "b"), (0, 20, 40))
    speeds = {"a": 1.0, "b": 0.9}  # 10% imbalance
    d = decide(cur, FLOPS, speeds, 4, steps_left=1000, move_cost_s=0.0)
    assert not d.adopt and "threshold" in d.reason
    slow = {"a": 1.0, "b": 0.25}
    d = decide(cur, FLOPS, slow, 4, steps_left=2, move_cost_s=1e6)
    assert not d.adopt and "moving costs" in d.reason
    balanced = {"a": 1.0, "b": 1.0}
    assert not decide(cur, FLOPS, balanced, 4, steps_left=100, move_cost_s=0).adopt


def test_bans_grow_with_each_failure():
    bans = Bans(base_s=10.0, max_s=35.0)
    assert bans.fail("x", 0.0) == 10.0
    assert bans.banned("x", 9.9) and not bans.banned("x", 10.1)
    assert bans.fail("x", 20.0) == 20.0
    assert bans.fail("x", 50.0) == 35.0
    assert bans.allowed(["x", "y"], 60.0) == ["y"]


def test_blame():
    """Blame by error code and peer id (wire/job.py Failure), never by error text."""
    peers = ["QmAAAAAAAAAAAAAA", "QmBBBBBBBBBBBBBB", "QmCCCCCCCCCCCCCC"]
    dropped = [Failure(ErrorCode.FAILED, "dropped")]
    assert blame({"QmAAAAAAAAAAAAAA": dropped}, peers, ["QmBBBBBBBBBBBBBB"]) == {
        "QmBBBBBBBBBBBBBB": "failure"
    }
    leaving = [Failure(ErrorCode.LEAVING, "refused: draining")]
    assert blame({"QmCCCCCCCCCCCCCC": leaving}, peers) == {"QmCCCCCCCCCCCCCC": "leave"}
    gone = blame({"QmCCCCCCCCCCCCCC": leaving}, peers, ["QmCCCCCCCCCCCCCC"])
    assert gone == {"QmCCCCCCCCCCCCCC": "leave"}  # it said so before it went: no ban
    named = {"QmAAAAAAAAAAAAAA": [Failure(ErrorCode.BAD_TENSOR, "refused 'job.step'", "QmCCCCCCCCCCCCCC")]}
    assert blame(named, peers) == {"QmCCCCCCCCCCCCCC": "failure"}
    stranger = {"QmAAAAAAAAAAAAAA": [Failure(ErrorCode.BAD_TENSOR, "bad", "QmZZZZZZZZZZZZZZ")]}
    assert blame(stranger, peers) == {"QmAAAAAAAAAAAAAA": "failure"}  # blames only peers of the plan
    assert blame({"QmAAAAAAAAAAAAAA": [Failure(ErrorCode.DEADLINE, "deadline")]}, peers) == {
        "QmAAAAAAAAAAAAAA": "failure"
    }
    limited = {"QmAAAAAAAAAAAAAA": [Failure(ErrorCode.UNANSWERED, "closed unanswered (a rate limit)")]}
    assert blame(limited, peers) == {}
    # the text says nothing to recovery: a refusal that quotes "leaving" is no leave
    assert blame({"QmAAAAAAAAAAAAAA": [Failure(ErrorCode.FAILED, "this peer is leaving")]}, peers) == {
        "QmAAAAAAAAAAAAAA": "failure"
    }


def test_calibrated_cluster_feeds_the_planner_estimator():
    doc = {
        "version": 1,
        "name": "t",
        "devices": [
            {"id": "a", "tflops": 10.0, "memory_gb": 8, "roles": ["worker"]},
            {"id": "b", "tflops": 10.0, "memory_gb": 8, "roles": ["worker"]},
        ],
        "links": {"inter_site": {"bandwidth_gbps": 1.0, "latency_ms": 1.0}, "pairs": []},
    }
    out = calibrate_cluster(doc, {"a": 100.0, "b": 25.0}, {"a": 10.0, "b": 10.0})
    tf = {d["id"]: d["tflops"] for d in out["devices"]}
    assert tf["a"] / tf["b"] == pytest.approx(4.0)
    est = Estimator(load_cluster_dict(out, "t"))
    assert est.compute_time(1, 1e12) == pytest.approx(4 * est.compute_time(0, 1e12))
    assert doc["devices"][1]["tflops"] == 10.0  # input untouched


def test_noise_is_the_median_spread_so_one_real_slowdown_is_not_noise():
    from fusionnode.train.rebalance import SpeedBook

    book = SpeedBook(4)
    for k in range(4):
        book.record("a", 100.0, 1.0 + 0.02 * (-1) ** k)  # +-2% jitter
        book.record("b", 100.0, 1.0 - 0.02 * (-1) ** k)
        book.record("c", 100.0, 1.0 if k < 2 else 4.0)  # slowed 4x halfway through its window
    noise = book.noise()
    assert 0.005 < noise < 0.03  # about the 2% jitter / sqrt(4 samples)
    assert book.noise(["c"]) > 0.3  # alone, the level shift is a large spread
    assert SpeedBook().noise() == 0.0


def test_trigger_needs_a_gain_over_the_noise_at_consecutive_checks():
    from fusionnode.train.rebalance import Trigger

    t = Trigger(persist=2, sigmas=3.0)
    # a noisy measurement: the gain is over the job's threshold but not over 3 x the noise
    assert t.threshold(0.25, 0.2) == pytest.approx(0.6)
    assert t.check(True, 0.5, 0.25, 0.2)[0] is False and t.streak == 0
    # a real slow-down: the same gain at two checks in a row
    assert t.check(True, 0.5, 0.25, 0.02)[0] is False and t.streak == 1
    act, why = t.check(True, 0.5, 0.25, 0.02)
    assert act and "2 checks" in why and t.streak == 0
    # one good window between bad ones resets the streak
    t.check(True, 0.5, 0.25, 0.02)
    t.check(False, 0.0, 0.25, 0.02)
    assert t.check(True, 0.5, 0.25, 0.02)[0] is False
