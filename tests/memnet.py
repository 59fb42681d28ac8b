"""An in-memory network for component tests: the transport interface the driver, workers and optimizer
hosts use (call / add_rpc / send / on_data / mailbox), without p2pd or sockets.

Every call, reply and data message is encoded to a real frame and decoded on the other side
(wire/messages.py), a refusal travels as `Reply{ok: false, result: {code, blame}}` like on the real
transport, and data messages land in the receiver's real `Mailbox` (sender binding, budgets), so
what the components exchange is exactly what crosses the wire, minus the network.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from fusionnode.errors import DeadlineError, PeerError
from fusionnode.runtime.mailbox import Mailbox, message_key
from fusionnode.runtime.transport import UNANSWERED, unanswered
from fusionnode.wire import Call, Reply, TensorMessage, decode_message, encode_message
from fusionnode.wire.job import ErrorCode, JobError, error_result, remote_error


class MemNet:
    """Peers by id; `down` ones neither answer calls nor take messages."""

    def __init__(self) -> None:
        self.peers: dict[str, MemTransport] = {}
        self.down: set[str] = set()
        # (peer, method) -> how many of its next calls lose their reply after the handler ran (a
        # stream reset): the caller then asks again as the real Transport.call does
        self.lose_replies: dict[tuple[str, str], int] = {}

    def join(self, peer_id: str, rpc_timeout: float = 30.0) -> MemTransport:
        t = MemTransport(self, peer_id, rpc_timeout)
        self.peers[peer_id] = t
        return t

    def reach(self, peer_id: str, what: str) -> MemTransport:
        t = self.peers.get(peer_id)
        if t is None or peer_id in self.down:
            raise PeerError(f"cannot reach peer {peer_id[:12]}… for {what!r}: gone")
        return t


class MemTransport:
    def __init__(self, net: MemNet, peer_id: str, rpc_timeout: float):
        self.net = net
        self.peer_id = peer_id
        self.rpc_timeout = rpc_timeout
        self.mailbox = Mailbox()
        self._rpc: dict[str, Any] = {}
        self._data: dict[str, Any] = {}
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.calls: list[str] = []  # methods this peer was called with, in order

    def add_rpc(self, method: str, handler: Any) -> None:
        self._rpc[method] = handler

    def on_data(self, kind: str, handler: Any) -> None:
        self._data[kind] = handler

    async def call(
        self,
        peer_id: str,
        method: str,
        args: dict[str, Any] | None = None,
        timeout: float | None = None,
        *,
        idempotent: bool = False,
        recall: str | None = None,
    ) -> dict[str, Any]:
        again = method if idempotent else recall
        try:
            return await self._call(peer_id, method, args, timeout)
        except JobError as exc:
            if not (again and unanswered(exc, method)):
                raise
        return await self._call(peer_id, again, args, timeout)

    async def _call(
        self, peer_id: str, method: str, args: dict[str, Any] | None, timeout: float | None
    ) -> Any:
        timeout = timeout or self.rpc_timeout
        target = self.net.reach(peer_id, method)
        call = decode_message(encode_message(Call(method, args or {})))
        target.calls.append(call.method)
        handler = target._rpc.get(call.method)
        if handler is None:
            reply = Reply(False, {}, f"unknown method {call.method!r}")
        else:
            try:
                result = await asyncio.wait_for(handler(dict(call.args), self.peer_id), timeout)
                reply = Reply(True, result or {}, "")
            except TimeoutError:
                raise DeadlineError(
                    f"peer {peer_id[:12]}… did not answer {method!r} within {timeout:.0f} s"
                ) from None
            except Exception as exc:
                reply = Reply(False, error_result(exc), f"{type(exc).__name__}: {exc}")
        if peer_id in self.net.down:
            raise PeerError(f"peer {peer_id[:12]}… dropped the {method!r} call: gone")
        lost = self.net.lose_replies.get((peer_id, method), 0)
        if lost > 0:
            self.net.lose_replies[(peer_id, method)] = lost - 1
            raise JobError(
                ErrorCode.UNANSWERED,
                f"peer {peer_id[:12]}… closed the {method!r} {UNANSWERED} (a stream reset)",
            )
        reply = decode_message(encode_message(reply))
        if not reply.ok:
            raise remote_error(f"peer {peer_id[:12]}… refused {method!r}: {reply.error}", reply.result)
        return dict(reply.result)

    async def send(self, peer_id: str, msg: TensorMessage, observe: Any = None) -> int:
        if peer_id == self.peer_id:
            self._deliver(msg, peer_id)
            return 0
        target = self.net.reach(peer_id, msg.kind)
        frame = encode_message(msg)
        target._deliver(decode_message(bytearray(frame)), self.peer_id)
        self.bytes_sent[str(msg.meta.get("job", ""))] += len(frame)
        if observe is not None:
            observe(len(frame), 1e-4)
        await asyncio.sleep(0)
        return len(frame)

    def _deliver(self, msg: TensorMessage, sender: str) -> None:
        message_key(msg)
        handler = self._data.get(msg.kind)
        if handler is not None:
            handler(msg, sender)
        else:
            self.mailbox.put(msg, sender)
