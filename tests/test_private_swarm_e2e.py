"""A private swarm of real `fusionnode join` processes: members train together, an outsider gets nowhere."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from fusionnode import control
from fusionnode.config import LOCAL_JOIN_FLAGS
from fusionnode.localswarm import LocalSwarm
from fusionnode.train.spec import JobSpec

pytestmark = pytest.mark.e2e


def keygen(path) -> None:
    subprocess.run(
        [sys.executable, "-m", "fusionnode", "keygen", "--out", str(path)],
        check=True,
        capture_output=True,
        timeout=60,
    )


def test_members_train_and_an_outsider_cannot_join(tmp_path):
    keygen(tmp_path / "swarm.key")
    keygen(tmp_path / "other.key")
    swarm = LocalSwarm(tmp_path / "members", 2, log=None)
    (tmp_path / "members").mkdir()
    swarm.extra_args = ["--swarm-key", str(tmp_path / "swarm.key")]
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        status = asyncio.run(control.call(swarm.control(0), "status"))
        assert status["private_swarm"]

        async def train() -> list[dict]:
            spec = JobSpec(model="gpt2-tiny", steps=2, batch_size=4, micro_batches=2, seq_len=16, seed=1)
            events = []
            async for obj in control.call_stream(
                swarm.control(0), "train", {"spec": spec.to_dict(), "stages": 2}, timeout=300
            ):
                if "event" in obj:
                    events.append(obj["event"])
                else:
                    return events
            return events

        steps = [e for e in asyncio.run(train()) if e["type"] == "step"]
        assert len(steps) == 2 and all(s["wire_bytes"] > 0 for s in steps)

        # an outsider with another key, dialing a member, is not let into the swarm
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "fusionnode",
                "join",
                "--state-dir",
                str(tmp_path / "outsider"),
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                *LOCAL_JOIN_FLAGS,
                "--swarm-key",
                str(tmp_path / "other.key"),
                "--initial-peers",
                *swarm.ready[0]["maddrs"],
                "--startup-timeout",
                "30",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out.stdout + out.stderr
        assert "Traceback" not in out.stderr
        assert (
            "may not hold this peer's swarm key" in out.stderr
            and "ensure_bootstrap_success" not in out.stderr
        )
        # one without any key is told the swarm may be private
        out = subprocess.run(
            [
                *(sys.executable, "-m", "fusionnode", "join", "--state-dir", str(tmp_path / "keyless")),
                *("--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peers", *swarm.ready[0]["maddrs"]),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out.stdout + out.stderr
        assert "if that swarm is private" in out.stderr and "--swarm-key FILE" in out.stderr
        # more stages than the swarm has workers: refused, not silently fewer
        out = subprocess.run(
            [
                *(sys.executable, "-m", "fusionnode", "train", "--state-dir", str(swarm.state_dir(0))),
                *("--stages", "3", "--steps", "1", "--seq-len", "16"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2
        assert "--stages 3 x 1 pipeline(s) need 3 workers; the swarm has 2 available" in out.stderr
        members = {p["peer_id"] for p in asyncio.run(control.call(swarm.control(1), "peers"))["peers"]}
        assert members == {r["peer_id"] for r in swarm.ready}
        assert json.dumps(status)  # the status stays serialisable with the security section
    finally:
        swarm.stop()
    for i in range(2):  # ordinary runs keep hivemind's INFO lines and a lone peer's first refusals quiet
        log = (tmp_path / "members" / f"peer{i}.log").read_text()
        assert "[INFO]" not in log and "not accepted by any DHT node" not in log, log[-2000:]
