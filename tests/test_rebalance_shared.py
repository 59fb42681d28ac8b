"""Rebalancing peers that share one machine's cores (issue 18, train/contention.py): a pinned
2 x 2 job on a 2-core host whose one peer slowed 4x is consolidated onto 2 busy peers (2 x 1, the
straggler and a healthy peer idle), which is what ran fastest there (2 x 1 18.7k tokens/s against
14.1k for the re-split that kept 3 peers busy); jobs on separate machines are priced as before."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest

from fusionnode.train.contention import SharedHosts, job_step_s, shared_hosts_of
from fusionnode.train.rebalance import Layout, decide_job

FLOPS = [1.0] * 40
PIPES = [Layout(("a", "b"), (0, 20, 40)), Layout(("c", "d"), (0, 20, 40))]
WORK = [[f * 8 for f in FLOPS], [f * 8 for f in FLOPS]]  # 8 sequences per pipeline
ONE_BOX = SharedHosts({p: "127.0.0.1" for p in "abcd"}, {"127.0.0.1": 2})


def _decide(speeds, hosts=None, pipes=PIPES, spares=()):
    return decide_job(
        pipes,
        WORK,
        speeds,
        [4, 4],
        steps_left=100,
        move_cost_s=0.0,
        shares=[8, 8],
        spares=spares,
        hosts=hosts,
    )


def _busy(layouts) -> set[str]:
    return {p for lay in layouts for p in lay.peers}


def test_a_straggler_of_a_pinned_job_on_one_machine_leaves_two_busy_peers():
    speeds = {"a": 1.0, "b": 0.9, "c": 0.25, "d": 1.0}  # c slowed 4x; a and b healthy
    d = _decide(speeds, ONE_BOX)
    assert d.adopt and len(d.layouts) == 2  # still 2 pipelines: the job's shape is its replicas
    assert _busy(d.layouts) == {"a", "d"}  # each pipeline on its fastest peer; b and c idle
    assert all(lay.bounds == (0, 40) for lay in d.layouts) and d.shares == ()
    # the per-peer model (what it did before): a share move (4 peers busy) or a re-split of the
    # straggler's pipeline only (3 busy)
    before = _decide(speeds)
    assert before.adopt and len(_busy(before.layouts)) >= 3
    # and priced with the shared cores, 2 busy peers beat 3 (the measured 18.7k vs 14.1k)
    assert job_step_s(d.layouts, WORK, speeds, [4, 4], ONE_BOX, PIPES) < 0.8 * job_step_s(
        before.layouts, WORK, speeds, [4, 4], ONE_BOX, PIPES
    )


def test_a_healthy_job_on_one_machine_keeps_its_peers():
    speeds = {"a": 1.0, "b": 0.8, "c": 0.9, "d": 1.0}  # no straggler: consolidating is not offered
    d = _decide(speeds, ONE_BOX)
    assert not d.adopt and _busy(d.layouts) == set("abcd")


def test_peers_on_their_own_machines_are_priced_as_before():
    speeds = {"a": 1.0, "b": 0.9, "c": 0.25, "d": 1.0}
    alone = SharedHosts({}, {})
    enough = SharedHosts({p: "box" for p in "abcd"}, {"box": 8})  # one machine, a core for each
    ref = _decide(speeds)
    for hosts in (alone, enough, None):
        d = _decide(speeds, hosts)
        assert (d.adopt, d.layouts, d.shares) == (ref.adopt, ref.layouts, ref.shares)


def test_a_consolidated_job_does_not_take_its_idle_peers_back():
    pipes = [Layout(("a",), (0, 40)), Layout(("d",), (0, 40))]
    speeds = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}  # the straggler has recovered, say
    d = _decide(speeds, ONE_BOX, pipes, spares=["b", "c"])
    assert not d.adopt and d.layouts == tuple(pipes)
    # the per-peer model would split a pipeline over a spare: each peer's core to itself
    assert _decide(speeds, None, pipes, spares=["b", "c"]).adopt


def test_shared_hosts_come_from_the_records():
    def rec(pid: str, ip: str, kind: str = "cpu", cores: int = 2) -> SimpleNamespace:
        return SimpleNamespace(
            peer_id=pid, maddrs=(f"/ip4/{ip}/tcp/1",), device=SimpleNamespace(kind=kind, cpu_count=cores)
        )

    records = [
        rec("a", "10.0.0.1"),
        rec("b", "10.0.0.1", cores=4),
        rec("c", "10.0.0.2"),
        rec("g", "10.0.0.1", "cuda"),
    ]
    hosts = shared_hosts_of(records, ["a", "b", "c", "g"])
    assert hosts.of == {"a": "10.0.0.1", "b": "10.0.0.1"} and hosts.cores == {"10.0.0.1": 4}
    assert hosts.factors([Layout(("a", "b"), (0, 2, 4))]) == {"a": 1.0, "b": 1.0}
    two = SharedHosts(hosts.of, {"10.0.0.1": 1})
    assert two.factors([Layout(("a", "b"), (0, 2, 4))]) == pytest.approx({"a": 0.5, "b": 0.5})


def test_the_recorded_check_of_a_pinned_ring_straggler_run_consolidates():
    """The check 5 steps after the slow-down of a recorded run (`bench faults --scenario straggler
    --pipelines 2 --pinned --offload off`, 2026-11-24, load ~1-2; stage compute seconds of the 4 steps
    before it, gpt2-tiny, 2 x 2 cut at operator 56 of 103, 8 sequences per pipeline). The per-peer
    model re-split the straggler's pipeline only (2 + 1 stages, 3 busy peers: 14.1k tokens/s, 0.75x
    2 x 1); with the machine's 2 cores priced it takes 2 x 1."""
    from fusionnode.graph.trace import graph_for
    from fusionnode.train.rebalance import stage_flops

    fl = [n.flops for n in graph_for("gpt2-tiny", 128).nodes]
    compute_s = {  # steps 9-12; "s" slowed 4x after step 7, "d" is the driver's peer
        "d": [0.0963, 0.0669, 0.0753, 0.0668],
        "b": [0.0731, 0.0549, 0.0443, 0.063],
        "s": [0.3637, 0.2094, 0.2621, 0.2434],
        "c": [0.0676, 0.0507, 0.0431, 0.0412],
    }
    cut = (0, 56, 103)
    pipes = [Layout(("d", "b"), cut), Layout(("s", "c"), cut)]
    first = {"d": True, "b": False, "s": True, "c": False}
    cuts = {p: (0, 56) if first[p] else (56, 103) for p in compute_s}  # a window's median, as SpeedBook
    speeds = {p: stage_flops(fl, *cuts[p]) * 8 / statistics.median(v) for p, v in compute_s.items()}
    work = [[f * 8 for f in fl]] * 2
    box = SharedHosts({p: "127.0.0.1" for p in compute_s}, {"127.0.0.1": 2})

    def decide(hosts):
        return decide_job(
            pipes, work, speeds, [4, 4], steps_left=17, move_cost_s=0.26, shares=[8, 8], hosts=hosts
        )

    before, now = decide(None), decide(box)
    assert before.adopt and _busy(before.layouts) == {"d", "b", "c"}  # what the run did: 0.75x 2 x 1
    assert now.adopt and [len(lay.peers) for lay in now.layouts] == [1, 1] and "s" not in _busy(now.layouts)
