"""Typed messages between peers over libp2p binary streams (hivemind's P2P).

Two protocols:
- ``/fusionnode/rpc/1``: one stream per call; the caller writes a ``Call``, the
  callee answers one ``Reply``. For small control messages.
- ``/fusionnode/data/1``: one long-lived stream per (sender, receiver) pair; the
  sender writes ``TensorMessage``s (activations, gradients, parameters, inputs),
  the receiver drops each into its ``Mailbox`` under a key, where a stage awaits it.

A message to ourselves never touches the wire. Every wait has a deadline.

Security (SECURITY.md): every inbound stream counts against its peer's `PeerLimits` (concurrent
streams, bytes in flight, RPC rate). With a `SwarmAuthorizer` (private swarm) the opener of a stream
first writes a small signed preamble (a ``Call`` to ``auth.open``, at most PREAUTH_MAX_FRAME_BYTES),
and every Call, Reply and TensorMessage carries a swarm MAC; a stream whose preamble or any message
fails is closed without a word, so an outsider learns nothing and makes us allocate at most 4 KiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from fusionnode.errors import DeadlineError, PeerError, ProtocolError
from fusionnode.security.auth import AUTH_FIELD, AuthenticationError, SwarmAuthorizer
from fusionnode.security.limits import DEFAULT_PEER_LIMITS, PeerLimiter, PeerLimits
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.messages import Call, Reply, TensorMessage
from fusionnode.wire.stream import read_message, write_message

logger = logging.getLogger(__name__)

PROTO_RPC = "/fusionnode/rpc/1"
PROTO_DATA = "/fusionnode/data/1"
MAX_PENDING_PER_JOB = 4096  # messages waiting in a mailbox for one job before the job is failed
MAX_PENDING_TOTAL = 16384  # messages waiting across all job ids (a peer may invent job ids)
PREAUTH_MAX_FRAME_BYTES = 4096  # bytes: largest first frame (the auth preamble) of a private-swarm stream
PREAUTH_TIMEOUT_S = 10.0  # seconds for the opener of a stream to deliver its preamble
AUTH_OPEN_METHOD = "auth.open"  # the preamble's Call.method
PREAUTH_LIMITS = Limits(max_frame_bytes=PREAUTH_MAX_FRAME_BYTES, max_string=1024, max_container_len=16)
RpcHandler = Callable[[dict[str, Any], str], Awaitable[dict[str, Any]]]
DataHandler = Callable[[TensorMessage, str], None]


def message_key(msg: TensorMessage) -> tuple:
    m = msg.meta
    return (
        msg.kind,
        str(m.get("job", "")),
        int(m.get("step", -1)),
        int(m.get("mb", -1)),
        int(m.get("stage", -1)),
    )


class Mailbox:
    """Messages keyed by (kind, job, step, mb, stage); a getter waits with a deadline."""

    def __init__(self) -> None:
        self._items: dict[tuple, tuple[TensorMessage, str]] = {}
        self._waiters: dict[tuple, asyncio.Future] = {}
        self._per_job: dict[str, int] = defaultdict(int)
        self._closed_jobs: set[str] = set()

    def put(self, msg: TensorMessage, sender: str) -> None:
        key = message_key(msg)
        job = key[1]
        if job in self._closed_jobs:
            return
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result((msg, sender))
            return
        if self._per_job[job] >= MAX_PENDING_PER_JOB:
            raise ProtocolError(f"too many pending messages for job {job!r}")
        if len(self._items) >= MAX_PENDING_TOTAL:
            raise ProtocolError("too many pending messages in the mailbox")
        self._items[key] = (msg, sender)
        self._per_job[job] += 1

    async def get(self, key: tuple, timeout: float) -> tuple[TensorMessage, str]:
        if key in self._items:
            self._per_job[key[1]] -= 1
            return self._items.pop(key)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise DeadlineError(
                f"no {key[0]!r} message for job {key[1]} step {key[2]} mb {key[3]} "
                f"stage {key[4]} within {timeout:.0f} s"
            ) from None
        finally:
            if self._waiters.get(key) is fut:
                del self._waiters[key]

    def fail_job(self, job: str, exc: BaseException) -> None:
        for key, fut in list(self._waiters.items()):
            if key[1] == job and not fut.done():
                fut.set_exception(exc)

    def drop_job(self, job: str) -> None:
        for key in [k for k in self._items if k[1] == job]:
            del self._items[key]
        self._per_job.pop(job, None)


class TokenBucket:
    """User-space bandwidth limit for one link (used where tc/netns is unavailable)."""

    def __init__(self, rate_bps: float, burst_bytes: int = 256 << 10):
        self.rate = rate_bps / 8.0  # bytes per second
        self.burst = burst_bytes
        self.tokens = float(burst_bytes)
        self.last = time.monotonic()

    async def take(self, nbytes: int) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            want = min(nbytes, self.burst)
            if self.tokens >= want:
                self.tokens -= want
                nbytes -= want
                if nbytes <= 0:
                    return
                continue
            await asyncio.sleep((want - self.tokens) / self.rate)


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
        self._tasks: set[asyncio.Task] = set()
        self.bytes_sent: dict[str, int] = defaultdict(int)  # per job id
        self.bytes_sent_to: dict[str, int] = defaultdict(int)  # per peer id
        self.rate_limits: dict[str, TokenBucket] = {}  # per destination peer
        self.egress_limit: TokenBucket | None = None  # every data stream this peer writes
        self.authorizer = authorizer
        self.peer_limiter = PeerLimiter(peer_limits)
        self.auth_refused: dict[str, int] = defaultdict(int)  # per peer id: streams closed for bad auth
        self._bad_streams: dict[str, int] = {}  # per peer id: malformed or refused streams (log throttle)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(PROTO_RPC, self._on_rpc_stream)
        await self.p2p.add_binary_stream_handler(PROTO_DATA, self._on_data_stream)

    async def close(self) -> None:
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
        handler = self._data_handlers.get(msg.kind)
        if handler is not None:
            handler(msg, sender)
        else:
            self.mailbox.put(msg, sender)

    # ---- RPC -----------------------------------------------------------------------------------
    def add_rpc(self, method: str, handler: RpcHandler) -> None:
        self._rpc[method] = handler

    async def call(
        self, peer_id: str, method: str, args: dict[str, Any] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        timeout = timeout or self.rpc_timeout
        if peer_id == self.peer_id:
            handler = self._rpc.get(method)
            if handler is None:
                raise PeerError(f"no RPC {method!r} here")
            return await asyncio.wait_for(handler(args or {}, self.peer_id), timeout)
        try:
            return await asyncio.wait_for(self._call_remote(peer_id, method, args or {}), timeout)
        except asyncio.TimeoutError:
            raise DeadlineError(
                f"peer {peer_id[:12]}… did not answer {method!r} within {timeout:.0f} s"
            ) from None

    async def _call_remote(self, peer_id: str, method: str, args: dict[str, Any]) -> dict[str, Any]:
        from hivemind.p2p import PeerID

        try:
            _info, reader, writer = await self.p2p.call_binary_stream_handler(
                PeerID.from_base58(peer_id), PROTO_RPC
            )
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
                raise PeerError(
                    f"peer {peer_id[:12]}… closed the {method!r} call unanswered "
                    "(a private swarm whose key this peer lacks, or a rate limit)"
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
            raise PeerError(f"peer {peer_id[:12]}… refused {method!r}: {reply.error}")
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
                    reply = Reply(ok=False, result={}, error=f"{type(exc).__name__}: {exc}")
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

        `observe(bytes, seconds)` gets the time the write took once the stream was ours."""
        if peer_id == self.peer_id:
            self._deliver(msg, self.peer_id)
            return 0
        job = str(msg.meta.get("job", ""))
        async with self._out_locks[peer_id]:
            for attempt in (0, 1):
                stream = self._out.get(peer_id)
                try:
                    if stream is None:
                        stream = await self._open_data(peer_id)
                    bucket = self.rate_limits.get(peer_id) or self.egress_limit
                    signed = msg
                    if self.authorizer is not None:
                        signed = self.authorizer.sign(msg, self.peer_id, peer_id)
                    t0 = time.perf_counter()
                    if bucket is not None:
                        n = await self._write_limited(stream[1], signed, bucket)
                    else:
                        n = await write_message(stream[1], signed)
                    self.bytes_sent[job] += n
                    self.bytes_sent_to[peer_id] += n
                    if observe is not None:
                        observe(n, time.perf_counter() - t0)
                    return n
                except (ConnectionError, OSError, PeerError) as exc:
                    self._out.pop(peer_id, None)
                    if attempt == 1:
                        raise PeerError(f"cannot send {msg.kind!r} to peer {peer_id[:12]}…: {exc}") from exc
        raise AssertionError("unreachable")

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
        from hivemind.p2p import PeerID

        try:
            _info, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), PROTO_DATA), self.rpc_timeout
            )
        except Exception as exc:
            raise PeerError(f"cannot open a data stream to {peer_id[:12]}…: {exc}") from exc
        await self._write_preamble(writer, peer_id, PROTO_DATA)
        self._out[peer_id] = (reader, writer)
        return reader, writer

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
                    self._deliver(msg, sender)
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
        }
