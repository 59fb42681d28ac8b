"""Typed messages between peers over libp2p binary streams (hivemind's P2P).

Two protocols:
- ``/fusionnode/rpc/1``: one stream per call; the caller writes a ``Call``, the
  callee answers one ``Reply``. For small control messages.
- ``/fusionnode/data/2``: one long-lived stream per (sender, receiver) pair; the
  sender opens it with a ``data.open`` Call (its session id and the sequence number of the
  stream's first message), then writes ``TensorMessage``s (activations, gradients, parameters,
  inputs), numbered implicitly from there; the receiver drops each into its ``Mailbox`` under a
  key, where a stage awaits it, and acknowledges it with its sequence number (8 bytes, big
  endian). A stream that breaks with messages unacknowledged (a libp2p stream reset) is
  reopened and those messages are written again; the receiver skips the ones it had already
  delivered (numbers at or below the last it delivered for that session), so each message is
  delivered once.

A message to ourselves never touches the wire. Every wait has a deadline.

Security (SECURITY.md): every inbound stream counts against its peer's `PeerLimits` (concurrent
streams, bytes in flight, RPC rate). With a `SwarmAuthorizer` (private swarm) the opener of a stream
first writes a small signed preamble (a ``Call`` to ``auth.open``, at most PREAUTH_MAX_FRAME_BYTES),
and every Call, Reply and TensorMessage carries a swarm MAC; a stream whose preamble or any message
fails is closed without a word, so an outsider learns nothing and makes us allocate at most 4 KiB.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import struct
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from fusionnode.errors import DeadlineError, PeerError, ProtocolError
from fusionnode.runtime.mailbox import Mailbox, message_key
from fusionnode.runtime.shaping import TokenBucket
from fusionnode.security.auth import AUTH_FIELD, AuthenticationError, SwarmAuthorizer
from fusionnode.security.limits import DEFAULT_PEER_LIMITS, PeerLimiter, PeerLimits
from fusionnode.wire.job import ErrorCode, JobError, Rpc, error_result, remote_error
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.messages import Call, Reply, TensorMessage
from fusionnode.wire.stream import read_message, write_message

logger = logging.getLogger(__name__)

PROTO_RPC = "/fusionnode/rpc/1"
PROTO_DATA = "/fusionnode/data/2"
DATA_OPEN_METHOD = Rpc.DATA_OPEN  # the Call that opens a data stream: {"session": hex, "first": seq}
ACK = struct.Struct(">Q")  # a data stream's acknowledgement: the sequence number delivered
MAX_RESENDS = 3  # times a message is written again on a new stream before it is given up
MAX_SESSIONS = 4096  # senders' sessions whose last delivered sequence number a receiver remembers
MAX_UNACKED = 1024  # messages per receiver kept for a resend; beyond, the oldest are let go (a peer
# that never acknowledges cannot make us hold everything we ever sent it)
PREAUTH_MAX_FRAME_BYTES = 4096  # bytes: largest first frame (the auth preamble) of a private-swarm stream
PREAUTH_TIMEOUT_S = 10.0  # seconds for the opener of a stream to deliver its preamble
AUTH_OPEN_METHOD = "auth.open"  # the preamble's Call.method
PREAUTH_LIMITS = Limits(max_frame_bytes=PREAUTH_MAX_FRAME_BYTES, max_string=1024, max_container_len=16)
RpcHandler = Callable[[dict[str, Any], str], Awaitable[dict[str, Any]]]
DataHandler = Callable[[TensorMessage, str], None]


DIRECT_MIN_BPS = 200e6  # bits/s: links known to be slower than this keep libp2p for their data streams
PATHS = ("direct", "libp2p", "relayed")  # a data stream's path: TCP + TLS, p2pd, p2pd over a relay
UNANSWERED = "call unanswered"  # in the error of a call whose stream closed before its reply


def unanswered(exc: BaseException, method: str) -> bool:
    """Whether `exc` says that this very call closed unanswered (not a refusal quoting another call
    the peer made in turn that did)."""
    head = str(exc).split(" (", 1)[0]
    return (
        head.startswith("peer ")
        and " refused " not in head
        and head.endswith(f"closed the {method!r} {UNANSWERED}")
    )


class Transport:
    def __init__(
        self,
        p2p: Any,
        *,
        rpc_timeout: float = 30.0,
        limits: Limits = DEFAULT_LIMITS,
        authorizer: SwarmAuthorizer | None = None,
        peer_limits: PeerLimits = DEFAULT_PEER_LIMITS,
    ):
        self.p2p = p2p
        self.peer_id = str(p2p.peer_id)
        self.rpc_timeout = rpc_timeout
        self.limits = limits
        self.mailbox = Mailbox()
        self._rpc: dict[str, RpcHandler] = {}
        self._data_handlers: dict[str, DataHandler] = {}
        self._out: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._out_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.session = secrets.token_hex(8)  # numbers this process's data messages, per receiver
        self._next_seq: dict[str, int] = defaultdict(int)  # per receiver: the next message's number
        self._unacked: dict[str, collections.deque] = defaultdict(collections.deque)  # [seq, msg, tries]
        self._delivered: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self.resent: dict[str, int] = defaultdict(int)  # per peer id: messages written again
        self._tasks: set[asyncio.Task] = set()
        self.bytes_sent: dict[str, int] = defaultdict(int)  # per job id
        self.bytes_sent_to: dict[str, int] = defaultdict(int)  # per peer id
        self.rate_limits: dict[str, TokenBucket] = {}  # per destination peer
        self.egress_limit: TokenBucket | None = None  # every data stream this peer writes
        self.authorizer = authorizer
        self.peer_limiter = PeerLimiter(peer_limits)
        self.auth_refused: dict[str, int] = defaultdict(int)  # per peer id: streams closed for bad auth
        self._bad_streams: dict[str, int] = {}  # per peer id: malformed or refused streams (log throttle)
        self.reach: Any = None  # swarm/reachability.py Reachability: dials peers behind NAT via relays
        self.direct: Any = None  # runtime/direct.py DirectPath: data streams over TCP + TLS when it can
        self.direct_book: Callable[[str], list[str]] | None = None  # peer id -> its direct addresses
        self.paths: dict[str, str] = {}  # per peer id: the last data stream's path (PATHS)
        self.path_bytes: dict[str, dict[str, int]] = defaultdict(
            lambda: defaultdict(int)
        )  # peer -> path -> bytes
        self.declared_bps: dict[str, float] = {}  # per peer id: link bandwidth we were told (not measured)
        # links known to be slower keep libp2p (nothing to gain). Known means capped by our own rate limit
        # or declared to us, never probed: a probe runs over libp2p and so measures p2pd's throughput as
        # much as the link's (a 1 MiB probe on a loaded machine reads under 200 Mbit/s on a 10 Gbit/s
        # veth), which is just where the direct path gains most
        self.direct_min_bps = DIRECT_MIN_BPS

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(PROTO_RPC, self._on_rpc_stream)
        await self.p2p.add_binary_stream_handler(PROTO_DATA, self._on_data_stream)

    async def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
        for _reader, writer in list(self._out.values()):
            writer.close()
        self._out.clear()
        for task in list(self._tasks):
            task.cancel()

    def set_rate_limit(self, peer_id: str, rate_bps: float | None) -> None:
        if rate_bps:
            self.rate_limits[peer_id] = TokenBucket(rate_bps)
        else:
            self.rate_limits.pop(peer_id, None)

    def on_data(self, kind: str, handler: DataHandler) -> None:
        """Data messages of this kind go to `handler(msg, sender)` instead of the mailbox."""
        self._data_handlers[kind] = handler

    def _deliver(self, msg: TensorMessage, sender: str) -> None:
        message_key(msg)  # a meta of the wrong shape is refused here, for handlers too
        handler = self._data_handlers.get(msg.kind)
        if handler is not None:
            handler(msg, sender)
        else:
            self.mailbox.put(msg, sender)

    # ---- RPC -----------------------------------------------------------------------------------
    def add_rpc(self, method: str, handler: RpcHandler) -> None:
        self._rpc[method] = handler

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
        """Calls `method` on a peer. When the call's stream closes before its reply (a rare libp2p
        stream reset, the peer alive and its work done), it asks once more: the same method if it is
        `idempotent` (runs twice without harm), else `recall`, a method that returns the result of the
        work already done (say `job.step_result` for `job.step`); with neither, it raises."""
        timeout = timeout or self.rpc_timeout
        if peer_id == self.peer_id:
            handler = self._rpc.get(method)
            if handler is None:
                raise PeerError(f"no RPC {method!r} here")
            return await asyncio.wait_for(handler(args or {}, self.peer_id), timeout)
        again = method if idempotent else recall
        name = method
        for attempt in (0, 1):
            try:
                return await asyncio.wait_for(self._call_remote(peer_id, name, args or {}), timeout)
            except TimeoutError:
                raise DeadlineError(
                    f"peer {peer_id[:12]}… did not answer {name!r} within {timeout:.0f} s"
                ) from None
            except PeerError as exc:
                if not (again and attempt == 0 and unanswered(exc, method)):
                    raise
                logger.warning("%s; asking again with %s", exc, again)
                name = again
        raise AssertionError("unreachable")

    async def _open_stream(self, peer_id: str, proto: str) -> tuple[Any, Any, Any]:
        """A libp2p stream to `peer_id`; when p2pd cannot dial it, once more after connecting through
        the relays the peer advertises (a peer behind NAT, swarm/reachability.py)."""
        from hivemind.p2p import PeerID

        try:
            return await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), proto)
        except Exception:
            if self.reach is None or not await self.reach.dial(self.p2p, peer_id):
                raise
        return await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), proto)

    async def _call_remote(self, peer_id: str, method: str, args: dict[str, Any]) -> dict[str, Any]:
        try:
            _info, reader, writer = await self._open_stream(peer_id, PROTO_RPC)
        except Exception as exc:
            raise PeerError(f"cannot reach peer {peer_id[:12]}… for {method!r}: {exc}") from exc
        try:
            await self._write_preamble(writer, peer_id, PROTO_RPC)
            call = Call(method=method, args=args)
            if self.authorizer is not None:
                call = self.authorizer.sign(call, self.peer_id, peer_id)
            await write_message(writer, call)
            reply = await read_message(reader, self.limits)
        except (ConnectionError, OSError) as exc:
            raise PeerError(f"peer {peer_id[:12]}… dropped the {method!r} call: {exc}") from exc
        except ProtocolError as exc:
            if "truncated" in str(exc):  # a private swarm closes unanswered on peers without its key
                raise JobError(
                    ErrorCode.UNANSWERED,
                    f"peer {peer_id[:12]}… closed the {method!r} {UNANSWERED} "
                    "(a stream reset, a private swarm whose key this peer lacks, or a rate limit)",
                ) from exc
            raise
        finally:
            writer.close()
        if not isinstance(reply, Reply):
            raise ProtocolError(f"expected a Reply to {method!r}, got {type(reply).__name__}")
        if self.authorizer is not None:
            reply, _ = self.authorizer.verify(
                reply, peer_id, self.peer_id, context=call.args[AUTH_FIELD]["nonce"]
            )
        if not reply.ok:
            raise remote_error(f"peer {peer_id[:12]}… refused {method!r}: {reply.error}", reply.result)
        return dict(reply.result)

    async def _on_rpc_stream(
        self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sender = str(info.peer_id)
        if not self.peer_limiter.open_stream(sender):
            writer.close()
            return
        reserved = [0]
        nonce = b""
        try:
            if not self.peer_limiter.allow_call(sender):
                return  # over its RPC rate: closed unanswered
            await self._read_preamble(reader, sender, PROTO_RPC)
            msg = await read_message(
                reader, self.limits, timeout=self.rpc_timeout, admit=self._admitter(sender, reserved)
            )
            if self.authorizer is not None:
                msg, nonce = self.authorizer.verify(msg, sender, self.peer_id)
            if not isinstance(msg, Call):
                raise ProtocolError(f"expected a Call, got {type(msg).__name__}")
            handler = self._rpc.get(msg.method)
            if handler is None:
                reply = Reply(ok=False, result={}, error=f"unknown method {msg.method!r}")
            else:
                try:
                    result = await handler(dict(msg.args), sender)
                    reply = Reply(ok=True, result=result or {}, error="")
                except Exception as exc:
                    if not isinstance(exc, (PeerError, ProtocolError, ValueError)):
                        logger.exception("RPC %s from %s failed", msg.method, sender[:12])
                    reply = Reply(ok=False, result=error_result(exc), error=f"{type(exc).__name__}: {exc}")
            await write_message(writer, self._sign_reply(reply, sender, nonce))
        except AuthenticationError as exc:
            self._refuse_auth(sender, exc)
        except (ProtocolError, DeadlineError) as exc:
            self._log_bad(sender, "bad RPC stream", exc)
            with contextlib.suppress(Exception):
                err = Reply(ok=False, result={}, error=f"ProtocolError: {exc}")
                await write_message(writer, self._sign_reply(err, sender, nonce))
        except (ConnectionError, OSError) as exc:
            logger.debug("RPC stream from %s dropped: %r", sender[:12], exc)
        except BaseException as exc:  # cancelled mid-call: the caller sees the stream close unanswered
            logger.warning("RPC from %s aborted before its reply: %r", sender[:12], exc)
            raise
        finally:
            if reserved[0]:
                self.peer_limiter.release(sender, reserved[0])
            self.peer_limiter.close_stream(sender)
            writer.close()

    def _sign_reply(self, reply: Reply, receiver: str, call_nonce: bytes) -> Reply:
        if self.authorizer is None:
            return reply
        return self.authorizer.sign(reply, self.peer_id, receiver, context=call_nonce)

    # ---- data plane ----------------------------------------------------------------------------
    async def send(
        self, peer_id: str, msg: TensorMessage, observe: Callable[[int, float], None] | None = None
    ) -> int:
        """Sends one TensorMessage; returns the bytes written on the wire (0 to ourselves).

        `observe(bytes, seconds)` gets the time the write took once the stream was ours. The message
        stays queued until the receiver acknowledges it: if the stream breaks first, it is written
        again on a new one (see the module docstring)."""
        if peer_id == self.peer_id:
            self._deliver(msg, self.peer_id)
            return 0
        job = str(msg.meta.get("job", ""))
        async with self._out_locks[peer_id]:
            pending = self._unacked[peer_id]
            entry = [self._next_seq[peer_id], msg, 0, 0]  # seq, message, times written, bytes
            self._next_seq[peer_id] += 1
            pending.append(entry)
            while len(pending) > MAX_UNACKED:
                pending.popleft()
            t0 = time.perf_counter()
            for attempt in (0, 1):
                try:
                    stream = self._out.get(peer_id)
                    if stream is None:
                        await self._open_data(peer_id)  # writes every pending message, this one too
                    else:
                        entry[3] = await self._write_data(peer_id, stream[1], msg)
                        entry[2] += 1
                    break
                except (ConnectionError, OSError, PeerError) as exc:
                    self._drop_out(peer_id)
                    if attempt == 1:
                        if pending and pending[-1] is entry:  # not sent: take its number back
                            pending.pop()
                            self._next_seq[peer_id] -= 1
                        raise PeerError(f"cannot send {msg.kind!r} to peer {peer_id[:12]}…: {exc}") from exc
            self.bytes_sent[job] += entry[3]
            if observe is not None:
                observe(entry[3], time.perf_counter() - t0)
            return entry[3]

    async def _write_data(self, peer_id: str, writer: asyncio.StreamWriter, msg: TensorMessage) -> int:
        bucket = self.rate_limits.get(peer_id) or self.egress_limit
        signed = self.authorizer.sign(msg, self.peer_id, peer_id) if self.authorizer is not None else msg
        if bucket is not None:
            n = await self._write_limited(writer, signed, bucket)
        else:
            n = await write_message(writer, signed)
        self.bytes_sent_to[peer_id] += n
        self.path_bytes[peer_id][self.paths.get(peer_id, "libp2p")] += n
        if len(self.path_bytes) > 4096:
            self.path_bytes.pop(next(iter(self.path_bytes)))
        return n

    def _drop_out(self, peer_id: str) -> None:
        stream = self._out.pop(peer_id, None)
        if stream is not None:
            stream[1].close()

    async def _write_limited(
        self, writer: asyncio.StreamWriter, msg: TensorMessage, bucket: TokenBucket
    ) -> int:
        from fusionnode.wire.messages import encode_message

        data = encode_message(msg)
        chunk = 64 << 10
        for i in range(0, len(data), chunk):
            piece = data[i : i + chunk]
            await bucket.take(len(piece))
            writer.write(piece)
            await writer.drain()
        return len(data)

    async def _open_data(self, peer_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new data stream to peer_id; the messages still unacknowledged are written on it first."""
        opened = await self._open_direct(peer_id)
        if opened is not None:
            reader, writer = opened
            self.paths[peer_id] = "direct"
        else:
            try:
                _info, reader, writer = await asyncio.wait_for(
                    self._open_stream(peer_id, PROTO_DATA), self.rpc_timeout
                )
            except Exception as exc:
                raise PeerError(f"cannot open a data stream to {peer_id[:12]}…: {exc}") from exc
            self.paths[peer_id] = (
                "relayed" if self.reach is not None and self.reach.is_relayed(peer_id) else "libp2p"
            )
        await self._write_preamble(writer, peer_id, PROTO_DATA)
        pending = self._unacked[peer_id]
        while pending and pending[0][2] >= MAX_RESENDS:  # the oldest were written the most often
            _seq, lost, _tries, _n = pending.popleft()
            logger.warning(
                "giving up %r (step %s) to %s: %d streams broke under it",
                lost.kind,
                lost.meta.get("step"),
                peer_id[:12],
                MAX_RESENDS,
            )
        # the messages this stream carries first, taken with their first number at once: an older
        # stream's acknowledgements may still drop some from `pending` while we write
        entries = list(pending)
        first = entries[0][0] if entries else self._next_seq[peer_id]
        await write_message(
            writer, Call(method=DATA_OPEN_METHOD, args={"session": self.session, "first": first})
        )
        self._out[peer_id] = (reader, writer)
        self._spawn(self._read_acks(peer_id, reader, writer))
        for entry in entries:  # in order: the receiver numbers them from `first`
            if entry[2] > 0:
                self.resent[peer_id] += 1
            entry[3] = await self._write_data(peer_id, writer, entry[1])
            entry[2] += 1
        return reader, writer

    def known_bps(self, peer_id: str) -> float | None:
        """The link's bandwidth to `peer_id` in bits/s as far as we know it: declared to us
        (set_link_limits' `declared`), and never above a rate limit we apply to it ourselves; None when
        nothing is known (the direct path is then tried). Probes do not count (see `direct_min_bps`)."""
        bps = self.declared_bps.get(peer_id)
        bucket = self.rate_limits.get(peer_id) or self.egress_limit
        if bucket is not None:
            bps = min(bps, bucket.rate * 8) if bps is not None else bucket.rate * 8
        return bps

    async def _open_direct(self, peer_id: str) -> tuple[Any, Any] | None:
        """A data stream to `peer_id` over the direct path when both ends have one and it is not a
        relayed peer; None (libp2p then) when it cannot be had. A failed dial is logged once with its
        reason and the peer stays on libp2p for `RETRY_AFTER_S`."""
        from fusionnode.runtime.direct import RETRY_AFTER_S

        if self.direct is None or self.direct_book is None:
            return None
        if self.reach is not None and self.reach.is_relayed(peer_id):
            return None  # never direct over a relay: the peer cannot be dialled directly
        bps = self.known_bps(peer_id)
        if bps is not None and bps < self.direct_min_bps:
            return None  # a slow link: nothing to gain off libp2p
        failed = self.direct.failed.get(peer_id)
        if failed is not None and time.monotonic() - failed[0] < RETRY_AFTER_S:
            return None
        addrs = self.direct_book(peer_id)
        if not addrs:
            return None
        try:
            return await self.direct.dial(peer_id, addrs)
        except PeerError as exc:
            if failed is None or failed[1] != str(exc):
                logger.warning("direct path to %s failed, using libp2p: %s", peer_id[:12], exc)
            self.direct.failed[peer_id] = (time.monotonic(), str(exc))
            if len(self.direct.failed) > 4096:
                self.direct.failed.pop(next(iter(self.direct.failed)))
            return None

    async def _read_acks(
        self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Drops acknowledged messages; when the stream breaks with some unacknowledged, opens a new
        one, which writes them again."""
        pending = self._unacked[peer_id]
        try:
            while True:
                (seq,) = ACK.unpack(await reader.readexactly(ACK.size))
                while pending and pending[0][0] <= seq:
                    pending.popleft()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        current = self._out.get(peer_id)
        if current is not None and current[1] is not writer:
            return  # a newer stream already carries this peer's messages
        if current is not None:
            self._drop_out(peer_id)
        if not pending:
            return
        logger.warning(
            "data stream to %s broke with %d message(s) unacknowledged: resending", peer_id[:12], len(pending)
        )
        try:
            async with self._out_locks[peer_id]:
                if peer_id not in self._out:
                    await self._open_data(peer_id)
        except (ConnectionError, OSError, PeerError) as exc:
            self._drop_out(peer_id)
            logger.warning("cannot resend %d message(s) to %s: %s", len(pending), peer_id[:12], exc)
            pending.clear()  # the receiver's stage will time out waiting and the step is replayed

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_data_stream(
        self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sender = str(info.peer_id)
        if not self.peer_limiter.open_stream(sender):
            writer.close()
            return
        reserved = [0]
        admit = self._admitter(sender, reserved)
        try:
            await self._read_preamble(reader, sender, PROTO_DATA)
            hello = await read_message(reader, PREAUTH_LIMITS, timeout=PREAUTH_TIMEOUT_S)
            if not isinstance(hello, Call) or hello.method != DATA_OPEN_METHOD:
                raise ProtocolError("a data stream must open with a data.open call")
            session, seq = hello.args.get("session"), hello.args.get("first")
            if not (
                isinstance(session, str)
                and 0 < len(session) <= 64
                and isinstance(seq, int)
                and not isinstance(seq, bool)
                and 0 <= seq < 1 << 62
            ):
                raise ProtocolError(f"bad data.open {hello.args!r:.200}")
            key = (sender, session)
            while True:
                try:
                    msg = await read_message(reader, self.limits, admit=admit)
                except ProtocolError as exc:
                    if "truncated" in str(exc) or "closed" in str(exc) or "empty" in str(exc):
                        return  # the sender closed its stream
                    raise
                try:
                    if self.authorizer is not None:
                        msg, _ = self.authorizer.verify(msg, sender, self.peer_id)
                    if not isinstance(msg, TensorMessage):
                        raise ProtocolError(
                            f"expected a TensorMessage on the data stream, got {type(msg).__name__}"
                        )
                    if seq > self._delivered.get(key, -1):  # not a copy of one delivered before a break
                        try:
                            self._deliver(msg, sender)
                        except (ValueError, TypeError, KeyError, OverflowError) as exc:  # a handler's input
                            raise ProtocolError(f"data message {msg.kind!r} refused: {exc}") from exc
                        self._delivered[key] = seq
                        self._delivered.move_to_end(key)
                        if len(self._delivered) > MAX_SESSIONS:
                            self._delivered.popitem(last=False)
                    writer.write(ACK.pack(seq))
                    seq += 1
                finally:
                    self.peer_limiter.release(sender, reserved[0])
                    reserved[0] = 0
        except AuthenticationError as exc:
            self._refuse_auth(sender, exc)
        except ProtocolError as exc:
            self._log_bad(sender, "closing data stream", exc)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, DeadlineError):
            pass
        finally:
            if reserved[0]:
                self.peer_limiter.release(sender, reserved[0])
            self.peer_limiter.close_stream(sender)
            writer.close()

    # ---- limits and authentication (SECURITY.md) -----------------------------------------------
    def _admitter(self, sender: str, reserved: list[int]) -> Callable[[int], Awaitable[None]]:
        """`read_message`'s admit hook: takes the frame's bytes from the sender's in-flight budget."""

        async def admit(nbytes: int) -> None:
            await self.peer_limiter.reserve(sender, nbytes)
            reserved[0] += nbytes

        return admit

    def preamble_hooks(self) -> tuple[Any, Any] | None:
        """(write, read) of the signed stream preamble, for handlers outside the Transport (link probes);
        None in a public swarm."""
        if self.authorizer is None:
            return None
        return self._write_preamble, self._read_preamble

    async def _write_preamble(self, writer: asyncio.StreamWriter, receiver: str, proto: str) -> None:
        if self.authorizer is not None:
            hello = self.authorizer.sign(
                Call(method=AUTH_OPEN_METHOD, args={}), self.peer_id, receiver, context=proto.encode()
            )
            await write_message(writer, hello)

    async def _read_preamble(self, reader: asyncio.StreamReader, sender: str, proto: str) -> None:
        """Private swarms: the first frame must be a small signed auth.open; anything else is refused."""
        if self.authorizer is None:
            return
        try:
            msg = await read_message(reader, PREAUTH_LIMITS, timeout=PREAUTH_TIMEOUT_S)
        except ProtocolError as exc:  # oversized, garbage, truncated: all the same to an outsider
            raise AuthenticationError(f"no valid auth preamble: {exc}") from exc
        if not isinstance(msg, Call) or msg.method != AUTH_OPEN_METHOD:
            raise AuthenticationError("stream did not open with an auth preamble")
        self.authorizer.verify(msg, sender, self.peer_id, context=proto.encode())

    def _refuse_auth(self, sender: str, exc: Exception) -> None:
        self.auth_refused[sender] += 1
        if len(self.auth_refused) > 4096:
            self.auth_refused.pop(next(iter(self.auth_refused)))
        self._log_bad(sender, "refused a stream", exc)

    def _log_bad(self, sender: str, what: str, exc: Exception) -> None:
        """A warning for a peer's 1st, 2nd, 4th, 8th ... bad stream; debug otherwise (no log floods)."""
        n = self._bad_streams[sender] = self._bad_streams.get(sender, 0) + 1
        if len(self._bad_streams) > 4096:
            self._bad_streams.pop(next(iter(self._bad_streams)))
        level = logging.WARNING if n & (n - 1) == 0 else logging.DEBUG
        logger.log(level, "%s from %s (bad stream #%d from this peer): %s", what, sender[:12], n, exc)

    def security_status(self) -> dict[str, Any]:
        """For the node's status: authentication and per-peer limit counters."""
        return {
            "private_swarm": self.authorizer is not None,
            "auth": self.authorizer.status() if self.authorizer is not None else None,
            "auth_refused_streams": dict(self.auth_refused),
            "peer_limits": self.peer_limiter.status(),
            "mailbox": self.mailbox.status(),
            "direct": self.direct.status() if self.direct is not None else None,
            "paths": dict(list(self.paths.items())[:256]),
            "path_bytes": {p: dict(v) for p, v in list(self.path_bytes.items())[:256]},
        }
