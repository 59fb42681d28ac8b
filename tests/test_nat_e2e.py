"""Peers behind NAT train through a relay (issue 22), in network namespaces.

Topology (tests/nat_topology.py): a public segment 198.51.100.0/24 (a documentation range that exists
only inside the namespaces) holding a relay, `fusionnode join --relay`; two private segments
10.1.0.0/24 and 10.2.0.0/24, each behind its own router doing nftables masquerade. Peers A and B
start with nothing but the relay as initial peer and reachability left on auto: each must find out
by itself that it is behind NAT (the relay's dial-back fails), take a slot on the relay, and
advertise its /p2p-circuit address. A job R -> A -> B then runs with A as the middle stage: A and B
cannot dial each other (two NATs), so their link runs through the relay; the losses follow the
single-process (`--local`) ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nat_topology import NatTopology, nft_missing, skip_reason

from fusionnode import control
from fusionnode.localswarm import fusionnode_command
from fusionnode.node import READY_PREFIX
from fusionnode.train.local import train_local
from fusionnode.train.spec import JobSpec

pytestmark = [pytest.mark.e2e]  # in the default run: the one test of NAT traversal (about 2 min)

PORT = 31337
READY_TIMEOUT_S = 120.0


def _join(
    topo: NatTopology, name: str, state: Path, listen_ip: str, extra: list[str]
) -> tuple[subprocess.Popen, dict]:
    cmd = [
        *fusionnode_command(),
        "--log-level",
        "INFO",
        "join",
        "--state-dir",
        str(state),
        "--listen",
        f"/ip4/{listen_ip}/tcp/{PORT}",
        "--nat-port-map",
        "off",
        "--heartbeat",
        "2",
        "--record-ttl",
        "8",
        "--probe-interval",
        "5",
        *extra,
    ]
    log = open(state.parent / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the process
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = topo.popen(name, cmd, stdout=subprocess.PIPE, stderr=log, env=env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode(errors="replace")
        if line.startswith(READY_PREFIX):
            return proc, json.loads(line[len(READY_PREFIX) :])
        if not line and proc.poll() is not None:
            break
    raise AssertionError(
        f"{name} did not start; see {state.parent / f'{name}.log'}:\n" + _tail(state.parent / f"{name}.log")
    )


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


async def _wait_peers(sock: Path, n: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    res: dict = {}
    while time.monotonic() < deadline:
        res = await control.call(sock, "peers")
        if len(res["peers"]) >= n:
            return res
        await asyncio.sleep(1.0)
    raise AssertionError(f"only {len(res.get('peers', []))} of {n} peers seen: {res}")


def test_a_peer_behind_nat_is_a_middle_stage_through_a_relay(tmp_path):
    why = skip_reason()
    if why:
        pytest.skip(why)
    assert nft_missing() is None, nft_missing()
    with NatTopology() as topo:
        topo.add_public("relay")
        topo.add_private("a")
        topo.add_private("b")
        dirs = {n: tmp_path / n for n in ("relay", "a", "b")}
        for d in dirs.values():
            d.mkdir()
        _r, relay = _join(topo, "relay", dirs["relay"], topo.addr["relay"], ["--relay"])
        assert relay["reachability"]["state"] == "public"
        boot = [m for m in relay["maddrs"] if topo.addr["relay"] in m]
        assert boot, relay["maddrs"]
        ready = {"relay": relay}
        for name in ("a", "b"):
            _p, ready[name] = _join(topo, name, dirs[name], topo.addr[name], ["--initial-peers", *boot])
            reach = ready[name]["reachability"]
            # found out by a dial-back, not told: behind NAT, with a slot on the relay
            assert reach["source"] == "dial-back", reach
            assert reach["state"] == "relayed", reach
            assert reach["observed"] == [topo.addr[f"{name}-gw"]], reach  # the NAT's public address
            assert reach["circuit_addrs"] == [f"{boot[0]}/p2p-circuit/p2p/{ready[name]['peer_id']}"]
            terms = reach["reservations"][boot[0]]
            assert terms["limit_s"] > 0 and terms["limit_bytes"] > 0, terms  # the relay's own terms
            print(f"{name}: relay terms {terms}", file=sys.stderr)
            assert any("/p2p-circuit/" in m for m in ready[name]["maddrs"])  # advertised in its record

        sock = {n: dirs[n] / "control.sock" for n in dirs}
        peers = asyncio.run(_wait_peers(sock["relay"], 3, 60))
        assert peers["reachability"]["state"] == "public"
        ids = [ready[n]["peer_id"] for n in ("relay", "a", "b")]

        spec = JobSpec(
            model="gpt2-tiny",
            steps=4,
            batch_size=8,
            micro_batches=2,
            seq_len=32,
            seed=5,
            grad_clip=None,
            lr=3e-3,
            warmup_steps=2,
        )

        async def run() -> list[dict]:
            events = []
            params = {"spec": spec.to_dict(), "stages": 3, "peers": ids, "planner": "simple"}
            async for obj in control.call_stream(sock["relay"], "train", params, timeout=600):
                if "event" in obj:
                    events.append(obj["event"])
                else:
                    return events
            raise AssertionError("no result")

        events = asyncio.run(run())
        plans = [e for e in events if e.get("type") == "plan"]
        assert plans and [st["peer"] for st in plans[0]["stages"]] == ids, plans  # A is the middle stage
        dist = [e["loss"] for e in events if e["type"] == "step"]
        ref = train_local(spec).losses
        assert len(dist) == len(ref) == spec.steps
        for i, (a, b) in enumerate(zip(dist, ref, strict=True)):
            assert abs(a - b) < 1e-6, f"step {i}: through the relay {a:.8f} vs local {b:.8f}"

        # the A -> B link ran through the relay; the peers say so
        status_a = asyncio.run(control.call(sock["a"], "status"))
        status_b = asyncio.run(control.call(sock["b"], "status"))
        print("A's connections", status_a["reachability"]["connections"], file=sys.stderr)
        print("B's connections", status_b["reachability"]["connections"], file=sys.stderr)
        dials = status_a["reachability"]["relay_dials"].get(ready["b"]["peer_id"], 0) + status_b[
            "reachability"
        ]["relay_dials"].get(ready["a"]["peer_id"], 0)
        print(
            "relay dials A->B, B->A",
            status_a["reachability"]["relay_dials"],
            status_b["reachability"]["relay_dials"],
            file=sys.stderr,
        )
        assert dials >= 1, (status_a["reachability"], status_b["reachability"])
        # the direct fast path where a dial can reach: A -> the relay (public); libp2p through the relay
        # between the two NATs ("relayed"), never direct
        paths_a = status_a["security"]["paths"]
        print("A's paths", paths_a, file=sys.stderr)
        assert paths_a.get(ready["b"]["peer_id"]) == "relayed", paths_a  # libp2p through the relay
        carried = status_a["security"]["path_bytes"][ready["b"]["peer_id"]]
        assert carried.get("relayed", 0) > 0 and "direct" not in carried, carried
        status_r = asyncio.run(control.call(sock["relay"], "status"))
        print(
            "paths R, A, B",
            status_r["security"]["paths"],
            paths_a,
            status_b["security"]["paths"],
            file=sys.stderr,
        )
        if ready["relay"]["peer_id"] in paths_a:  # A dials the public relay: the direct path
            assert paths_a[ready["relay"]["peer_id"]] == "direct", paths_a
        assert status_r["security"]["paths"].get(ready["a"]["peer_id"]) == "libp2p"  # A's address is private
        # never a direct connection between the two NATs (no hole punching in the shipped p2pd)
        for addr in status_a["reachability"]["connections"].get(ready["b"]["peer_id"], []):
            assert "/p2p-circuit" in addr, addr
        # the link probes of A and B ran over the relay and say so in the records the planner reads
        recs = {r["peer_id"]: r for r in asyncio.run(control.call(sock["relay"], "peers"))["peers"]}
        links = {n: recs[ready[n]["peer_id"]]["links"] for n in ("a", "b")}
        print("A's and B's links", links, file=sys.stderr)
        relayed_links = [
            m
            for n, other in (("a", "b"), ("b", "a"))
            for pid, m in links[n].items()
            if pid == ready[other]["peer_id"]
        ]
        assert relayed_links and all(m["relayed"] and m["bandwidth_bps"] > 0 for m in relayed_links), links
        out = subprocess.run(
            [sys.executable, "-m", "fusionnode", "status", "--state-dir", str(dirs["a"])],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "behind NAT" in out.stdout and "relayed" in out.stdout, out.stdout + out.stderr
