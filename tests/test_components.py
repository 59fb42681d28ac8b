"""Component tests: the driver, workers and optimizer hosts through their typed interfaces (wire/job.py)
on an in-memory network (tests/memnet.py: real frames, real mailboxes, no daemons)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from memnet import MemNet

from fusionnode.optim.host import OptimizerHostService
from fusionnode.runtime.worker import WorkerService
from fusionnode.train.driver import Driver
from fusionnode.train.local import train_local
from fusionnode.train.spec import JobSpec
from fusionnode.wire import job as jp
from fusionnode.wire.job import ErrorCode, JobError, Rpc

torch.set_num_threads(1)
CONFIG = SimpleNamespace(step_timeout_s=20.0, lease_s=60.0)


def small_spec(**kw) -> JobSpec:
    base = dict(model="gpt2-tiny", steps=3, batch_size=8, micro_batches=4, seq_len=32, seed=3, lr=3e-3)
    base.update(kw)
    return JobSpec(**base)


def round_job(spec: JobSpec, sync: Any, **extra: Any) -> dict[str, Any]:
    """The train params of a --sync round job: 2 replicas of 2 stages, offloaded to 2 optimizer hosts."""
    params = {
        "spec": spec.to_dict(),
        "stages": 2,
        "replicas": 2,
        "offload": "on",
        "optimizer_hosts": 2,
        "sync": sync.to_dict(),
    }
    return {**params, **extra}


class Membership:
    """The swarm's peer records as the driver reads them (roles, availability, speed, memory)."""

    def __init__(self, roles: dict[str, list[str]]):
        self.roles = roles

    async def peers(self):
        return [
            SimpleNamespace(
                peer_id=p,
                roles=r,
                availability="available",
                device=SimpleNamespace(tflops_fp32=1.0, kind="cpu"),
                capacity_bytes=1 << 30,
                links={},
            )
            for p, r in self.roles.items()
        ]


class Swarm:
    def __init__(self, tmp_path, workers: int, hosts: int = 0):
        self.net = MemNet()
        ids = [f"QmWorker{i:02d}xxxxxxxxxxxxxxxx" for i in range(workers)]
        ids += [f"QmHost{i:02d}xxxxxxxxxxxxxxxxxx" for i in range(hosts)]
        self.workers: dict[str, WorkerService] = {}
        self.hosts: dict[str, OptimizerHostService] = {}
        roles = {}
        for i, pid in enumerate(ids):
            t = self.net.join(pid)
            if i < workers:
                self.workers[pid] = WorkerService(
                    t, capacity_bytes=1 << 30, config=CONFIG, state_dir=tmp_path
                )
                roles[pid] = ["worker"]
            else:  # every daemon answers job.ping (its worker service), also one that offers no work
                WorkerService(t, capacity_bytes=0, config=CONFIG, can_work=False)
                self.hosts[pid] = OptimizerHostService(t, state_dir=tmp_path / pid, step_deadline_s=20.0)
                roles[pid] = ["optimizer"]
        self.ids = ids
        self.driver = Driver(
            self.net.peers[ids[0]], Membership(roles), config=CONFIG, state_dir=tmp_path / "drv"
        )
        self.events: list[dict] = []

    async def emit(self, event: dict) -> None:
        self.events.append(event)

    def steps(self) -> list[dict]:
        return [e for e in self.events if e["type"] == "step"]


def test_driver_and_workers_in_memory_follow_the_single_process_loss(tmp_path):
    """Three stages on three workers, the optimizer on the workers: the same losses as one process,
    every worker driven through assign, start, step, commit, release."""
    spec = small_spec()
    s = Swarm(tmp_path, workers=3)
    result = asyncio.run(s.driver.run_job({"spec": spec.to_dict(), "stages": 3, "offload": "off"}, s.emit))
    ref = train_local(spec).losses
    got = [e["loss"] for e in s.steps()]
    assert len(got) == len(ref) == spec.steps
    for a, b in zip(got, ref, strict=True):
        assert abs(a - b) < 1e-5, (got, ref)
    assert result["steps"] == spec.steps and len(result["stages"]) == 3
    for pid in s.ids:
        calls = s.net.peers[pid].calls
        for method in (Rpc.JOB_ASSIGN, Rpc.JOB_START, Rpc.JOB_STEP, Rpc.JOB_COMMIT, Rpc.JOB_RELEASE):
            assert method in calls, (pid, method, calls)
        assert calls.count(Rpc.JOB_STEP) == spec.steps
        assert not s.workers[pid].jobs  # released at the end
    stages = s.steps()[-1]["stages"]
    assert all(st["sent_bytes"] > 0 and st["compute_s"] > 0 for st in stages)


def test_a_worker_refuses_with_machine_readable_codes(tmp_path):
    s = Swarm(tmp_path, workers=2)
    w, other = s.ids
    t = s.net.peers[other]
    desc = {
        "format": "fusionnode.subdag",
        "version": 1,
        "inputs": [],
        "outputs": [],
        "params": {},
        "buffers": {},
    }
    a = jp.StageAssignment(
        job="j", stage=0, num_stages=1, driver=other, description=desc, param_specs={}, spec={}, peer=w
    )

    async def main():
        async def code_of(method, req) -> tuple[str, str]:
            with pytest.raises(JobError) as e:
                await jp.call(t, w, method, req)
            return e.value.code, str(e.value)

        assert (await code_of(Rpc.JOB_ASSIGN, a.replace(driver=w)))[0] == ErrorCode.FORBIDDEN
        assert (
            await code_of(Rpc.JOB_STEP, jp.StepRequest(job="j", stage=0, step=0, micro_batches=1, mb_size=1))
        )[0] == ErrorCode.NOT_HELD
        step = jp.StepRequest(job="j", stage=0, step=0, micro_batches=1, mb_size=1)
        assert (await code_of(Rpc.JOB_STEP_RESULT, step))[0] == ErrorCode.NOT_HELD  # the recall parses
        code, text = await code_of(Rpc.JOB_ASSIGN, a.replace(need_bytes=1 << 40))
        assert code == ErrorCode.NO_ROOM and "offers" in text
        with pytest.raises(JobError, match="unknown field") as e:
            await t.call(w, Rpc.JOB_ASSIGN, {**a.to_wire(), "flops": 1})
        assert e.value.code == ErrorCode.BAD_REQUEST
        assert (await jp.call(t, w, Rpc.JOB_ASSIGN, a)).accepted
        await s.workers[w].drain()
        assert (await code_of(Rpc.JOB_ASSIGN, a.replace(stage=1)))[0] == ErrorCode.LEAVING
        ping = await jp.call(t, w, Rpc.JOB_PING, jp.PingRequest(job="j"))
        assert ping == jp.PingReply(alive=True, draining=True, jobs=1, stages=1)

    asyncio.run(main())


def test_a_worker_sending_non_finite_activations_is_blamed_by_its_peer_id_and_replaced(tmp_path):
    """The middle stage's activations turn non-finite: the next stage refuses them with bad_tensor
    blaming the sender, the driver bans exactly that peer, re-plans on a spare, and the job ends
    with finite losses."""
    spec = small_spec(steps=4, grad_clip=1.0)
    s = Swarm(tmp_path, workers=4, hosts=1)
    params = {"spec": spec.to_dict(), "stages": 3, "offload": "on", "peers": s.ids[:4]}

    async def main():
        job = asyncio.ensure_future(s.driver.run_job(params, s.emit))
        bad = None
        while bad is None:  # the middle stage, once its link to the next stage exists
            await asyncio.sleep(0.01)
            if job.done():
                job.result()  # the job failed before it started: say why
            stages = {sj.pos: (pid, sj) for pid, w in s.workers.items() for sj in w.jobs.values()}
            if 1 in stages and stages[1][1].module is not None:
                bad, sj = stages[1]
        encode = sj.fwd.encode

        def poisoned(tensors, step, key, target, **where):
            return encode({n: t * math.nan for n, t in tensors.items()}, step, key, target, **where)

        sj.fwd.encode = poisoned
        return await job, bad

    result, bad = asyncio.run(main())
    failures = [e for e in s.events if e["type"] == "event" and e["kind"] == "failure"]
    assert [f["peer"] for f in failures] == [bad]
    assert "non-finite" in failures[0]["reason"] and failures[0]["ban_s"] > 0
    assert any(e["type"] == "event" and e["kind"] == "recovered" for e in s.events)
    assert bad not in [st["peer"] for st in result["stages"]]
    assert result["steps"] == spec.steps and all(math.isfinite(e["loss"]) for e in s.steps())


def test_a_commit_failure_after_the_update_waits_for_the_steps_checks_before_the_re_plan(tmp_path):
    """A checked job (offload: the checks run while the next step does): a worker fails on commit after
    the hosts applied the step, so the driver re-plans at once. The re-plan releases the old stages,
    and with them the messages the step's audits read: it waits for the audits first (as every other
    re-plan does), so no honest worker is taken for a liar (caught, banned) and nothing is rolled back."""
    spec = small_spec(steps=4, grad_clip=1.0, compress="none")
    s = Swarm(tmp_path, workers=4, hosts=1)
    params = {
        "spec": spec.to_dict(),
        "stages": 3,
        "offload": "on",
        "peers": s.ids[:4],
        "verify_policy": "all",
        "rebalance_every": 0,
    }
    broken = s.ids[2]
    failed = []
    for pid in s.ids[:4]:
        rpcs = s.net.peers[pid]._rpc
        audit = rpcs[Rpc.JOB_AUDIT]

        async def slow_audit(args, sender, audit=audit):  # an audit that takes a while, honestly
            await asyncio.sleep(1.5)
            return await audit(args, sender)

        rpcs[Rpc.JOB_AUDIT] = slow_audit
    commit = s.net.peers[broken]._rpc[Rpc.JOB_COMMIT]

    async def failing_commit(args, sender):
        if args.get("step") == 1 and not failed:
            failed.append(1)
            raise JobError(ErrorCode.INTERNAL, "disk gone while applying the step")
        return await commit(args, sender)

    s.net.peers[broken]._rpc[Rpc.JOB_COMMIT] = failing_commit
    result = asyncio.run(s.driver.run_job(params, s.emit))
    events = [e for e in s.events if e["type"] == "event"]
    assert failed, "the commit of step 1 did not fail"
    assert not [e for e in events if e["kind"] in ("caught", "rollback")], events
    assert result["steps"] == spec.steps and result["verify"]["caught"] == 0
