"""Recovery of `--offload off` jobs (train/ringrecovery.py), on the in-memory network (tests/memnet.py):
a ring member lost mid-step or while applying a step, the job re-placed from the survivors'
parameters and optimizer state, the losses still those of one process (fp32, 1e-5: every step applied
once, on the whole batch, with the AdamW state carried); a stage whose every holder died stops the job
with the stage named, or resumes from the driver's checkpoint. The real daemons' version (SIGKILL) is
in tests/test_faults.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_allreduce import _typed
from test_components import Swarm, small_spec

from fusionnode.errors import PeerError, PlanError
from fusionnode.runtime import optstate
from fusionnode.train.local import train_local
from fusionnode.wire.job import Rpc

torch.set_num_threads(1)
RING = {"stages": 2, "replicas": 2, "offload": "off"}


def _assert_follows_reference(s: Swarm, spec) -> None:
    steps = [e["step"] for e in s.steps()]
    assert steps == list(range(spec.steps)), steps  # each step recorded once: none lost, none twice
    ref = train_local(spec).losses
    for i, (a, b) in enumerate(zip([e["loss"] for e in s.steps()], ref, strict=True)):
        assert abs(a - b) < 1e-5, f"step {i}: swarm {a:.7f} vs local {b:.7f}"


def _events(s: Swarm, kind: str) -> list[dict]:
    return [e for e in s.events if e.get("kind") == kind]


def _victim_of(s: Swarm, stage_pos: int, replica: int) -> str:
    plan = next(e for e in s.events if e["type"] == "plan")
    return next(st["peer"] for st in plan["stages"] if st["replica"] == replica and st["pos"] == stage_pos)


def _dies_at(s: Swarm, victim: str, method: str, at_step: int) -> None:
    """Makes `victim`'s worker vanish in its `method` (`_allreduce`, `_run_step`) at step `at_step`:
    the peer goes down and the call raises; other steps run as before."""
    orig = getattr(s.workers[victim], method)

    async def die(sj, step, *a, **kw):
        if step == at_step:
            s.net.down.add(victim)
            raise PeerError("this peer vanished")
        return await orig(sj, step, *a, **kw)

    setattr(s.workers[victim], method, die)


def test_a_ring_member_lost_mid_allreduce_is_replaced_from_its_replica(tmp_path):
    """2 pipelines x 2 stages; a member of pipeline 1 vanishes in its all-reduce at step 2: the step
    is replayed on the survivors' state and every loss is the single-process one."""
    spec = small_spec(steps=5, micro_batches=2, grad_clip=1.0)
    s = Swarm(tmp_path, workers=4)
    victim = s.ids[2]  # the simple layout: pipeline 1's first stage
    _dies_at(s, victim, "_allreduce", 2)
    res = asyncio.run(s.driver.run_job({"spec": spec.to_dict(), **RING}, s.emit))
    assert res["steps"] == spec.steps and victim == _victim_of(s, 0, 1)
    _assert_follows_reference(s, spec)
    (rec,) = _events(s, "recovered")
    assert rec["step"] == 2 and rec["time_to_recover_s"] > 0 and "replay_from" not in rec
    assert victim not in {st["peer"] for st in res["stages"]}


def test_a_member_lost_while_applying_the_step_leaves_no_step_half_applied(tmp_path):
    """The victim dies in its `job.commit` of step 1 (before applying it), after the other stages
    committed or while they do: the driver re-sends the commit to every survivor, so all stand after
    step 1, which is kept (not replayed); the losses stay the single-process ones."""
    spec = small_spec(steps=4, micro_batches=2, grad_clip=1.0)
    s = Swarm(tmp_path, workers=4)
    victim = s.ids[1]  # pipeline 0's last stage: its replica in pipeline 1 holds the same state
    w = s.workers[victim]
    orig = w.rpc_commit

    async def commit(req, sender):
        if req.step == 1:
            await asyncio.sleep(0.05)  # the others' commits get there first
            s.net.down.add(victim)
            raise PeerError("this peer vanished")
        return await orig(req, sender)

    s.net.peers[victim].add_rpc(Rpc.JOB_COMMIT, _typed(commit))
    asyncio.run(s.driver.run_job({"spec": spec.to_dict(), **RING}, s.emit))
    _assert_follows_reference(s, spec)
    (rec,) = _events(s, "recovered")
    assert rec["step"] == 2  # step 1 was applied everywhere else: the job goes on after it


def test_a_stage_with_no_surviving_holder_stops_the_job_naming_it(tmp_path):
    """One pipeline (no replica): its second stage's only holder dies: without a checkpoint the job
    stops with the lost stage named; with one it resumes from it, with the workers' AdamW state the
    checkpoint holds, and follows the uninterrupted single-process run (every step, 1e-5)."""
    params = {"stages": 2, "offload": "off"}
    spec = small_spec(steps=4, micro_batches=2)
    s = Swarm(tmp_path / "a", workers=3)
    victim = s.ids[1]
    _dies_at(s, victim, "_run_step", 2)
    with pytest.raises(PlanError, match=r"stage 1 \(graph nodes \d+\.\.\d+\) of pipeline\(s\) 0 .* is lost"):
        asyncio.run(s.driver.run_job({"spec": spec.to_dict(), **params}, s.emit))

    spec2 = small_spec(steps=6, micro_batches=2, save_dir=str(tmp_path / "ckpt"), save_every=1)
    s2 = Swarm(tmp_path / "b", workers=3)
    victim = s2.ids[1]
    _dies_at(s2, victim, "_run_step", 3)
    res = asyncio.run(s2.driver.run_job({"spec": spec2.to_dict(), **params}, s2.emit))
    assert res["steps"] == spec2.steps
    (rec,) = _events(s2, "recovered")
    assert rec["replay_from"] == 3 and rec["fresh_optimizer"] is False
    # the replayed step 3 too: the optimizer state came back with the checkpoint
    ref = train_local(spec2.replace(save_dir=None, save_every=0)).losses
    got = {e["step"]: e["loss"] for e in s2.steps()}
    assert sorted(got) == list(range(spec2.steps))
    for i in range(spec2.steps):
        assert abs(got[i] - ref[i]) < 1e-5, f"step {i}: swarm {got[i]:.7f} vs local {ref[i]:.7f}"


def test_a_resumed_ring_job_takes_the_checkpoints_optimizer_state(tmp_path):
    """A 2 x 2 ring job saves every 2 steps (the workers' AdamW state with the parameters); resumed
    from its step-2 checkpoint on new workers, it follows the uninterrupted single-process run within
    1e-5. A checkpoint without that state resumes with new optimizer state, and
    its steps after the resume are off the reference."""
    import shutil

    from fusionnode.train.checkpoint import load_checkpoint

    save = tmp_path / "ckpt"
    spec = small_spec(steps=5, micro_batches=2, grad_clip=1.0, save_dir=str(save), save_every=2)
    s = Swarm(tmp_path / "a", workers=4)
    asyncio.run(s.driver.run_job({"spec": spec.to_dict(), **RING}, s.emit))
    for step in (5, 4):  # the newest checkpoint left is step 2's
        shutil.rmtree(save / f"step-{step:08d}")
    ckpt = load_checkpoint(save)
    assert ckpt.step == 2 and {k.rpartition("|")[2] for k in ckpt.optimizer_state["worker_optim"]} == {
        "exp_avg",
        "exp_avg_sq",
        "steps",
    }
    ref = train_local(spec.replace(save_dir=None, save_every=0)).losses

    def resumed(name: str) -> list[float]:
        s2 = Swarm(tmp_path / name, workers=4)
        res = asyncio.run(s2.driver.run_job({"spec": spec.to_dict(), **RING, "resume": True}, s2.emit))
        assert res["steps"] == spec.steps and [e["step"] for e in s2.steps()] == [2, 3, 4]
        return [e["loss"] for e in s2.steps()]

    for i, loss in enumerate(resumed("b"), start=2):
        assert abs(loss - ref[i]) < 1e-5, f"step {i}: resumed {loss:.7f} vs local {ref[i]:.7f}"
    # the same checkpoint less the workers' optimizer state (as before this was saved): new state
    for step in (5, 4):
        shutil.rmtree(save / f"step-{step:08d}", ignore_errors=True)
    from fusionnode.train.checkpoint import save_checkpoint

    state = {k: v for k, v in ckpt.optimizer_state.items() if k != "worker_optim"}
    save_checkpoint(save, 2, ckpt.params, state, ckpt.data_state, ckpt.spec)
    fresh = resumed("c")
    assert max(abs(a - b) for a, b in zip(fresh[1:], ref[3:], strict=True)) > 1e-4


def test_optimizer_state_round_trips_through_the_wire_format():
    from types import SimpleNamespace

    from fusionnode.runtime.stagejob import make_optimizer

    spec = small_spec().to_dict()
    params = {"a.w": torch.nn.Parameter(torch.randn(3, 4)), "b": torch.nn.Parameter(torch.randn(4))}
    sj = SimpleNamespace(params=params, opt=make_optimizer(params, spec))
    for p in params.values():
        p.grad = torch.randn_like(p)
    sj.opt.step(1e-2)
    msgs = optstate.state_of(sj)
    assert sorted(msgs) == ["a.w", "b"] and set(msgs["b"]) == {"b|exp_avg", "b|exp_avg_sq", "b|steps"}
    want = optstate.expected(sj)
    assert {k for m in msgs.values() for k in m} == set(want)
    assert msgs["a.w"]["a.w|steps"].item() == 1.0


def test_a_share_move_of_a_ring_job_reweighs_the_rings_and_keeps_the_loss(tmp_path, monkeypatch):
    """Straggler rebalancing of a ring job: the check at step 2 is made to move the shares [8, 8] ->
    [12, 4]; each stage is told its rings' new weights (`job.resize`, no stage re-placed, nothing
    shipped), so the ring's average weighs each replica by its samples and the losses stay one
    process's."""
    from test_rebalance_trigger import _force_one_share_move

    calls = _force_one_share_move(monkeypatch)
    spec = small_spec(steps=8, batch_size=16, micro_batches=2)
    s = Swarm(tmp_path, workers=4)
    asyncio.run(s.driver.run_job({"spec": spec.to_dict(), **RING, "rebalance_every": 2}, s.emit))
    replans = _events(s, "replan")
    assert [e.get("moved") for e in replans] == ["shares"] and replans[0]["shares"] == [12, 4]
    assert calls[1] == [12, 4]
    for pid in s.workers:
        got = s.net.peers[pid].calls
        assert got.count(Rpc.JOB_ASSIGN) == 1 and got.count(Rpc.JOB_RESIZE) == 1, (pid, got)
    _assert_follows_reference(s, spec)


def test_a_resplit_of_an_offload_off_job_moves_the_optimizer_state_along(tmp_path, monkeypatch):
    """The rebalancer's re-split of a job with the optimizer on the workers (one pipeline, no sync):
    a check is made to move the cut and one stage to the spare worker; the new stages start from the
    old ones' parameters and AdamW state, so the losses stay one process's."""
    from fusionnode.train import rebalance
    from fusionnode.train.rebalance import Check, JobDecision, Layout

    real, moved = rebalance.check_job, []

    def forced(book, trigger, current, *args, **kw):
        c = real(book, trigger, current, *args, **kw)
        if moved:
            return Check(c.decision, False, "the test moves once", 0.0, 0.0, None)
        (lay,) = current
        spare = next(p for p in s.ids if p not in lay.peers)
        b = list(lay.bounds)
        b[1] += 7
        new = Layout((lay.peers[0], spare), tuple(b))
        moved.append(new)
        return Check(
            JobDecision(True, "forced by the test", 1.0, 0.5, (new,), (), None), True, "forced", 0, 0, None
        )

    monkeypatch.setattr(rebalance, "check_job", forced)
    spec = small_spec(steps=6, micro_batches=2)
    s = Swarm(tmp_path, workers=3)
    res = asyncio.run(
        s.driver.run_job(
            {"spec": spec.to_dict(), "stages": 2, "offload": "off", "rebalance_every": 2}, s.emit
        )
    )
    (replan,) = [e for e in _events(s, "replan") if str(e.get("reason", "")).startswith("rebalance")]
    assert replan["peers"] == list(moved[0].peers) and res["offload"] is False
    _assert_follows_reference(s, spec)


def test_a_holder_whose_state_fetch_fails_once_is_asked_again(tmp_path):
    """A surviving holder's `job.fetch` of its optimizer state fails once (it still answers probes):
    it is asked again rather than counted lost, and the job still follows one process."""
    from fusionnode.wire.job import ErrorCode, JobError

    spec = small_spec(steps=4, micro_batches=2, grad_clip=1.0)
    s = Swarm(tmp_path, workers=4)
    victim, flaky = s.ids[3], s.ids[1]  # pipeline 1's last stage, and its replica in pipeline 0
    fetch = s.net.peers[flaky]._rpc[Rpc.JOB_FETCH]
    failed = []

    async def flaky_fetch(args, sender):
        if args.get("what") == "optim" and not failed:
            failed.append(args)
            raise JobError(ErrorCode.RING_BROKEN, "woken by a ring that broke late")
        return await fetch(args, sender)

    _dies_at(s, victim, "_allreduce", 1)
    s.net.peers[flaky].add_rpc(Rpc.JOB_FETCH, flaky_fetch)
    asyncio.run(s.driver.run_job({"spec": spec.to_dict(), **RING}, s.emit))
    assert failed
    _assert_follows_reference(s, spec)


def _force_one_escalation(monkeypatch, shape_of) -> list[list]:
    """The escalation of a rebalance check made to want `shape_of(job)` (Pipelines of a new shape)
    once, with a peer of the plan taken as the clear straggler; the rest of its path (the streak of 2
    checks, `recovery.adopt`) is the real one. Returns the layouts it proposed."""
    from fusionnode.train import escalate

    proposed: list[list] = []

    async def predict(self, recovery, job, run, step, workers, speeds, noise, cheap=None, **kw):
        if proposed:
            return escalate.Escalation(False, "the test escalates once", 1.0, 1.0), job.pipelines
        want = shape_of(job)
        if self.streak + 1 >= self.persist:
            proposed.append(want)
        return escalate.Escalation(True, "forced by the test", 1.0, 0.5, 9.0), want

    monkeypatch.setattr(escalate, "outliers", lambda speeds, in_plan: [in_plan[-1]])
    monkeypatch.setattr(escalate.Escalator, "predict", predict)
    return proposed


def _two_by_one(job) -> list:
    """2 x 2 -> 2 pipelines of one stage each, on the first peer of each (the last peer idle)."""
    import dataclasses

    n = job.pipelines[0].bounds[-1]
    return [dataclasses.replace(p, peers=[p.peers[0]], bounds=[0, n]) for p in job.pipelines]


@pytest.mark.parametrize("reshape", [True, False])
def test_a_ring_job_escalates_to_a_new_shape_moving_its_optimizer_state(tmp_path, monkeypatch, reshape):
    """Escalation of a ring job (issue 18): a 2 x 2 ring laid out by --stages/--replicas with
    --reshape is re-planned into 2 pipelines of one stage each; the new stages start from the old
    ones' parameters and AdamW state (`survivor_state`), so every loss stays one process's (1e-5).
    Without --reshape the same job keeps its shape (no escalation is asked)."""
    proposed = _force_one_escalation(monkeypatch, _two_by_one)
    spec = small_spec(steps=12, batch_size=16, micro_batches=2)
    s = Swarm(tmp_path, workers=4)
    params = {"spec": spec.to_dict(), **RING, "rebalance_every": 2, "reshape": reshape}
    res = asyncio.run(s.driver.run_job(params, s.emit))
    escalated = [e for e in _events(s, "replan") if "re-planned" in str(e.get("reason", ""))]
    assert res["offload"] is False
    if not reshape:
        assert escalated == [] and proposed == []
        return
    (e,) = escalated
    assert e["step"] < spec.steps - 2  # steps ran on the new shape
    assert len(e["peers"]) == 2 and e["bounds"] == [[0, proposed[0][0].bounds[-1]]] * 2, e
    _assert_follows_reference(s, spec)


@pytest.mark.parametrize("slowed", [True, False])
def test_a_ring_job_is_replanned_without_its_straggler(tmp_path, monkeypatch, slowed):
    """The whole escalation path of a 2 x 2 ring job (--reshape; the planner lays gpt2-tiny out on one
    in-memory worker, no ring) on 4 in-memory workers: one
    worker's measured speeds are scaled 4x down (the only thing faked: timing on the in-memory
    network is the host's); the clear straggler is found, the planner lays the job out over the
    others at the measured speeds, priced with the ring all-reduce, it wins at 2 checks in a row, the
    new stages take the old ones' AdamW state, and every loss stays one process's (1e-5). Without the
    slow-down nothing is re-planned."""
    from fusionnode.train.state import Run

    real, victim = Run.speeds, []

    def speeds(self):
        got = real(self)
        if slowed and not victim and len(got) > 1:
            victim.append(sorted(p for p in got if p != s.ids[0])[-1])
        return {p: v * 0.25 if p in victim else v for p, v in got.items()}

    monkeypatch.setattr(Run, "speeds", speeds)
    spec = small_spec(steps=14, batch_size=16, micro_batches=2)
    s = Swarm(tmp_path, workers=4)
    params = {"spec": spec.to_dict(), **RING, "reshape": True, "rebalance_every": 2}
    res = asyncio.run(s.driver.run_job(params, s.emit))
    assert res["offload"] is False
    replans = [e for e in _events(s, "replan") if e.get("step")]
    if not slowed:
        assert replans == []
        return
    plan = next(e for e in s.events if e["type"] == "plan")
    assert victim, plan["stages"]
    assert victim[0] in {st["peer"] for st in plan["stages"]}
    escalated = [e for e in replans if "re-planned" in str(e.get("reason", ""))]
    assert escalated and victim[0] not in escalated[0]["peers"], replans
    assert escalated[0]["step"] < spec.steps - 2
    _assert_follows_reference(s, spec)


def _run_ring(tmp_path, spec) -> tuple[Swarm, list[dict]]:
    """Runs `spec` as the 2-pipeline ring on 4 in-memory workers, re-shaping looked at every 2 steps;
    returns the swarm and its escalation's re-plans."""
    s = Swarm(tmp_path, workers=4)
    params = {"spec": spec.to_dict(), **RING, "rebalance_every": 2, "reshape": True}
    asyncio.run(s.driver.run_job(params, s.emit))
    return s, [e for e in _events(s, "replan") if "re-planned" in str(e.get("reason", ""))]


@pytest.mark.parametrize("dropped", [True, False])
def test_a_straggler_that_dropped_is_replanned_only_when_the_trigger_acts(tmp_path, monkeypatch, dropped):
    """Issue 18's clean-run margin: the escalation wants a re-plan at 2 checks in a row (forced), with
    a peer of the plan a clear straggler. When that peer's own speed dropped on the plan within the
    share move's trigger's reach (a deep load spell of a clean run looks so), its re-plan waits for
    that trigger, which does not act here (no slow-down on the in-memory network): no re-plan at the
    escalation's own streak of 2 checks, and the spell ends before the hold's bound. A peer slow
    since the plan began (or one whose drop the trigger cannot act on) is re-planned at the streak."""
    from fusionnode.train import escalate

    _force_one_escalation(monkeypatch, _two_by_one)
    monkeypatch.setattr(escalate, "has_dropped", lambda run, peer: dropped)
    spec = small_spec(steps=12, batch_size=16, micro_batches=2)
    s, escalated = _run_ring(tmp_path, spec)
    assert len(escalated) == (0 if dropped else 1), escalated
    _assert_follows_reference(s, spec)


def test_a_dropped_straggler_the_trigger_misses_is_replanned_at_the_holds_bound(tmp_path, monkeypatch):
    """Review 7, M2: the hold of a straggler whose drop is within the trigger's reach is bounded. The
    escalation wants the same re-plan at every check, the peer's drop is forced, and the share
    move's trigger never acts (no real slow-down): the re-plan comes at the check that ends
    PERSIST_CHECKS + HOLD_CHECKS checks in a row (not at 2, nor never), once, and the losses follow
    `train_local`."""
    from fusionnode.train import escalate

    streaks: list[int] = []

    async def predict(self, recovery, job, run, step, workers, speeds, noise, cheap=None, **kw):
        if all(len(p.peers) == 1 for p in job.pipelines):  # re-planned: nothing more to want
            return escalate.Escalation(False, "re-planned already", 1.0, 1.0), job.pipelines
        streaks.append(self.streak + 1)
        return escalate.Escalation(True, "forced by the test", 1.0, 0.5, 9.0), _two_by_one(job)

    monkeypatch.setattr(escalate, "outliers", lambda speeds, in_plan: [in_plan[-1]])
    monkeypatch.setattr(escalate.Escalator, "predict", predict)
    monkeypatch.setattr(escalate, "has_dropped", lambda run, peer: True)
    spec = small_spec(steps=18, batch_size=16, micro_batches=2)
    s, escalated = _run_ring(tmp_path, spec)
    bound = escalate.PERSIST_CHECKS + escalate.HOLD_CHECKS
    assert streaks == list(range(1, bound + 1)), streaks
    (e,) = escalated
    assert e["step"] < spec.steps - 2 and len(e["peers"]) == 2, e  # steps ran on 2 x 1
    _assert_follows_reference(s, spec)
