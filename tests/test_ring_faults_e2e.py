"""A ring job (`--offload off`, 2 pipelines x 2 stages) on real `fusionnode join` processes on
loopback: a worker SIGKILLed mid-job; the job re-plans from the surviving replica's parameters and
optimizer state (train/ringrecovery.py) and finishes with every step recorded once, each loss that of
the single-process run of the same steps (the global batch does not change with the pipelines, and
the AdamW state is carried, so the reference is `--local` itself)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
from test_faults import kill, metrics_events, peer_index, spec_for, train

from fusionnode.localswarm import LocalSwarm
from fusionnode.train.local import train_local

pytestmark = pytest.mark.e2e

LOSS_TOL = 1e-4  # fp32 on both sides; the swarm sums the replicas' shares in another order


def test_a_ring_member_killed_mid_job_is_replaced_and_the_loss_is_the_single_process_one(tmp_path):
    swarm = LocalSwarm(tmp_path, 4, log=sys.stderr)
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        spec = spec_for(tmp_path, steps=10)
        killed: list[tuple[str, float]] = []

        async def on_event(ev: dict, events: list[dict]) -> None:
            if ev["type"] == "step" and ev["step"] == 3 and not killed:
                plan = next(e for e in events if e["type"] == "plan")
                # pipeline 1's last stage: its replica (pipeline 0) is the only other holder of its state
                victim = next(s["peer"] for s in plan["stages"] if s["replica"] == 1 and s["pos"] == 1)
                assert victim != swarm.ready[0]["peer_id"]
                await asyncio.sleep(ev["step_time_s"] / 2)  # inside the next step
                kill(swarm, peer_index(swarm, victim))
                killed.append((victim, time.time()))

        params = {"spec": spec.to_dict(), "stages": 2, "replicas": 2, "offload": "off", "rebalance_every": 0}
        result, events = asyncio.run(train(swarm, params, on_event))
        assert killed and result["offload"] is False
        steps = [e for e in events if e["type"] == "step"]
        assert [e["step"] for e in steps] == list(range(spec.steps))  # none lost, none twice
        ref = train_local(spec.replace(metrics_out=None)).losses
        diffs = [abs(e["loss"] - b) for e, b in zip(steps, ref, strict=True)]
        for i, (e, b) in enumerate(zip(steps, ref, strict=True)):
            assert diffs[i] < LOSS_TOL, f"step {i}: {e['loss']:.6f} vs single-process {b:.6f}"
        ev = metrics_events(spec.metrics_out)
        failure = next(e for e in ev if e["event"] == "failure" and e.get("peer"))
        assert failure["peer"] == killed[0][0]
        recovered = next(e for e in ev if e["event"] == "recovered")
        assert "replay_from" not in recovered and recovered["state_fetch_s"] >= 0
        assert killed[0][0] not in {s["peer"] for s in result["stages"]}
        with open(spec.metrics_out, encoding="utf-8") as f:
            recs = [json.loads(line) for line in f]
        after = next(r for r in recs if r["type"] == "step" and r["ts"] > recovered["ts"])
        print(
            f"ring recovery: kill -> next step recorded {after['ts'] - killed[0][1]:.2f} s, "
            f"failure -> recovered {recovered['ts'] - failure['ts']:.2f} s, "
            f"re-plan {recovered['time_to_recover_s']:.2f} s (state fetch {recovered['state_fetch_s']:.3f} s), "
            f"max loss diff {max(diffs):.1e}"
        )
    finally:
        swarm.stop()
