"""Ring all-reduce among the replicas of a stage (runtime/allreduce.py): the schedule over in-process
queues (sums, identical bits, chunks, bytes, a lost member), then two pipelines of two stages with the
optimizer on the workers through the driver and workers on the in-memory network (tests/memnet.py),
against the single-process reference; the loopback daemons' version is in test_pipeline_e2e.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_components import Swarm, small_spec

from fusionnode.errors import PeerError
from fusionnode.runtime.allreduce import hops, pieces, ring_allreduce, segments
from fusionnode.train.local import train_local
from fusionnode.wire.job import AllReduceRing, ErrorCode, JobError, Rpc

torch.set_num_threads(1)


class Lost(Exception):
    pass


async def run_ring(flats: list[torch.Tensor], chunk: int, lose: int | None = None) -> list[int]:
    """Runs every member's ring_allreduce over queues (member i -> i + 1); member `lose` vanishes
    after its first hop (its sends stop, its successor's receive fails as a timeout would)."""
    k = len(flats)
    boxes: list[dict[int, asyncio.Future]] = [{} for _ in range(k)]
    loop = asyncio.get_running_loop()

    def box(i: int, mb: int) -> asyncio.Future:
        return boxes[i].setdefault(mb, loop.create_future())

    def member(i: int):
        hop_count = 0

        async def send(mb: int, t: torch.Tensor) -> int:
            if lose == i and hop_count > 0:
                raise Lost("gone")
            box((i + 1) % k, mb).set_result(t.clone())
            return t.numel() * 4

        async def recv(mb: int, numel: int) -> torch.Tensor:
            nonlocal hop_count
            got = await asyncio.wait_for(box(i, mb), 1)
            hop_count += 1
            assert got.numel() == numel
            return got

        return ring_allreduce(flats[i], 3, k, i, send, recv, chunk)

    return list(await asyncio.gather(*(member(i) for i in range(k))))


@pytest.mark.parametrize(("k", "n", "chunk"), [(2, 10, 3), (3, 17, 2), (5, 23, 100), (4, 3, 1)])
def test_every_member_ends_with_the_same_weighted_sum(k, n, chunk):
    torch.manual_seed(k * 100 + n)
    grads = [torch.randn(n) for _ in range(k)]
    weights = torch.rand(k) + 0.1
    weights = (weights / weights.sum()).tolist()
    flats = [g * w for g, w in zip(grads, weights, strict=True)]
    want = sum(g.double() * w for g, w in zip(grads, weights, strict=True)).float()
    sent = asyncio.run(run_ring(flats, chunk))
    for f in flats:
        assert torch.equal(f, flats[0])  # bit-identical on every member
        torch.testing.assert_close(f, want, rtol=1e-6, atol=1e-7)
    # each member sends 2 (k - 1) segments, n/k elements each (to rounding)
    assert sum(sent) == 2 * (k - 1) * n * 4


def test_the_schedule_touches_each_segment_once_per_hop_and_chunks_are_bounded():
    for k in range(2, 7):
        for i in range(k):
            hs = list(hops(k, i))
            assert len(hs) == 2 * (k - 1)
            assert all(out != inn for _, _, out, inn in hs)
            # after the reduce-scatter member i holds the finished segment (i + 1) mod k, which it sends first
            assert hs[k - 1][2] == (i + 1) % k
    assert segments(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert pieces(4, 14, 4) == [(4, 8), (8, 12), (12, 14)] and pieces(5, 5, 4) == [(5, 5)]


def test_a_member_lost_mid_ring_fails_the_others():
    flats = [torch.ones(12) for _ in range(3)]
    with pytest.raises(Lost):
        asyncio.run(run_ring(flats, 2, lose=1))


def test_a_ring_message_is_checked():
    ok = dict(id=0, members=["a", "b"], member_stages=[0, 2], weights=[0.25, 0.75], names=["w"])
    AllReduceRing(**ok)
    for bad in (
        {"members": ["a"], "member_stages": [0], "weights": [1.0]},
        {"weights": [0.5, 0.6]},
        {"member_stages": [1, 1]},
        {"names": []},
        {"id": 1 << 20},
    ):
        with pytest.raises(JobError) as e:
            AllReduceRing(**{**ok, **bad})
        assert e.value.code == ErrorCode.BAD_REQUEST


def test_two_pipelines_without_hosts_follow_the_single_process_loss(tmp_path):
    """2 pipelines x 2 stages, offload off: each stage averages its gradients with its replica by ring
    all-reduce and steps its own AdamW; the losses follow one process (fp32, 1e-5) and the replicas'
    parameters stay bit-identical."""
    spec = small_spec(steps=4, micro_batches=2, grad_clip=1.0)
    s = Swarm(tmp_path, workers=4)
    params = {"spec": spec.to_dict(), "stages": 2, "shares": [2, 6], "offload": "off"}
    res = asyncio.run(s.driver.run_job(params, s.emit))
    assert res["offload"] is False and res["optimizer_hosts"] == []
    ref = train_local(spec).losses
    got = [e["loss"] for e in s.steps()]
    assert len(got) == len(ref) == spec.steps
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) < 1e-5, f"step {i}: swarm {a:.7f} vs local {b:.7f}"
    # the grad norm the driver clipped with is that of the averaged gradient (one process's)
    stages = s.steps()[-1]["stages"]
    assert {st["stage"] for st in stages} == {0, 1, 2, 3}
    for pid in s.workers:
        calls = s.net.peers[pid].calls
        assert calls.count(Rpc.JOB_COMMIT) == spec.steps and not s.workers[pid].jobs


def test_replicas_stay_bit_identical_and_a_lost_replica_is_named(tmp_path):
    spec = small_spec(steps=2, micro_batches=2)
    s = Swarm(tmp_path, workers=4)
    snapshots: list[dict] = []
    orig_commit = {}

    for pid, w in s.workers.items():  # after each commit, every stage's parameters by name and replica
        orig_commit[pid] = w.rpc_commit

        async def commit(req, sender, pid=pid, w=w):
            reply = await orig_commit[pid](req, sender)
            sj = w.jobs[(req.job, req.stage)]
            snapshots.append(
                {
                    "replica": sj.replica,
                    "step": req.step,
                    **{n: p.detach().clone() for n, p in sj.params.items()},
                }
            )
            return reply

        w.rpc_commit = commit
        s.net.peers[pid].add_rpc(Rpc.JOB_COMMIT, _typed(commit))
    params = {"spec": spec.to_dict(), "stages": 2, "replicas": 2, "offload": "off"}
    asyncio.run(s.driver.run_job(params, s.emit))
    by_step: dict[int, dict[int, dict]] = {}
    for snap in snapshots:
        by_step.setdefault(snap["step"], {}).setdefault(snap["replica"], {}).update(snap)
    for step, reps in by_step.items():
        a, b = reps[0], reps[1]
        names = set(a) - {"replica", "step"}
        assert names == set(b) - {"replica", "step"} and len(names) > 10
        for n in names:
            assert torch.equal(a[n], b[n]), (step, n)

    # a replica lost mid-step: the ring member is named, and the job goes on from the survivors'
    # state (tests/test_ring_recovery.py has the losses)
    s2 = Swarm(tmp_path / "lost", workers=4)
    victim = s2.ids[3]
    orig = s2.workers[victim]._allreduce

    async def die(sj, step):
        if step == 1:
            s2.net.down.add(victim)
            raise PeerError("this peer vanished")
        return await orig(sj, step)

    s2.workers[victim]._allreduce = die
    res = asyncio.run(s2.driver.run_job({**params, "spec": small_spec(steps=3).to_dict()}, s2.emit))
    assert res["steps"] == 3 and victim not in {st["peer"] for st in res["stages"]}
    failures = [e for e in s2.events if e.get("kind") == "failure" and e.get("peer")]
    assert failures and failures[0]["peer"] == victim


def test_a_stage_ring_names_the_member_it_lost(tmp_path):
    """StageRing over the in-memory network's real mailboxes: a member that cannot be reached, or that
    sends nothing within the deadline, fails the step with `ring_broken` blaming that member."""
    from memnet import MemNet

    from fusionnode.runtime.allreduce import StageRing

    net = MemNet()
    ids = ["QmA" + "x" * 20, "QmB" + "x" * 20, "QmC" + "x" * 20]
    ts = [net.join(p) for p in ids]
    ring = AllReduceRing(id=0, members=ids, member_stages=[0, 2, 4], weights=[0.5, 0.25, 0.25], names=["w"])
    for t, stage in zip(ts, (0, 2, 4), strict=True):
        t.mailbox.accept("j", ("stage", stage), ids, 1 << 20)
    w = torch.nn.Parameter(torch.ones(6))
    w.grad = torch.full((6,), 2.0)

    async def all_three():
        rings = [StageRing(ring, st, t, "j", 2.0) for st, t in zip((0, 2, 4), ts, strict=True)]
        ps = [{"w": torch.nn.Parameter(torch.ones(6))} for _ in rings]
        for i, p in enumerate(ps):
            p["w"].grad = torch.full((6,), float(i + 1))
        await asyncio.gather(*(r.run(p, 5) for r, p in zip(rings, ps, strict=True)))
        return [p["w"].grad for p in ps]

    grads = asyncio.run(all_three())
    for g in grads:  # 0.5 * 1 + 0.25 * 2 + 0.25 * 3
        assert torch.equal(g, torch.full((6,), 1.75))

    net.down.add(ids[1])
    with pytest.raises(JobError) as e:
        asyncio.run(StageRing(ring, 0, ts[0], "j", 2.0).run({"w": w}, 6))
    assert (e.value.code, e.value.blame) == (ErrorCode.RING_BROKEN, ids[1])
    assert "all-reduce ring 0" in str(e.value)
    net.down.clear()
    with pytest.raises(JobError) as e:  # the previous member (C) never sends
        asyncio.run(StageRing(ring, 0, ts[0], "j", 0.2).run({"w": w}, 7))
    assert (e.value.code, e.value.blame) == (ErrorCode.RING_BROKEN, ids[2])


def _typed(handler):
    from fusionnode.wire import job as jp

    spec = jp.RPCS[Rpc.JOB_COMMIT]

    async def typed(args, sender):
        return (await handler(spec.request.from_wire(args), sender)).to_wire()

    return typed


def test_a_planned_job_follows_the_plans_choice_of_a_ring_over_far_hosts(tmp_path):
    """`--planner fusion --offload auto` with an optimizer host behind a slow link: the plan prices
    the hosts against a ring all-reduce among the replicas, takes the ring, and the job runs without
    hosts and follows the single-process loss."""
    spec = small_spec(steps=3, batch_size=16, micro_batches=2)
    s = Swarm(tmp_path, workers=4, hosts=1)
    n = len(s.ids)
    bw = [[10.0] * n for _ in range(n)]
    for i in range(4):
        bw[i][4] = bw[4][i] = 0.001
    devices = [{"id": p, "tflops": 0.002, "memory_gb": 1, "roles": ["worker"]} for p in s.ids[:4]]
    devices.append({"id": s.ids[4], "tflops": 1, "memory_gb": 1, "roles": ["optimizer"], "ram_gb": 8})
    doc = {"name": "far-host", "devices": devices, "links": {"matrix": {"bandwidth_gbps": bw}}}
    params = {"spec": spec.to_dict(), "planner": "fusion", "offload": "auto", "cluster": doc}
    res = asyncio.run(s.driver.run_job(params, s.emit))
    plan = next(e for e in s.events if e["type"] == "plan")
    assert plan["prediction"]["dp_sync"] == "ring" and not plan["offload"] and plan["optimizer_hosts"] == []
    assert len({st["replica"] for st in plan["stages"]}) > 1, plan["stages"]
    assert res["offload"] is False
    ref = train_local(spec).losses
    got = [e["loss"] for e in s.steps()]
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) < 1e-5, f"step {i}: swarm {a:.7f} vs local {b:.7f}"
    assert Rpc.OPT_INIT not in s.net.peers[s.ids[4]].calls


def test_rings_join_the_stages_holding_the_same_parameters_even_when_cuts_differ():
    from fusionnode.runtime.allreduce import allreduce_rings
    from fusionnode.train.state import Pipeline

    # pipeline 0: [a b | c d], pipeline 1: [a | b c d]; tied "e" goes through the driver
    p0 = Pipeline(0, ["P0", "P1"], [0, 2, 4], 2, 1, 0)
    p1 = Pipeline(1, ["P2", "P3"], [0, 1, 4], 6, 1, 2)
    params_of = [[["a", "b", "e"], ["c", "d", "e"]], [["a", "e"], ["b", "c", "d", "e"]]]
    rings = allreduce_rings([p0, p1], params_of, {"e"})
    got = {st: [(r["member_stages"], r["names"]) for r in rs] for st, rs in rings.items()}
    assert got == {
        0: [([0, 2], ["a"]), ([0, 3], ["b"])],
        2: [([0, 2], ["a"])],
        3: [([0, 3], ["b"]), ([1, 3], ["c", "d"])],
        1: [([1, 3], ["c", "d"])],
    }
    ring = AllReduceRing.from_wire(rings[1][0])
    assert ring.members == ["P1", "P3"] and ring.weights == [0.25, 0.75]
    assert len({r["id"] for rs in rings.values() for r in rs}) == 3
