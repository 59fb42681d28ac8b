"""Faults under `--sync diloco|sparseloco` on the in-memory network (tests/memnet.py): a worker that
dies mid-round, an optimizer host that dies mid-round, a job resumed from its checkpoints. Every
round is applied exactly once (the hosts' round ledger), and the losses follow the in-process
reference that redoes the same rounds (`train_local_replicas(restart_rounds=...)`)."""

from __future__ import annotations

import asyncio

import torch
from test_components import Swarm, small_spec

from fusionnode.sync import SyncConfig
from fusionnode.train.replicas import train_local_replicas

torch.set_num_threads(1)

TOL = 1e-4  # diloco, fp32: the swarm computes what the reference computes


class FaultySwarm(Swarm):
    """A Swarm whose peer `victim()` goes down once the step `at` is reported."""

    def __init__(self, tmp_path, workers: int, hosts: int, at: int, victim):
        super().__init__(tmp_path, workers=workers, hosts=hosts)
        self.at, self.victim = at, victim
        self.downed: list[str] = []

    async def emit(self, event: dict) -> None:
        await super().emit(event)
        if event["type"] == "step" and event["step"] == self.at and not self.downed:
            peer = self.victim(self)
            self.net.down.add(peer)
            self.downed.append(peer)


def final_runs(steps: list[dict]) -> dict[int, dict]:
    """Step -> the record of its last run (a redone round's steps are recorded again)."""
    return {e["step"]: e for e in steps}


def recovered(s: Swarm) -> list[dict]:
    return [e for e in s.events if e["type"] == "event" and e["kind"] == "recovered"]


def test_a_worker_dying_mid_round_redoes_the_round_and_applies_each_round_once(tmp_path):
    sync = SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9)
    spec = small_spec(steps=7, micro_batches=2)

    def victim(s: Swarm) -> str:  # a worker of the plan that is not the driver's own peer
        plan = next(e for e in s.events if e["type"] == "plan")
        return next(st["peer"] for st in plan["stages"] if st["peer"] != s.ids[0])

    s = FaultySwarm(tmp_path, workers=5, hosts=2, at=3, victim=victim)  # step 4, in round 1, fails
    params = {
        "spec": spec.to_dict(),
        "stages": 2,
        "replicas": 2,
        "offload": "on",
        "optimizer_hosts": 2,
        "sync": sync.to_dict(),
        "rebalance_every": 0,
    }
    result = asyncio.run(s.driver.run_job(params, s.emit))
    assert s.downed and result["steps"] == spec.steps
    rec = [e for e in recovered(s) if e.get("role") == "rounds"]
    assert len(rec) == 1 and rec[0]["replay_from"] == 3 and rec[0]["rounds_applied"] == 1
    steps = s.steps()
    # steps 0..3 ran, step 4 failed, the round of steps 3..5 was redone on the new plan
    assert [e["step"] for e in steps] == [0, 1, 2, 3, 3, 4, 5, 6]
    last = final_runs(steps)
    # the ledger: each round closed once in the trajectory kept, and the hosts' count follows it
    assert [last[i].get("round_closed") for i in range(spec.steps)] == [None, None, 0, None, None, 1, 2]
    assert [last[i]["rounds_applied"] for i in range(spec.steps)] == [0, 0, 1, 1, 1, 2, 3]
    assert all(h["rounds_closed"] == 3 for h in last[6]["optimizer_hosts"])
    ref = train_local_replicas(spec, sync, replicas=2, restart_rounds={1}).losses
    for i in range(spec.steps):
        assert abs(last[i]["loss"] - ref[i]) < TOL, f"step {i}: swarm {last[i]['loss']:.6f} vs {ref[i]:.6f}"
    # the redo is what the reference computes: not the uninterrupted run (the inner state was lost)
    plain = train_local_replicas(spec, sync, replicas=2).losses
    assert max(abs(last[i]["loss"] - plain[i]) for i in range(3, spec.steps)) > 10 * TOL
    assert s.downed[0] not in {
        st["peer"] for st in [e for e in s.events if e["type"] == "plan"][-1]["stages"]
    }
