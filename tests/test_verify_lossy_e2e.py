"""Spot-checks over AdaTopK links on real `fusionnode join --debug` processes on loopback: the job
declares slow links (a cluster document, as `fusionnode demo --link-limit` does), so AdaTopK sends
q8 during its warm-up and then centered top-k activations at its floor with q8 gradients; an honest
run with every micro-batch checked bans nobody, and a worker scaling what it sends by 1% is caught
by the recompute (verify/lossy.py), banned, and the job finishes on a new plan without it."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from fusionnode.localswarm import LocalSwarm
from tests.test_verify_e2e import kept_steps, spec_for, train

pytestmark = pytest.mark.e2e

SLOW_LINK_BPS = 1e6  # what the job is told its links carry: AdaTopK compresses to its floor


def slow_cluster(swarm: LocalSwarm) -> dict:
    ids = [r["peer_id"] for r in swarm.ready]
    return {
        "version": 1,
        "name": "slow-links",
        "devices": [{"id": pid, "tflops": 0.05, "memory_gb": 4} for pid in ids],
        "links": {"inter_site": {"bandwidth_gbps": SLOW_LINK_BPS / 1e9, "latency_ms": 0.1}},
    }


def keep_ratios(metrics_path) -> list[float]:
    """Each step's keep ratio of the activation link (1.0: dense, or the warm-up's q8)."""
    out = []
    with open(metrics_path, encoding="utf-8") as f:
        lines = f.readlines()
    for line in lines:
        rec = json.loads(line)
        if rec.get("type") == "step":
            out += [s["links"]["fwd"]["ratio"] for s in rec["stages"] if s["links"]["fwd"]["dense_bytes"]]
    return out


def scale_liar_on_plan(swarm, liar: list[str]):
    """An event callback that, at the first plan, makes a worker other than the driver's peer scale
    what it sends by 1% (the debug liar) and appends its peer id to `liar`."""

    async def on_plan(ev: dict) -> None:
        if ev["type"] == "plan" and not liar:
            victim = next(s["peer"] for s in ev["stages"] if s["peer"] != swarm.ready[0]["peer_id"])
            i = next(i for i, r in enumerate(swarm.ready) if r["peer_id"] == victim)
            (swarm.state_dir(i) / "debug_lie").write_text(json.dumps({"kind": "scale", "factor": 1.01}))
            liar.append(victim)

    return on_plan


def test_adatopk_links_are_checked_honest_passes_and_a_one_percent_liar_is_caught(tmp_path):
    swarm = LocalSwarm(tmp_path, 3, log=sys.stderr)
    swarm.extra_args = ["--debug"]
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        base = {
            "stages": 2,
            "offload": "on",
            "rebalance_every": 0,
            "verify_policy": "all",
            "cluster": slow_cluster(swarm),
        }

        # 1. honest: every micro-batch checked, through the q8 warm-up and the top-k steps after it
        spec = spec_for(tmp_path, "honest", compress="adatopk", steps=8)
        result, events = asyncio.run(train(swarm, {"spec": spec.to_dict(), **base}))
        kinds = [e.get("kind") for e in events if e["type"] == "event"]
        assert "caught" not in kinds and "failure" not in kinds and "dispute" not in kinds, [
            e.get("reason") for e in events if e["type"] == "event"
        ]
        assert "notice" not in kinds, [e for e in events if e.get("kind") == "notice"]  # checks not off
        assert result["verify"]["caught"] == 0 and result["verify"]["checked"] == spec.steps * 2 * 2
        assert len(kept_steps(events)) == spec.steps
        ratios = keep_ratios(tmp_path / "honest.jsonl")
        assert len(ratios) == spec.steps and ratios[-1] <= 0.25, ratios  # top-k after the warm-up

        # 2. a worker other than the driver's peer scales what it sends by 1% from its first step
        spec = spec_for(tmp_path, "liar", compress="adatopk", steps=8, seed=6)
        liar: list[str] = []
        on_plan = scale_liar_on_plan(swarm, liar)

        result, events = asyncio.run(train(swarm, {"spec": spec.to_dict(), **base}, on_plan))
        caught = [e for e in events if e["type"] == "event" and e.get("kind") == "caught"]
        assert liar and [e["peer"] for e in caught] == liar, caught
        assert "failed a spot-check" in caught[0]["reason"], caught[0]["reason"]
        plans = [e for e in events if e["type"] == "plan"]
        assert len(plans) >= 2 and liar[0] not in [s["peer"] for s in plans[-1]["stages"]]
        assert [e["step"] for e in kept_steps(events)] == list(range(spec.steps))
    finally:
        for i in range(len(swarm.ready)):
            (swarm.state_dir(i) / "debug_lie").unlink(missing_ok=True)
        swarm.stop()


@pytest.mark.slow
def test_round_mode_with_adatopk_links_checked_honest_passes_and_a_liar_is_banned(tmp_path):
    """--sync diloco (H = 2) over the same slow AdaTopK links, every micro-batch checked: the round
    mode's recompute (from the worker's committed inner parameters) goes through the lossy
    comparator; an honest run catches nobody, a worker scaling what it sends by 1% is caught,
    banned and planned away, and the job finishes."""
    from fusionnode.sync import SyncConfig

    swarm = LocalSwarm(tmp_path, 3, log=sys.stderr)
    swarm.extra_args = ["--debug"]
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        base = {
            "stages": 2,
            "offload": "on",
            "rebalance_every": 0,
            "verify_policy": "all",
            "contrib_policy": "off",
            "cluster": slow_cluster(swarm),
            "sync": SyncConfig("diloco", inner_steps=2).to_dict(),
        }
        spec = spec_for(tmp_path, "honest", compress="adatopk", steps=8)
        result, events = asyncio.run(train(swarm, {"spec": spec.to_dict(), **base}))
        kinds = [e.get("kind") for e in events if e["type"] == "event"]
        assert not {"caught", "failure", "dispute", "notice"} & set(kinds), [
            (e.get("kind"), e.get("reason")) for e in events if e["type"] == "event"
        ]
        assert result["verify"]["caught"] == 0 and result["verify"]["checked"] > 0, result["verify"]
        assert [e["step"] for e in kept_steps(events)] == list(range(spec.steps))
        ratios = keep_ratios(tmp_path / "honest.jsonl")
        assert ratios[-1] <= 0.25, ratios  # top-k after the warm-up

        spec = spec_for(tmp_path, "liar", compress="adatopk", steps=8, seed=6)
        liar: list[str] = []
        on_plan = scale_liar_on_plan(swarm, liar)

        result, events = asyncio.run(train(swarm, {"spec": spec.to_dict(), **base}, on_plan))
        evs = [e for e in events if e["type"] == "event"]
        caught = [e for e in evs if e.get("kind") == "caught"]
        assert liar and [e["peer"] for e in caught] == liar, caught
        banned = [e for e in evs if e.get("kind") == "failure" and e.get("peer") == liar[0]]
        assert banned and banned[0].get("ban_s", 0) > 0, evs
        plans = [e for e in events if e["type"] == "plan"]
        assert len(plans) >= 2 and liar[0] not in [s["peer"] for s in plans[-1]["stages"]]
        assert result["verify"]["caught"] == 1, result["verify"]
        assert max(e["step"] for e in kept_steps(events)) == spec.steps - 1
    finally:
        for i in range(len(swarm.ready)):
            (swarm.state_dir(i) / "debug_lie").unlink(missing_ok=True)
        swarm.stop()
