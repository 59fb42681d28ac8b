"""The direct fast path (runtime/direct.py) between real Transports on loopback: TLS 1.3 keyed to the
libp2p identities, fallback to libp2p, and what an outsider can and cannot do with it."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import rsa

from fusionnode.config import LOCAL_ONLY
from fusionnode.runtime.direct import (
    NONCE_BYTES,
    DirectIdentity,
    DirectPath,
    WrongIdentity,
    dial_blocking,
    direct_addr,
)
from fusionnode.runtime.transport import Transport
from fusionnode.security import SwarmAuthorizer
from fusionnode.security.keys import SwarmKey
from fusionnode.swarm.identity import peer_id_from_public_key
from fusionnode.swarm.libp2p import create_p2p
from fusionnode.wire.messages import TensorMessage


def _key() -> tuple[rsa.RSAPrivateKey, str]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key, peer_id_from_public_key(key.public_key()).to_base58()


class Peer:
    """A Transport on a real p2pd, with a direct path keyed to the p2pd's own identity file."""

    def __init__(self, p2p, transport: Transport, direct: DirectPath):
        self.p2p, self.t, self.direct = p2p, transport, direct
        self.got: list[tuple[TensorMessage, str]] = []
        transport.on_data("activation", lambda msg, sender: self.got.append((msg, sender)))

    @property
    def id(self) -> str:
        return self.t.peer_id

    @property
    def addr(self) -> str:
        return direct_addr("127.0.0.1", self.direct.port)


async def _peer(tmp_path, name: str, authorizer=None, initial=None) -> Peer:
    from fusionnode.swarm.identity import load_or_create_identity

    state = tmp_path / name
    state.mkdir()
    ident = load_or_create_identity(state)
    p2p = await create_p2p(
        ["/ip4/127.0.0.1/tcp/0"], initial, options=LOCAL_ONLY, identity_path=str(ident.p2p_key_path)
    )
    t = Transport(p2p, authorizer=authorizer, rpc_timeout=15)
    await t.start()
    direct = DirectPath(ident.private_key, t.peer_id, host="127.0.0.1")
    await direct.start(t._on_data_stream)
    t.direct = direct
    return Peer(p2p, t, direct)


async def _close(*peers: Peer) -> None:
    for p in peers:
        await p.t.close()
        await p.p2p.shutdown()


def _msg(step: int) -> TensorMessage:
    return TensorMessage.from_tensors(
        "activation", {"job": "j", "step": step, "mb": 0, "stage": 1}, {"x": torch.arange(4096.0) + step}
    )


async def _wait(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


def test_tensors_go_direct_and_the_receiver_knows_the_sender(tmp_path):
    async def go():
        a = await _peer(tmp_path, "a")
        b = await _peer(tmp_path, "b", initial=await a.p2p.get_visible_maddrs())
        try:
            a.t.direct_book = lambda pid: [b.addr] if pid == b.id else []
            for step in range(3):
                await a.t.send(b.id, _msg(step))
            await _wait(lambda: len(b.got) == 3)
            assert [int(m.meta["step"]) for m, _ in b.got] == [0, 1, 2]
            assert all(sender == a.id for _, sender in b.got)
            assert torch.equal(b.got[2][0].decode_tensors()["x"], torch.arange(4096.0) + 2)
            assert a.t.paths[b.id] == "direct"
            assert b.direct.connections == 1 and a.direct.connections == 1
        finally:
            await _close(a, b)

    asyncio.run(go())


def test_a_direct_address_of_someone_else_falls_back_to_libp2p_logged_once(tmp_path, caplog):
    async def go():
        a = await _peer(tmp_path, "a")
        b = await _peer(tmp_path, "b", initial=await a.p2p.get_visible_maddrs())
        c_key, c_id = _key()
        c = DirectPath(c_key, c_id, host="127.0.0.1")
        await c.start(lambda *args: asyncio.sleep(0))
        try:
            # b's record names c's listener (a stale or hostile address): the dial must not trust it
            a.t.direct_book = lambda pid: [direct_addr("127.0.0.1", c.port)] if pid == b.id else []
            with caplog.at_level(logging.WARNING, logger="fusionnode.runtime.transport"):
                await a.t.send(b.id, _msg(0))
                a.t._drop_out(b.id)  # a new stream: the failed dial is remembered, not retried
                await a.t.send(b.id, _msg(1))
            await _wait(lambda: len(b.got) == 2)
            assert a.t.paths[b.id] == "libp2p"
            warnings = [r for r in caplog.records if "direct path" in r.getMessage()]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
            assert f"not {b.id[:12]}" in warnings[0].getMessage()
            assert c.connections == 0  # c never accepted a's hello: a stopped at c's certificate
        finally:
            c.close()
            await _close(a, b)

    asyncio.run(go())


def test_wrong_identity_is_detected_before_anything_is_sent():
    key, pid = _key()
    other_key, other_id = _key()

    async def go():
        listener = DirectPath(key, pid, host="127.0.0.1")
        await listener.start(lambda *args: asyncio.sleep(0))
        try:
            with pytest.raises(WrongIdentity):
                await asyncio.to_thread(
                    dial_blocking,
                    DirectIdentity(other_key, other_id),
                    "127.0.0.1",
                    listener.port,
                    other_id,
                    3,
                )
        finally:
            listener.close()

    asyncio.run(go())


def _raw_tls(port: int) -> ssl.SSLSocket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5))


def _closed_without_a_word(sock: ssl.SSLSocket) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError, OSError):
        return True


def test_an_outsider_cannot_skip_authentication(tmp_path):
    """Claiming a member's identity without its key, garbage, or a valid identity of its own in a
    private swarm without the swarm key: each is closed; no handler sees a single message."""
    key = SwarmKey.generate()

    async def go():
        a = await _peer(tmp_path, "a", authorizer=SwarmAuthorizer(key))
        m = await _peer(
            tmp_path, "m", authorizer=SwarmAuthorizer(key), initial=await a.p2p.get_visible_maddrs()
        )
        try:
            # 1. a hello that names member m's public key, signed by someone else
            def impersonate() -> bool:
                sock = _raw_tls(a.direct.port)
                sock.recv(NONCE_BYTES)
                ident_m = DirectIdentity(m.direct.ident.key, m.id)
                sig = bytes(256)
                sock.sendall(
                    struct.pack(">H", len(ident_m.public_der))
                    + ident_m.public_der
                    + struct.pack(">H", 256)
                    + sig
                )
                return _closed_without_a_word(sock)

            assert await asyncio.to_thread(impersonate)

            # 2. an oversized hello
            def garbage() -> bool:
                sock = _raw_tls(a.direct.port)
                sock.recv(NONCE_BYTES)
                sock.sendall(b"\xff\xff" + bytes(1000))
                return _closed_without_a_word(sock)

            assert await asyncio.to_thread(garbage)
            await _wait(lambda: a.direct.refused >= 2)
            # 3. an outsider with a real identity of its own but no swarm key: the TLS and the hello
            # pass, the stream's swarm preamble does not
            o_key, o_id = _key()
            outsider = DirectPath(o_key, o_id, host="127.0.0.1")
            reader, writer = await outsider.dial(a.id, [a.addr])
            from fusionnode.wire.stream import write_message

            await write_message(writer, _msg(0))
            assert await asyncio.wait_for(reader.read(1), 10) == b""  # closed unanswered
            await _wait(lambda: a.t.auth_refused.get(o_id, 0) == 1)
            # a member with the key gets through on the same path
            m.t.direct_book = lambda pid: [a.addr] if pid == a.id else []
            await m.t.send(a.id, _msg(7))
            await _wait(lambda: len(a.got) == 1)
            assert a.got[0][1] == m.id and m.t.paths[a.id] == "direct"
        finally:
            await _close(a, m)

    asyncio.run(go())


def test_a_flood_of_silent_connections_is_capped_and_then_cleared():
    from fusionnode.runtime.direct import HELLO_TIMEOUT_S, MAX_PENDING_HANDSHAKES

    key, pid = _key()
    other_key, other_id = _key()

    async def go():
        listener = DirectPath(key, pid, host="127.0.0.1")
        await listener.start(lambda *args: asyncio.sleep(0))
        silent = []
        try:
            for _ in range(MAX_PENDING_HANDSHAKES + 8):
                silent.append(socket.create_connection(("127.0.0.1", listener.port), timeout=5))
            await _wait(lambda: listener.refused >= 8)  # the ones past the cap: closed unread at once
            await asyncio.sleep(HELLO_TIMEOUT_S + 1)  # the pending handshakes time out
            sock = await asyncio.to_thread(
                dial_blocking, DirectIdentity(other_key, other_id), "127.0.0.1", listener.port, pid, 3
            )
            sock.close()
            assert listener.connections == 1
        finally:
            for s in silent:
                s.close()
            listener.close()

    asyncio.run(go())


def test_a_receiver_that_does_not_read_holds_a_bounded_amount():
    from fusionnode.runtime.direct_io import READ_AHEAD

    key, pid = _key()
    other_key, other_id = _key()

    async def go():
        held = []

        async def idle(_info, reader, writer):  # reads one byte, then nothing more
            assert await reader.read(1) == b"\0"
            held.append(reader)
            await asyncio.sleep(30)

        listener = DirectPath(key, pid, host="127.0.0.1")
        await listener.start(idle)
        dialer = DirectPath(other_key, other_id, host="127.0.0.1")
        try:
            _r, w = await dialer.dial(pid, [direct_addr("127.0.0.1", listener.port)])
            chunk = bytes(1 << 20)

            async def push():
                for _ in range(256):  # 256 MiB, far more than any buffer
                    w.write(chunk)
                    await w.drain()

            task = asyncio.ensure_future(push())
            await asyncio.sleep(3)
            assert not task.done()  # the sender is held back
            await _wait(lambda: bool(held))
            assert held[0].buffered() < READ_AHEAD, held[0].buffered()  # what that one read brought
            task.cancel()
            w.close()
        finally:
            listener.close()

    asyncio.run(go())


def test_a_slow_probe_does_not_keep_libp2p(tmp_path):
    """A probe runs over libp2p, so a slow one may be p2pd's CPU, not the link (the CI run where a 1 MiB
    probe read under 200 Mbit/s on a veth kept the NAT test's A -> relay link off the direct path): the
    prober's figures do not decide the path, only a rate limit or a declared bandwidth does."""

    async def go():
        a = await _peer(tmp_path, "a")
        b = await _peer(tmp_path, "b", initial=await a.p2p.get_visible_maddrs())
        try:
            a.t.direct_book = lambda pid: [b.addr] if pid == b.id else []
            assert a.t.known_bps(b.id) is None
            await a.t.send(b.id, _msg(0))
            await _wait(lambda: len(b.got) == 1)
            assert a.t.paths[b.id] == "direct" and b.direct.connections == 1
        finally:
            await _close(a, b)

    asyncio.run(go())


async def _pair(handler):
    """A listener with `handler` and a dialer's (reader, writer) to it, on loopback."""
    key, pid = _key()
    other_key, other_id = _key()
    listener = DirectPath(key, pid, host="127.0.0.1")
    await listener.start(handler)
    dialer = DirectPath(other_key, other_id, host="127.0.0.1")
    reader, writer = await dialer.dial(pid, [direct_addr("127.0.0.1", listener.port)])
    return listener, reader, writer


def test_frames_of_every_size_arrive_whole_and_a_cut_frame_is_truncated():
    """The reader thread fills a frame's payload straight into the frame: small and multi-MiB frames,
    headers split across TLS records, back to back; a stream cut mid-frame is a truncated frame."""
    from fusionnode.errors import ProtocolError
    from fusionnode.wire.stream import read_message, write_message

    sizes = [1, 5000, 3 << 18, 7, 1 << 20, 0, 123457]
    got: list = []
    errors: list = []

    async def go():
        async def receive(_info, reader, writer):
            try:
                for _ in sizes:
                    got.append(await read_message(reader))
                await read_message(reader)
            except ProtocolError as exc:
                errors.append(str(exc))
            writer.close()

        listener, _r, w = await _pair(receive)
        try:
            for i, n in enumerate(sizes):
                await write_message(w, _sized(i, n), chunk_bytes=4093)  # odd chunks: records split headers
            frame = b"".join(bytes(p) for p in _frame_parts(_sized(99, 1 << 20)))
            w.write(frame[: len(frame) // 2])  # then the sender goes away mid-frame
            await w.drain()
            w.close()
            await _wait(lambda: bool(errors), 20)
        finally:
            listener.close()

    asyncio.run(go())
    assert [int(m.meta["step"]) for m in got] == list(range(len(sizes)))
    for i, (m, n) in enumerate(zip(got, sizes, strict=True)):
        assert torch.equal(m.decode_tensors()["x"], _sized(i, n).decode_tensors()["x"])
    assert "truncated" in errors[0], errors


def _sized(step: int, n: int) -> TensorMessage:
    return TensorMessage.from_tensors(
        "activation", {"step": step}, {"x": torch.arange(n, dtype=torch.float32) * (step + 1)}
    )


def _frame_parts(msg: TensorMessage) -> list:
    from fusionnode.wire.messages import frame_parts

    return frame_parts(msg)


def test_a_read_that_times_out_loses_no_bytes():
    """wait_for on a read (the preamble's and acknowledgements' timeouts) cancels it while the reader
    thread waits: what arrives later is still read, in order."""
    seen: list[bytes] = []

    async def go():
        ready = asyncio.Event()

        async def receive(_info, reader, writer):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.readexactly(8), 0.2)  # nothing sent yet
            ready.set()
            seen.append(await reader.readexactly(8))
            seen.append(await reader.read(100))
            writer.close()

        listener, _r, w = await _pair(receive)
        try:
            await asyncio.wait_for(ready.wait(), 10)
            w.write(b"12345678abc")
            await w.drain()
            await _wait(lambda: len(seen) == 2)
            w.close()
        finally:
            listener.close()

    asyncio.run(go())
    assert seen == [b"12345678", b"abc"]


def test_a_link_known_to_be_slow_keeps_libp2p_and_each_path_is_counted(tmp_path):
    """The rule for links nobody probed: a rate limit we apply (user-space testbed) or a bandwidth we
    were told (set_link_limits' `declared`, a testbed shaped by tc) under DIRECT_MIN_BPS keeps libp2p;
    a fast one goes direct; the bytes each path carried are counted per peer (`path_bytes`)."""
    from fusionnode.runtime.transport import DIRECT_MIN_BPS

    async def go():
        a = await _peer(tmp_path, "a")
        b = await _peer(tmp_path, "b", initial=await a.p2p.get_visible_maddrs())
        try:
            a.t.direct_book = lambda pid: [b.addr] if pid == b.id else []
            a.t.set_rate_limit(b.id, 8e6)  # capped at 8 Mbit/s
            assert a.t.known_bps(b.id) == pytest.approx(8e6)
            await a.t.send(b.id, _msg(0))
            await _wait(lambda: len(b.got) == 1)
            assert a.t.paths[b.id] == "libp2p" and b.direct.connections == 0
            a.t.set_rate_limit(b.id, None)
            a.t.declared_bps[b.id] = 10e6  # told: a 10 Mbit/s link
            a.t._drop_out(b.id)
            await a.t.send(b.id, _msg(1))
            await _wait(lambda: len(b.got) == 2)
            assert a.t.paths[b.id] == "libp2p" and b.direct.connections == 0
            a.t.declared_bps[b.id] = 2 * DIRECT_MIN_BPS  # a fast link
            a.t._drop_out(b.id)
            await a.t.send(b.id, _msg(2))
            await _wait(lambda: len(b.got) == 3)
            assert a.t.paths[b.id] == "direct" and b.direct.connections == 1
            carried = a.t.security_status()["path_bytes"][b.id]
            assert set(carried) == {"libp2p", "direct"}
            assert carried["libp2p"] > carried["direct"] > 4096 * 4  # two messages, then one
        finally:
            await _close(a, b)

    asyncio.run(go())
