"""Attacks on real peers over loopback (real p2pd daemons, real Transports): private swarms, replay,
forgery, hostile gradients, stream floods, job authority, fuzzed frames."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import socket
import struct
import time
from collections.abc import Callable

import psutil
import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr

from fusionnode.config import LOCAL_ONLY
from fusionnode.errors import DaemonError, PeerError
from fusionnode.optim.contributions import Contributor, ExpectedContributions
from fusionnode.optim.host import OptimizerHostService
from fusionnode.optim.optimizers import job_optimizer_config
from fusionnode.optim.store import ParameterStore
from fusionnode.runtime.transport import PROTO_DATA, PROTO_RPC, Transport
from fusionnode.security import (
    DHTSwarmAuthorizer,
    GuardConfig,
    PeerLimits,
    SwarmAuthorizer,
    SwarmKey,
)
from fusionnode.swarm import load_or_create_identity, start_dht, stop_dht
from fusionnode.swarm.libp2p import create_p2p
from fusionnode.train.spec import JobSpec
from fusionnode.wire.checked import tensor_message
from fusionnode.wire.messages import Call, TensorMessage, encode_message

torch.set_num_threads(1)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
KEY = SwarmKey(bytes(range(32)))
OTHER_KEY = SwarmKey(bytes(range(1, 33)))


async def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


@contextlib.asynccontextmanager
async def peers(*authorizers, peer_limits: PeerLimits | None = None):
    """One real P2P daemon + Transport per authorizer (None: a public peer); all know the first."""
    stack = contextlib.AsyncExitStack()
    ts: list[Transport] = []
    async with stack:
        first = None
        for auth in authorizers:
            p2p = await create_p2p(LOOPBACK, first, options=LOCAL_ONLY, startup_timeout=30)
            stack.push_async_callback(p2p.shutdown)
            if first is None:
                first = await p2p.get_visible_maddrs()
            kwargs = {"peer_limits": peer_limits} if peer_limits else {}
            t = Transport(p2p, rpc_timeout=5.0, authorizer=auth, **kwargs)
            await t.start()
            stack.push_async_callback(t.close)
            ts.append(t)
        yield ts


def _echo_counter(t: Transport) -> list:
    calls: list = []

    async def echo(args, sender):
        calls.append(sender)
        return {"echo": args.get("x")}

    t.add_rpc("echo", echo)
    return calls


async def _raw_exchange(p2p, peer: str, proto: str, data: bytes, timeout: float = 5.0) -> bytes | None:
    """Open a stream, write `data`, return everything the other side wrote before closing it
    (None if it did not close within `timeout` seconds)."""
    _info, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), proto)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    except TimeoutError:
        return None
    finally:
        writer.close()


# ------------------------------------------------------------------ private swarm: transport


def test_outsider_is_refused_and_replay_forgery_rejected():
    async def main():
        async with peers(
            SwarmAuthorizer(KEY), SwarmAuthorizer(KEY), None, SwarmAuthorizer(OTHER_KEY), SwarmAuthorizer(KEY)
        ) as (a, b, outsider, wrong_key, insider):
            calls = _echo_counter(b)
            got = []
            b.on_data("probe", lambda msg, sender: got.append(sender))
            assert (await a.call(b.peer_id, "echo", {"x": 1}))["echo"] == 1  # members talk
            await a.send(b.peer_id, TensorMessage("probe", {"job": "j"}, {}))
            await wait_for(lambda: got == [a.peer_id], 5, "a member's data message")

            # outsiders (no key, another key) are closed on unanswered, within one round trip
            for t in (outsider, wrong_key):
                t0 = time.monotonic()
                with pytest.raises(PeerError):
                    await t.call(b.peer_id, "echo", {"x": 2})
                assert time.monotonic() - t0 < 1.0
                with contextlib.suppress(PeerError):
                    await t.send(b.peer_id, TensorMessage("probe", {"job": "j"}, {}))
            await wait_for(lambda: b.auth_refused[outsider.peer_id] >= 2, 5, "outsider refusals")
            await wait_for(lambda: b.auth_refused[wrong_key.peer_id] >= 2, 5, "wrong-key refusals")
            assert calls == [a.peer_id] and got == [a.peer_id]  # no handler ever saw them
            # and a raw outsider learns nothing: not a byte comes back
            junk = encode_message(Call("echo", {"x": 3}))
            assert await _raw_exchange(outsider.p2p, b.peer_id, PROTO_RPC, junk) == b""
            assert await _raw_exchange(outsider.p2p, b.peer_id, PROTO_DATA, junk) == b""

            # a captured request: accepted once, refused when replayed, by its sender or anyone else
            pre = a.authorizer.sign(Call("auth.open", {}), a.peer_id, b.peer_id, context=PROTO_RPC.encode())
            call = a.authorizer.sign(Call("echo", {"x": 4}), a.peer_id, b.peer_id)
            frames = encode_message(pre) + encode_message(call)
            assert await _raw_exchange(a.p2p, b.peer_id, PROTO_RPC, frames) != b""
            assert len(calls) == 2
            before = b.auth_refused[a.peer_id]
            assert await _raw_exchange(a.p2p, b.peer_id, PROTO_RPC, frames) == b""  # same sender
            assert await _raw_exchange(insider.p2p, b.peer_id, PROTO_RPC, frames) == b""  # other member
            assert len(calls) == 2 and b.auth_refused[a.peer_id] == before + 1
            # a forged (altered) request from a member: refused
            fresh_pre = a.authorizer.sign(
                Call("auth.open", {}), a.peer_id, b.peer_id, context=PROTO_RPC.encode()
            )
            forged = a.authorizer.sign(Call("echo", {"x": 5}), a.peer_id, b.peer_id)
            forged = Call("echo", {**forged.args, "x": 6})
            frames = encode_message(fresh_pre) + encode_message(forged)
            assert await _raw_exchange(a.p2p, b.peer_id, PROTO_RPC, frames) == b""
            assert len(calls) == 2
            status = b.security_status()
            assert status["private_swarm"] and sum(status["auth_refused_streams"].values()) >= 8
            assert status["auth"]["refused"] >= 5  # MAC, replay and forgery failures

    asyncio.run(main())


# ------------------------------------------------------------------ private swarm: DHT


@pytest.fixture
def _collect_mpfutures():
    yield
    gc.collect()


def test_dht_without_the_swarm_key_cannot_join_read_or_write(tmp_path, _collect_mpfutures):
    ids = [load_or_create_identity(tmp_path / n) for n in ("a", "b", "c", "d")]

    async def main():
        a = await start_dht(ids[0], LOOPBACK, [], authorizer=DHTSwarmAuthorizer(KEY))
        try:
            maddrs = [str(m) for m in a.get_visible_maddrs()]
            b = await start_dht(ids[1], LOOPBACK, maddrs, authorizer=DHTSwarmAuthorizer(KEY))
            try:
                from hivemind.utils.timed_storage import get_dht_time

                assert await b.store("k", "members only", get_dht_time() + 30, return_future=True)
                got = await a.get("k", latest=True, return_future=True)
                assert got is not None and got.value == "members only"
            finally:
                await stop_dht(b)
            for auth in (None, DHTSwarmAuthorizer(OTHER_KEY)):
                ident = ids[2] if auth is None else ids[3]
                t0 = time.monotonic()
                with pytest.raises(DaemonError, match=r"initial peer|answered|bootstrap"):
                    await start_dht(ident, LOOPBACK, maddrs, authorizer=auth, startup_timeout=15)
                assert time.monotonic() - t0 < 30
        finally:
            await stop_dht(a)

    asyncio.run(main())


# ------------------------------------------------------------------ hostile gradients


def test_malicious_pusher_is_bounded_and_banned(tmp_path):
    """W drives and pushes honest gradients; M (named in the plan) pushes NaN, huge, wrong-shape and
    1-element gradients. The host's parameters end exactly where honest pushes alone take them."""
    shape = (4, 3)
    job = "j-sec"
    spec = JobSpec(optimizer="sgd", lr=0.1, weight_decay=0.0, grad_clip=None, job_id=job)
    specs = {"w": {"shape": list(shape), "dtype": "float32"}}
    init = torch.arange(12, dtype=torch.float32).reshape(shape) / 10
    gen = torch.Generator().manual_seed(0)
    honest = [torch.randn(shape, generator=gen) for _ in range(10)]

    async def main():
        async with peers(None, None, None) as (h, w, m):
            svc = OptimizerHostService(
                h,
                state_dir=tmp_path,
                step_deadline_s=5.0,
                guard=GuardConfig(ban_base_s=0.1, min_history=3, norm_factor=10),
            )
            expected = {
                "w": {
                    "r0/s0": {"replica": 0, "samples": 1, "peer": w.peer_id},
                    "r1/s0": {"replica": 1, "samples": 1, "peer": m.peer_id},
                }
            }
            init_args = {
                "job": job,
                "driver": w.peer_id,
                "host_index": 0,
                "spec": spec.to_dict(),
                "param_specs": specs,
                "expected": expected,
                "step_deadline_s": 5.0,
            }
            await w.call(h.peer_id, "opt.init", init_args)
            await w.send(
                h.peer_id,
                tensor_message("opt_params", {"job": job, "stage": 0, "step": -1, "mb": 0}, {"w": init}),
            )
            assert (await w.call(h.peer_id, "opt.load", {"job": job}))["ready"]
            shard = svc.shards[job]
            ref = ParameterStore(
                job,
                {"w": init},
                job_optimizer_config(spec.to_dict(), specs),
                ExpectedContributions({"w": {"r0/s0": Contributor("0", 1), "r1/s0": Contributor("1", 1)}}),
            )

            def push(t: Transport, key: str, step: int, grad: torch.Tensor):
                meta = {"job": job, "step": step, "mb": -1, "stage": 0, "contributor": key, "samples": 1}
                return t.send(h.peer_id, tensor_message("push", meta, {"w": grad}))

            attacks = [
                ("rejected_nonfinite", torch.full(shape, float("nan"))),
                ("grad_norm", honest[0] * 1e6),
                ("rejected_shape", torch.ones(3, 4)),
                ("rejected_shape", torch.ones(1)),
            ]
            for step in range(1, 10):
                pushes = shard.store.counters["pushes"]
                await push(w, "r0/s0", step, honest[step])
                ref.push(step, "r0/s0", "w", honest[step], 1)
                offences = sum(svc.bans.offences.values())
                if step <= 4:  # M behaves while a norm history builds up
                    await push(m, "r1/s0", step, honest[step] * 0.5)
                    ref.push(step, "r1/s0", "w", honest[step] * 0.5, 1)
                    await wait_for(lambda p=pushes: shard.store.counters["pushes"] == p + 2, 5, "two pushes")
                elif step <= 8:
                    await wait_for(lambda: not svc.bans.is_banned(m.peer_id), 5, "the previous ban to end")
                    kind, bad = attacks[step - 5]
                    await push(m, "r1/s0", step, bad)
                    await wait_for(
                        lambda o=offences: sum(svc.bans.offences.values()) == o + 1, 5, "an offence"
                    )
                    assert svc.bans.offences[kind] >= 1 and svc.bans.is_banned(m.peer_id)
                    await wait_for(lambda p=pushes: shard.store.counters["pushes"] == p + 1, 5, "W's push")
                else:  # pushes of a banned peer are dropped before they are decoded
                    svc.bans.ban(m.peer_id, "test", "")
                    dropped = svc.bans.dropped_while_banned
                    await push(m, "r1/s0", step, honest[step])
                    await wait_for(lambda d=dropped: svc.bans.dropped_while_banned == d + 1, 5, "a drop")
                    await wait_for(lambda p=pushes: shard.store.counters["pushes"] == p + 1, 5, "W's push")
                await w.call(h.peer_id, "opt.ready", {"job": job, "step": step, "timeout": 0.01})
                out = await w.call(
                    h.peer_id, "opt.apply", {"job": job, "step": step, "lr": 0.1, "force": True}
                )
                assert out["applied"]
                ref.apply(step, 0.1, force=True)
            got = shard.store.get_params(["w"])[1]["w"]
            want = ref.get_params(["w"])[1]["w"]
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            sec = svc.status()[0]["security"]
            assert sec["offences"] == {
                "rejected_nonfinite": 1,
                "grad_norm": 1,
                "rejected_shape": 2,
                "test": 1,
            }
            assert sec["dropped_while_banned"] == 1
            # ban lengths doubled: 0.1, 0.2, 0.4, 0.8, then 1.6 s (which may be over by now, under load)
            assert svc.bans._peers[m.peer_id].strikes == 5

            # job authority: M is in the plan but not the driver; a stranger S is in nothing
            for t in (m,):
                for method, args in (
                    ("opt.apply", {"job": job, "step": 10, "lr": 1.0, "force": True}),
                    ("opt.ready", {"job": job, "step": 10}),
                    ("opt.release", {"job": job}),
                    ("opt.load", {"job": job}),
                    ("opt.init", {**init_args, "job": job, "driver": w.peer_id}),
                ):
                    with pytest.raises(PeerError, match="driver"):
                        await t.call(h.peer_id, method, args)
            with pytest.raises(PeerError, match="another driver"):
                await m.call(h.peer_id, "opt.init", {**init_args, "driver": m.peer_id})

    asyncio.run(main())


def test_strangers_cannot_pull_or_control_a_job(tmp_path):
    async def main():
        async with peers(None, None, None) as (h, driver, stranger):
            svc = OptimizerHostService(h, state_dir=tmp_path)
            from fusionnode.optim.host import HostedShard

            store = ParameterStore(
                "j",
                {"w": torch.zeros(2)},
                job_optimizer_config(JobSpec(job_id="j").to_dict(), {"w": {"shape": [2]}}),
                ExpectedContributions({"w": {"r0/s0": Contributor("0", 1)}}),
            )
            svc.shards["j"] = HostedShard(
                "j", driver.peer_id, store, {"w": {"shape": [2]}}, {"r0/s0": driver.peer_id}, None, 0, 0
            )
            for method, args in (
                ("opt.pull", {"job": "j", "names": ["w"]}),
                ("opt.apply", {"job": "j", "step": 1, "lr": 1.0, "force": True}),
            ):
                with pytest.raises(PeerError, match=r"driver|workers"):
                    await stranger.call(h.peer_id, method, args)
            # a push for a contributor the plan gives to someone else is not counted
            meta = {"job": "j", "step": 1, "mb": -1, "stage": 0, "contributor": "r0/s0", "samples": 1}
            await stranger.send(h.peer_id, tensor_message("push", meta, {"w": torch.ones(2)}))
            await wait_for(lambda: svc.shards["j"].rejected.get("not_in_plan") == 1, 5, "refusal")
            assert store.counters["pushes"] == 0

    asyncio.run(main())


# ------------------------------------------------------------------ resource limits


def test_stream_flood_from_one_peer_is_capped_others_served():
    cap = 8

    async def main():
        async with peers(None, None, None, peer_limits=PeerLimits(max_streams=cap)) as (b, flooder, honest):
            calls = _echo_counter(b)
            held = []
            for _ in range(100):  # open streams and never finish a frame
                _i, reader, writer = await flooder.p2p.call_binary_stream_handler(
                    PeerID.from_base58(b.peer_id), PROTO_DATA
                )
                writer.write(b"FNWP")
                held.append((reader, writer))
            await wait_for(
                lambda: b.peer_limiter.refused.get(flooder.peer_id, {}).get("streams", 0) >= 100 - cap,
                10,
                "refused streams",
            )
            assert b.peer_limiter.streams[flooder.peer_id] <= cap
            t0 = time.monotonic()
            assert (await honest.call(b.peer_id, "echo", {"x": 7}))["echo"] == 7
            assert time.monotonic() - t0 < 2.0 and calls == [honest.peer_id]
            for _r, w in held:
                w.close()
            await wait_for(lambda: flooder.peer_id not in b.peer_limiter.streams, 10, "streams to close")
            status = b.security_status()["peer_limits"]
            assert status["refused"][flooder.peer_id]["streams"] >= 100 - cap

    asyncio.run(main())


# ------------------------------------------------------------------ fuzzing


def _mutations(rng: random.Random, seeds: list[bytes], n: int):
    for i in range(n):
        base = bytearray(rng.choice(seeds))
        op = i % 6
        if op == 0:  # bit flips
            for _ in range(rng.randint(1, 8)):
                pos = rng.randrange(len(base))
                base[pos] ^= 1 << rng.randrange(8)
        elif op == 1:  # truncation
            base = base[: rng.randrange(len(base))]
        elif op == 2:  # random bytes after a valid prefix
            base = base[:6] + bytearray(rng.randbytes(rng.randint(0, 200)))
        elif op == 3:  # hostile header lengths
            struct.pack_into("<IQ", base, 8, rng.choice([0, 1, 0xFFFFFFFF]), rng.choice([0, 1 << 62, 23]))
        elif op == 4:  # envelope bytes scrambled
            for _ in range(rng.randint(1, 16)):
                pos = rng.randrange(24, len(base)) if len(base) > 24 else 0
                base[pos] = rng.randrange(256)
        else:  # pure noise
            base = bytearray(rng.randbytes(rng.randint(0, 64)))
        yield bytes(base)


def test_fuzzed_frames_no_crash_no_hang_memory_flat():
    """10,000+ malformed frames into the RPC and data handlers of running Transports (public and
    private) over real socket streams, then a few hundred through p2pd itself; both stay healthy."""
    n_frames = 10_500

    async def main():
        async with peers(None, SwarmAuthorizer(KEY), None) as (pub, priv, attacker):
            _echo_counter(pub)
            _echo_counter(priv)
            msg = tensor_message("act", {"job": "f", "step": 1, "mb": 0, "stage": 0}, {"x": torch.ones(2, 3)})
            signed = priv.authorizer.sign(msg, attacker.peer_id, priv.peer_id)
            seeds = [
                encode_message(Call("echo", {"x": 1})),
                encode_message(msg),
                encode_message(signed),
                encode_message(priv.authorizer.sign(Call("auth.open", {}), attacker.peer_id, priv.peer_id)),
            ]
            info = StreamInfo(
                PeerID.from_base58(attacker.peer_id), Multiaddr("/ip4/127.0.0.1/tcp/1"), PROTO_RPC
            )
            handlers = [pub._on_rpc_stream, pub._on_data_stream, priv._on_rpc_stream, priv._on_data_stream]
            rng = random.Random(1234)
            proc = psutil.Process(os.getpid())

            async def one(frame: bytes, handler) -> None:
                s1, s2 = socket.socketpair()
                r_srv, w_srv = await asyncio.open_connection(sock=s1)
                _r_cli, w_cli = await asyncio.open_connection(sock=s2)
                w_cli.write(frame)
                w_cli.write_eof()
                await asyncio.wait_for(handler(info, r_srv, w_srv), 5.0)  # no hang
                w_cli.close()

            frames = list(_mutations(rng, seeds, n_frames))
            for i, frame in enumerate(frames[:1000]):  # warm-up: allocator and caches settle
                await one(frame, handlers[i % 4])
            gc.collect()
            rss0 = proc.memory_info().rss
            t0 = time.perf_counter()
            for i, frame in enumerate(frames[1000:]):
                await one(frame, handlers[i % 4])
            dt = time.perf_counter() - t0
            gc.collect()
            rss1 = proc.memory_info().rss
            print(
                f"fuzz: {n_frames - 1000} frames in {dt:.1f} s ({(n_frames - 1000) / dt:.0f}/s); "
                f"RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB"
            )
            assert rss1 - rss0 < 48 << 20
            # a few hundred through p2pd as well
            for frame in frames[:300]:
                with contextlib.suppress(Exception):
                    await _raw_exchange(
                        attacker.p2p, pub.peer_id, rng.choice([PROTO_RPC, PROTO_DATA]), frame, timeout=0.05
                    )
            # both still serve members
            assert (await attacker.call(pub.peer_id, "echo", {"x": 9}))["echo"] == 9
            assert pub.peer_limiter.streams.get(attacker.peer_id, 0) == 0
            assert not pub.peer_limiter.inflight and not priv.peer_limiter.inflight

    asyncio.run(main())
