"""Spot-checks under `--sync diloco` on real `fusionnode join --debug` processes (issue 20): the
workers commit to their own inner parameters, the driver recomputes checked micro-batches with them.
An honest run with every micro-batch checked bans nobody and follows the in-process reference; a
worker scaling what it sends by 1% inside an otherwise honest replica is caught, banned, and its
round is redone without it on a new plan (nothing of it reached the hosts)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from fusionnode import control
from fusionnode.localswarm import LocalSwarm
from fusionnode.sync import SyncConfig
from fusionnode.train.replicas import train_local_replicas
from fusionnode.train.spec import JobSpec

pytestmark = pytest.mark.e2e

H = 3


def spec_for(**kw) -> JobSpec:
    base = dict(
        model="gpt2-tiny", steps=6, batch_size=8, micro_batches=2, seq_len=32, seed=5, lr=3e-3,
        warmup_steps=2, grad_clip=1.0,
    )  # fmt: skip
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


def job(spec: JobSpec, sync: SyncConfig) -> dict:
    return {
        "spec": spec.to_dict(), "stages": 2, "replicas": 2, "offload": "on", "optimizer_hosts": 2,
        "sync": sync.to_dict(), "rebalance_every": 0, "verify_policy": "all", "contrib_policy": "off",
    }  # fmt: skip


def test_diloco_honest_run_is_checked_and_a_one_percent_liar_is_caught(tmp_path):
    swarm = LocalSwarm(tmp_path, 4, log=sys.stderr)
    swarm.extra_args = ["--debug"]
    sync = SyncConfig("diloco", inner_steps=H)
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())

        # 1. honest: every micro-batch of every stage checked with the workers' own inner
        # parameters, nobody caught, the losses of the in-process reference
        spec = spec_for()
        result, events = asyncio.run(train(swarm, job(spec, sync)))
        kinds = [e.get("kind") for e in events if e["type"] == "event"]
        assert "caught" not in kinds and "failure" not in kinds, kinds
        assert result["verify"]["caught"] == 0
        assert result["verify"]["checked"] == spec.steps * 4 * 2  # 4 stages x 2 micro-batches
        losses = [e["loss"] for e in events if e["type"] == "step"]
        ref = train_local_replicas(spec, sync, replicas=2).losses
        for i, (a, b) in enumerate(zip(losses, ref, strict=True)):
            assert abs(a - b) < 1e-4, f"step {i}: swarm {a:.6f} vs local {b:.6f}"

        # 2. a worker (not the driver's peer) scales what it sends by 1% from step 1's end on
        spec = spec_for(seed=6)
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

        result, events = asyncio.run(train(swarm, job(spec, sync), on_event))
        assert liar
        caught = [e for e in events if e["type"] == "event" and e.get("kind") == "caught"]
        assert [e["peer"] for e in caught] == liar, caught
        assert "relative error" in caught[0]["reason"], caught[0]["reason"]
        assert caught[0]["step"] >= 2
        plans = [e for e in events if e["type"] == "plan"]
        assert len(plans) >= 2 and liar[0] not in [s["peer"] for s in plans[-1]["stages"]]
        # the caught step's round is redone from its start (the hosts' parameters): nothing of the
        # liar's inner steps left its worker
        redo = [e for e in events if e["type"] == "event" and e.get("role") == "rounds"]
        assert redo and redo[0]["replay_from"] == caught[0]["step"] // H * H, redo
        steps = [e for e in events if e["type"] == "step"]
        assert steps[-1]["step"] == spec.steps - 1
        assert result["verify"]["caught"] == 1
    finally:
        swarm.stop()
