"""Faults under `--sync diloco|sparseloco` on the in-memory network (tests/memnet.py): a worker that
dies mid-round, an optimizer host that dies mid-round, a job resumed from its checkpoints. Every
round is applied exactly once (the hosts' round ledger), and the losses follow the in-process
reference that redoes the same rounds (`train_local_replicas(restart_rounds=...)`)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_components import Swarm, round_job, small_spec

from fusionnode.sync import SyncConfig
from fusionnode.train.replicas import train_local_replicas
from fusionnode.wire.job import Rpc, TensorKind

torch.set_num_threads(1)

TOL = 1e-4  # diloco, fp32: the swarm computes what the reference computes
SPARSE_TOL = 1e-3  # sparseloco: top-k and 2-bit bins may flip on near-ties


class FaultySwarm(Swarm):
    """A Swarm whose peer `victim()` goes down once the step `at` is reported."""

    def __init__(self, tmp_path, workers: int, hosts: int, at: int, victim):
        super().__init__(tmp_path, workers=workers, hosts=hosts)
        self.at, self.victim = at, victim
        self.downed: list[str] = []

    async def emit(self, event: dict) -> None:
        await super().emit(event)
        if event["type"] == "step" and event["step"] == self.at and not self.downed:
            peer = self.victim(self)
            self.net.down.add(peer)
            self.downed.append(peer)


def final_runs(steps: list[dict]) -> dict[int, dict]:
    """Step -> the record of its last run (a redone round's steps are recorded again)."""
    return {e["step"]: e for e in steps}


def recovered(s: Swarm) -> list[dict]:
    return [e for e in s.events if e["type"] == "event" and e["kind"] == "recovered"]


def _a_worker(s: Swarm) -> str:
    """A worker of the job's first plan that is not the driver's own peer."""
    plan = next(e for e in s.events if e["type"] == "plan")
    return next(st["peer"] for st in plan["stages"] if st["peer"] != s.ids[0])


def _first_host(s: Swarm) -> str:
    """The first optimizer host of the job's first plan."""
    return next(e for e in s.events if e["type"] == "plan")["optimizer_hosts"][0]


@pytest.mark.parametrize(
    ("sync", "tol", "save"),
    [
        (SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9), TOL, False),
        (SyncConfig("sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256), SPARSE_TOL, True),
        # --sync-overlap: the new stages start the redone round from the hosts' θ, round 0's update
        # (still under way with D = H when the worker dies) in it from the round's first step
        (SyncConfig("diloco", inner_steps=3, outer_lr=0.7, overlap=True, overlap_steps=1), TOL, False),
        (SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9, overlap=True), TOL, False),
    ],
    ids=["diloco", "sparseloco-checkpointed", "diloco-overlap-D=1", "diloco-overlap-D=H"],
)
def test_a_worker_dying_mid_round_redoes_the_round_and_applies_each_round_once(tmp_path, sync, tol, save):
    """diloco without checkpoints; sparseloco with a checkpoint at every round boundary, from which the
    new stages get the replicas' error feedback at the redone round's start (the dead stage's is gone)."""
    kw = {"save_dir": str(tmp_path / "ck"), "save_every": 3} if save else {}
    spec = small_spec(steps=7, micro_batches=2, **kw)

    s = FaultySwarm(tmp_path, workers=5, hosts=2, at=3, victim=_a_worker)  # step 4, in round 1, fails
    params = round_job(spec, sync, rebalance_every=0)
    result = asyncio.run(s.driver.run_job(params, s.emit))
    assert s.downed and result["steps"] == spec.steps
    rec = [e for e in recovered(s) if e.get("role") == "rounds"]
    assert len(rec) == 1 and rec[0]["replay_from"] == 3 and rec[0]["rounds_applied"] == 1
    steps = s.steps()
    # steps 0..3 ran, step 4 failed, the round of steps 3..5 was redone on the new plan
    assert [e["step"] for e in steps] == [0, 1, 2, 3, 3, 4, 5, 6]
    last = final_runs(steps)
    # the ledger: each round closed once in the trajectory kept, and the hosts' count follows it
    assert [last[i].get("round_closed") for i in range(spec.steps)] == [None, None, 0, None, None, 1, 2]
    # (--sync-overlap counts a round at the commit that installs it: round 0 at the redone round's
    # start, round 1 with round 2 at the last step, which installs both)
    applied = [0, 0, 0, 1, 1, 1, 3] if sync.overlap else [0, 0, 1, 1, 1, 2, 3]
    assert [last[i]["rounds_applied"] for i in range(spec.steps)] == applied
    assert all(h["rounds_closed"] == 3 for h in last[6]["optimizer_hosts"])
    ref = train_local_replicas(spec, sync, replicas=2, restart_rounds={1}).losses
    for i in range(spec.steps):
        assert abs(last[i]["loss"] - ref[i]) < tol, f"step {i}: swarm {last[i]['loss']:.6f} vs {ref[i]:.6f}"
    # the redo is what the reference computes: not the uninterrupted run (the inner state was lost)
    plain = train_local_replicas(spec, sync, replicas=2).losses
    assert max(abs(last[i]["loss"] - plain[i]) for i in range(3, spec.steps)) > 3 * tol
    assert s.downed[0] not in {
        st["peer"] for st in [e for e in s.events if e["type"] == "plan"][-1]["stages"]
    }


def test_an_optimizer_host_dying_mid_round_is_replaced_from_the_checkpoints(tmp_path):
    """The host dies in round 1; the round's close finds it gone. The new host cannot read the dead
    one's disk: every host restarts from the driver's step-3 checkpoint (new outer state), and round 1
    is redone: applied once."""
    sync = SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9)
    spec = small_spec(steps=9, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=3)

    s = FaultySwarm(tmp_path, workers=4, hosts=3, at=4, victim=_first_host)
    params = round_job(spec, sync, rebalance_every=0)
    result = asyncio.run(s.driver.run_job(params, s.emit))
    assert s.downed and result["steps"] == spec.steps
    rec = {e.get("role"): e for e in recovered(s)}
    assert rec["optimizer"]["replay_from"] == 3 and rec["optimizer"]["fresh_optimizer"]
    assert rec["rounds"]["replay_from"] == 3 and rec["rounds"]["rounds_applied"] == 1
    plans = [e for e in s.events if e["type"] == "plan"]
    assert s.downed[0] not in plans[-1]["optimizer_hosts"]
    last = final_runs(s.steps())
    closed = [last[i].get("round_closed") for i in range(spec.steps)]
    assert closed == [None, None, 0, None, None, 1, None, None, 2]
    assert all(h["rounds_closed"] == 3 for h in last[8]["optimizer_hosts"])
    ref = train_local_replicas(spec, sync, replicas=2, restart_rounds={1}, fresh_outer_rounds={1}).losses
    for i in range(spec.steps):
        assert abs(last[i]["loss"] - ref[i]) < TOL, f"step {i}: swarm {last[i]['loss']:.6f} vs {ref[i]:.6f}"


class Interrupted(Exception):
    pass


@pytest.mark.parametrize(
    ("sync", "tol", "lost", "every"),
    [
        (SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9), TOL, "fresh_outer_rounds", 3),
        (
            SyncConfig("sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256),
            SPARSE_TOL,
            "fresh_feedback_rounds",
            3,
        ),
        # --sync-overlap: round 0's update is applied late; round 1's close, checkpointed, installs it
        (
            SyncConfig(
                "sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256, overlap=True, overlap_steps=1
            ),
            SPARSE_TOL,
            "fresh_feedback_rounds",
            6,
        ),
    ],
    ids=["diloco", "sparseloco", "sparseloco-overlap"],
)
def test_a_resumed_job_continues_the_rounds_with_the_checkpointed_outer_state(
    tmp_path, sync, tol, lost, every
):
    """A job stopped in round 2 resumes from its step-6 checkpoints: the hosts' shard checkpoints hold
    the masters, the open round and the outer Nesterov buffer, the driver's the replicas' SparseLoCo
    error feedback, so the resumed rounds are the reference's (whose replicas restart their inner
    optimizers at round 2, as the new stages do); without that state they would not be."""
    spec = small_spec(steps=12, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=every)
    s = Swarm(tmp_path, workers=4, hosts=2)
    params = round_job(spec, sync, rebalance_every=0)

    async def stop_at_step_7(event: dict) -> None:
        s.events.append(event)
        if event["type"] == "step" and event["step"] == 7:
            raise Interrupted

    with pytest.raises(Interrupted):
        asyncio.run(s.driver.run_job(params, stop_at_step_7))
    assert [e["step"] for e in s.steps()] == list(range(8))
    s.events.clear()
    result = asyncio.run(s.driver.run_job({**params, "resume": True}, s.emit))
    assert result["steps"] == spec.steps
    steps = s.steps()
    assert [e["step"] for e in steps] == list(range(6, 12))
    assert [e.get("round_closed") for e in steps] == [None, None, 2, None, None, 3]
    assert steps[0]["rounds_applied"] == 2 and steps[-1]["rounds_applied"] == 4
    ref = train_local_replicas(spec, sync, replicas=2, restart_rounds={2}).losses
    for e in steps:
        assert abs(e["loss"] - ref[e["step"]]) < tol, (
            f"step {e['step']}: {e['loss']:.6f} vs {ref[e['step']]:.6f}"
        )
    # the outer state came back: without it the resumed rounds would differ
    fresh = train_local_replicas(spec, sync, replicas=2, restart_rounds={2}, **{lost: {2}}).losses
    assert max(abs(e["loss"] - fresh[e["step"]]) for e in steps[3:]) > 3 * tol
    if sync.overlap:  # and the late updates are not the blocking rounds'
        blocking = SyncConfig(**{**sync.to_dict(), "overlap": False, "overlap_steps": None})
        plain = train_local_replicas(spec, blocking, replicas=2, restart_rounds={2}).losses
        assert max(abs(e["loss"] - plain[e["step"]]) for e in steps) > 3 * tol


def test_an_optimizer_host_dying_under_sync_overlap_is_replaced_from_the_checkpoints(tmp_path):
    """--sync-overlap with checkpoints every 4 steps (H = 2): round 0's update is applied a step late,
    round 1's close (checkpointed at step 4) installs its round at once. The host dies in round 2;
    every host restarts from the driver's step-4 checkpoint (new outer state) and round 2 is redone
    from the hosts' θ: every round applied once, the losses the reference's."""
    sync = SyncConfig(
        "diloco", inner_steps=2, outer_lr=0.7, outer_momentum=0.9, overlap=True, overlap_steps=1
    )
    spec = small_spec(steps=8, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=4)

    s = FaultySwarm(tmp_path, workers=4, hosts=3, at=4, victim=_first_host)
    params = round_job(spec, sync, rebalance_every=0)
    result = asyncio.run(s.driver.run_job(params, s.emit))
    assert s.downed and result["steps"] == spec.steps
    rec = {e.get("role"): e for e in recovered(s)}
    assert rec["optimizer"]["replay_from"] == 4 and rec["optimizer"]["fresh_optimizer"]
    assert rec["rounds"]["replay_from"] == 4 and rec["rounds"]["rounds_applied"] == 2
    last = final_runs(s.steps())
    closed = [last[i].get("round_closed") for i in range(spec.steps)]
    assert closed == [None, 0, None, 1, None, 2, None, 3]
    assert all(h["rounds_closed"] == 4 for h in last[7]["optimizer_hosts"])
    ref = train_local_replicas(spec, sync, replicas=2, restart_rounds={2}, fresh_outer_rounds={2}).losses
    for i in range(spec.steps):
        assert abs(last[i]["loss"] - ref[i]) < TOL, f"step {i}: swarm {last[i]['loss']:.6f} vs {ref[i]:.6f}"
    blocking = SyncConfig(**{**sync.to_dict(), "overlap": False, "overlap_steps": None})
    plain = train_local_replicas(spec, blocking, replicas=2, restart_rounds={2}, fresh_outer_rounds={2})
    assert max(abs(last[i]["loss"] - plain.losses[i]) for i in range(spec.steps)) > 3 * TOL


def test_a_worker_dying_after_its_round_reached_the_hosts_does_not_redo_the_round(tmp_path):
    """The victim sends its pseudo-gradients of round 1 and dies while pulling the update: the hosts
    close round 1 (every contribution arrived) and the victim's commit fails. The step is recorded,
    the hosts' ledger says round 1 is applied, so the job goes on at round 2 on a new plan: round 1
    is not redone (it would be applied twice)."""
    sync = SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9)
    spec = small_spec(steps=9, micro_batches=2)
    s = Swarm(tmp_path, workers=5, hosts=2)
    victim: list[str] = []
    downed: list[str] = []

    async def emit(event: dict) -> None:
        s.events.append(event)
        if event["type"] == "plan" and not victim:
            victim.append(next(st["peer"] for st in event["stages"] if st["peer"] != s.ids[0]))

    for pid in s.hosts:
        t = s.net.peers[pid]
        pull = t._rpc[Rpc.OPT_ROUND_PULL]

        async def dies_while_pulling(args, sender, pull=pull):
            if victim and sender == victim[0] and args.get("round") == 1 and not downed:
                s.net.down.add(sender)
                downed.append(sender)
            return await pull(args, sender)

        t._rpc[Rpc.OPT_ROUND_PULL] = dies_while_pulling
    params = round_job(spec, sync, rebalance_every=0)
    result = asyncio.run(s.driver.run_job(params, emit))
    assert downed and result["steps"] == spec.steps
    rec = [e for e in recovered(s) if e.get("role") == "rounds"]
    assert len(rec) == 1 and rec[0]["replay_from"] == 6 and rec[0]["rounds_applied"] == 2
    steps = s.steps()
    assert [e["step"] for e in steps] == list(range(9))  # nothing redone
    assert [e.get("round_closed") for e in steps] == [None, None, 0, None, None, 1, None, None, 2]
    assert steps[-1]["rounds_applied"] == 3
    ref = train_local_replicas(spec, sync, replicas=2, restart_rounds={2}).losses
    for e in steps:
        assert abs(e["loss"] - ref[e["step"]]) < TOL, (
            f"step {e['step']}: {e['loss']:.6f} vs {ref[e['step']]:.6f}"
        )


def test_a_worker_dying_before_the_driver_sends_its_tied_weight_sum_fails_only_the_step(tmp_path):
    """The victim reported step 4 and is gone when the driver sends it the tied weights' gradient sum
    (round modes step each replica alone, with the driver summing the tied gradients): a StepFailed,
    recovered like any other, not the end of the job."""
    sync = SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9)
    spec = small_spec(steps=7, micro_batches=2)
    s = Swarm(tmp_path, workers=5, hosts=2)
    downed: list[str] = []
    driver_t = s.net.peers[s.ids[0]]
    send = driver_t.send

    async def send_or_find_gone(peer, msg, observe=None):
        if (
            msg.kind == TensorKind.SHARED_SUM
            and msg.meta.get("step") == 4
            and peer != s.ids[0]
            and not downed
        ):
            s.net.down.add(peer)
            downed.append(peer)
        return await send(peer, msg, observe)

    driver_t.send = send_or_find_gone
    params = round_job(spec, sync, rebalance_every=0)
    result = asyncio.run(s.driver.run_job(params, s.emit))
    assert downed and result["steps"] == spec.steps
    assert [e["step"] for e in s.steps()] == [0, 1, 2, 3, 3, 4, 5, 6]
    ref = train_local_replicas(spec, sync, replicas=2, restart_rounds={1}).losses
    for i, e in final_runs(s.steps()).items():
        assert abs(e["loss"] - ref[i]) < TOL, f"step {i}: {e['loss']:.6f} vs {ref[i]:.6f}"


def test_a_job_that_cannot_go_on_mid_round_checkpoints_the_round_start_as_its_step(tmp_path):
    """--sync diloco, 2 replicas of 1 stage on 2 workers, no spare: a worker dies at step 4 (in the
    round of steps 3..5) and the job cannot go on. Its last checkpoint holds the hosts' parameters,
    which are the round's start: it is saved as step 3 (was: as step 4, so a resume would skip the
    round's first step and the hosts, given that step, refused it as no round boundary)."""
    from fusionnode.errors import PlanError
    from fusionnode.train.checkpoint import read_resume

    sync = SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9)
    spec = small_spec(steps=7, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=6)

    s = FaultySwarm(tmp_path, workers=2, hosts=1, at=3, victim=_a_worker)
    params = {
        "spec": spec.to_dict(),
        "stages": 1,
        "replicas": 2,
        "offload": "on",
        "sync": sync.to_dict(),
        "rebalance_every": 0,
    }
    with pytest.raises(PlanError, match="checkpoint of step 3 in"):
        asyncio.run(s.driver.run_job(params, s.emit))
    assert s.downed
    ckpt = read_resume(spec)
    assert ckpt.step == 3
