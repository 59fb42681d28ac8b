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

I/O (runtime/direct_io.py): the TLS socket is blocking and driven by two threads per connection
(OpenSSL releases the GIL while it encrypts and decrypts), presented to the Transport as an asyncio
reader/writer pair whose threads meet the event loop once per message (a frame's payload is read
straight into the frame).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import os
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fusionnode.errors import PeerError
from fusionnode.runtime.direct_io import DirectConnection

logger = logging.getLogger(__name__)

DIRECT_TAG = "/tls/fusionnode-direct"  # suffix of the address a node advertises for its direct path
CONTEXT = b"fusionnode-direct/1"
NONCE_BYTES = 32
MAX_HELLO_BYTES = 4096  # dialer's public key + signature
HELLO_TIMEOUT_S = 5.0  # seconds for a dialer to finish the handshake and its hello
DIAL_TIMEOUT_S = 3.0  # seconds to connect and authenticate before falling back to libp2p
RETRY_AFTER_S = 300.0  # seconds a peer whose direct dial failed stays on libp2p
MAX_PENDING_HANDSHAKES = 64  # inbound connections still in their handshake; more are closed at once
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
