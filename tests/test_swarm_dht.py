"""Swarm layer over real DHTs on loopback: startup errors, restarts, membership, probing, leaving, forgery."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
from collections.abc import Awaitable, Callable

import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.utils.timed_storage import get_dht_time

from fusionnode.config import LOCAL_ONLY
from fusionnode.errors import ConfigError, DaemonError
from fusionnode.swarm import (
    Membership,
    MembershipConfig,
    ProbeConfig,
    load_or_create_identity,
    start_dht,
    stop_dht,
)
from fusionnode.swarm.libp2p import OptionsDHT
from fusionnode.swarm.profile import DeviceProfile
from fusionnode.swarm.records import MAX_RECORD_TTL, PEERS_KEY

torch.set_num_threads(1)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PROFILE = DeviceProfile(
    kind="cpu",
    name="test cpu",
    memory_total_bytes=16 << 30,
    memory_free_bytes=8 << 30,
    tflops_fp32=0.1,
    tflops_bf16=None,
    tflops_fp16=None,
    torch_version=str(torch.__version__),
    cpu_count=2,
    measured_at=1.0e9,
)
FAST = MembershipConfig(
    heartbeat_s=0.5,
    record_ttl_s=2.0,
    leave_ttl_s=0.5,
    probe=ProbeConfig(interval_s=1.0, probe_bytes=256 << 10, peers_per_round=2, pings=3),
)


@pytest.fixture(autouse=True)
def _collect_mpfutures():
    """Free hivemind MPFutures (torch shared memory) while torch_shm_manager is alive.

    Exceptions from a failed DHT start keep MPFutures alive in reference cycles; if those are collected
    after the session-end reaper in conftest.py has killed torch_shm_manager, freeing their shared
    memory aborts the interpreter ("Broken pipe" from libshm).
    """
    yield
    gc.collect()


async def wait_until(cond: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Poll ``cond`` until true; return seconds waited; fail the test after ``timeout`` seconds."""
    t0 = time.monotonic()
    while not await cond():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_initial_peer_is_a_clear_daemon_error(tmp_path):
    ident = load_or_create_identity(tmp_path / "a")
    other = load_or_create_identity(tmp_path / "b")
    addr = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{other.peer_id}"

    async def main():
        t0 = time.monotonic()
        with pytest.raises(DaemonError, match="initial peer") as info:
            await start_dht(ident, LOOPBACK, [addr], startup_timeout=30)
        assert addr in str(info.value)
        assert time.monotonic() - t0 < 35
        with pytest.raises(ConfigError, match="p2p"):
            await start_dht(ident, LOOPBACK, ["/ip4/127.0.0.1/tcp/1"])
        with pytest.raises(ConfigError, match="not a multiaddr"):
            await start_dht(ident, ["garbage"], [])

    asyncio.run(main())


def test_peer_id_survives_restart(tmp_path):
    async def main():
        seen = []
        for _ in range(2):
            ident = load_or_create_identity(tmp_path)
            dht = await start_dht(ident, LOOPBACK, [])
            try:
                seen.append(dht.peer_id)
                assert dht.peer_id == ident.peer_id  # p2pd really runs with our key
            finally:
                await stop_dht(dht)
        assert seen[0] == seen[1]

    asyncio.run(main())


def test_three_peers_find_each_other_probe_and_leave(tmp_path):
    idents = [load_or_create_identity(tmp_path / f"n{i}") for i in range(3)]

    async def main():
        dhts = [await start_dht(idents[0], LOOPBACK, [])]
        boot = [str(m) for m in dhts[0].get_visible_maddrs()]
        dhts += await asyncio.gather(*(start_dht(i, LOOPBACK, boot) for i in idents[1:]))
        members, tasks = [], []
        try:
            for dht, ident in zip(dhts, idents, strict=True):
                p2p = await dht.replicate_p2p()
                maddrs = [str(m) for m in dht.get_visible_maddrs()]
                m = Membership(
                    dht,
                    p2p,
                    ident,
                    PROFILE,
                    roles=["worker"],
                    capacity_bytes=1 << 30,
                    maddrs=maddrs,
                    config=FAST,
                )
                members.append(m)
            tasks = [asyncio.create_task(m.run()) for m in members]
            all_ids = {i.peer_id.to_base58() for i in idents}

            async def everyone_sees_three() -> bool:
                views = [await m.peers() for m in members]
                return all({r.peer_id for r in v} == all_ids for v in views)

            await wait_until(everyone_sees_three, 20, "3 peers to see each other")
            records = await members[0].peers()
            assert all(r.device == PROFILE and r.roles == ("worker",) for r in records)
            assert {r.peer_id for r in await members[0].peers(include_self=False)} == all_ids - {
                idents[0].peer_id.to_base58()
            }

            async def a_link_is_published() -> bool:
                return any(r.links for r in await members[1].peers())

            await wait_until(a_link_is_published, 20, "a measured link in a published record")
            for rec in await members[1].peers():
                for target, link in rec.links.items():
                    assert target in all_ids - {rec.peer_id}
                    assert link.bandwidth_bps > 0 and link.rtt_s > 0
            direct = await members[0].prober.probe(idents[1].peer_id.to_base58())
            assert direct.bandwidth_bps > 0 and 0 < direct.rtt_s < 1

            # jobs and availability changes are published without waiting a heartbeat
            members[1].set_jobs(["job-a"])
            members[1].set_availability("paused", next_window="22:00-06:00")

            async def change_seen() -> bool:
                r = {x.peer_id: x for x in await members[0].peers()}.get(idents[1].peer_id.to_base58())
                return r is not None and r.jobs == ("job-a",) and r.availability == "paused"

            await wait_until(change_seen, 10, "availability/jobs change")

            # graceful leave: gone from peers() at once, entry expires shortly after
            await members[2].withdraw()
            await asyncio.wait_for(tasks[2], 5)  # run() returns after withdraw
            leaver = idents[2].peer_id.to_base58()

            async def leaver_gone() -> bool:
                return leaver not in {r.peer_id for r in await members[0].peers()}

            assert await wait_until(leaver_gone, 2, "withdrawn peer to disappear") < 2
            leaving = {r.peer_id: r for r in await members[0].peers(include_leaving=True)}
            assert leaver not in leaving or leaving[leaver].availability == "leaving"

            # crash: no withdraw; the record disappears once its TTL runs out
            tasks[1].cancel()
            await stop_dht(dhts[1])
            crashed = idents[1].peer_id.to_base58()

            async def crashed_gone() -> bool:
                return crashed not in {r.peer_id for r in await members[0].peers(include_leaving=True)}

            waited = await wait_until(crashed_gone, FAST.record_ttl_s + 5, "crashed peer to expire")
            assert waited <= FAST.record_ttl_s + 5
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for dht in dhts:
                await stop_dht(dht)

    asyncio.run(main())


async def _stored_entries(_dht: OptionsDHT, node) -> dict[bytes, tuple[float, bytes]]:
    """Runs inside a DHT process: {subkey: (expiration, signed value bytes)} held under PEERS_KEY."""
    key_id = DHTID.generate(source=PEERS_KEY)
    entries = {}
    for storage in (node.protocol.storage, node.protocol.cache):
        found = storage.get(key_id)
        if found is not None and hasattr(found.value, "items"):
            for subkey, item in found.value.items():
                entries[subkey] = (item.expiration_time, item.value)
    return entries


def test_live_nodes_reject_forged_and_far_future_records(tmp_path):
    honest = load_or_create_identity(tmp_path / "honest")
    attacker = load_or_create_identity(tmp_path / "attacker")

    async def main():
        dht = await start_dht(honest, LOOPBACK, [])
        # the attacker runs modified software: it signs with its own key but skips the binding and schema checks
        evil = await asyncio.to_thread(
            OptionsDHT,
            options=LOCAL_ONLY,
            initial_peers=[str(m) for m in dht.get_visible_maddrs()],
            start=True,
            host_maddrs=LOOPBACK,
            identity_path=str(attacker.p2p_key_path),
            record_validators=[RSASignatureValidator(attacker.private_key)],
        )
        try:
            member = Membership(
                dht,
                await dht.replicate_p2p(),
                honest,
                PROFILE,
                roles=[],
                capacity_bytes=0,
                maddrs=[],
                config=FAST,
            )
            assert await member.publish()
            genuine = member.own_record().to_wire()
            forged = dict(genuine, capacity_bytes=1 << 40, updated_at=get_dht_time() + 1)  # honest's peer id
            # (store() reports the last replica's answer, so its return value says little here)
            await evil.store(
                PEERS_KEY, forged, get_dht_time() + 10, subkey=attacker.owner_tag, return_future=True
            )
            # the attacker's own node kept it ...
            assert attacker.owner_tag in await evil.run_coroutine(_stored_entries, return_future=True)
            # ... the honest node refused to store it, and does not list it
            held = await dht.run_coroutine(_stored_entries, return_future=True)
            assert honest.owner_tag in held and attacker.owner_tag not in held
            records = await member.peers()
            assert [(r.peer_id, r.capacity_bytes) for r in records] == [(honest.peer_id.to_base58(), 0)]

            # an expiration beyond the cap, or an unknown field, never enters the honest node's storage
            far = get_dht_time() + MAX_RECORD_TTL + 3600
            await dht.store(PEERS_KEY, genuine, far, subkey=honest.owner_tag, return_future=True)
            bad = dict(genuine, extra_field=1, updated_at=get_dht_time() + 2)
            await dht.store(PEERS_KEY, bad, get_dht_time() + 5, subkey=honest.owner_tag, return_future=True)
            expiration, value = (await dht.run_coroutine(_stored_entries, return_future=True))[
                honest.owner_tag
            ]
            assert expiration < get_dht_time() + MAX_RECORD_TTL and b"extra_field" not in value
            # while the attacker's lax node took the far-future one (so the honest refusal is what we saw)
            evil_held = await evil.run_coroutine(_stored_entries, return_future=True)
            assert evil_held[honest.owner_tag][0] == far
        finally:
            await stop_dht(evil)
            await stop_dht(dht)

    asyncio.run(main())
