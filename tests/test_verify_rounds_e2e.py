"""Spot-checks under `--sync diloco` on real `fusionnode join --debug` processes (issue 20): the
workers commit to their own inner parameters, the driver recomputes checked micro-batches with them.
An honest run with every micro-batch checked bans nobody and follows the in-process reference; a
worker scaling what it sends by 1% inside an otherwise honest replica is caught, banned, and its
round is redone without it on a new plan (nothing of it reached the hosts); so is a worker whose
inner optimizer steps 1% too far (the transition check)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from test_verify_e2e import train

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


def job(spec: JobSpec, sync: SyncConfig) -> dict:
    return {
        "spec": spec.to_dict(), "stages": 2, "replicas": 2, "offload": "on", "optimizer_hosts": 2,
        "sync": sync.to_dict(), "rebalance_every": 0, "verify_policy": "all", "contrib_policy": "off",
        "debug_forget_bans": True,  # each job starts with no bans (daemons run --debug)
    }  # fmt: skip


def set_liar(swarm: LocalSwarm, victim: str | None, lie: dict | None) -> None:
    for i, r in enumerate(swarm.ready):
        path = swarm.state_dir(i) / "debug_lie"
        if r["peer_id"] == victim and lie is not None:
            path.write_text(json.dumps(lie))
        else:
            path.unlink(missing_ok=True)


def test_diloco_honest_run_is_checked_and_a_one_percent_liar_is_caught(debug_swarm):
    sync = SyncConfig("diloco", inner_steps=H)
    # 1. honest: every micro-batch of every stage checked with the workers' own inner
    # parameters, nobody caught, the losses of the in-process reference
    spec = spec_for()
    result, events = asyncio.run(train(debug_swarm, job(spec, sync)))
    kinds = [e.get("kind") for e in events if e["type"] == "event"]
    assert "caught" not in kinds and "failure" not in kinds, kinds
    assert result["verify"]["caught"] == 0
    assert result["verify"]["checked"] == spec.steps * 4 * 2  # 4 stages x 2 micro-batches
    # every inner step that does not close a round (0, 1, 3, 4) of each stage, checked at the next
    assert result["verify"]["transitions"] == 4 * 4 and result["verify"]["transitions_caught"] == 0
    print(f"transition max relative error {result['verify']['transition_max_rel_err']:.3g}", file=sys.stderr)
    assert result["verify"]["transition_max_rel_err"] < 1e-6  # CPU: the same float32 code
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
            victim = next(s["peer"] for s in stages if s["peer"] != debug_swarm.ready[0]["peer_id"])
            set_liar(debug_swarm, victim, {"kind": "scale", "factor": 1.01})
            liar.append(victim)

    result, events = asyncio.run(train(debug_swarm, job(spec, sync), on_event))
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
    set_liar(debug_swarm, None, None)


def test_diloco_inner_step_liar_is_caught_by_the_transition_check(debug_swarm):
    # a worker whose messages are honest for the parameters it holds, but which scales its inner
    # optimizer's update by 1%: the transition check recomputes the step and catches it
    sync = SyncConfig("diloco", inner_steps=H)
    spec = spec_for(seed=7)
    # the liar is set before the job, on a worker that is not the driver's peer: four daemons for four
    # stages, so every one of them holds a stage. Set on the plan event it could land after step 1's
    # transition check, the client reading the event stream late under load (then caught later, or
    # not at all within the job's 6 steps)
    liar = [debug_swarm.ready[1]["peer_id"]]
    set_liar(debug_swarm, liar[0], {"kind": "update", "factor": 1.01})
    result, events = asyncio.run(train(debug_swarm, job(spec, sync)))
    plan = next(e for e in events if e["type"] == "plan")
    assert liar[0] in [s["peer"] for s in plan["stages"]], plan["stages"]
    caught = [e for e in events if e["type"] == "event" and e.get("kind") == "caught"]
    assert [e["peer"] for e in caught] == liar, caught
    assert "failed a transition check" in caught[0]["reason"], caught[0]["reason"]
    assert caught[0]["step"] == 1  # its first inner step (0), checked at step 1
    assert result["verify"]["transitions_caught"] == 1
    redo = [e for e in events if e["type"] == "event" and e.get("role") == "rounds"]
    assert redo and redo[0]["replay_from"] == 0, redo
    set_liar(debug_swarm, None, None)


def test_diloco_pseudo_gradient_liar_is_caught_at_the_round_end(debug_swarm):
    # scoring holds each round on the hosts: the driver checks each replica's pseudo-gradient against
    # the hosts' θ minus its stages' last inner step recomputed; an honest run passes it (and loses
    # nothing), a worker sending a random pseudo-gradient of its honest norm is caught at the first
    # round's end, its replica gets no weight in that round and the job goes on without it
    sync = SyncConfig("diloco", inner_steps=H)
    spec = spec_for(seed=8)
    result, events = asyncio.run(train(debug_swarm, {**job(spec, sync), "contrib_policy": "score"}))
    assert not [e for e in events if e["type"] == "event" and e.get("kind") in ("caught", "failure")]
    # 16 inner-step transitions (test above) + 2 rounds x 4 stages at the round ends
    assert result["verify"]["transitions"] == 16 + 8 and result["verify"]["transitions_caught"] == 0
    print(f"round-end max relative error {result['verify']['round_end_max_rel_err']:.3g}", file=sys.stderr)
    assert result["verify"]["round_end_max_rel_err"] < 1e-4
    # the liar is set before the job, on a worker of the honest run's plan (the same job on the same
    # swarm): set on the plan event it could land after the first round's close, the client reading
    # the event stream late under load (the lie then starts a round late: caught at step 2H - 1)
    first = next(e for e in events if e["type"] == "plan")
    liar = [next(s["peer"] for s in first["stages"] if s["peer"] != debug_swarm.ready[0]["peer_id"])]
    set_liar(debug_swarm, liar[0], {"kind": "random_pseudo_gradient"})
    result, events = asyncio.run(train(debug_swarm, {**job(spec, sync), "contrib_policy": "score"}))
    plan = next(e for e in events if e["type"] == "plan")
    assert liar[0] in [s["peer"] for s in plan["stages"]], plan["stages"]
    caught = [e for e in events if e["type"] == "event" and e.get("kind") == "caught"]
    scored = [e for e in events if e["type"] == "event" and e.get("kind") == "scored"]
    assert [e["peer"] for e in caught] == liar, (caught, scored)
    assert "failed a pseudo-gradient check" in caught[0]["reason"], caught[0]["reason"]
    assert caught[0]["step"] == H - 1, (caught, scored)  # the first round's last step
    replica = next(s["replica"] for s in plan["stages"] if s["peer"] == liar[0])
    assert scored[0]["verdict"][replica] == 0.0, scored[0]
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == list(range(spec.steps))  # the round stood: none replayed
    set_liar(debug_swarm, None, None)
