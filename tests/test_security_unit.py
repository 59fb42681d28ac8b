"""Pure parts of fusionnode.security: swarm keys, MACs, replay cache, norm bound, bans, per-peer limits."""

from __future__ import annotations

import asyncio
import os
import stat
import statistics

import pytest
import torch

from fusionnode.errors import ConfigError, ProtocolError
from fusionnode.security import (
    AUTH_FIELD,
    SWARM_KEY_ENV,
    AuthenticationError,
    BanList,
    GuardConfig,
    NonceCache,
    NormBound,
    PeerLimiter,
    PeerLimits,
    SwarmAuthorizer,
    SwarmKey,
    load_swarm_key,
    swarm_key_from_env_or_path,
    write_swarm_key,
)
from fusionnode.wire.checked import tensor_message
from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.messages import Call, Reply, TensorMessage, decode_message, encode_message

torch.set_num_threads(1)


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_keygen_file_is_0600_and_loads(tmp_path, monkeypatch):
    path = tmp_path / "swarm.key"
    key = write_swarm_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_swarm_key(path).secret == key.secret and key.fingerprint not in repr(key.secret)
    assert key.secret.hex() not in repr(key)
    with pytest.raises(ConfigError, match="exists"):
        write_swarm_key(path)
    monkeypatch.setenv(SWARM_KEY_ENV, str(path))
    assert swarm_key_from_env_or_path(None).secret == key.secret
    monkeypatch.delenv(SWARM_KEY_ENV)
    assert swarm_key_from_env_or_path(None) is None
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_swarm_key(path)
    bad = tmp_path / "bad.key"
    bad.write_text("hello\n")
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match="not a swarm key"):
        load_swarm_key(bad)


def test_mac_binds_sender_receiver_content_and_reply_context():
    clock = Clock()
    a = SwarmAuthorizer(SwarmKey(b"k" * 32), clock=clock)
    b = SwarmAuthorizer(SwarmKey(b"k" * 32), clock=clock)
    msg = tensor_message("act", {"job": "j", "step": 1}, {"x": torch.arange(6.0).reshape(2, 3)})
    wire = decode_message(encode_message(a.sign(msg, "A", "B")))
    got, nonce = b.verify(wire, "A", "B")
    assert AUTH_FIELD not in got.meta and torch.equal(got.decode_tensors()["x"], msg.decode_tensors()["x"])
    fresh = lambda: decode_message(encode_message(a.sign(msg, "A", "B")))  # noqa: E731
    with pytest.raises(AuthenticationError):
        b.verify(fresh(), "C", "B")  # played by another sender
    with pytest.raises(AuthenticationError):
        b.verify(fresh(), "A", "C")  # to another receiver
    with pytest.raises(AuthenticationError, match="replayed"):
        b.verify(wire, "A", "B")
    tampered = fresh()
    enc = tampered.tensors["x"]
    data = bytearray(enc.data)
    data[0] ^= 1
    tampered = TensorMessage(
        tampered.kind, tampered.meta, {"x": EncodedTensor(enc.dtype, enc.shape, enc.codec, enc.params, data)}
    )
    with pytest.raises(AuthenticationError, match="bad swarm MAC"):
        b.verify(tampered, "A", "B")
    with pytest.raises(AuthenticationError, match="unauthenticated"):
        b.verify(Call("x", {}), "A", "B")
    with pytest.raises(AuthenticationError, match="bad swarm MAC"):
        SwarmAuthorizer(SwarmKey(b"o" * 32), clock=clock).verify(fresh(), "A", "B")
    reply = b.sign(Reply(True, {"r": 1}), "B", "A", context=nonce)
    with pytest.raises(AuthenticationError):
        a.verify(reply, "B", "A", context=b"another call")
    assert a.verify(b.sign(Reply(True, {"r": 1}), "B", "A", context=nonce), "B", "A", context=nonce)[
        0
    ].result == {"r": 1}
    with pytest.raises(AuthenticationError, match="window"):
        b.verify(_signed_at(a, msg, clock, -31), "A", "B")  # signed 31 s ago
    with pytest.raises(ProtocolError):
        a.sign(Call("x", {AUTH_FIELD: 1}), "A", "B")


def _signed_at(auth: SwarmAuthorizer, msg, clock: Clock, offset: float):
    clock.t += offset
    try:
        return auth.sign(msg, "A", "B")
    finally:
        clock.t -= offset


def test_nonce_cache_overflow_never_reopens_a_replay():
    cache = NonceCache(capacity=3, window_s=30)
    for i in range(3):
        assert cache.check_and_add(bytes([i]) * 16, 100.0 + i, 105.0) is None
    assert cache.check_and_add(bytes([9]) * 16, 104.0, 105.0) is None  # evicts nonce 0 (ts 100)
    assert len(cache) == 3 and cache.floor == 100.0
    assert "older" in cache.check_and_add(bytes([0]) * 16, 100.0, 105.0)
    assert "replayed" in cache.check_and_add(bytes([2]) * 16, 102.0, 105.0)
    assert "window" in cache.check_and_add(b"x" * 16, 50.0, 105.0)


def test_norm_bound_and_doubling_bans():
    cfg = GuardConfig(norm_factor=10, min_history=3, ban_base_s=15, ban_max_s=100)
    nb = NormBound(cfg)
    assert nb.check("w", 1e9) is None  # no history yet: nothing to compare with
    for v in (1.0, 2.0, 3.0):
        nb.record("w", v)
    assert nb.bound("w") == 20.0 and nb.check("w", 19.0) is None
    assert "exceeds" in nb.check("w", 21.0) and "non-finite" in nb.check("w", float("nan"))
    clock = Clock(0.0)
    bans = BanList(cfg, clock=clock)
    assert [bans.ban("p", "x") for _ in range(5)] == [15, 30, 60, 100, 100]
    assert bans.is_banned("p") and not bans.is_banned("q")
    clock.t = 101
    assert not bans.is_banned("p") and bans.status()["offences"] == {"x": 5}


def test_peer_limiter_streams_rate_and_bytes():
    clock = Clock(0.0)
    lim = PeerLimiter(
        PeerLimits(max_streams=2, rpc_rate=1.0, rpc_burst=2, max_inflight_bytes=100, inflight_wait_s=0.05),
        clock,
    )
    assert lim.open_stream("p") and lim.open_stream("p") and not lim.open_stream("p") and lim.open_stream("q")
    lim.close_stream("p")
    assert lim.open_stream("p")
    assert lim.allow_call("p") and lim.allow_call("p") and not lim.allow_call("p") and lim.allow_call("q")
    clock.t += 1.0
    assert lim.allow_call("p")

    async def main():
        await lim.reserve("p", 60)
        with pytest.raises(ProtocolError, match="exceeds"):
            await lim.reserve("p", 101)
        waiter = asyncio.ensure_future(lim.reserve("p", 60))
        await asyncio.sleep(0)
        assert not waiter.done()
        lim.release("p", 60)
        await asyncio.wait_for(waiter, 1.0)
        await lim.reserve("q", 100)  # another peer's budget is its own

    asyncio.run(main())
    assert lim.refused["p"] == {"streams": 1, "rate": 1, "bytes": 1}


def test_control_socket_is_a_0600_unix_socket_only(tmp_path):
    """The control API is a Unix socket readable by its owner only: no TCP port, no other users."""
    import socket

    import psutil

    from fusionnode.control import ControlServer

    async def main():
        async def ping(_args, _emit):
            return {"pong": True}

        server = ControlServer(tmp_path / "control.sock", {"ping": ping})
        before = {c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"}
        await server.start()
        try:
            st = (tmp_path / "control.sock").stat()
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
            after = {c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"}
            assert after == before  # no network listener was opened
            with socket.socket(socket.AF_UNIX) as s:  # the owner can connect
                s.connect(str(tmp_path / "control.sock"))
        finally:
            await server.close()

    asyncio.run(main())


def test_norm_bound_forgets_undone_steps_so_a_replay_meets_the_same_bound():
    """A rollback or a re-plan undoes steps whose pushes were recorded: `forget_steps` drops their
    norms, so the replayed steps record them again and meet the bound an honest run meets; the
    median reads the last norm_history norms only, whatever slack is kept for replays."""
    cfg = GuardConfig(norm_factor=10.0, norm_history=4, min_history=2)
    honest, replayed = NormBound(cfg), NormBound(cfg)
    norms = [1.0, 2.0, 3.0, 4.0, 100.0, 200.0, 5.0, 6.0]
    for step, v in enumerate(norms):
        honest.record("w", v, step)
    for step, v in enumerate(norms[:6]):  # steps 0..5 pushed, then 3..5 undone (a rollback to 3)
        replayed.record("w", v, step)
    replayed.record("other-job", 7.0, 5)
    replayed.record("other-job", 9.0, 6)
    assert replayed.forget_steps(lambda k: k == "w", 3) == 3
    assert replayed.bound("w") == 10 * 2.0  # median of steps 0..2 only
    assert replayed.bound("other-job") == 10 * 8.0  # another key: untouched
    for step, v in list(enumerate(norms))[3:]:
        replayed.record("w", v, step)
    assert replayed.bound("w") == honest.bound("w") == 10 * statistics.median(norms[-4:])
    assert replayed.forget_steps(lambda k: k == "w", 100) == 0  # nothing recorded that late
    legacy = NormBound(cfg)  # norms recorded without a step are never forgotten
    legacy.record("w", 1.0)
    legacy.record("w", 3.0)
    assert legacy.forget_steps(lambda k: True, 0) == 0 and legacy.bound("w") == 20.0
