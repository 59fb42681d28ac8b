"""Real `fusionnode join` processes on loopback: they find each other, measure links, and forget the dead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fusionnode.localswarm import LocalSwarm

pytestmark = pytest.mark.e2e


def peers_json(swarm: LocalSwarm, i: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "fusionnode", "peers", "--json", "--state-dir", str(swarm.state_dir(i))],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_three_peers_find_each_other_measure_links_and_forget_a_killed_one(tmp_path):
    swarm = LocalSwarm(tmp_path, 3, log=None)
    swarm.extra_args = ["--probe-interval", "2"]
    try:
        swarm.start()
        ids = {r["peer_id"] for r in swarm.ready}

        def all_listed_with_a_link():
            res = peers_json(swarm, 2)
            listed = {p["peer_id"]: p for p in res["peers"]}
            links = [link for p in listed.values() for link in (p.get("links") or {}).values()]
            return res if set(listed) == ids and links else None

        res = wait_for(all_listed_with_a_link, 60, "3 peers and a measured link")
        for p in res["peers"]:
            assert p["device"]["tflops_fp32"] > 0 and p["device"]["memory_total_bytes"] > 0
            assert p["maddrs"] and set(p["roles"]) == {"worker", "optimizer"}
        link = next(v for p in res["peers"] for v in (p.get("links") or {}).values())
        assert link["bandwidth_bps"] > 0 and link["rtt_s"] > 0

        # the table form is readable and names every peer
        table = subprocess.run(
            [sys.executable, "-m", "fusionnode", "peers", "--state-dir", str(swarm.state_dir(0))],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert all(f"…{pid[-8:]}" in table for pid in ids)  # as cli.short_peer names them

        # offline-style planning over the live swarm: every device of the plan is a peer of the swarm
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "fusionnode",
                "plan",
                "--swarm",
                "--state-dir",
                str(swarm.state_dir(0)),
                "--model",
                "gpt2-tiny",
                "--batch-size",
                "16",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        plan = json.loads(out.stdout)
        devices = {d for pipe in plan["pipelines"] for st in pipe["stages"] for d in st["devices"]}
        assert devices and devices <= ids

        victim = swarm.ready[1]["peer_id"]
        os.kill(swarm.procs[1].pid, signal.SIGKILL)  # no goodbye: its record must expire (TTL 8 s)
        t0 = time.monotonic()
        wait_for(
            lambda: victim not in {p["peer_id"] for p in peers_json(swarm, 0)["peers"]},
            40,
            "the killed peer to disappear",
        )
        assert time.monotonic() - t0 < 40

        # graceful leave: the daemon exits by itself with code 0
        out = subprocess.run(
            [sys.executable, "-m", "fusionnode", "leave", "--state-dir", str(swarm.state_dir(2))],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "leaving" in out.stdout
        assert swarm.procs[2].wait(timeout=60) == 0
    finally:
        swarm.stop()


def test_commands_without_a_daemon_say_so(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fusionnode", "peers", "--state-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "no daemon is running" in out.stderr and "Traceback" not in out.stderr
