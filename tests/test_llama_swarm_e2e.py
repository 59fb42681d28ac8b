"""A tiny Llama trained as a 3-stage pipeline over real loopback peers follows `--local` exactly (fp32)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from fusionnode import control
from fusionnode.demo import LocalSwarm
from fusionnode.train.checkpoint import load_checkpoint
from fusionnode.train.local import train_local
from fusionnode.train.spec import JobSpec

pytestmark = pytest.mark.e2e

N_PEERS = 3
TOL = 1e-5


def run_job(swarm: LocalSwarm, spec: JobSpec, **extra) -> list[dict]:
    async def go():
        events = []
        params = {"spec": spec.to_dict(), "stages": N_PEERS, **extra}
        async for obj in control.call_stream(swarm.control(0), "train", params, timeout=300):
            if "event" in obj:
                events.append(obj["event"])
            else:
                return events
        raise AssertionError("no result")

    return asyncio.run(go())


def test_tiny_llama_over_three_peers_follows_local(tmp_path):
    spec = JobSpec(
        model="llama-tiny",
        steps=6,
        batch_size=8,
        micro_batches=2,
        seq_len=32,
        seed=5,
        lr=3e-3,
        warmup_steps=2,
        compress="none",
        save_dir=str(tmp_path / "swarm"),
        save_every=0,
    )
    (tmp_path / "peers").mkdir()
    swarm = LocalSwarm(tmp_path / "peers", N_PEERS, log=sys.stderr)
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        events = run_job(swarm, spec, offload="on")
    finally:
        swarm.stop()
    plan = next(e for e in events if e["type"] == "plan")
    assert len({s["peer"] for s in plan["stages"]}) == N_PEERS
    dist = [e["loss"] for e in events if e["type"] == "step"]
    local = train_local(spec.replace(save_dir=str(tmp_path / "local")))
    assert len(dist) == len(local.losses) == spec.steps
    for i, (a, b) in enumerate(zip(dist, local.losses, strict=True)):
        assert abs(a - b) < TOL, f"step {i}: swarm {a:.7f} vs local {b:.7f}"
    got = load_checkpoint(str(tmp_path / "swarm")).params
    for name, want in local.params.items():
        err = ((got[name] - want).norm() / want.norm()).item()
        assert err < TOL, f"{name}: relative difference {err:.2e}"
