"""The mailbox that holds a job's tensors until a stage asks for them: keyed, bounded, with deadlines."""

from __future__ import annotations

import asyncio

import pytest

from fusionnode.errors import DeadlineError, ProtocolError
from fusionnode.runtime import transport as T
from fusionnode.wire.messages import TensorMessage


def msg(job: str, step: int = 0, mb: int = 0) -> TensorMessage:
    return TensorMessage(kind="act", meta={"job": job, "step": step, "mb": mb, "stage": 1}, tensors={})


def test_a_message_waits_for_its_getter_and_a_getter_for_its_message():
    async def go():
        box = T.Mailbox()
        box.put(msg("a", mb=1), "peer-x")
        got, sender = await box.get(("act", "a", 0, 1, 1), timeout=1)
        assert sender == "peer-x" and got.meta["mb"] == 1
        waiter = asyncio.ensure_future(box.get(("act", "a", 0, 2, 1), timeout=5))
        await asyncio.sleep(0)
        box.put(msg("a", mb=2), "peer-y")
        assert (await waiter)[1] == "peer-y"
        with pytest.raises(DeadlineError):
            await box.get(("act", "a", 0, 3, 1), timeout=0.05)

    asyncio.run(go())


def test_invented_job_ids_cannot_fill_memory(monkeypatch):
    monkeypatch.setattr(T, "MAX_PENDING_TOTAL", 50)
    box = T.Mailbox()
    for i in range(50):
        box.put(msg(f"job{i}"), "flooder")
    with pytest.raises(ProtocolError, match="too many pending"):
        box.put(msg("one-more"), "flooder")


def test_one_job_cannot_hold_more_than_its_share(monkeypatch):
    monkeypatch.setattr(T, "MAX_PENDING_PER_JOB", 3)
    box = T.Mailbox()
    for i in range(3):
        box.put(msg("a", mb=i), "p")
    with pytest.raises(ProtocolError, match="job 'a'"):
        box.put(msg("a", mb=9), "p")
    box.drop_job("a")
    box.put(msg("a", mb=9), "p")  # dropping a job frees its share
