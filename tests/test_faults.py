"""Faults on real `fusionnode join` processes on loopback: a worker SIGKILLed mid-step, a worker
that leaves gracefully, a driver that disappears. With offload every step is applied exactly once,
so the loss curve equals the single-process reference."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time

import pytest

from fusionnode import control
from fusionnode.demo import LocalSwarm
from fusionnode.train.local import train_local
from fusionnode.train.spec import JobSpec

pytestmark = pytest.mark.e2e

LOSS_TOL = 1e-3  # absolute loss difference to the single-process run (the e2e tests' tolerance)


def spec_for(tmp_path, **kw) -> JobSpec:
    base = dict(
        model="gpt2-tiny",
        steps=12,
        batch_size=8,
        micro_batches=2,
        seq_len=32,
        seed=5,
        grad_clip=1.0,
        lr=3e-3,
        warmup_steps=2,
        metrics_out=str(tmp_path / "metrics.jsonl"),
    )
    base.update(kw)
    return JobSpec(**base)


def peer_index(swarm: LocalSwarm, peer_id: str) -> int:
    return next(i for i, r in enumerate(swarm.ready) if r["peer_id"] == peer_id)


def kill(swarm: LocalSwarm, i: int) -> None:
    os.killpg(swarm.procs[i].pid, signal.SIGKILL)  # the daemon, its DHT child and p2pd: no goodbye
    swarm.procs[i].wait(10)


async def train(swarm: LocalSwarm, params: dict, on_event=None) -> tuple[dict, list[dict]]:
    events = []
    async for obj in control.call_stream(swarm.control(0), "train", params, timeout=600):
        if "event" not in obj:
            return obj["result"], events
        events.append(obj["event"])
        if on_event is not None:
            await on_event(obj["event"], events)
    raise AssertionError("the driver closed the job without a result")


def metrics_events(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    return [r for r in recs if r.get("type") == "event"]


def test_a_worker_killed_mid_step_is_replaced_and_no_step_is_lost_or_repeated(tmp_path):
    swarm = LocalSwarm(tmp_path, 3, log=sys.stderr)
    rng = random.Random(7)
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        spec = spec_for(tmp_path)
        killed: list[str] = []

        async def on_event(ev: dict, events: list[dict]) -> None:
            if ev["type"] == "step" and ev["step"] == 4 and not killed:
                plan = next(e for e in events if e["type"] == "plan")
                victim = next(s["peer"] for s in plan["stages"] if s["peer"] != swarm.ready[0]["peer_id"])
                await asyncio.sleep(rng.uniform(0.0, ev["step_time_s"]))  # somewhere in the next step
                kill(swarm, peer_index(swarm, victim))
                killed.append(victim)

        t0 = time.monotonic()
        result, events = asyncio.run(
            train(
                swarm, {"spec": spec.to_dict(), "stages": 2, "offload": "on", "rebalance_every": 0}, on_event
            )
        )
        assert killed
        steps = [e for e in events if e["type"] == "step"]
        assert [e["step"] for e in steps] == list(range(spec.steps))  # none lost, none twice
        ref = train_local(spec.replace(metrics_out=None)).losses
        for i, (a, b) in enumerate(zip([e["loss"] for e in steps], ref, strict=True)):
            assert abs(a - b) < LOSS_TOL, f"step {i}: {a:.6f} vs single-process {b:.6f}"
        ev = metrics_events(spec.metrics_out)
        failure = next(e for e in ev if e["event"] == "failure")
        assert failure["peer"] == killed[0]
        recovered = next(e for e in ev if e["event"] == "recovered")
        assert recovered["ts"] >= failure["ts"] and recovered["time_to_recover_s"] > 0
        replans = [e for e in ev if e["event"] == "replan"]
        assert len(replans) == 2 and killed[0] not in replans[-1]["peers"]
        assert result["steps"] == spec.steps
        assert time.monotonic() - t0 < 120
    finally:
        swarm.stop()
