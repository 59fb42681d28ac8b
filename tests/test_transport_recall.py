"""A call whose stream closes before its reply (a libp2p stream reset, the peer alive and its work
done) is asked again with a method that returns the result without redoing the work."""

from __future__ import annotations

import asyncio
import types

import pytest
from hivemind.p2p import P2P

from fusionnode.errors import PeerError
from fusionnode.runtime.transport import Transport
from fusionnode.train.driver import Driver

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _pair() -> tuple[list, list]:
    p2ps, ts = [], []
    first = None
    for _ in range(2):
        p2p = await P2P.create(initial_peers=first, host_maddrs=LOOPBACK, startup_timeout=30)
        p2ps.append(p2p)
        if first is None:
            first = await p2p.get_visible_maddrs()
        t = Transport(p2p, rpc_timeout=5.0)
        await t.start()
        ts.append(t)
    return p2ps, ts


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
            driver = types.SimpleNamespace(t=a)
            args = {"job": "j", "stage": 0, "step": 7}
            with pytest.raises(PeerError, match="unanswered"):
                await a.call(b.peer_id, "job.step", args, timeout=10)
            got = await Driver._call_or_recall(driver, b.peer_id, "job.step", "job.step_result", args, 10)
            assert got == {"report": 7, "runs": 2}  # asked again, the step itself did not run a third time
            # a refusal is an answer: not asked again
            with pytest.raises(PeerError, match="no such stage"):
                await Driver._call_or_recall(driver, b.peer_id, "job.refuse", "job.step_result", args, 10)
        finally:
            for t in (a, b):
                await t.close()
            for p in p2ps:
                await p.shutdown()

    asyncio.run(main())
