"""Real `fusionnode join --debug` processes: a 2 x 2 `--sync diloco` job under `--contrib-policy score`
drops the replica whose workers send random pseudo-gradients from every round, and an honest one
keeps both replicas and follows the in-process reference (issue 20)."""

from __future__ import annotations

import asyncio
import json

import pytest

from fusionnode import control
from fusionnode.localswarm import LocalSwarm
from fusionnode.sync import SyncConfig
from fusionnode.train.replicas import train_local_replicas
from fusionnode.train.spec import JobSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SYNC = SyncConfig("diloco", inner_steps=3)


def spec(job_id: str) -> JobSpec:
    return JobSpec(
        model="gpt2-tiny", steps=9, batch_size=8, micro_batches=2, seq_len=32, seed=4, lr=3e-3, job_id=job_id
    )


def run(swarm: LocalSwarm, job_id: str, liar: bool) -> tuple[dict, list[dict]]:
    lying: list[int] = []

    async def go():
        events = []
        params = {
            "spec": spec(job_id).to_dict(),
            "stages": 2,
            "replicas": 2,
            "offload": "on",
            "optimizer_hosts": 2,
            "sync": SYNC.to_dict(),
            "contrib_policy": "score",  # a loopback swarm is a local one: auto would leave it off
        }
        async for obj in control.call_stream(swarm.control(0), "train", params, timeout=600):
            if "event" not in obj:
                return obj["result"], events
            ev = obj["event"]
            events.append(ev)
            if liar and ev["type"] == "plan" and not lying:  # before the first round closes
                for st in ev["stages"]:
                    if st["replica"] == 1:
                        i = next(i for i, r in enumerate(swarm.ready) if r["peer_id"] == st["peer"])
                        lie = {"kind": "random_pseudo_gradient", "seed": 3}
                        (swarm.state_dir(i) / "debug_lie").write_text(json.dumps(lie))
                        lying.append(i)
        raise AssertionError("no result")

    try:
        return asyncio.run(go())
    finally:
        for i in lying:
            (swarm.state_dir(i) / "debug_lie").unlink(missing_ok=True)


def scored(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "event" and e.get("kind") == "scored"]


def test_an_honest_scored_job_keeps_both_replicas_and_follows_the_reference(debug_swarm):
    result, events = run(debug_swarm, "contrib-honest", liar=False)
    rounds = scored(events)
    assert [e["round"] for e in rounds] == [0, 1, 2]
    assert all(e["verdict"] == [1.0, 1.0] and "error" not in e for e in rounds), rounds
    assert result["contrib"]["dropped"] == {} and result["contrib"]["failed"] == 0
    ref = train_local_replicas(spec(""), SYNC, replicas=2).losses
    got = [e["loss"] for e in events if e["type"] == "step"]
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-4


def test_a_replica_sending_random_pseudo_gradients_is_dropped_from_every_round(debug_swarm):
    result, events = run(debug_swarm, "contrib-liar", liar=True)
    rounds = scored(events)
    assert len(rounds) == 3
    for e in rounds:
        assert e["verdict"] == [1.0, 0.0], e
        assert all(w[1] == 0.0 and w[0] > 0 for w in e["weights"]), e  # both hosts left it out
    assert result["contrib"]["dropped"] == {"1": 3}
