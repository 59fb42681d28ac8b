"""The verifier peer's service (train/verifier_peer.py VerifierService) as a peer of the swarm that
other peers may call (review 7, H1, M1, L1): only the drivers of `--serve-checks-for` are served; a
check's bytes count until it is judged; waiting calls take a running slot; empty messages are charged;
a call waits WAIT_CAP_S at most; held messages expire on each call too; a duplicate call is refused."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_components import Swarm

from fusionnode.config import NodeConfig
from fusionnode.errors import ConfigError
from fusionnode.train import verifier_peer
from fusionnode.train.verifier_peer import MSG_CHARGE, VerifierService, param_messages
from fusionnode.wire import job as jp
from fusionnode.wire.job import ErrorCode, JobError, TensorKind
from fusionnode.wire.messages import TensorMessage

VERIFIER = "QmVerifier0xxxxxxxxxxxxxxxx"


def _base(**kw):
    base = dict(
        job="j", stage=0, step=0, ticket=1, chunks=1, params=1, assignment={}, commit={}, listed={},
        src="x", mbs=[0], grads=False, losses=[], micro_batches=2, rel_tol=1e-3, wait_s=0.3,
    )  # fmt: skip
    return jp.VerifyCheck(**{**base, **kw})


def _chunk(ticket: int, job: str = "j", mb: int = 0) -> TensorMessage:
    return TensorMessage(TensorKind.VERIFY_AUDIT, {"job": job, "step": ticket, "mb": mb, "stage": 0}, {})


async def _code(call) -> str:
    with pytest.raises(JobError) as e:
        await call
    return e.value.code


def test_a_caller_not_allowed_is_forbidden_and_its_messages_dropped(tmp_path, monkeypatch):
    """The hog (not in --serve-checks-for) can neither park messages nor call; the allowed driver's
    check goes through even with a budget the hog's messages alone would fill."""
    monkeypatch.setattr(verifier_peer, "HELD_BYTES", 960 + 3 * MSG_CHARGE)
    s = Swarm(tmp_path, workers=2)
    hog, honest = s.net.peers[s.ids[0]], s.net.peers[s.ids[1]]
    service = VerifierService(s.net.join(VERIFIER), serve=True, allow=[s.ids[1]])

    async def judged(sender, req, audit, mine):
        return jp.VerifyCheckReply(verdict="")

    monkeypatch.setattr(service, "_judge", judged)

    async def main():
        (msg,) = param_messages("j", 1, 0, 1, {"w": torch.ones(240)})  # 960 bytes
        await hog.send(VERIFIER, msg)
        assert service.held_bytes == 0 and not service.held and service.dropped == 1
        code = await _code(jp.call(hog, VERIFIER, jp.Rpc.VERIFY_CHECK, _base(wait_s=600.0)))
        assert code == ErrorCode.FORBIDDEN
        await honest.send(VERIFIER, _chunk(5, job="k"))
        (mine,) = param_messages("k", 5, 0, 1, {"w": torch.ones(240)})
        await honest.send(VERIFIER, mine)
        reply = await jp.call(honest, VERIFIER, jp.Rpc.VERIFY_CHECK, _base(job="k", ticket=5))
        assert reply.verdict == "" and service.held_bytes == 0 and service.running == 0

    asyncio.run(main())


def test_empty_messages_are_charged_and_bounded(tmp_path, monkeypatch):
    """Messages without payload count MSG_CHARGE each: 2,000 of them fit only as far as the budget."""
    monkeypatch.setattr(verifier_peer, "HELD_BYTES", 100 * MSG_CHARGE)
    s = Swarm(tmp_path, workers=1)
    service = VerifierService(s.net.join(VERIFIER), serve=True, allow=s.ids)
    t = s.net.peers[s.ids[0]]

    async def main():
        for i in range(2000):
            await t.send(VERIFIER, _chunk(i, mb=i % 50))
        await t.send(VERIFIER, _chunk(5000, mb=10**6))  # an index past any check's size: dropped

    asyncio.run(main())
    assert len(service.held) == 100 and service.held_bytes == 100 * MSG_CHARGE
    assert service.dropped == 1901 and (s.ids[0], "j", 5000, 0) in service.refused


def test_a_check_over_its_size_cap_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(verifier_peer, "CHECK_BYTES", 500 + MSG_CHARGE)
    s = Swarm(tmp_path, workers=1)
    service = VerifierService(s.net.join(VERIFIER), serve=True, allow=s.ids)
    t = s.net.peers[s.ids[0]]

    async def main():
        (msg,) = param_messages("j", 1, 0, 1, {"w": torch.ones(240)})  # 960 bytes: over 500
        await t.send(VERIFIER, msg)
        assert service.held_bytes == 0 and service.dropped == 1
        assert (
            await _code(jp.call(t, VERIFIER, jp.Rpc.VERIFY_CHECK, _base(wait_s=600.0))) == ErrorCode.NO_ROOM
        )

    asyncio.run(main())


def test_wait_s_is_clamped_and_held_messages_expire_on_a_call(tmp_path, monkeypatch):
    monkeypatch.setattr(verifier_peer, "WAIT_CAP_S", 0.2)
    s = Swarm(tmp_path, workers=1)
    service = VerifierService(s.net.join(VERIFIER), serve=True, allow=s.ids)
    t = s.net.peers[s.ids[0]]

    async def main():
        await t.send(VERIFIER, _chunk(3))  # never called for
        assert len(service.held) == 1
        monkeypatch.setattr(verifier_peer, "HELD_S", 0.0)
        await asyncio.sleep(0.01)
        call = jp.call(t, VERIFIER, jp.Rpc.VERIFY_CHECK, _base(wait_s=600.0))
        code = await asyncio.wait_for(_code(call), 5.0)  # the server's cap, not the caller's 600 s
        assert code == ErrorCode.DEADLINE
        assert not service.held and service.held_bytes == 0  # the idle check expired on the call

    asyncio.run(main())


def test_a_second_call_for_a_waiting_check_is_refused(tmp_path):
    s = Swarm(tmp_path, workers=1)
    service = VerifierService(s.net.join(VERIFIER), serve=True, allow=s.ids)
    t = s.net.peers[s.ids[0]]

    async def main():
        first = asyncio.ensure_future(jp.call(t, VERIFIER, jp.Rpc.VERIFY_CHECK, _base(wait_s=0.3)))
        await asyncio.sleep(0.05)
        second = jp.call(t, VERIFIER, jp.Rpc.VERIFY_CHECK, _base(wait_s=0.3))
        return await asyncio.gather(first, second, return_exceptions=True)

    codes = [getattr(r, "code", repr(r)) for r in asyncio.run(main())]
    assert codes == [ErrorCode.DEADLINE, ErrorCode.BAD_REQUEST], codes
    assert service.running == 0 and not service._arrived


def test_a_checks_bytes_count_until_it_is_judged_and_waiting_calls_take_a_slot(tmp_path, monkeypatch):
    """Five calls arrive before their messages with MAX_RUNNING=2: two wait (taking the slots), three
    are refused at once; the two checks' bytes stay in held_bytes while they are judged."""
    per_check = 960 + 2 * MSG_CHARGE  # an empty chunk and 960 bytes of parameters
    monkeypatch.setattr(verifier_peer, "HELD_BYTES", 2 * per_check + 100)
    monkeypatch.setattr(verifier_peer, "MAX_RUNNING", 2)
    s = Swarm(tmp_path, workers=1)
    service = VerifierService(s.net.join(VERIFIER), serve=True, allow=s.ids)
    t = s.net.peers[s.ids[0]]
    gate = asyncio.Event()
    queued = []

    async def slow_judge(sender, req, audit, mine):
        queued.append(sum(v.numel() * v.element_size() for v in mine.values()))
        await gate.wait()
        return jp.VerifyCheckReply(verdict="")

    monkeypatch.setattr(service, "_judge", slow_judge)

    async def main():
        calls = [
            asyncio.ensure_future(jp.call(t, VERIFIER, jp.Rpc.VERIFY_CHECK, _base(ticket=k, wait_s=5.0)))
            for k in range(5)
        ]
        await asyncio.sleep(0.05)
        waiting = service.running
        for ticket in range(5):
            await t.send(VERIFIER, _chunk(ticket))
            for msg in param_messages("j", ticket, 0, 1, {"w": torch.ones(240)}):
                await t.send(VERIFIER, msg)
            await asyncio.sleep(0.02)
        held, running = service.held_bytes, service.running
        gate.set()
        got = await asyncio.gather(*calls, return_exceptions=True)
        return waiting, held, running, got

    waiting, held, running, got = asyncio.run(main())
    assert waiting == 2 and running == 2 and held == 2 * per_check and queued == [960, 960]
    codes = [getattr(r, "code", None) for r in got]
    assert codes.count(ErrorCode.NO_ROOM) == 3 and codes.count(None) == 2, got
    assert service.held_bytes == 0 and not service.held and service.running == 0


def test_serve_checks_needs_its_allow_list(tmp_path):
    with pytest.raises(ConfigError, match="--serve-checks-for"):
        NodeConfig(tmp_path, serve_checks=True)
    with pytest.raises(ConfigError, match="without --serve-checks"):
        NodeConfig(tmp_path, serve_checks_for=(VERIFIER,))
    with pytest.raises(ConfigError, match="peer ids"):
        NodeConfig(tmp_path, serve_checks=True, serve_checks_for=("not a peer",))
    assert NodeConfig(tmp_path, serve_checks=True, serve_checks_for=(VERIFIER,)).serve_checks_for == (
        VERIFIER,
    )


def test_a_broken_check_process_is_replaced_at_the_next_check():
    """Review 7 L4: the check process killed, the check it was asked fails (BrokenExecutor) and the
    next one gets a new process; the shared buffers kept for reuse stay bounded."""
    import concurrent.futures
    import os
    import signal

    from fusionnode.train.checks import _BUFFERS, MAX_LAG, CheckProcess, _child_ready

    async def main():
        checker = CheckProcess("j")
        loop = asyncio.get_running_loop()
        pid = await loop.run_in_executor(CheckProcess._pool, _child_ready)
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        with pytest.raises(concurrent.futures.BrokenExecutor):
            await checker(None, (torch.zeros(1, dtype=torch.uint8),))
        assert CheckProcess._pool is None  # forgotten: the next check starts a new one
        CheckProcess._start()
        new = await loop.run_in_executor(CheckProcess._pool, _child_ready)
        assert new != pid

    asyncio.run(main())
    lent = [_BUFFERS.take((1 << 10) + 64 * (i % 3)) for i in range(MAX_LAG + 6)]  # sizes differ
    for buf in lent:
        _BUFFERS.give(buf)
    assert len(_BUFFERS.free) <= MAX_LAG + 2
