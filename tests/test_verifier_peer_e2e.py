"""A verifier peer on real `fusionnode join` daemons (loopback): the driver names a fourth daemon,
started with `--serve-checks`, as its verifier (`train --verifier PEER_ID`). A worker scaling what it
sends by 1% is caught through it (the verifier's check process judged the audits, the driver's never
started) and the run matches the single-process reference; then the verifier is killed mid-job: its
checks fall back to the driver's check process with a `verifier_down` notice, and the job finishes,
every step checked and matching the reference."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest
from test_verify_e2e import assert_matches_reference, spec_for, train

from fusionnode.localswarm import LocalSwarm

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # 70-150 s here (4 daemons, 2 jobs)


def test_a_liar_is_caught_through_a_verifier_peer_and_a_killed_verifier_falls_back(tmp_path):
    swarm = LocalSwarm(tmp_path, 3, log=sys.stderr)
    swarm.extra_args = ["--debug"]
    try:
        swarm.start()
        drivers = ",".join(r["peer_id"] for r in swarm.ready)  # the verifier serves the swarm's daemons
        swarm.extra_args = ["--debug", "--serve-checks", "--serve-checks-for", drivers, "--role", "worker"]
        v = swarm.add_peer()
        asyncio.run(swarm.wait_connected())
        ids = [r["peer_id"] for r in swarm.ready]
        verifier = ids[v]
        base = {
            "stages": 2,
            "offload": "on",
            "rebalance_every": 0,
            "verify_policy": "all",
            "verifier": verifier,
            "peers": ids[:3],  # the verifier offers the worker role, but holds no stage
        }

        # 1. a stage's worker other than the driver's peer scales what it sends by 1% from its first step
        spec = spec_for(tmp_path, "liar", seed=6)
        liar: list[str] = []

        async def on_plan(ev: dict) -> None:
            if ev["type"] == "plan" and not liar:
                victim = next(s["peer"] for s in ev["stages"] if s["peer"] != ids[0])
                (swarm.state_dir(ids.index(victim)) / "debug_lie").write_text(
                    json.dumps({"kind": "scale", "factor": 1.01})
                )
                liar.append(victim)

        result, events = asyncio.run(train(swarm, {"spec": spec.to_dict(), **base}, on_plan))
        caught = [e for e in events if e["type"] == "event" and e.get("kind") == "caught"]
        assert liar and [e["peer"] for e in caught] == liar, caught
        assert "relative error" in caught[0]["reason"]
        totals = result["verify"]["verifier"]
        assert totals["peer"] == verifier and totals["remote"] > 0, totals
        assert totals["fallback"] == 0 and totals["failures"] == 0, totals
        assert_matches_reference(spec, events)  # nothing of the lie stayed in the model
        for i in range(len(ids)):
            (swarm.state_dir(i) / "debug_lie").unlink(missing_ok=True)

        # 2. honest, the verifier killed (with its p2pd) after step 1: the job goes on and finishes
        spec = spec_for(tmp_path, "killed", seed=7, steps=6)
        killed: list[int] = []

        async def on_step(ev: dict) -> None:
            if ev["type"] == "step" and ev["step"] == 1 and not killed:
                os.killpg(swarm.procs[v].pid, signal.SIGKILL)
                killed.append(ev["step"])

        result, events = asyncio.run(train(swarm, {"spec": spec.to_dict(), **base}, on_step))
        assert killed
        kinds = [e.get("kind") for e in events if e["type"] == "event"]
        assert "caught" not in kinds and "failure" not in kinds, kinds
        notices = [e for e in events if e["type"] == "event" and e.get("what") == "verifier_down"]
        assert len(notices) == 1 and verifier[:12] in notices[0]["reason"], notices
        totals = result["verify"]["verifier"]
        assert totals["fallback"] > 0 and totals["failures"] >= 1, totals
        assert totals["remote"] + totals["fallback"] == spec.steps * 2  # every stage-step judged once
        assert result["verify"]["checked"] == spec.steps * 2 * 2 and result["verify"]["caught"] == 0
        assert_matches_reference(spec, events)
    finally:
        swarm.stop()
