"""`job.start` builds a stage once per assignment, so the driver may ask again when the call's stream
closes unanswered (a libp2p stream reset under load): the second start answers what the first did,
a conflicting one is refused (protocol/SPEC.md 13.1, "job.start")."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from memnet import MemNet
from test_components import Swarm, small_spec

from fusionnode.graph.portable import describe_stage
from fusionnode.graph.trace import trace_spec
from fusionnode.models import build_model
from fusionnode.runtime.stage import StageModule
from fusionnode.runtime.worker import WorkerService
from fusionnode.train.local import train_local
from fusionnode.wire import job as jp
from fusionnode.wire.checked import tensor_message
from fusionnode.wire.job import ErrorCode, JobError, Rpc, TensorKind

torch.set_num_threads(1)
CONFIG = SimpleNamespace(step_timeout_s=4.0, lease_s=60.0)
W = "QmWorkerStartxxxxxxxxxxxxxxxx"
D = "QmDriverStartxxxxxxxxxxxxxxxx"


def test_a_start_whose_reply_is_lost_is_asked_again_and_the_job_trains(tmp_path):
    """The worker built the stage, then the reply was lost: the driver asks again, the worker answers
    ready without waiting for the parameters it already took, and the job follows one process."""
    spec = small_spec()
    s = Swarm(tmp_path, workers=3)
    lossy = s.ids[1]
    s.net.lose_replies[(lossy, Rpc.JOB_START)] = 1
    asyncio.run(s.driver.run_job({"spec": spec.to_dict(), "stages": 3, "offload": "off"}, s.emit))
    assert s.net.lose_replies[(lossy, Rpc.JOB_START)] == 0  # the loss happened
    assert s.net.peers[lossy].calls.count(Rpc.JOB_START) == 2  # asked again, once
    assert not [e for e in s.events if e.get("kind") in ("refused", "replan", "failed")], s.events
    got = [e["loss"] for e in s.steps()]
    ref = train_local(spec).losses
    assert len(got) == spec.steps
    for a, b in zip(got, ref, strict=True):
        assert abs(a - b) < 1e-5, (got, ref)


def _stage() -> tuple[dict, dict[str, torch.Tensor]]:
    traced = trace_spec("gpt2-tiny", seq_len=16)
    state = build_model("gpt2-tiny").state_dict()
    desc = describe_stage(traced, 0, 8)
    names = StageModule.from_description(desc).state_names()
    return desc, {n: state[n].detach().clone() for n in names}


def test_a_repeated_start_answers_ready_and_a_conflicting_one_is_refused(tmp_path, monkeypatch):
    desc, params = _stage()
    builds: list[int] = []
    build = StageModule.from_description.__func__

    def counted(cls, *args, **kw):
        builds.append(1)
        return build(cls, *args, **kw)

    monkeypatch.setattr(StageModule, "from_description", classmethod(counted))
    net = MemNet()
    worker = WorkerService(net.join(W), capacity_bytes=1 << 30, config=CONFIG, state_dir=tmp_path)
    t = net.join(D)
    specs = {n: {"shape": list(p.shape), "dtype": "float32"} for n, p in params.items()}
    held = dict(job="j", stage=0, num_stages=2, driver=D, description=desc, param_specs=specs, peer=W)
    a = jp.StageAssignment(**held, spec=small_spec().to_dict())

    async def assign_and_send() -> None:
        await jp.call(t, W, Rpc.JOB_ASSIGN, a)
        for idx, name in enumerate(sorted(specs)):
            meta = {"job": "j", "stage": 0, "step": -1, "mb": idx}
            await t.send(W, tensor_message(TensorKind.PARAMS, meta, {name: params[name]}))

    async def main() -> None:
        ref = jp.StageRef(job="j", stage=0)
        await assign_and_send()
        first = await jp.call(t, W, Rpc.JOB_START, ref)
        assert first.ready and first.params == len(params)
        module = worker.jobs[("j", 0)].module
        t0 = time.monotonic()
        again = await jp.call(t, W, Rpc.JOB_START, ref)  # no parameters sent again: answered at once
        assert again == first and time.monotonic() - t0 < CONFIG.step_timeout_s / 2
        assert worker.jobs[("j", 0)].module is module and len(builds) == 1
        with pytest.raises(JobError) as e:  # other counts than the start made: refused, stage kept
            await jp.call(t, W, Rpc.JOB_START, jp.StageRef(job="j", stage=0, optim=len(params)))
        assert e.value.code == ErrorCode.BAD_REQUEST and "conflicts with the start already made" in str(
            e.value
        )
        assert worker.jobs[("j", 0)].module is module
        # a new job.assign (a new plan) starts afresh; two starts at once (the first one's stream
        # reset while it still built): both ready, one build
        await assign_and_send()
        both = await asyncio.gather(*(jp.call(t, W, Rpc.JOB_START, ref) for _ in range(2)))
        assert both[0] == both[1] == first and len(builds) == 2
        assert worker.jobs[("j", 0)].module is not module
        # a release drops the stage: a later start is refused as not held, not built
        await jp.call(t, W, Rpc.JOB_RELEASE, jp.ReleaseRequest(job="j", stage=0))
        with pytest.raises(JobError) as e:
            await jp.call(t, W, Rpc.JOB_START, ref)
        assert e.value.code == ErrorCode.NOT_HELD and len(builds) == 2

    asyncio.run(main())


def test_a_start_cancelled_by_a_release_answers_not_held(tmp_path):
    """review8 L1: a stage released while its start waits for parameters: the start's caller gets
    `not_held` ("dropped while starting"), not a cancellation that closes its stream unanswered."""
    desc, params = _stage()
    net = MemNet()
    worker = WorkerService(net.join(W), capacity_bytes=1 << 30, config=CONFIG, state_dir=tmp_path)
    t = net.join(D)
    specs = {n: {"shape": list(p.shape), "dtype": "float32"} for n, p in params.items()}
    held = dict(job="j", stage=0, num_stages=2, driver=D, description=desc, param_specs=specs, peer=W)
    a = jp.StageAssignment(**held, spec=small_spec().to_dict())

    async def main() -> None:
        await jp.call(t, W, Rpc.JOB_ASSIGN, a)
        ref = jp.StageRef(job="j", stage=0)
        start = asyncio.ensure_future(jp.call(t, W, Rpc.JOB_START, ref))  # no parameters sent: it waits
        await asyncio.sleep(0.1)
        assert not start.done()
        await jp.call(t, W, Rpc.JOB_RELEASE, jp.ReleaseRequest(job="j", stage=0))
        with pytest.raises(JobError) as e:
            await asyncio.wait_for(start, CONFIG.step_timeout_s / 2)
        assert e.value.code == ErrorCode.NOT_HELD and "dropped while starting" in str(e.value)
        assert not worker.jobs

    asyncio.run(main())


def test_a_start_whose_stream_resets_after_the_build_is_asked_again_over_p2pd(tmp_path):
    """The same over the real transport (two p2pd daemons on loopback): the worker builds the stage,
    then the call's stream closes unanswered; `Transport.call` asks again (idempotent, as
    placement.ship calls it) and the worker answers ready from the first build."""
    from test_transport_recall import _close, _pair

    desc, params = _stage()
    specs = {n: {"shape": list(p.shape), "dtype": "float32"} for n, p in params.items()}

    async def main() -> None:
        p2ps, (drv, w) = await _pair()
        try:
            worker = WorkerService(w, capacity_bytes=1 << 30, config=CONFIG, state_dir=tmp_path)
            built = w._rpc[Rpc.JOB_START]
            replies: list[dict] = []

            async def reset_the_first(args, sender):
                replies.append(await built(args, sender))
                if len(replies) == 1:
                    raise asyncio.CancelledError  # built; the stream closes before the reply
                return replies[-1]

            w.add_rpc(Rpc.JOB_START, reset_the_first)
            held = dict(
                job="j", stage=0, num_stages=2, driver=drv.peer_id, description=desc, param_specs=specs
            )
            a = jp.StageAssignment(**held, spec=small_spec().to_dict(), peer=w.peer_id)
            await jp.call(drv, w.peer_id, Rpc.JOB_ASSIGN, a)
            for idx, name in enumerate(sorted(specs)):
                meta = {"job": "j", "stage": 0, "step": -1, "mb": idx}
                await drv.send(w.peer_id, tensor_message(TensorKind.PARAMS, meta, {name: params[name]}))
            ref = jp.StageRef(job="j", stage=0)
            got = await jp.call(drv, w.peer_id, Rpc.JOB_START, ref, timeout=20, idempotent=True)
            assert got.ready and got.params == len(params) and len(replies) == 2
            assert replies[0] == replies[1] and worker.jobs[("j", 0)].module is not None
        finally:
            await _close(p2ps, (drv, w))

    asyncio.run(main())
