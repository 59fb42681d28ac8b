"""The receiving side's inbox of data messages: each held under its key (kind, job, step,
micro-batch, stage) until a stage takes it, bound to the sender it came from and counted against
that sender's byte budget (SECURITY.md: the mailbox limits); `Transport` feeds it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from fusionnode.errors import DeadlineError, ProtocolError
from fusionnode.wire.messages import TensorMessage

logger = logging.getLogger(__name__)

MAX_JOB_ID_CHARS = 128  # characters of a data message's job id
MESSAGE_OVERHEAD_BYTES = 1024  # bytes a held message counts beyond its payloads (so empty ones count)


def _key_int(meta: dict[str, Any], name: str) -> int:
    value = meta.get(name, -1)
    if not isinstance(value, int) or isinstance(value, bool) or not -(1 << 62) <= value < 1 << 62:
        raise ProtocolError(f"message meta {name!r} must be an integer, got {value!r:.40}")
    return value


def message_key(msg: TensorMessage) -> tuple:
    """(kind, job, step, mb, stage) of a data message; ProtocolError when its meta is not of that shape."""
    m = msg.meta
    job = m.get("job", "")
    if not isinstance(job, str) or len(job) > MAX_JOB_ID_CHARS:
        raise ProtocolError(f"message meta 'job' must be a string of at most {MAX_JOB_ID_CHARS} characters")
    return (msg.kind, job, _key_int(m, "step"), _key_int(m, "mb"), _key_int(m, "stage"))


def message_bytes(msg: TensorMessage) -> int:
    """What a held message counts against its sender's mailbox budget: payloads plus a fixed overhead."""
    return MESSAGE_OVERHEAD_BYTES + sum(len(enc.data) for enc in msg.tensors.values())


class Mailbox:
    """Data messages of the jobs this node serves, each bound to the peer that sent it.

    A job is served while some holder (a stage, a shard, the driver's own job) has `accept`ed it,
    naming the peers that may send for it and a byte budget. A message for a job not served, or from
    a peer its holders did not name, is dropped and counted (`dropped`, per sender). Held messages
    are keyed (kind, job, step, mb, stage) *and* sender: `get` names the peer it expects, so another
    peer can neither take an honest message's place nor be taken for it; when it is answered, the
    other senders' messages under that key are dropped and counted. A sender re-sending a key
    replaces its earlier message and is counted once. Each sender's held bytes per job are bounded
    by the job's budget (the sum of its holders'); past it the stream is closed (ProtocolError).
    """

    def __init__(self) -> None:
        self._items: dict[tuple, dict[str, TensorMessage]] = {}
        self._waiters: dict[tuple, tuple[str, asyncio.Future]] = {}
        self._holders: dict[
            str, dict[Any, tuple[frozenset[str], int]]
        ] = {}  # job -> holder -> (peers, bytes)
        self._held: dict[tuple[str, str], int] = defaultdict(int)  # (job, sender) -> bytes held
        self.dropped: dict[str, int] = defaultdict(int)  # per sender: messages not taken

    # ---- which jobs this node serves --------------------------------------------------------------
    def accept(self, job: str, holder: Any, peers: Any, max_bytes: int) -> None:
        """`holder` (say ("stage", 3)) serves `job`: messages from `peers`, at most `max_bytes` held per sender."""
        self._holders.setdefault(job, {})[holder] = (frozenset(p for p in peers if p), max(0, int(max_bytes)))

    def release(self, job: str, holder: Any) -> None:
        """`holder` no longer serves `job`; with no holder left its held messages are dropped."""
        holders = self._holders.get(job)
        if holders is None:
            return
        holders.pop(holder, None)
        if not holders:
            del self._holders[job]
            self.drop_job(job)

    def serves(self, job: str, sender: str) -> bool:
        return any(sender in peers for peers, _ in self._holders.get(job, {}).values())

    def _budget(self, job: str, sender: str) -> int:
        return sum(b for peers, b in self._holders.get(job, {}).values() if sender in peers)

    # ---- messages ---------------------------------------------------------------------------------
    def _drop(self, sender: str, n: int = 1) -> None:
        self.dropped[sender] += n
        if len(self.dropped) > 4096:
            self.dropped.pop(next(iter(self.dropped)))

    def put(self, msg: TensorMessage, sender: str) -> None:
        key = message_key(msg)
        job = key[1]
        if not self.serves(job, sender):
            self._drop(sender)
            return
        waiter = self._waiters.get(key)
        if waiter is not None and not waiter[1].done():
            if waiter[0] != sender:
                self._drop(sender)
                return
            del self._waiters[key]
            waiter[1].set_result((msg, sender))
            return
        slot = self._items.setdefault(key, {})
        old = slot.get(sender)
        nbytes = message_bytes(msg)
        held = self._held[(job, sender)] - (message_bytes(old) if old is not None else 0)
        if held + nbytes > self._budget(job, sender):
            if not slot:
                del self._items[key]
            raise ProtocolError(
                f"peer holds {held} bytes of messages for job {job!r} here; its budget is "
                f"{self._budget(job, sender)} bytes"
            )
        slot[sender] = msg
        self._held[(job, sender)] = held + nbytes

    def _take(self, key: tuple, sender: str) -> TensorMessage | None:
        """The message `sender` left under `key`; the other senders' messages under it are dropped."""
        slot = self._items.pop(key, None)
        if slot is None:
            return None
        msg = None
        for src, m in slot.items():
            self._unhold(key[1], src, message_bytes(m))
            if src == sender:
                msg = m
            else:
                self._drop(src)
        return msg

    def _unhold(self, job: str, sender: str, nbytes: int) -> None:
        left = self._held.get((job, sender), 0) - nbytes
        if left > 0:
            self._held[(job, sender)] = left
        else:
            self._held.pop((job, sender), None)

    async def get(self, key: tuple, timeout: float, *, sender: str) -> tuple[TensorMessage, str]:
        """The message under `key` from `sender` (the one peer the plan names for it), waiting up to
        `timeout` seconds."""
        msg = self._take(key, sender)
        if msg is not None:
            return msg, sender
        fut = asyncio.get_running_loop().create_future()
        self._waiters[key] = (sender, fut)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise DeadlineError(
                f"no {key[0]!r} message for job {key[1]} step {key[2]} mb {key[3]} "
                f"stage {key[4]} from {sender[:12]}… within {timeout:.0f} s"
            ) from None
        finally:
            if self._waiters.get(key, (None, None))[1] is fut:
                del self._waiters[key]

    def fail_job(self, job: str, exc: BaseException) -> None:
        for key, (_sender, fut) in list(self._waiters.items()):
            if key[1] == job and not fut.done():
                fut.set_exception(exc)

    def drop_job(self, job: str) -> None:
        """Forgets the messages held for `job` (whoever serves it)."""
        for key in [k for k in self._items if k[1] == job]:
            for src, m in self._items.pop(key).items():
                self._unhold(job, src, message_bytes(m))

    def drop_before(self, job: str, stage: int, step: int, kinds: tuple[str, ...]) -> int:
        """Forgets the messages of `kinds` held for stage `stage` of `job` with a step below `step`
        (a fused stage's inputs fed ahead on a guess the round's close proved wrong: its steps only
        go up); returns how many."""
        keys = [k for k in self._items if k[1] == job and k[4] == stage and k[2] < step and k[0] in kinds]
        for key in keys:
            for src, m in self._items.pop(key).items():
                self._unhold(job, src, message_bytes(m))
        return len(keys)

    def held_bytes(self) -> int:
        return sum(self._held.values())

    def status(self) -> dict[str, Any]:
        return {
            "jobs": len(self._holders),
            "held_messages": sum(len(slot) for slot in self._items.values()),
            "held_bytes": self.held_bytes(),
            "dropped": dict(self.dropped),
        }
