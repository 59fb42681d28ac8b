"""Fused steps queued ahead under `--round-close time` (train/queued_rounds.py, runtime/queued.py):
a one-stage fused replica gets its next step's call while its current step runs, and another
replica closing the round withdraws it (`job.withdraw`). The stage decides once whether the queued
step started; the driver must count exactly the steps that ran, each in the round it ran in.

On the in-memory network (real driver, workers and hosts): every worker's applied fused steps are
recorded and compared with the rounds' records, so a queued step counted in the wrong round, counted
after being withdrawn, or run without being counted fails the test; the losses follow the replay of
the recorded schedule."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch
from test_components import Swarm, round_job, small_spec
from test_time_close_faults import SPARSE_TOL, TOL, _follows, _replay, _timed

from fusionnode.runtime import fused, queued
from fusionnode.sync import SyncConfig
from fusionnode.verify import compat
from fusionnode.wire import job as jp
from fusionnode.wire.job import JobError, Rpc

torch.set_num_threads(1)

H = 3
DILOCO = _timed(SyncConfig("diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.9))
OVERLAP_D2 = _timed(SyncConfig("diloco", inner_steps=H, outer_lr=0.7, overlap=True, overlap_steps=2))
OVERLAP = _timed(
    SyncConfig("sparseloco", inner_steps=H, topk_density=1 / 16, chunk=256, overlap=True, overlap_steps=1)
)


# ---- the stage's side, alone --------------------------------------------------------------------
def _stage(last: int = 4) -> types.SimpleNamespace:
    return types.SimpleNamespace(stage=0, last_step=last)


def _req(step: int, after: int) -> jp.StepRequest:
    return jp.StepRequest(
        job="j", stage=0, step=step, micro_batches=1, mb_size=1, commit_lr=1e-3, after_step=after
    )


def test_a_queued_step_starts_when_the_step_it_follows_ends() -> None:
    async def go():
        sj = _stage(4)
        waiting = asyncio.ensure_future(queued.wait_turn(sj, _req(6, 5)))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # step 5 still runs
        sj.last_step = 5
        queued.ended(sj, 5, True)
        await asyncio.wait_for(waiting, 1)
        # it started: a withdrawal now is too late and says so
        assert not queued.withdraw(sj, jp.WithdrawRequest(job="j", stage=0, step=6)).withdrawn

    asyncio.run(go())


def test_a_withdrawn_step_never_runs_whether_it_waits_or_comes_later() -> None:
    async def go():
        sj = _stage(4)
        waiting = asyncio.ensure_future(queued.wait_turn(sj, _req(6, 5)))
        await asyncio.sleep(0.01)
        assert queued.withdraw(sj, jp.WithdrawRequest(job="j", stage=0, step=6)).withdrawn
        with pytest.raises(JobError, match="withdrawn"):
            await asyncio.wait_for(waiting, 1)
        # withdrawn before its request arrives (another stream): refused when it comes, even once
        # the step it follows has ended
        assert queued.withdraw(sj, jp.WithdrawRequest(job="j", stage=0, step=9)).withdrawn
        sj.last_step = 8
        queued.ended(sj, 8, True)
        with pytest.raises(JobError, match="withdrawn"):
            await queued.wait_turn(sj, _req(9, 8))

    asyncio.run(go())


def test_a_queued_step_is_refused_when_the_step_it_follows_fails() -> None:
    async def go():
        sj = _stage(4)
        waiting = asyncio.ensure_future(queued.wait_turn(sj, _req(6, 5)))
        await asyncio.sleep(0.01)
        queued.ended(sj, 5, False)  # step 5 failed: last_step stays 4
        with pytest.raises(JobError, match="did not complete"):
            await asyncio.wait_for(waiting, 1)
        # and a step queued after one the stage never ran, arriving late, is refused too
        with pytest.raises(JobError, match="did not complete"):
            await queued.wait_turn(sj, _req(7, 5))

    asyncio.run(go())


def test_after_step_belongs_to_a_fused_step_below_it() -> None:
    with pytest.raises(JobError, match="after_step"):
        jp.StepRequest(job="j", stage=0, step=3, micro_batches=1, mb_size=1, after_step=2)
    assert "after_step" not in jp.StepRequest(job="j", stage=0, step=3, micro_batches=1, mb_size=1).to_wire()
    sj = types.SimpleNamespace(rounds=object(), opt=object(), shared_names=set(), params={})
    assert "after_step must be below step" in fused.refusal(sj, _req(3, 3))
    assert fused.refusal(sj, _req(3, 2)) is None


def _held_stage(tmp_path):
    """A real WorkerService on the in-memory network holding one assigned stage (not started: the
    queue's side needs no module), and the driver's transport."""
    from memnet import MemNet
    from test_start_once import CONFIG, D, W, _stage

    from fusionnode.runtime.worker import WorkerService

    desc, params = _stage()
    net = MemNet()
    worker = WorkerService(net.join(W), capacity_bytes=1 << 30, config=CONFIG, state_dir=tmp_path)
    t = net.join(D)
    specs = {n: {"shape": list(p.shape), "dtype": "float32"} for n, p in params.items()}
    held = dict(job="j", stage=0, num_stages=2, driver=D, description=desc, param_specs=specs, peer=W)
    a = jp.StageAssignment(**held, spec=small_spec().to_dict())
    return worker, t, a, D, W


def test_the_recall_of_a_queued_step_waits_for_it_and_answers_its_refusal(tmp_path) -> None:
    """review8 M1: a queued step's stream reset while it waits its turn; the recall
    (`job.step_result`) waits for the step (it would otherwise answer no_report, and the step would
    run uncounted), and answers `aborted` when the queue refuses it."""
    worker, t, a, d, _ = _held_stage(tmp_path)

    async def go():
        await jp.call(t, a.peer, Rpc.JOB_ASSIGN, a)
        sj = worker.jobs[("j", 0)]
        sj.last_step, sj.last_report = 4, (4, "report 4")
        five = asyncio.get_running_loop().create_future()  # fused step 5 runs
        sj.step_task, sj.step_task_step = five, 5
        waiting = asyncio.ensure_future(queued.wait_turn(sj, _req(6, 5)))  # the original job.step
        await asyncio.sleep(0.01)
        recall = asyncio.ensure_future(worker.rpc_step_result(_req(6, 5), d))
        await asyncio.sleep(0.05)
        assert not recall.done()  # step 6 waits its turn: no "no_report"
        five.set_result("report 5")
        sj.step_task, sj.last_step, sj.last_report = None, 5, (5, "report 5")
        queued.ended(sj, 5, True)
        await asyncio.wait_for(waiting, 1)
        await asyncio.sleep(0.05)
        assert not recall.done()  # started, waiting for the stage: still held
        six = asyncio.get_running_loop().create_future()  # rpc_step runs it
        sj.step_task, sj.step_task_step = six, 6
        queued.leave(sj, 6)
        await asyncio.sleep(0.01)
        assert not recall.done()  # it awaits the running step
        six.set_result("report 6")
        assert await asyncio.wait_for(recall, 1) == "report 6"
        sj.step_task, sj.last_step, sj.last_report = None, 6, (6, "report 6")
        queued.ended(sj, 6, True)
        # withdrawn while it waits: the recall answers aborted, not no_report
        waiting = asyncio.ensure_future(queued.wait_turn(sj, _req(8, 7)))
        await asyncio.sleep(0.01)
        recall = asyncio.ensure_future(worker.rpc_step_result(_req(8, 7), d))
        await asyncio.sleep(0.01)
        assert queued.withdraw(sj, jp.WithdrawRequest(job="j", stage=0, step=8)).withdrawn
        for f in (waiting, recall):
            with pytest.raises(JobError, match="withdrawn") as e:
                await asyncio.wait_for(f, 1)
            assert e.value.code == jp.ErrorCode.ABORTED
        # the step it follows failed: aborted too
        waiting = asyncio.ensure_future(queued.wait_turn(sj, _req(10, 9)))
        await asyncio.sleep(0.01)
        recall = asyncio.ensure_future(worker.rpc_step_result(_req(10, 9), d))
        await asyncio.sleep(0.01)
        assert not recall.done()
        queued.ended(sj, 9, False)
        for f in (waiting, recall):
            with pytest.raises(JobError, match="did not complete") as e:
                await asyncio.wait_for(f, 1)
            assert e.value.code == jp.ErrorCode.ABORTED

    asyncio.run(go())


def test_releasing_a_stage_refuses_its_queued_steps_at_once(tmp_path) -> None:
    """review8 M3: `job.release` (as lease expiry, drain or a new assignment: `_drop`) wakes the
    steps queued on the stage, refused `not_held`, instead of leaving them waiting WAIT_LIMIT_S."""
    worker, t, a, d, _ = _held_stage(tmp_path)

    async def go():
        await jp.call(t, a.peer, Rpc.JOB_ASSIGN, a)
        sj = worker.jobs[("j", 0)]
        sj.last_step = 4
        waiting = asyncio.ensure_future(queued.wait_turn(sj, _req(6, 5)))
        await asyncio.sleep(0.01)
        recall = asyncio.ensure_future(worker.rpc_step_result(_req(6, 5), d))
        await asyncio.sleep(0.01)
        await jp.call(t, a.peer, Rpc.JOB_RELEASE, jp.ReleaseRequest(job="j", stage=0))
        for f in (waiting, recall):
            with pytest.raises(JobError, match="dropped") as e:
                await asyncio.wait_for(f, 1)
            assert e.value.code == jp.ErrorCode.NOT_HELD
        with pytest.raises(JobError, match="dropped"):  # one arriving after the drop: refused too
            await asyncio.wait_for(queued.wait_turn(sj, _req(7, 6)), 1)

    asyncio.run(go())


def test_a_peer_whose_caps_ping_went_unanswered_is_asked_again(tmp_path) -> None:
    """review8 L4: a peer the plan's ping got no answer from (caps None) is asked again."""
    from fusionnode.train import queued_rounds

    _worker, t, _, _, w = _held_stage(tmp_path)  # the worker answers the ping
    job = types.SimpleNamespace(caps={w: None})
    asyncio.run(queued_rounds.ask(types.SimpleNamespace(t=t), job, [w]))
    assert compat.has(job.caps[w], *queued_rounds.CAP)


# ---- a swarm on the in-memory network ------------------------------------------------------------
def _queued_swarm(tmp_path, slow_s: float, late_withdraw_s: float = 0.0):
    """2 workers, 2 hosts; the second worker's steps take `slow_s` longer (inside the step, so that
    a queued step waits behind it), and its `job.withdraw` calls arrive `late_withdraw_s` late (the
    queued step has started by then); every worker's applied fused steps and every withdrawal recorded."""
    s = Swarm(tmp_path, workers=2, hosts=2)
    slow_id = sorted(s.workers)[1]
    slow = s.workers[slow_id]
    run_step = slow._run_step
    withdraw = s.net.peers[slow_id]._rpc[Rpc.JOB_WITHDRAW]

    async def slowed(*args, **kw):
        await asyncio.sleep(slow_s)
        return await run_step(*args, **kw)

    async def late(args: dict, sender: str):
        await asyncio.sleep(late_withdraw_s)
        return await withdraw(args, sender)

    slow._run_step = slowed
    s.net.peers[slow_id]._rpc[Rpc.JOB_WITHDRAW] = late
    applied: dict[str, list[int]] = {pid: [] for pid in s.workers}
    withdrawals: list[tuple[int, int, bool]] = []  # (stage, step, withdrawn)
    queued_calls: list[int] = []
    return s, applied, withdrawals, queued_calls


@pytest.mark.parametrize("late", [False, True], ids=["withdrawn", "started-first"])
@pytest.mark.parametrize(
    ("sync", "tol"),
    [(DILOCO, TOL), (OVERLAP, SPARSE_TOL), (OVERLAP_D2, TOL)],
    ids=["diloco", "sparseloco-overlap", "diloco-overlap-d2"],
)
def test_queued_steps_are_counted_in_the_round_they_ran_and_withdrawn_ones_never(
    tmp_path, monkeypatch, sync, tol, late
):
    """`late`: the withdrawals reach the slowed worker after its queued step started (answered
    `withdrawn: false`): that step counts, as the replica's last of the round it ran in."""
    s, applied, withdrawals, queued_calls = _queued_swarm(tmp_path, 0.25, late_withdraw_s=0.6 if late else 0)
    step_of = fused.fused_step
    withdraw = queued.withdraw

    async def counted_step(worker, sj, req):
        report = await step_of(worker, sj, req)
        applied[worker.t.peer_id].append(req.step)
        if req.after_step is not None:
            queued_calls.append(req.step)
        return report

    def counted_withdraw(sj, req):
        reply = withdraw(sj, req)
        withdrawals.append((sj.stage, req.step, reply.withdrawn))
        return reply

    monkeypatch.setattr(fused, "fused_step", counted_step)
    monkeypatch.setattr(queued, "withdraw", counted_withdraw)
    spec = small_spec(steps=12, micro_batches=2)
    params = round_job(spec, sync, stages=1, rebalance_every=0, contrib_policy="off")
    asyncio.run(asyncio.wait_for(s.driver.run_job(params, s.emit), 180))
    rounds = s.steps()
    assert len(rounds) == spec.steps // H
    assert all(rep["fused"] for r in rounds for rep in r["replicas"])
    assert queued_calls, "no step was queued ahead"
    # every withdrawal answers as the test arranged: not started yet, or started first
    assert withdrawals and all(w is not late for *_, w in withdrawals), withdrawals
    # the steps each worker applied are exactly the ones its replica's records count, round by round
    (plan,) = [e for e in s.events if e["type"] == "plan"]
    peer_of = {st["replica"]: st["peer"] for st in plan["stages"]}
    counted: dict[int, list[int]] = {rep: [] for rep in peer_of}
    for q, r in enumerate(rounds):
        for rep in r["replicas"]:
            counted[rep["replica"]] += [q * H + k for k in range(rep["steps"])]
    assert {peer_of[rep]: steps for rep, steps in counted.items()} == applied, (withdrawals, rounds)
    peer_of_stage = {st["stage"]: st["peer"] for st in plan["stages"]}
    for stage, step, w in withdrawals:  # a withdrawn step never ran; one that was not withdrawn did
        assert (step in applied[peer_of_stage[stage]]) is not w, (stage, step, w, applied)
    assert any(min(rep["steps"] for rep in r["replicas"]) < H for r in rounds), "no round was cut short"
    _follows(rounds, _replay(spec, sync, rounds), tol)


def test_the_withdrawal_is_asked_of_the_replica_whose_step_is_queued(tmp_path) -> None:
    """The slowed replica's queued step of a round the other closed is withdrawn on its own worker."""
    s, *_ = _queued_swarm(tmp_path, slow_s=0.25)
    spec = small_spec(steps=6, micro_batches=2)
    params = round_job(spec, DILOCO, stages=1, rebalance_every=0, contrib_policy="off")
    asyncio.run(asyncio.wait_for(s.driver.run_job(params, s.emit), 120))
    fast, slow = sorted(s.workers)
    assert Rpc.JOB_WITHDRAW in s.net.peers[slow].calls
    assert Rpc.JOB_WITHDRAW not in s.net.peers[fast].calls


@pytest.mark.parametrize(
    "old_caps",
    [None, {"commit": ["b3"], "dither": ["keyed", "counter"]}],
    ids=["before-caps", "caps-without-steps"],
)
def test_a_worker_that_does_not_advertise_queued_steps_gets_none_and_the_job_works(
    tmp_path, monkeypatch, old_caps
):
    """Mixed versions: the slowed worker poses as an older version (it refuses `after_step` as an
    unknown field, as one does). Its replica keeps one call per step; the other replica is still
    queued; the capabilities come with the plan's liveness pings, none asked after it."""
    s, applied, withdrawals, _ = _queued_swarm(tmp_path, 0.25)
    fast, slow = sorted(s.workers)
    s.workers[slow].caps = old_caps
    rpc_step = s.net.peers[slow]._rpc[Rpc.JOB_STEP]
    sent_after: list[int] = []  # the `after_step` fields the older worker was sent

    async def seen(args: dict, sender: str):
        if args.get("after_step") is not None:
            sent_after.append(args["after_step"])
        return await rpc_step(args, sender)

    s.net.peers[slow]._rpc[Rpc.JOB_STEP] = seen
    step_of, withdraw, peer_caps = fused.fused_step, queued.withdraw, compat.peer_caps
    queued_of: dict[str, list[int]] = {fast: [], slow: []}
    asked_after: list[list[str]] = []

    async def counted_step(worker, sj, req):
        report = await step_of(worker, sj, req)
        applied[worker.t.peer_id].append(req.step)
        if req.after_step is not None:
            queued_of[worker.t.peer_id].append(req.step)
        return report

    def counted_withdraw(sj, req):
        reply = withdraw(sj, req)
        withdrawals.append((sj.stage, req.step, reply.withdrawn))
        return reply

    async def counted_caps(t, peers, *a, **kw):
        asked_after.append(list(peers))
        return await peer_caps(t, peers, *a, **kw)

    monkeypatch.setattr(fused, "fused_step", counted_step)
    monkeypatch.setattr(queued, "withdraw", counted_withdraw)
    monkeypatch.setattr(compat, "peer_caps", counted_caps)
    spec = small_spec(steps=12, micro_batches=2)
    params = round_job(spec, DILOCO, stages=1, rebalance_every=0, contrib_policy="off")
    asyncio.run(asyncio.wait_for(s.driver.run_job(params, s.emit), 180))
    rounds = s.steps()
    assert len(rounds) == spec.steps // H
    assert not any(e.get("kind") in ("failure", "recovered") for e in s.events), s.events
    assert sent_after == [] and queued_of[slow] == [], sent_after  # the older worker: no after_step
    assert queued_of[fast], queued_of  # the new worker's replica still queues
    assert asked_after == []  # the plan's pings asked every worker's capabilities
    assert Rpc.JOB_WITHDRAW not in s.net.peers[slow].calls
    (plan,) = [e for e in s.events if e["type"] == "plan"]
    peer_of = {st["replica"]: st["peer"] for st in plan["stages"]}
    counted: dict[int, list[int]] = {rep: [] for rep in peer_of}
    for q, r in enumerate(rounds):
        for rep in r["replicas"]:
            counted[rep["replica"]] += [q * H + k for k in range(rep["steps"])]
    assert {peer_of[rep]: steps for rep, steps in counted.items()} == applied, (withdrawals, rounds)
    _follows(rounds, _replay(spec, DILOCO, rounds), TOL)
