"""The mailbox that holds a job's tensors until a stage asks for them: sender-bound, bounded in bytes,
only for jobs this node serves, with deadlines (SECURITY.md, attacks 2 and 4)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fusionnode.errors import DeadlineError, ProtocolError
from fusionnode.runtime import mailbox as T
from fusionnode.wire.checked import tensor_message
from fusionnode.wire.messages import TensorMessage

MiB = 1 << 20


def msg(job: str, step: int = 0, mb: int = 0, value: float = 0.0, n: int = 0) -> TensorMessage:
    tensors = {"x": torch.full((n,), value)} if n else {}
    return tensor_message("act", {"job": job, "step": step, "mb": mb, "stage": 1}, tensors)


def test_a_message_waits_for_its_getter_and_a_getter_for_its_message():
    async def go():
        box = T.Mailbox()
        box.accept("a", "stage", {"peer-x", "peer-y"}, MiB)
        box.put(msg("a", mb=1), "peer-x")
        got, sender = await box.get(("act", "a", 0, 1, 1), timeout=1, sender="peer-x")
        assert sender == "peer-x" and got.meta["mb"] == 1
        waiter = asyncio.ensure_future(box.get(("act", "a", 0, 2, 1), timeout=5, sender="peer-y"))
        await asyncio.sleep(0)
        box.put(msg("a", mb=2), "peer-y")
        assert (await waiter)[1] == "peer-y"
        with pytest.raises(DeadlineError):
            await box.get(("act", "a", 0, 3, 1), timeout=0.05, sender="peer-x")

    asyncio.run(go())


def test_a_peer_cannot_take_the_place_of_the_sender_the_plan_names():
    """Attack 2: a member of the job writes the key of a message it does not own, before and after the
    honest one. The getter gets the honest message; the impostor's are dropped and counted."""

    async def go():
        box = T.Mailbox()
        box.accept("j", "stage", {"honest", "impostor"}, 64 * MiB)
        key = ("act", "j", 0, 0, 1)
        box.put(msg("j", value=6.66, n=4), "impostor")  # before the honest one
        box.put(msg("j", value=1.0, n=4), "honest")
        box.put(msg("j", value=6.66, n=4), "impostor")  # and after it (used to overwrite it)
        got, sender = await box.get(key, timeout=1, sender="honest")
        assert sender == "honest" and torch.equal(got.decode_tensors()["x"], torch.ones(4))
        assert box.dropped["impostor"] == 1 and box.held_bytes() == 0  # its message went with the key
        # while a getter waits for the honest peer, the impostor's message is dropped at once
        waiter = asyncio.ensure_future(box.get(("act", "j", 0, 1, 1), timeout=5, sender="honest"))
        await asyncio.sleep(0)
        box.put(msg("j", mb=1, value=6.66, n=4), "impostor")
        assert not waiter.done() and box.dropped["impostor"] == 2
        box.put(msg("j", mb=1, value=2.0, n=4), "honest")
        got, _ = await waiter
        assert torch.equal(got.decode_tensors()["x"], torch.full((4,), 2.0))

    asyncio.run(go())


def test_messages_for_jobs_not_served_are_dropped_not_held():
    """Attack 4: messages for invented job ids, or from peers a job's holders did not name, hold
    nothing (they used to stay forever, 4,096 per job, up to 256 MiB each)."""
    box = T.Mailbox()
    box.accept("mine", "stage", {"member"}, MiB)
    for i in range(1000):
        box.put(msg(f"invented{i}", n=256), "flooder")
        box.put(msg("mine", mb=i, n=256), "flooder")  # a served job, but not from a named peer
    assert box.held_bytes() == 0 and box.status()["held_messages"] == 0
    assert box.dropped["flooder"] == 2000
    box.put(msg("mine"), "member")  # honest messages are unaffected
    assert box.status()["held_messages"] == 1


def test_each_sender_is_bounded_in_bytes_and_an_overwrite_counts_once():
    """Attack 4: a key re-sent 4,096 times used to count 4,096 and lock the job out; now it holds one
    message's bytes. A sender past its byte budget is refused; the other senders keep theirs."""

    async def go():
        box = T.Mailbox()
        budget = 8 * T.MESSAGE_OVERHEAD_BYTES + 4 * 1024 * 4  # about 4 messages of 1,024 floats
        box.accept("j", "stage", {"a", "b"}, budget)
        for _ in range(4096):
            box.put(msg("j", n=1024), "a")  # the same key again and again
        assert box.status()["held_messages"] == 1
        assert box.held_bytes() == T.MESSAGE_OVERHEAD_BYTES + 4096
        for mb in range(1, 4):
            box.put(msg("j", mb=mb, n=1024), "a")
        with pytest.raises(ProtocolError, match="budget"):
            for mb in range(4, 100):
                box.put(msg("j", mb=mb, n=1024), "a")
        assert box.held_bytes() <= budget
        box.put(msg("j", mb=50, n=1024), "b")  # another sender has its own budget
        assert (await box.get(("act", "j", 0, 50, 1), timeout=1, sender="b"))[1] == "b"
        await box.get(("act", "j", 0, 0, 1), timeout=1, sender="a")
        box.put(msg("j", mb=7, n=1024), "a")  # taking a message frees its bytes

    asyncio.run(go())


def test_a_job_is_served_until_its_last_holder_releases_it():
    box = T.Mailbox()
    box.accept("j", ("stage", 1), {"p"}, MiB)
    box.accept("j", ("host",), {"d"}, MiB)
    box.put(msg("j"), "p")
    box.release("j", ("stage", 1))
    assert not box.serves("j", "p") and box.serves("j", "d")
    assert box.status()["held_messages"] == 1  # the host still serves the job: nothing dropped yet
    box.release("j", ("host",))
    assert box.held_bytes() == 0 and box.status()["jobs"] == 0


@pytest.mark.parametrize(
    "meta",
    [
        {"job": "j", "step": "x", "mb": 0, "stage": 0},
        {"job": "j", "step": float("inf"), "mb": 0, "stage": 0},
        {"job": "j", "step": True, "mb": 0, "stage": 0},
        {"job": "j", "step": 1 << 63, "mb": 0, "stage": 0},
        {"job": 7, "step": 0, "mb": 0, "stage": 0},
    ],
)
def test_a_malformed_key_is_a_protocol_error(meta):
    """Attack 9: a step of "x" or infinity used to raise ValueError/OverflowError out of the handler."""
    box = T.Mailbox()
    box.accept("j", "stage", {"p"}, MiB)
    with pytest.raises(ProtocolError):
        box.put(TensorMessage("act", meta, {}), "p")


def test_a_fused_stage_drops_the_inputs_of_steps_it_skipped():
    """`drop_before` (runtime/fused.py, a fused stage's next step): the inputs and targets fed ahead
    for a step the round's close skipped are forgotten and their bytes freed; those of the step
    itself, later steps, other kinds and other stages stay."""
    box = T.Mailbox()
    box.accept("j", "stage", {"driver"}, MiB)

    def put(kind: str, step: int, stage: int = 1) -> None:
        meta = {"job": "j", "step": step, "mb": 0, "stage": stage}
        box.put(tensor_message(kind, meta, {"x": torch.zeros(64)}), "driver")

    for step in (4, 5, 6):
        put("input", step)
        put("target", step)
    put("input", 4, stage=2)
    put("act", 4)
    before = box.held_bytes()
    assert box.drop_before("j", 1, 6, ("input", "target")) == 4  # steps 4 and 5 of stage 1
    left = sorted(k for k in box._items)
    assert left == sorted(
        [("act", "j", 4, 0, 1), ("input", "j", 4, 0, 2), ("input", "j", 6, 0, 1), ("target", "j", 6, 0, 1)]
    )
    assert box.held_bytes() == before * 4 // 8
