"""The direct fast path: tensor streams over TCP + TLS 1.3 between peers that can dial each other.

p2pd carries a stream at a fraction of plain TCP (`fusionnode bench wire`); peers on one LAN or with
public addresses move their data streams (``/fusionnode/data/2``: the same framing, limits,
acknowledgements and replay as over libp2p, runtime/transport.py) to a direct connection and keep
libp2p for discovery, NAT traversal, control RPCs and relayed links.

Authentication, keyed to the libp2p identities:
- the listener's TLS certificate carries the node's identity key (the RSA key whose hash is its peer
  id). The dialer checks that the key in the certificate hashes to the peer id it meant to reach, so
  only the holder of that identity completes the handshake (TLS 1.3 proves possession).
- the listener then sends a fresh 32-byte nonce; the dialer answers with its public key and an RSA-PSS
  signature over the nonce, the listener's peer id and certificate: the listener learns the dialer's
  peer id, bound to this very connection, before it reads anything else.
- in a private swarm the stream then opens with the same signed preamble as a libp2p stream (the
  swarm MAC) and every message carries its MAC: a peer without the swarm key is refused as on libp2p.
An outsider that connects gets a nonce and nothing else; a wrong signature, an oversized hello or
silence past `HELLO_TIMEOUT_S` closes the connection (tests/test_direct.py).

I/O: the TLS socket is blocking and driven by two threads per connection (OpenSSL releases the GIL
while it encrypts and decrypts), presented to the Transport as an asyncio reader/writer pair whose
threads meet the event loop once per message (a frame's payload is read straight into the frame).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import os
import queue
import select
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fusionnode.errors import PeerError

logger = logging.getLogger(__name__)

DIRECT_TAG = "/tls/fusionnode-direct"  # suffix of the address a node advertises for its direct path
CONTEXT = b"fusionnode-direct/1"
NONCE_BYTES = 32
MAX_HELLO_BYTES = 4096  # dialer's public key + signature
HELLO_TIMEOUT_S = 5.0  # seconds for a dialer to finish the handshake and its hello
DIAL_TIMEOUT_S = 3.0  # seconds to connect and authenticate before falling back to libp2p
RETRY_AFTER_S = 300.0  # seconds a peer whose direct dial failed stays on libp2p
MAX_PENDING_HANDSHAKES = 64  # inbound connections still in their handshake; more are closed at once
HIGH_WATER = 8 << 20  # bytes queued for the writer thread before drain() waits
LOW_WATER = 4 << 20  # a waiting drain() resumes once the queue is down to this
READ_AHEAD = 256 << 10  # bytes the reader thread may read past what was asked (read(), frame headers)
RECORD = 16 << 10  # a full TLS record's plaintext: data arriving in these is a bulk transfer
LINGER_S = 0.0005  # read(n) during a bulk transfer waits this long for more before handing over
_LEN = struct.Struct(">H")


def direct_addr(ip: str, port: int) -> str:
    return f"/ip4/{ip}/tcp/{port}{DIRECT_TAG}"


def parse_direct_addr(addr: str) -> tuple[str, int] | None:
    if not addr.endswith(DIRECT_TAG):
        return None
    parts = addr[: -len(DIRECT_TAG)].split("/")
    if len(parts) != 5 or parts[1] != "ip4" or parts[3] != "tcp":
        return None
    try:
        port = int(parts[4])
    except ValueError:
        return None
    return (parts[2], port) if 0 < port < 65536 else None


# ---- identity ---------------------------------------------------------------------------------------


def _crypto_key(private_key: Any) -> Any:
    return getattr(private_key, "_private_key", private_key)  # hivemind's RSAPrivateKey wraps cryptography's


def peer_id_of_der(public_der: bytes) -> str:
    """libp2p peer id of an RSA public key (as fusionnode.swarm.identity derives it): multihash(sha2-256,
    protobuf PublicKey{RSA, SubjectPublicKeyInfo DER})."""
    import multihash
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_der).SerializeToString()
    return PeerID(
        multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    ).to_base58()


def _public_der(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _signed_bytes(nonce: bytes, listener_id: str, cert_der: bytes) -> bytes:
    return CONTEXT + nonce + listener_id.encode() + hashlib.sha256(cert_der).digest()


def _sign(key: Any, data: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    return key.sign(data, padding.PSS(padding.MGF1(hashes.SHA256()), 32), hashes.SHA256())


def _verify(public_der: bytes, sig: bytes, data: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding, rsa
    from cryptography.hazmat.primitives.serialization import load_der_public_key

    try:
        key = load_der_public_key(public_der)
    except ValueError:
        return False
    if not isinstance(key, rsa.RSAPublicKey):
        return False
    try:
        key.verify(sig, data, padding.PSS(padding.MGF1(hashes.SHA256()), 32), hashes.SHA256())
    except InvalidSignature:
        return False
    return True


class DirectIdentity:
    """TLS contexts for one node: its certificate holds the identity key itself."""

    def __init__(self, private_key: Any, peer_id: str):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.x509.oid import NameOID

        self.key = _crypto_key(private_key)
        self.peer_id = peer_id
        self.public_der = _public_der(self.key.public_key())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id[:64])])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(int.from_bytes(os.urandom(8), "big"))
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .sign(self.key, hashes.SHA256())
        )
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self.server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server_ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        self.server_ctx.num_tickets = 0  # no session tickets: one connection, one handshake
        with tempfile.TemporaryDirectory() as tmp:  # load_cert_chain reads files only
            cert_path, key_path = os.path.join(tmp, "c.pem"), os.path.join(tmp, "k.pem")
            with open(cert_path, "wb") as f:
                f.write(cert.public_bytes(serialization.Encoding.PEM))
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(
                    self.key.private_bytes(
                        serialization.Encoding.PEM,
                        serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption(),
                    )
                )
            self.server_ctx.load_cert_chain(cert_path, key_path)
        self.client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.client_ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        self.client_ctx.check_hostname = False
        self.client_ctx.verify_mode = ssl.CERT_NONE  # no CA: the certificate's key must hash to the peer id


class WrongIdentity(PeerError):
    """The peer at a direct address is not the one we meant to reach."""


def _recv_exactly(sock: ssl.SSLSocket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed during the direct handshake")
        buf += chunk
    return bytes(buf)


def dial_blocking(
    ident: DirectIdentity, host: str, port: int, expected: str, timeout: float
) -> ssl.SSLSocket:
    """Connects, checks the listener is `expected`, proves who we are; the authenticated socket."""
    raw = socket.create_connection((host, port), timeout=timeout)
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = ident.client_ctx.wrap_socket(raw, server_hostname=None)
    except BaseException:
        raw.close()
        raise
    try:
        cert = sock.getpeercert(binary_form=True)
        from cryptography import x509

        found = peer_id_of_der(_public_der(x509.load_der_x509_certificate(cert).public_key()))
        if found != expected:
            raise WrongIdentity(f"{host}:{port} is {found[:12]}…, not {expected[:12]}…")
        nonce = _recv_exactly(sock, NONCE_BYTES)
        sig = _sign(ident.key, _signed_bytes(nonce, expected, cert))
        sock.sendall(_LEN.pack(len(ident.public_der)) + ident.public_der + _LEN.pack(len(sig)) + sig)
        if _recv_exactly(sock, 1) != b"\x01":
            raise PeerError(f"{expected[:12]}… refused our direct hello")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def accept_blocking(ident: DirectIdentity, raw: socket.socket) -> tuple[ssl.SSLSocket, str]:
    """Server side of the handshake on an accepted socket: (the socket, the dialer's peer id)."""
    raw.settimeout(HELLO_TIMEOUT_S)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    deadline = time.monotonic() + HELLO_TIMEOUT_S
    sock = ident.server_ctx.wrap_socket(raw, server_side=True)
    try:
        nonce = os.urandom(NONCE_BYTES)
        sock.sendall(nonce)
        (n,) = _LEN.unpack(_recv_exactly(sock, 2))
        if n > MAX_HELLO_BYTES:
            raise PeerError(f"direct hello of {n} bytes")
        public_der = _recv_exactly(sock, n)
        (m,) = _LEN.unpack(_recv_exactly(sock, 2))
        if m > MAX_HELLO_BYTES:
            raise PeerError(f"direct hello signature of {m} bytes")
        sig = _recv_exactly(sock, m)
        if time.monotonic() > deadline:
            raise PeerError("direct hello too slow")
        if not _verify(public_der, sig, _signed_bytes(nonce, ident.peer_id, ident.cert_der)):
            raise PeerError("direct hello with a bad signature")
        peer = peer_id_of_der(public_der)
        sock.sendall(b"\x01")
        sock.settimeout(None)
        return sock, peer
    except BaseException:
        sock.close()
        raise


# ---- asyncio face of a blocking TLS socket ------------------------------------------------------------
#
# The loop thread and the two I/O threads meet once per message, not once per TLS record: the reader
# thread reads only what the loop asks for, and a frame's payload straight into the frame's own
# buffer (`readinto_exactly`, used by wire.stream.read_message); the writer thread sends whole queued
# buffers and wakes the loop only when the queue runs dry or falls below LOW_WATER. OpenSSL releases
# the GIL while it encrypts, decrypts and waits, so the threads run beside the loop instead of taking
# turns with it (the profile in issue 22: a wake-up per 16 KiB record cost more than TLS itself).


class _Writer:
    """asyncio.StreamWriter's subset the Transport uses, writing through a thread."""

    def __init__(self, sock: ssl.SSLSocket, loop: asyncio.AbstractEventLoop, on_close: Callable[[], None]):
        self._sock = sock
        self._loop = loop
        self._queue: deque[Any] = deque()
        self._cv = threading.Condition()
        self._pending = 0
        self._waiters: list[asyncio.Future] = []
        self._error: BaseException | None = None
        self._closed = False
        self._on_close = on_close
        self._thread = threading.Thread(target=self._run, name="direct-writer", daemon=True)
        self._thread.start()

    def write(self, data: Any) -> None:
        if self._error is not None:
            raise ConnectionResetError(f"direct connection broke: {self._error!r}")
        if self._closed:
            raise ConnectionResetError("direct connection closed")
        view = memoryview(data).cast("B")
        if not len(view):
            return
        with self._cv:
            self._queue.append(view)
            self._pending += len(view)
            self._cv.notify()

    async def drain(self) -> None:
        """Returns at once while at most HIGH_WATER bytes wait for the thread; above that, once the
        thread has sent all but LOW_WATER of them (one wake-up per few MiB, not per write)."""
        while True:
            if self._error is not None:
                raise ConnectionResetError(f"direct connection broke: {self._error!r}")
            with self._cv:
                if self._pending <= HIGH_WATER or self._closed:
                    return
                fut = self._loop.create_future()
                self._waiters.append(fut)
            await fut

    def _wake(self) -> None:
        with self._cv:
            waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    break
                view = self._queue.popleft()
            try:
                self._sock.sendall(view)
            except BaseException as exc:  # the peer went away: every later write fails
                self._error = exc
                with self._cv:
                    self._queue.clear()
                    self._pending = 0
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._wake)
                break
            with self._cv:
                self._pending -= len(view)
                wake = bool(self._waiters) and (self._pending <= LOW_WATER or not self._queue)
            if wake:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._wake)
        self._on_close()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def is_closing(self) -> bool:
        return self._closed or self._error is not None

    async def wait_closed(self) -> None:
        await asyncio.to_thread(self._thread.join, 10)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._sock.getpeername() if name == "peername" else default


class _Reader:
    """asyncio.StreamReader's subset the Transport and read_message use (readexactly, read, at_eof) plus
    `readinto_exactly`, reading through a thread that reads only on request: a receiver that does
    not read holds no more than its last read asked for plus READ_AHEAD bytes (TCP's window then
    holds the sender back, the flow control asyncio's own transports have)."""

    def __init__(self, sock: ssl.SSLSocket, loop: asyncio.AbstractEventLoop, on_close: Callable[[], None]):
        self._sock = sock
        self._loop = loop
        self._on_close = on_close
        self._buf = bytearray()  # received, not yet consumed
        self._eof = False
        self._broken: str | None = None  # why no read can continue (a cancelled read into a caller's buffer)
        self._busy: asyncio.Future | None = None  # the request the thread is working on
        self._lock = threading.Lock()
        self._stopped = False
        self._requests: queue.SimpleQueue[tuple[memoryview, int, bool, asyncio.Future] | None] = (
            queue.SimpleQueue()
        )
        self._scratch = bytearray()  # the thread's target for reads into our own buffer (sized on use)
        self._thread = threading.Thread(target=self._run, name="direct-reader", daemon=True)
        self._thread.start()

    # -- thread side
    def _run(self) -> None:
        try:
            while True:
                req = self._requests.get()
                if req is None:
                    break
                view, need, linger, fut = req
                n, error = 0, None
                try:
                    while n < need:
                        got = self._sock.recv_into(view[n:])
                        if not got:
                            break
                        n += got
                    # what has already arrived: the rest of a decrypted record or more records in
                    # the socket (look-ahead past a frame header, read(n)); for read(n) while a bulk
                    # transfer streams in (full records), what arrives within LINGER_S as well, so
                    # that the loop is woken per READ_AHEAD-sized piece rather than per record
                    while n < len(view) and (
                        self._sock.pending()
                        or select.select([self._sock], [], [], LINGER_S if linger and n >= RECORD else 0)[0]
                    ):
                        got = self._sock.recv_into(view[n:])
                        if not got:
                            break
                        n += got
                except (OSError, ValueError) as exc:
                    error = exc
                try:
                    self._loop.call_soon_threadsafe(self._done, fut, n, n < need, error)
                except RuntimeError:  # the loop is gone
                    break
                if n < need:
                    break
        finally:
            with self._lock:
                self._stopped = True
            self._on_close()

    def stop(self) -> None:
        """No more reads (the connection is closing): the thread ends after the request in hand."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._requests.put(None)

    # -- loop side
    def _done(self, fut: asyncio.Future, n: int, eof: bool, error: BaseException | None) -> None:
        if eof:
            self._eof = True
        if not fut.done():
            fut.set_result((n, error))

    async def _idle(self) -> None:
        while self._busy is not None:  # a read cancelled earlier is still in the thread's hands
            await asyncio.shield(self._busy)

    async def _request(self, view: memoryview, need: int, own: bool, linger: bool = False) -> int:
        """The thread reads at least `need` bytes (fewer at the end of the stream) into `view`, part of
        our scratch buffer when `own`, else the caller's."""
        await self._idle()
        if self._eof or self._broken:
            return 0
        fut = self._loop.create_future()
        with self._lock:
            if self._stopped:
                self._eof = True
                return 0
            self._requests.put((view, need, linger, fut))
        self._busy = fut
        try:
            n, _error = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if own:  # what the thread reads is kept for the next read
                scratch = self._scratch
                fut.add_done_callback(lambda f: self._keep(scratch, f.result()[0]))
            else:  # the bytes land in a buffer nobody will read: the stream is cut mid-frame
                self._broken = "a read into a frame was cancelled"
            fut.add_done_callback(lambda _f: setattr(self, "_busy", None))
            raise
        self._busy = None
        return n

    def _keep(self, scratch: bytearray, n: int) -> None:
        self._buf += memoryview(scratch)[:n]

    async def _fill(self, need: int, limit: int, linger: bool = False) -> None:
        """At least `need` more bytes into our buffer (fewer at the end), up to `limit` at once."""
        await self._idle()
        if limit > len(self._scratch):
            self._scratch = bytearray(limit)
        scratch = self._scratch
        n = await self._request(memoryview(scratch)[:limit], need, own=True, linger=linger)
        self._keep(scratch, n)

    def _check(self) -> None:
        if self._broken:
            raise ConnectionResetError(f"direct connection unusable: {self._broken}")

    async def readexactly(self, n: int) -> bytes:
        self._check()
        await self._idle()
        while len(self._buf) < n:
            if self._eof:
                partial = bytes(self._buf)
                self._buf.clear()
                raise asyncio.IncompleteReadError(partial, n)
            await self._fill(n - len(self._buf), max(n - len(self._buf), READ_AHEAD))
            self._check()
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    async def read(self, n: int = -1) -> bytes:
        self._check()
        if n == 0:
            return b""
        await self._idle()
        if not self._buf and not self._eof:  # straight from the thread's buffer: one copy
            limit = READ_AHEAD if n < 0 else min(n, 4 * READ_AHEAD)
            if limit > len(self._scratch):
                self._scratch = bytearray(limit)
            got = await self._request(memoryview(self._scratch)[:limit], 1, own=True, linger=True)
            self._check()
            return bytes(memoryview(self._scratch)[:got])
        if n < 0 or n >= len(self._buf):
            data = bytes(self._buf)
            self._buf.clear()
        else:
            data = bytes(self._buf[:n])
            del self._buf[:n]
        return data

    async def readinto_exactly(self, view: memoryview) -> None:
        """Fills `view` (a frame's payload area) completely: what is buffered first, the rest read by
        the thread straight into it, one hand-over for the whole of it. IncompleteReadError at the
        end of the stream."""
        self._check()
        await self._idle()
        view = view.cast("B")
        have = min(len(self._buf), len(view))
        view[:have] = memoryview(self._buf)[:have]
        del self._buf[:have]
        pos = have
        while pos < len(view):
            if self._eof:
                raise asyncio.IncompleteReadError(b"", len(view) - pos)
            pos += await self._request(view[pos:], len(view) - pos, own=False)
            self._check()

    def at_eof(self) -> bool:
        return self._eof and not self._buf

    def buffered(self) -> int:
        """Bytes received and not yet consumed."""
        return len(self._buf)


class DirectConnection:
    """One authenticated TLS connection as an asyncio (reader, writer) pair."""

    def __init__(self, sock: ssl.SSLSocket, peer_id: str, loop: asyncio.AbstractEventLoop):
        self.sock = sock
        self.peer_id = peer_id
        self.loop = loop
        self._done = 0
        self._lock = threading.Lock()
        self.writer = _Writer(sock, loop, self._writer_done)
        self.reader = _Reader(sock, loop, self._half_closed)

    def _writer_done(self) -> None:
        self._half_closed()
        reader = getattr(self, "reader", None)
        if reader is not None:
            reader.stop()

    def _half_closed(self) -> None:
        with self._lock:
            self._done += 1
            last = self._done == 2
        if last or self.writer.is_closing():
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        if last:
            with contextlib.suppress(OSError):
                self.sock.close()


@dataclass
class _PeerInfo:
    peer_id: str


StreamHandler = Callable[[Any, Any, Any], Awaitable[None]]


class DirectPath:
    """A node's direct listener and dialer (see the module docstring)."""

    def __init__(self, private_key: Any, peer_id: str, host: str = "0.0.0.0", port: int = 0):
        self.ident = DirectIdentity(private_key, peer_id)
        self.host = host
        self.port = port
        self._server: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handler: StreamHandler | None = None
        self.failed: dict[str, tuple[float, str]] = {}  # peer id -> (when, why) of its last failed dial
        self.connections = 0  # authenticated direct connections opened or accepted
        self.refused = 0  # inbound connections that failed the handshake
        self._tasks: set[asyncio.Task] = set()
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)

    async def start(self, handler: StreamHandler) -> int:
        """Listens; each authenticated inbound connection goes to `handler(info, reader, writer)`."""
        self._loop = asyncio.get_running_loop()
        self._handler = handler
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((self.host, self.port))
        srv.listen(64)
        self._server = srv
        self.port = srv.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept, name="direct-accept", daemon=True)
        self._accept_thread.start()
        return self.port

    def _accept(self) -> None:
        assert self._server is not None
        while True:
            try:
                raw, _addr = self._server.accept()
            except OSError:
                return
            if not self._pending.acquire(blocking=False):  # a flood: no thread for it
                self.refused += 1
                with contextlib.suppress(OSError):
                    raw.close()
                continue
            threading.Thread(target=self._handshake, args=(raw,), daemon=True).start()

    def _handshake(self, raw: socket.socket) -> None:
        try:
            sock, peer = accept_blocking(self.ident, raw)
        except Exception as exc:
            self._pending.release()
            self.refused += 1
            logger.debug("direct connection refused: %r", exc)
            with contextlib.suppress(OSError):
                raw.close()
            return
        self._pending.release()
        loop = self._loop
        if loop is None or loop.is_closed():
            sock.close()
            return
        self.connections += 1

        def serve() -> None:
            conn = DirectConnection(sock, peer, loop)
            assert self._handler is not None
            task = asyncio.ensure_future(self._handler(_PeerInfo(peer), conn.reader, conn.writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        loop.call_soon_threadsafe(serve)

    async def dial(self, peer_id: str, addrs: list[str], timeout: float = DIAL_TIMEOUT_S) -> tuple[Any, Any]:
        """An authenticated (reader, writer) to `peer_id` at one of its direct addresses; PeerError
        (WrongIdentity for a listener that is someone else) with every reason when none works."""
        reasons = []
        for addr in addrs:
            hp = parse_direct_addr(addr)
            if hp is None:
                continue
            try:
                sock = await asyncio.wait_for(
                    asyncio.to_thread(dial_blocking, self.ident, hp[0], hp[1], peer_id, timeout), timeout + 1
                )
            except WrongIdentity:
                raise
            except (TimeoutError, OSError, ssl.SSLError, PeerError, ConnectionError) as exc:
                reasons.append(f"{hp[0]}:{hp[1]}: {exc!r}"[:200])
                continue
            self.connections += 1
            conn = DirectConnection(sock, peer_id, asyncio.get_running_loop())
            return conn.reader, conn.writer
        raise PeerError("; ".join(reasons) or "no direct address")

    def addrs(self, ips: list[str]) -> list[str]:
        return [direct_addr(ip, self.port) for ip in ips]

    def close(self) -> None:
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self._server.close()
            self._server = None

    def status(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "connections": self.connections,
            "refused": self.refused,
            "fell_back": {p: why for p, (_t, why) in list(self.failed.items())[:64]},
        }
