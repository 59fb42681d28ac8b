"""Extending a finished run (issue 23 item 3) on real `fusionnode join` processes: `--steps 5 --save
ck`, then `--steps 8 --save ck --resume` from another driver peer. The optimizer hosts find their
shards of step 5 (the driver proves it owns them with the job secret kept in ck) and steps 5..7 run."""

from __future__ import annotations

import asyncio
import sys

import pytest
from test_faults import metrics_events, spec_for, train_on

from fusionnode.localswarm import LocalSwarm

pytestmark = pytest.mark.e2e


def test_a_finished_run_resumes_with_more_steps_on_another_driver(tmp_path):
    swarm = LocalSwarm(tmp_path, 3, log=sys.stderr)
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        spec = spec_for(tmp_path, steps=5, save_dir=str(tmp_path / "ck"), save_every=100)
        params = {"spec": spec.to_dict(), "stages": 2, "offload": "on", "rebalance_every": 0}
        first, events = asyncio.run(train_on(swarm, 0, params))
        assert first["steps"] == 5
        longer = spec.replace(steps=8, metrics_out=str(tmp_path / "resumed.jsonl"))
        assert longer.job_id != spec.job_id  # the id derives from every field, steps too
        result, events = asyncio.run(train_on(swarm, 1, {**params, "spec": longer.to_dict(), "resume": True}))
        steps = [e["step"] for e in events if e["type"] == "step"]
        assert steps == [5, 6, 7] and result["steps"] == 8
        assert result["job"] == first["job"]  # the checkpoint's job goes on (its shards are under its id)
        ev = metrics_events(longer.metrics_out)
        assert not [e for e in ev if e["event"] == "resume"]  # the hosts had step 5: no fallback
        print(
            f"\nresumed at step 5 on another driver; losses {[e['loss'] for e in events if e['type'] == 'step']}"
        )
    finally:
        swarm.stop()
