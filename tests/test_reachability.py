"""Reachability (swarm/reachability.py) on loopback with real p2pd daemons: dial-back answers, relay
slots from a real relay, and relays that cannot serve (unreachable, refusing) logged once and skipped.
The NAT topology itself is tests/test_nat_e2e.py."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket

import pytest

from fusionnode.config import LOCAL_ONLY, NetworkOptions, add_network_arguments, network_options
from fusionnode.errors import ConfigError, PeerError
from fusionnode.runtime.transport import Transport
from fusionnode.swarm.libp2p import create_p2p, daemon_flags
from fusionnode.swarm.reachability import (
    DIALBACK_METHOD,
    Reachability,
    Verdict,
    answer_dialback,
    ask_dialback,
    circuit_addrs,
    tcp_ports,
)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RELAY = NetworkOptions(nat_port_map="off", autonat="off", relay_service=True, reachability="public")


def _parse(*argv: str) -> NetworkOptions:
    p = argparse.ArgumentParser()
    add_network_arguments(p)
    return network_options(p.parse_args(list(argv)))


def test_relay_and_reachability_options():
    relay = _parse("--relay")
    assert relay.relay_service and relay.relay_client and relay.reachability == "public"
    flags = daemon_flags(relay, ["/ip4/198.51.100.1/tcp/1"])
    assert flags["relayService"] and flags["forceReachabilityPublic"]
    via = "/ip4/198.51.100.1/tcp/1/p2p/QmQBmnNqwNGtDVC7qQSEEW6jgyT6KyBTWxNHEWe7z5Jca7"
    nat = _parse("--reachability", "private", "--relay-via", via)
    flags = daemon_flags(nat, ["/ip4/10.0.0.2/tcp/1"])
    assert flags["forceReachabilityPrivate"] and flags["autoRelay"] and flags["trustedRelays"] == via
    assert "forceReachabilityPublic" not in daemon_flags(_parse(), ["/ip4/10.0.0.2/tcp/1"])
    assert daemon_flags(_parse(), ["/ip4/127.0.0.1/tcp/1"]).get("autoRelay") is None
    assert _parse().resolve(["/ip4/127.0.0.1/tcp/0"])["reachability"] == "local"
    with pytest.raises(ConfigError, match="publicly reachable"):
        _parse("--relay", "--reachability", "private")
    with pytest.raises(ConfigError, match="/p2p/"):
        _parse("--relay-via", "/ip4/1.2.3.4/tcp/5")
    assert not _parse("--direct", "off").direct


def test_dialback_reaches_a_listening_port_and_not_a_closed_one():
    async def go():
        a = await create_p2p(LOOPBACK, options=LOCAL_ONLY)
        b = await create_p2p(LOOPBACK, await a.get_visible_maddrs(), options=LOCAL_ONLY)
        ta, tb = Transport(a), Transport(b)
        ta.add_rpc(DIALBACK_METHOD, lambda args, sender: answer_dialback(a, sender, args))
        await ta.start()
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
        closed.close()  # nothing listens there any more
        try:
            port = tcp_ports([str(m) for m in await b.get_visible_maddrs()])[0]
            res = await tb.call(a.peer_id.to_base58(), DIALBACK_METHOD, {"ports": [port, closed_port]})
            assert res["observed"] == ["127.0.0.1"] and res["reached"] == [port], res
            verdict = await ask_dialback(tb, [a.peer_id.to_base58()], [closed_port])
            assert verdict.state == "nat" and verdict.source == "dial-back", verdict
            assert (await ask_dialback(tb, [a.peer_id.to_base58()], [port])).state == "public"
            with pytest.raises(PeerError, match="TCP ports"):
                await tb.call(a.peer_id.to_base58(), DIALBACK_METHOD, {"ports": list(range(1, 10))})
            nobody = await ask_dialback(tb, [], [port])
            assert nobody.state == "unknown"
        finally:
            await ta.close()
            await a.shutdown()
            await b.shutdown()

    asyncio.run(go())


def test_unreachable_and_refusing_relays_are_logged_once_and_a_working_one_serves(caplog):
    """Bad relays: one where nothing listens, one whose port accepts and closes at once (refuses the
    libp2p handshake); both logged once with the reason, the working relay serves. (The shipped p2pd
    grants reservations even with -relayService=0, so a p2pd that refuses a slot is not available.)"""

    async def go():
        relay = await create_p2p(LOOPBACK, options=RELAY)
        nat = await create_p2p(LOOPBACK, options=LOCAL_ONLY)
        ghost = await create_p2p(LOOPBACK, options=LOCAL_ONLY)  # only for a valid peer id nobody serves
        ghost_id = ghost.peer_id.to_base58()
        await ghost.shutdown()

        async def slam(_reader, writer):
            writer.close()

        refuser = await asyncio.start_server(slam, "127.0.0.1", 0)
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
        closed.close()
        try:
            good = str((await relay.get_visible_maddrs())[0])
            refusing = f"/ip4/127.0.0.1/tcp/{refuser.sockets[0].getsockname()[1]}/p2p/{ghost_id}"
            unreachable = f"/ip4/127.0.0.1/tcp/{dead_port}/p2p/{ghost_id}"
            me = nat.peer_id.to_base58()
            reach = Reachability(
                Verdict("nat", "dial-back"), relays=[unreachable, refusing, good], peer_id=me
            )
            with caplog.at_level(logging.WARNING, logger="fusionnode.swarm.reachability"):
                await reach.keep_reservations(nat)
                reach.reservations.clear()  # renew now: the bad relays are tried again, not logged again
                await reach.keep_reservations(nat)
            assert list(reach.reservations) == [good]
            terms = reach.reservations[good]
            assert terms["limit_s"] > 0 and terms["limit_bytes"] > 0 and terms["expires_at"] > 0
            assert reach.state == "relayed"
            assert reach.circuit_addrs == circuit_addrs([good], me)
            msgs = [r.getMessage() for r in caplog.records if "no slot on relay" in r.getMessage()]
            assert len(msgs) == 2, msgs
            assert all("unreachable" in m for m in msgs), msgs
            assert "relayed via" in reach.line()
            # every relay failing: back to plain "behind NAT", said in the line
            reach.relays = [unreachable]
            reach.reservations.clear()
            await reach.keep_reservations(nat)
            assert reach.state == "nat" and reach.circuit_addrs == []
        finally:
            refuser.close()
            for p in (relay, nat):
                await p.shutdown()

    asyncio.run(go())


def test_a_relay_that_refuses_the_reservation_is_logged_once_and_skipped(caplog):
    """A real libp2p peer that speaks the relay protocol and answers RESERVE with RESERVATION_REFUSED
    (its hop handler is ours: the shipped p2pd cannot be told to refuse): logged once with the
    relay's reason, no circuit address from it; the working relay serves."""
    from fusionnode.swarm.reachability import HOP_PROTOCOL

    async def go():
        relay = await create_p2p(LOOPBACK, options=RELAY)
        refuser = await create_p2p(LOOPBACK, options=LOCAL_ONLY)
        nat = await create_p2p(LOOPBACK, options=LOCAL_ONLY)
        asked = []

        async def refuse(_info, reader, writer):
            asked.append(await reader.readexactly(3))  # HopMessage{type: RESERVE}
            writer.write(b"\x05\x08\x02\x28\xc8\x01")  # HopMessage{type: STATUS, status: 200}
            await writer.drain()
            writer.close()

        await refuser.add_binary_stream_handler(HOP_PROTOCOL, refuse)
        try:
            good = str((await relay.get_visible_maddrs())[0])
            refusing = str((await refuser.get_visible_maddrs())[0])
            me = nat.peer_id.to_base58()
            reach = Reachability(Verdict("nat", "dial-back"), relays=[refusing, good], peer_id=me)
            with caplog.at_level(logging.WARNING, logger="fusionnode.swarm.reachability"):
                await reach.keep_reservations(nat)
                reach.reservations.clear()  # renewals: the refusing relay is asked again, not logged again
                await reach.keep_reservations(nat)
            assert asked == [b"\x02\x08\x00"] * 2
            msgs = [r.getMessage() for r in caplog.records if "no slot on relay" in r.getMessage()]
            assert len(msgs) == 1 and "refused a slot: RESERVATION_REFUSED" in msgs[0], msgs
            assert list(reach.reservations) == [good] and reach.state == "relayed"
            assert reach.circuit_addrs == circuit_addrs([good], me)
        finally:
            for p in (relay, refuser, nat):
                await p.shutdown()

    asyncio.run(go())


def test_a_peer_reached_through_its_relay_over_loopback():
    """A peer that listens on nothing (so only its relay slot reaches it) is dialed through the relay:
    the live connection is a /p2p-circuit one."""

    async def go():
        relay = await create_p2p(LOOPBACK, options=RELAY)
        good = str((await relay.get_visible_maddrs())[0])
        peer = await create_p2p(
            LOOPBACK, [good], options=LOCAL_ONLY, no_listen=True
        )  # dialable by relay only
        client = await create_p2p(LOOPBACK, [good], options=LOCAL_ONLY)
        try:
            pid = peer.peer_id.to_base58()
            held = Reachability(Verdict("nat", "option"), relays=[good], peer_id=pid)
            await held.keep_reservations(peer)
            dialer = Reachability(Verdict("public", "option"), peer_id=client.peer_id.to_base58())
            dialer.learn(pid, held.circuit_addrs)
            assert await dialer.dial(client, pid)
            await dialer.refresh(client)
            assert dialer.is_relayed(pid) and "/p2p-circuit" in dialer.relayed_peers[pid]
            assert dialer.relay_dials[pid] == 1
        finally:
            for p in (relay, peer, client):
                await p.shutdown()

    asyncio.run(go())


def test_relayed_links_are_flagged_in_records_and_in_the_planners_cluster():
    import dataclasses
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_swarm_records import make_record

    from fusionnode.swarm.records import LinkMeasurement, PeerRecord
    from fusionnode.train.placement import cluster_from_records

    a_id, b_id = (
        "QmQBmnNqwNGtDVC7qQSEEW6jgyT6KyBTWxNHEWe7z5Jca7",
        "QmQeF1MRu2re6xR1gKK8sy1CVkSbbJBU8wJAfR7LbWDnuZ",
    )
    relayed = LinkMeasurement(bandwidth_bps=2e6, rtt_s=0.05, measured_at=1.0e9, relayed=True)
    a = make_record(a_id, links={b_id: relayed})
    b = make_record(b_id, links={a_id: dataclasses.replace(relayed, relayed=False, bandwidth_bps=3e6)})
    wire = a.to_wire()
    assert wire["links"][b_id]["relayed"] is True
    assert PeerRecord.from_wire(wire).links[b_id].relayed
    old = b.to_wire()
    del old["links"][a_id]["relayed"]  # a record from before issue 22
    assert PeerRecord.from_wire(old).links[a_id].relayed is False
    doc = cluster_from_records([a, b], [a_id, b_id], [])
    (pair,) = doc["links"]["pairs"]
    assert pair["relayed"] is True and pair["bandwidth_gbps"] == 2e6 / 1e9  # the slower measured figure
    # a live peer left out of the job (`train --peers`) is no device, nor in any pair: the planner
    # refused such a document ("links.pairs[0]: unknown device")
    alone = cluster_from_records([a, b], [a_id], [])
    assert [d["id"] for d in alone["devices"]] == [a_id] and alone["links"]["pairs"] == []


def test_the_probe_before_start_speaks_the_private_swarms_authentication():
    from fusionnode.security import SwarmAuthorizer
    from fusionnode.security.keys import SwarmKey
    from fusionnode.swarm.reachability import probe_before_start

    key = SwarmKey.generate()

    async def go():
        a = await create_p2p(LOOPBACK, options=LOCAL_ONLY)
        ta = Transport(a, authorizer=SwarmAuthorizer(key))
        ta.add_rpc(DIALBACK_METHOD, lambda args, sender: answer_dialback(a, sender, args))
        await ta.start()
        boot = [str(m) for m in await a.get_visible_maddrs()]
        try:
            member = await probe_before_start(
                LOOPBACK, boot, make_transport=lambda p2p: Transport(p2p, authorizer=SwarmAuthorizer(key))
            )
            assert member.state == "public" and member.source == "dial-back", member
            outsider = await probe_before_start(
                LOOPBACK,
                boot,
                make_transport=lambda p2p: Transport(p2p, authorizer=SwarmAuthorizer(SwarmKey.generate())),
            )
            assert outsider.state == "unknown" and outsider.reason, outsider  # refused unanswered
        finally:
            await ta.close()
            await a.shutdown()

    asyncio.run(go())
