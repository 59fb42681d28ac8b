"""Real `fusionnode join` processes under `--sync diloco` (issue 19): a worker SIGKILLed mid-round and
an optimizer host SIGKILLed mid-round (with checkpoints). The driver re-plans, the open round is
redone from the hosts' parameters (its inner steps replayed, inner optimizer state new), and every
round is applied exactly once: the round ledger of the kept trajectory closes rounds 0, 1, 2, ...
each once, and the losses follow the in-process reference that redoes the same round within 1e-4
(fp32; a round applied twice or lost would move them by orders of magnitude more)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys

import pytest

from fusionnode import control
from fusionnode.localswarm import LocalSwarm
from fusionnode.sync import SyncConfig
from fusionnode.train.replicas import train_local_replicas
from fusionnode.train.spec import JobSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOL = 1e-4  # |loss - reference| per step, the exactness criterion of the sync e2e tests
H = 3
STEPS = 12
SYNC = SyncConfig("diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.9)
# --sync-overlap (bench testbed's fusionnode-dp): round r's update is applied after round r + 1's first
# step; a checkpointed boundary (the host part: every H steps) installs its round at once
OVERLAP = SyncConfig(**{**SYNC.to_dict(), "overlap": True, "overlap_steps": 1})


def spec(tmp_path, name: str, **kw) -> JobSpec:
    base = dict(
        model="gpt2-tiny",
        steps=STEPS,
        batch_size=8,
        micro_batches=2,
        seq_len=32,
        seed=5,
        lr=3e-3,
        warmup_steps=3,
        metrics_out=str(tmp_path / f"{name}.jsonl"),
    )
    base.update(kw)
    return JobSpec(**base)


def kill(swarm: LocalSwarm, peer: str) -> None:
    i = next(i for i, r in enumerate(swarm.ready) if r["peer_id"] == peer)
    os.killpg(swarm.procs[i].pid, signal.SIGKILL)  # the daemon, its DHT child and p2pd: no goodbye
    swarm.procs[i].wait(10)


def train(swarm: LocalSwarm, params: dict, pick_victim) -> tuple[dict, list[dict], list[str]]:
    """Runs the job; once step 4 (in round 1) is reported, SIGKILLs `pick_victim(plan)` somewhere in
    the next step."""
    rng = random.Random(11)
    killed: list[str] = []

    async def go():
        events = []
        async for obj in control.call_stream(swarm.control(0), "train", params, timeout=900):
            if "event" not in obj:
                return obj["result"], events
            ev = obj["event"]
            events.append(ev)
            if ev["type"] == "step" and ev["step"] == 4 and not killed:
                victim = pick_victim(next(e for e in events if e["type"] == "plan"))
                await asyncio.sleep(rng.uniform(0.0, ev["step_time_s"]))
                kill(swarm, victim)
                killed.append(victim)
        raise AssertionError("the driver closed the job without a result")

    result, events = asyncio.run(go())
    return result, events, killed


def metrics_events(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r.get("type") == "event"]


def check_rounds_once(events: list[dict], sp: JobSpec, sync: SyncConfig, *, fresh_outer: bool) -> int:
    """The ledger of the kept trajectory and the losses against the reference; returns the round redone."""
    rec = next(
        e for e in metrics_events(sp.metrics_out) if e["event"] == "recovered" and e.get("role") == "rounds"
    )
    redone = rec["replay_from"] // H
    assert rec["replay_from"] % H == 0 and rec["rounds_applied"] == redone >= 1
    steps = [e for e in events if e["type"] == "step"]
    last = {e["step"]: e for e in steps}  # a redone round's steps are recorded again: keep the last
    # steps 0..k ran (k: the failed step, recorded when only its commit failed), then the steps from
    # the open round's start
    order = [e["step"] for e in steps]
    k = len(order) - (sp.steps - rec["replay_from"]) - 1
    assert order == list(range(k + 1)) + list(range(rec["replay_from"], sp.steps))
    assert k >= rec["replay_from"] - 1
    closed = [last[i].get("round_closed") for i in range(sp.steps)]
    assert [c for c in closed if c is not None] == list(range(-(-sp.steps // H)))  # each round once
    late = sync.overlap and not sp.save_dir  # a round counted at the commit that installs it
    assert [last[i]["rounds_applied"] for i in range(rec["replay_from"], sp.steps)] == [
        i // H if late and i + 1 < sp.steps else (i + 1) // H for i in range(rec["replay_from"], sp.steps)
    ]
    ref = train_local_replicas(
        sp.replace(metrics_out=None),
        sync,
        replicas=2,
        restart_rounds={redone},
        fresh_outer_rounds={redone} if fresh_outer else (),
    ).losses
    for i in range(sp.steps):
        assert abs(last[i]["loss"] - ref[i]) < TOL, f"step {i}: swarm {last[i]['loss']:.6f} vs {ref[i]:.6f}"
    fail = next(
        e for e in metrics_events(sp.metrics_out) if e["event"] == "recovered" and "time_to_recover_s" in e
    )
    print(
        f"{sp.metrics_out}: failed at step {rec['step']}, rounds applied {rec['rounds_applied']}, "
        f"went on from step {rec['replay_from']}; re-plan {fail['time_to_recover_s']} s; "
        f"max |loss - reference| {max(abs(last[i]['loss'] - ref[i]) for i in range(sp.steps)):.2e}",
        file=sys.stderr,
    )
    return redone


@pytest.mark.parametrize("sync", [SYNC, OVERLAP], ids=["blocking", "overlap"])
def test_a_worker_and_an_optimizer_host_killed_mid_round_leave_every_round_applied_once(tmp_path, sync):
    swarm = LocalSwarm(tmp_path, 6, log=sys.stderr)
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        ids = [r["peer_id"] for r in swarm.ready]

        # 1. a worker dies: 5 workers (4 in the plan, a spare), one optimizer host apart
        sp = spec(tmp_path, "worker")
        params = {
            "spec": sp.to_dict(),
            "stages": 2,
            "replicas": 2,
            "offload": "on",
            "optimizer_hosts": 1,
            "sync": sync.to_dict(),
            "rebalance_every": 0,
            "peers": ids[:5],
            "optimizer_peers": [ids[5]],
        }
        result, events, killed = train(
            swarm, params, lambda plan: next(s["peer"] for s in plan["stages"] if s["peer"] != ids[0])
        )
        assert killed and result["steps"] == STEPS
        check_rounds_once(events, sp, sync, fresh_outer=False)
        plans = [e for e in events if e["type"] == "plan"]
        assert killed[0] not in {s["peer"] for s in plans[-1]["stages"]}

        # 2. the optimizer host dies (checkpoints every 3 steps): a new host takes its shard
        new = swarm.ready[swarm.add_peer()]["peer_id"]
        asyncio.run(swarm.wait_connected(peers=[new]))
        workers = [p for p in ids[:5] if p != killed[0]]
        sp = spec(tmp_path, "host", save_dir=str(tmp_path / "ck-host"), save_every=H)
        params = {
            **params,
            "spec": sp.to_dict(),
            "peers": workers,
            "optimizer_peers": [ids[5], new],
        }
        result, events, killed = train(swarm, params, lambda plan: plan["optimizer_hosts"][0])
        assert killed and result["steps"] == STEPS
        ev = metrics_events(sp.metrics_out)
        host_rec = next(e for e in ev if e["event"] == "recovered" and e.get("role") == "optimizer")
        # the new host cannot read the dead one's disk: the hosts restart from the driver's
        # checkpoint of the round's start, with new outer state (the reference does the same)
        assert host_rec["fresh_optimizer"] and host_rec["replay_from"] % H == 0
        check_rounds_once(events, sp, sync, fresh_outer=True)
        assert killed[0] not in [e for e in events if e["type"] == "plan"][-1]["optimizer_hosts"]
    finally:
        swarm.stop()
