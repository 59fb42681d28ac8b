"""A call whose stream closes before its reply (a libp2p stream reset, the peer alive and its work
done) is asked again with a method that returns the result without redoing the work."""

from __future__ import annotations

import asyncio
import types

import pytest

from fusionnode.config import LOCAL_ONLY
from fusionnode.errors import PeerError
from fusionnode.runtime.transport import Transport
from fusionnode.swarm.libp2p import create_p2p

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _pair() -> tuple[list, list]:
    p2ps, ts = [], []
    first = None
    for _ in range(2):
        p2p = await create_p2p(LOOPBACK, first, options=LOCAL_ONLY, startup_timeout=30)
        p2ps.append(p2p)
        if first is None:
            first = await p2p.get_visible_maddrs()
        t = Transport(p2p, rpc_timeout=5.0)
        await t.start()
        ts.append(t)
    return p2ps, ts


async def _close(p2ps: list, ts: tuple) -> None:
    for t in ts:
        await t.close()
    for p in p2ps:
        await p.shutdown()


async def _until(cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_an_unanswered_step_is_fetched_not_rerun():
    async def main():
        p2ps, (a, b) = await _pair()
        runs: list[int] = []
        try:

            async def step(args, sender):
                runs.append(args["step"])
                raise asyncio.CancelledError  # the handler dies before replying: the stream closes unanswered

            async def step_result(args, sender):
                return {"report": args["step"], "runs": len(runs)}

            async def refuse(args, sender):
                raise PeerError("no such stage")

            b.add_rpc("job.step", step)
            b.add_rpc("job.step_result", step_result)
            b.add_rpc("job.refuse", refuse)
            args = {"job": "j", "stage": 0, "step": 7}
            with pytest.raises(PeerError, match="unanswered"):
                await a.call(b.peer_id, "job.step", args, timeout=10)
            got = await a.call(b.peer_id, "job.step", args, timeout=10, recall="job.step_result")
            assert got == {"report": 7, "runs": 2}  # asked again, the step itself did not run a third time
            # a refusal is an answer: not asked again
            with pytest.raises(PeerError, match="no such stage"):
                await a.call(b.peer_id, "job.refuse", args, timeout=10, recall="job.step_result")
            # an idempotent call is simply made again, once
            flaky: list[int] = []

            async def read(args, sender):
                flaky.append(1)
                if len(flaky) % 2:
                    raise asyncio.CancelledError
                return {"value": 42}

            b.add_rpc("opt.read", read)
            assert await a.call(b.peer_id, "opt.read", {}, timeout=10, idempotent=True) == {"value": 42}
            with pytest.raises(PeerError, match="unanswered"):
                await a.call(b.peer_id, "opt.read", {}, timeout=10)
        finally:
            await _close(p2ps, (a, b))

    asyncio.run(main())


def _tmsg(i: int):
    import torch

    from fusionnode.wire.checked import tensor_message

    return tensor_message(
        "act", {"job": "j", "step": i, "mb": 0, "stage": 1}, {"x": torch.full((64,), float(i))}
    )


def test_a_broken_data_stream_loses_nothing_and_duplicates_nothing():
    """Messages written into a stream that then breaks (here: cut in the middle of a message, as a
    libp2p reset would) are written again on a new stream; the receiver skips the ones it had."""
    from fusionnode.wire.messages import encode_message

    async def main():
        p2ps, (a, b) = await _pair()
        got: list[int] = []
        b.on_data("act", lambda msg, sender: got.append(int(msg.meta["step"])))
        try:
            for i in range(5):
                await a.send(b.peer_id, _tmsg(i))
            # the next message is only half written when the stream breaks
            _reader, writer = a._out[b.peer_id]
            entry = [a._next_seq[b.peer_id], _tmsg(5), 1, 0]
            a._next_seq[b.peer_id] += 1
            a._unacked[b.peer_id].append(entry)
            data = encode_message(_tmsg(5))
            writer.write(data[: len(data) // 2])
            await writer.drain()
            writer.close()
            for i in range(6, 10):
                await a.send(b.peer_id, _tmsg(i))
            await _until(lambda: len(got) >= 10 and not a._unacked[b.peer_id], "10 messages acknowledged")
            assert got == list(range(10))
            assert a.resent[b.peer_id] >= 1 and not a._unacked[b.peer_id]
            # a copy of a delivered message (its ack lost) is skipped: replay the whole history
            a._unacked[b.peer_id].extend([[k, _tmsg(k), 1, 0] for k in range(10)])
            a._drop_out(b.peer_id)
            await a.send(b.peer_id, _tmsg(10))
            await _until(lambda: len(got) >= 11 and not a._unacked[b.peer_id], "11 messages acknowledged")
            assert got == list(range(11))
        finally:
            await _close(p2ps, (a, b))

    asyncio.run(main())


def test_unanswered_is_about_this_call_only():
    from fusionnode.runtime.transport import unanswered

    direct = PeerError("peer QmX… closed the 'job.step' call unanswered (a stream reset, ...)")
    nested = PeerError(
        "peer QmX… refused 'job.step': PeerError: peer QmY… closed the 'opt.pull' call unanswered (...)"
    )
    assert unanswered(direct, "job.step") and not unanswered(direct, "job.commit")
    assert not unanswered(nested, "job.step") and not unanswered(nested, "opt.pull")


def test_a_peer_that_never_acknowledges_cannot_make_us_hold_everything(monkeypatch):
    from fusionnode.runtime import transport as T

    monkeypatch.setattr(T, "MAX_UNACKED", 3)

    async def main():
        p2ps, (a, b) = await _pair()
        try:
            b._delivered.clear()
            real = T.ACK  # the receiver writes no acknowledgements
            monkeypatch.setattr(
                T, "ACK", types.SimpleNamespace(pack=lambda seq: b"", size=real.size, unpack=real.unpack)
            )
            for i in range(6):
                await a.send(b.peer_id, _tmsg(i))
            assert [e[0] for e in a._unacked[b.peer_id]] == [3, 4, 5]
        finally:
            await _close(p2ps, (a, b))

    asyncio.run(main())


def test_a_repeated_offload_commit_starts_no_second_pull():
    """An offloaded stage's commit starts the prefetch of the new parameters; the same commit asked
    again (its reply lost) must not start another pull, which would race the first for its messages."""
    from fusionnode.runtime.worker import WorkerService
    from fusionnode.wire.job import CommitReply, CommitRequest

    pulls: list[int] = []

    async def pull(sj, step):
        pulls.append(step)

    from fusionnode.sync import SyncConfig

    sj = types.SimpleNamespace(offload={"hosts": {}}, last_step=-1, pull_task=None, sync=SyncConfig())
    w = types.SimpleNamespace(_get=lambda args, sender: sj, _pull=pull)

    async def main():
        args = CommitRequest(job="j", stage=1, step=7)
        first = await WorkerService.rpc_commit(w, args, "driver")
        again = await WorkerService.rpc_commit(w, args, "driver")
        await sj.pull_task
        assert first == CommitReply(applied=7, prefetching=True) and again.again is True
        assert pulls == [7]
        assert (await WorkerService.rpc_commit(w, args.replace(step=8), "driver")).prefetching
        await sj.pull_task
        assert pulls == [7, 8]

    asyncio.run(main())
