"""Spot-checks on real `fusionnode join --debug` processes on loopback: an honest run bans nobody and
trains exactly as one process does; a worker scaling what it sends by 1% is caught by the
recompute (while the next step runs), banned, the lied step undone on the optimizer hosts and replayed
under a new plan, and the run still matches the single-process reference (nothing from the liar
stays); so is a worker pushing a random gradient to the optimizer hosts (the gradient check)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from fusionnode import control
from fusionnode.localswarm import LocalSwarm
from fusionnode.train.local import train_local
from fusionnode.train.spec import JobSpec

pytestmark = pytest.mark.e2e

LOSS_TOL = 1e-3  # absolute loss difference to the single-process run (the e2e tests' tolerance)


def spec_for(tmp_path, name: str, **kw) -> JobSpec:
    base = dict(
        model="gpt2-tiny",
        steps=6,
        batch_size=8,
        micro_batches=2,
        seq_len=32,
        seed=5,
        grad_clip=1.0,
        lr=3e-3,
        warmup_steps=2,
        metrics_out=str(tmp_path / f"{name}.jsonl"),
    )
    base.update(kw)
    return JobSpec(**base)


async def train(swarm: LocalSwarm, params: dict, on_event=None) -> tuple[dict, list[dict]]:
    events = []
    async for obj in control.call_stream(swarm.control(0), "train", params, timeout=600):
        if "event" not in obj:
            return obj["result"], events
        events.append(obj["event"])
        if on_event is not None:
            await on_event(obj["event"])
    raise AssertionError("the driver closed the job without a result")


def kept_steps(events: list[dict]) -> list[dict]:
    """The step records that stand: a `rollback` event (a lie found in a step already applied, by
    the checks that run while the next step does) voids the records from its step on."""
    steps: list[dict] = []
    for e in events:
        if e["type"] == "step":
            steps.append(e)
        elif e["type"] == "event" and e.get("kind") == "rollback":
            steps = [s for s in steps if s["step"] < e["step"]]
    return steps


def assert_matches_reference(spec: JobSpec, events: list[dict]) -> None:
    steps = kept_steps(events)
    assert [e["step"] for e in steps] == list(range(spec.steps))  # none lost, none twice
    ref = train_local(spec.replace(metrics_out=None)).losses
    for i, (a, b) in enumerate(zip([e["loss"] for e in steps], ref, strict=True)):
        assert abs(a - b) < LOSS_TOL, f"step {i}: {a:.6f} vs single-process {b:.6f}"


def test_honest_run_bans_nobody_and_a_one_percent_liar_is_caught_banned_and_replayed(tmp_path):
    swarm = LocalSwarm(tmp_path, 3, log=sys.stderr)
    swarm.extra_args = ["--debug"]
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        base = {"stages": 2, "offload": "on", "rebalance_every": 0, "verify_policy": "all"}

        # 1. honest: every micro-batch of every stage checked, nobody caught, the reference's losses
        spec = spec_for(tmp_path, "honest")
        result, events = asyncio.run(train(swarm, {"spec": spec.to_dict(), **base}))
        kinds = [e.get("kind") for e in events if e["type"] == "event"]
        assert "caught" not in kinds and "failure" not in kinds, kinds
        assert result["verify"]["caught"] == 0 and result["verify"]["checked"] == spec.steps * 2 * 2
        assert_matches_reference(spec, events)

        # 2. a stage's worker other than the driver's peer scales what it sends by 1% (activations, or
        # the input gradients if it holds the last stage), from after step 1 on: its honest steps
        # 0 and 1 are undone with the lied one (the hosts go back to the plan's start, the mark)
        spec = spec_for(tmp_path, "liar", seed=6)
        liar: list[str] = []
        first_plan: list[dict] = []

        async def on_event(ev: dict) -> None:
            if ev["type"] == "plan" and not first_plan:
                first_plan.append(ev)
            if ev["type"] == "step" and ev["step"] == 1 and not liar:
                stages = first_plan[0]["stages"]
                victim = next(s["peer"] for s in stages if s["peer"] != swarm.ready[0]["peer_id"])
                i = next(i for i, r in enumerate(swarm.ready) if r["peer_id"] == victim)
                (swarm.state_dir(i) / "debug_lie").write_text(json.dumps({"kind": "scale", "factor": 1.01}))
                liar.append(victim)

        result, events = asyncio.run(train(swarm, {"spec": spec.to_dict(), **base}, on_event))
        assert liar
        caught = [e for e in events if e["type"] == "event" and e.get("kind") == "caught"]
        assert [e["peer"] for e in caught] == liar, caught
        assert "failed a spot-check" in caught[0]["reason"] and "relative error" in caught[0]["reason"]
        plans = [e for e in events if e["type"] == "plan"]
        assert len(plans) >= 2 and liar[0] not in [s["peer"] for s in plans[-1]["stages"]]
        assert result["verify"]["caught"] == 1 and result["verify"]["deferred"]
        # checked while the next step ran: the hosts undid the lied step, which was replayed
        rollbacks = [e for e in events if e["type"] == "event" and e.get("kind") == "rollback"]
        assert [e["lied_step"] for e in rollbacks] == [caught[0]["step"]], rollbacks
        assert caught[0]["step"] >= 2, caught  # it lied from step 2 (or 3) on
        assert rollbacks[0]["step"] == 0  # back to the plan's start: the liar computed every step since
        assert_matches_reference(spec, events)  # nothing of the lie stayed in the model
        for i in range(len(swarm.ready)):
            (swarm.state_dir(i) / "debug_lie").unlink(missing_ok=True)

        # 3. a worker pushing a random gradient of the right norm to the optimizer hosts
        spec = spec_for(tmp_path, "gradient", seed=7, steps=4)
        liar.clear()
        lie = {"kind": "random_pseudo_gradient"}

        async def on_plan(ev: dict) -> None:
            if ev["type"] == "plan" and not liar:
                victim = next(s["peer"] for s in ev["stages"] if s["peer"] != swarm.ready[0]["peer_id"])
                i = next(i for i, r in enumerate(swarm.ready) if r["peer_id"] == victim)
                (swarm.state_dir(i) / "debug_lie").write_text(json.dumps(lie))
                liar.append(victim)

        result, events = asyncio.run(train(swarm, {"spec": spec.to_dict(), **base}, on_plan))
        caught = [e for e in events if e["type"] == "event" and e.get("kind") == "caught"]
        assert [e["peer"] for e in caught] == liar, caught
        # the hosts' digest of the push binds what it shows: the recompute refutes it
        assert "failed a gradient check" in caught[0]["reason"], caught[0]["reason"]
        assert_matches_reference(spec, events)
    finally:
        swarm.stop()
