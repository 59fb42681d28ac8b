"""`--sync-warmup` on the swarm's real components over the in-memory network (tests/memnet.py): the
driver, workers and optimizer hosts follow the in-process reference through the warm-up's one-step
rounds and the switch to rounds of H (diloco within 1e-4, sparseloco within 1e-3, as
tests/test_sync_swarm_e2e.py), count each round once, and a job resumed from a checkpoint inside
the warm-up goes on as the reference does."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_components import Swarm, round_job, small_spec

from fusionnode.sync import SyncConfig
from fusionnode.train.replicas import train_local_replicas

torch.set_num_threads(1)

TOL = 1e-4
SPARSE_TOL = 1e-3
# H = 3 after a warm-up of 6 one-step rounds: rounds [0]..[5] | [6,7,8] [9,10,11]
CLOSED = [0, 1, 2, 3, 4, 5, None, None, 6, None, None, 7]
DILOCO = SyncConfig(
    "diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9, overlap=True, overlap_steps=1, warmup_steps=6
)
SPARSE = SyncConfig(
    "sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256, overlap=True, overlap_steps=1, warmup_steps=6
)


@pytest.mark.parametrize(("sync", "tol"), [(DILOCO, TOL), (SPARSE, SPARSE_TOL)], ids=["diloco", "sparseloco"])
def test_the_swarm_follows_the_reference_through_the_warmup(tmp_path, sync, tol):
    spec = small_spec(steps=12, micro_batches=2)
    s = Swarm(tmp_path, workers=4, hosts=2)
    result = asyncio.run(s.driver.run_job(round_job(spec, sync, rebalance_every=0), s.emit))
    assert result["steps"] == spec.steps
    steps = s.steps()
    assert [e.get("round_closed") for e in steps] == CLOSED
    assert all(h["rounds_closed"] == 8 for h in steps[-1]["optimizer_hosts"])
    # the warm-up's rounds are installed at their close: each commit answers its own round
    assert [e["rounds_applied"] for e in steps[:6]] == [1, 2, 3, 4, 5, 6]
    ref = train_local_replicas(spec, sync, replicas=2).losses
    for e in steps:
        assert abs(e["loss"] - ref[e["step"]]) < tol, (
            f"step {e['step']}: {e['loss']:.6f} vs {ref[e['step']]:.6f}"
        )
    # the warm-up changed the trajectory: not the run without it
    plain = train_local_replicas(spec, SyncConfig(**{**sync.to_dict(), "warmup_steps": 0}), replicas=2).losses
    assert max(abs(e["loss"] - plain[e["step"]]) for e in steps) > 3 * tol


class Interrupted(Exception):
    pass


def test_a_job_resumed_inside_the_warmup_follows_the_reference(tmp_path):
    """Checkpoints every 2 steps (warm-up boundaries); the job stops at step 4 and resumes from its
    step-4 checkpoint, in the warm-up: round 4 is redone with new inner optimizers (the reference's
    `restart_rounds={4}`) and the outer Nesterov state the hosts checkpointed."""
    spec = small_spec(steps=12, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=2)
    sync = DILOCO
    s = Swarm(tmp_path, workers=4, hosts=2)
    params = round_job(spec, sync, rebalance_every=0)

    async def stop_at_step_4(event: dict) -> None:
        s.events.append(event)
        if event["type"] == "step" and event["step"] == 4:
            raise Interrupted

    with pytest.raises(Interrupted):
        asyncio.run(s.driver.run_job(params, stop_at_step_4))
    s.events.clear()
    result = asyncio.run(s.driver.run_job({**params, "resume": True}, s.emit))
    assert result["steps"] == spec.steps
    steps = s.steps()
    assert [e["step"] for e in steps] == list(range(4, 12))
    assert [e.get("round_closed") for e in steps] == CLOSED[4:]
    assert steps[0]["rounds_applied"] == 5 and steps[-1]["rounds_applied"] == 8
    ref = train_local_replicas(spec, sync, replicas=2, restart_rounds={4}).losses
    for e in steps:
        assert abs(e["loss"] - ref[e["step"]]) < TOL, (
            f"step {e['step']}: {e['loss']:.6f} vs {ref[e['step']]:.6f}"
        )
    fresh = train_local_replicas(spec, sync, replicas=2, restart_rounds={4}, fresh_outer_rounds={4}).losses
    assert max(abs(e["loss"] - fresh[e["step"]]) for e in steps[1:]) > 3 * TOL
