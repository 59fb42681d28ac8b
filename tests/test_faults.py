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
from fusionnode.localswarm import LocalSwarm
from fusionnode.train.local import train_local
from fusionnode.train.spec import JobSpec

pytestmark = pytest.mark.e2e

LOSS_TOL = 1e-3  # absolute loss difference to the single-process run (the e2e tests' tolerance)
FRESH_OPTIMIZER_TOL = 0.25  # the last steps' loss difference after hosts restarted with new Adam state


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
        failure = next(e for e in ev if e["event"] == "failure" and e.get("peer"))  # transient ones name none
        assert failure["peer"] == killed[0]
        recovered = next(e for e in ev if e["event"] == "recovered")
        assert recovered["ts"] >= failure["ts"] and recovered["time_to_recover_s"] > 0
        replans = [e for e in ev if e["event"] == "replan"]
        # the initial plan and the one replacing the victim; a transient error elsewhere under load may add
        # a re-plan, which must still leave every step done exactly once (checked above)
        assert len(replans) >= 2 and killed[0] not in replans[-1]["peers"]
        assert result["steps"] == spec.steps
        assert time.monotonic() - t0 < 120
    finally:
        swarm.stop()


def status(swarm: LocalSwarm, i: int) -> dict:
    return asyncio.run(control.call(swarm.control(i), "status"))


def final_losses(steps: list[dict]) -> dict[int, float]:
    """Step -> loss of its last run (a replayed step is recorded again)."""
    return {e["step"]: e["loss"] for e in steps}


@pytest.mark.slow
def test_leave_driver_death_resume_and_optimizer_host_death(tmp_path):
    """One swarm of 4 for the slower faults: a graceful leave, an optimizer host SIGKILLed (restored
    from its shard checkpoint, steps since replayed), and the driver SIGKILLed (the workers drop
    the job when its lease runs out; `train --resume` from another peer finishes it)."""
    swarm = LocalSwarm(tmp_path, 4, log=sys.stderr)
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        ids = [r["peer_id"] for r in swarm.ready]
        ref_spec = spec_for(tmp_path)
        ref = train_local(ref_spec.replace(metrics_out=None)).losses

        # 1. graceful leave: SIGTERM a worker of the plan; it drains, the driver re-plans without it
        left: list[str] = []

        async def on_leave(ev: dict, events: list[dict]) -> None:
            if ev["type"] == "step" and ev["step"] == 3 and not left:
                plan = next(e for e in events if e["type"] == "plan")
                victim = next(s["peer"] for s in plan["stages"] if s["peer"] != ids[0])
                swarm.procs[ids.index(victim)].send_signal(signal.SIGTERM)
                left.append(victim)

        spec = ref_spec.replace(metrics_out=str(tmp_path / "leave.jsonl"))
        _res, events = asyncio.run(
            train(
                swarm, {"spec": spec.to_dict(), "stages": 2, "offload": "on", "rebalance_every": 0}, on_leave
            )
        )
        steps = [e for e in events if e["type"] == "step"]
        assert [e["step"] for e in steps] == list(range(spec.steps))
        assert max(abs(a - b) for a, b in zip([e["loss"] for e in steps], ref, strict=True)) < LOSS_TOL
        ev = metrics_events(spec.metrics_out)
        leave = next(e for e in ev if e["event"] == "leave")
        assert leave["peer"] == left[0]
        assert not any(
            e["event"] == "failure" and e.get("peer") for e in ev
        )  # a leave is not a failure: no ban
        swarm.procs[ids.index(left[0])].wait(30)
        swarm.add_peer()
        ids = [r["peer_id"] for r in swarm.ready]
        alive = [i for i, p in enumerate(swarm.procs) if p.poll() is None]
        asyncio.run(swarm.wait_connected(peers=[ids[alive[-1]]]))  # the driver (peer 0) knows the new peer

        # 2. the optimizer host dies: hosts restore the last shard checkpoint, steps since are replayed
        host = ids[alive[-1]]
        workers = [ids[i] for i in alive if ids[i] != host]
        killed: list[str] = []

        async def on_host(ev: dict, events: list[dict]) -> None:
            if ev["type"] == "step" and ev["step"] == 6 and not killed:
                kill(swarm, ids.index(host))
                killed.append(host)

        spec = ref_spec.replace(
            metrics_out=str(tmp_path / "host.jsonl"), save_dir=str(tmp_path / "ck-host"), save_every=4
        )
        params = {
            "spec": spec.to_dict(),
            "stages": 2,
            "offload": "on",
            "rebalance_every": 0,
            "peers": workers,
            "optimizer_peers": [host],
        }
        _res, events = asyncio.run(train(swarm, params, on_host))
        plan = next(e for e in events if e["type"] == "plan")
        assert plan["optimizer_hosts"] == [host]
        steps = [e for e in events if e["type"] == "step"]
        got = final_losses(steps)
        assert sorted(got) == list(range(spec.steps))
        ev = metrics_events(spec.metrics_out)
        rec = next(e for e in ev if e["event"] == "recovered" and e.get("role") == "optimizer")
        assert rec["replay_from"] == 4  # the checkpoint of step 4
        # the new host cannot read the dead one's disk: the hosts restart from the driver's step-4
        # checkpoint with new optimizer state
        assert rec["fresh_optimizer"]
        assert max(abs(got[i] - ref[i]) for i in got if i < 4) < LOSS_TOL
        # new Adam state: the first step after it spikes (4.39 -> 6.77 once, the reference 3.89), the
        # last steps are back near the reference
        assert max(abs(got[i] - ref[i]) for i in got if i >= spec.steps - 3) < FRESH_OPTIMIZER_TOL
        assert any(e["event"] == "failure" and e["peer"] == host for e in ev)

        # 3. the driver dies: its workers drop the job once its lease runs out; resume elsewhere
        alive = [i for i, p in enumerate(swarm.procs) if p.poll() is None]
        drv = alive[1]  # a driver that is not peer 0, whose control socket resumes the job
        spec = ref_spec.replace(
            metrics_out=str(tmp_path / "drv.jsonl"), save_dir=str(tmp_path / "ck-drv"), save_every=4
        )
        params = {"spec": spec.to_dict(), "stages": 2, "offload": "on", "rebalance_every": 0, "lease_s": 4}

        async def drive_then_die() -> None:
            async for obj in control.call_stream(swarm.control(drv), "train", params, timeout=600):
                ev = obj.get("event", {})
                if ev.get("type") == "step" and ev["step"] == 6:
                    kill(swarm, drv)
                    return

        asyncio.run(drive_then_die())
        others = [i for i in alive if i != drv]
        deadline = time.monotonic() + 40
        while any(status(swarm, i)["serving"] for i in others):
            assert time.monotonic() < deadline, "workers kept the stages of a dead driver"
            time.sleep(0.5)
        res_params = {**params, "resume": True, "lease_s": None}
        result, events = asyncio.run(train_on(swarm, others[0], res_params))
        steps = [e for e in events if e["type"] == "step"]
        assert steps[0]["step"] == 4 and steps[-1]["step"] == spec.steps - 1
        assert not any(e.get("fresh_optimizer") for e in metrics_events(spec.metrics_out))
        for e in steps:  # exact: the new driver found the host holding the job's shards (opt.held)
            assert abs(e["loss"] - ref[e["step"]]) < LOSS_TOL, e["step"]
        assert result["steps"] == spec.steps
    finally:
        swarm.stop()


async def train_on(swarm: LocalSwarm, i: int, params: dict) -> tuple[dict, list[dict]]:
    events = []
    async for obj in control.call_stream(swarm.control(i), "train", params, timeout=600):
        if "event" not in obj:
            return obj["result"], events
        events.append(obj["event"])
    raise AssertionError("no result")


@pytest.mark.slow
def test_five_kills_at_random_moments_with_spares_lose_no_step(tmp_path):
    import argparse

    from fusionnode.bench.faults import run_kills

    args = argparse.Namespace(steps=40, kills=5, seq_len=32, batch_size=8, micro_batches=2, seed=3, lr=3e-3)
    res = run_kills(args, tmp_path)
    assert res["kills"] == 5
    assert res["step_ids_in_order"] and res["steps_completed"] == args.steps
    assert res["failures"] >= 5 and res["recoveries"] >= 5
    assert res["max_abs_loss_diff_vs_single_process"] < LOSS_TOL
