"""Real `fusionnode join` processes: `--sync diloco|sparseloco` on 2 replicas x 2 stages follows the
in-process reference (`train --local --replicas 2 --sync ...`) step by step (issue 19)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from fusionnode import control
from fusionnode.localswarm import LocalSwarm
from fusionnode.sync import SyncConfig
from fusionnode.train.checkpoint import list_checkpoints, read_checkpoint
from fusionnode.train.local import build_job_model
from fusionnode.train.replicas import train_local_replicas
from fusionnode.train.spec import JobSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N_PEERS = 4
STEPS = 30


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("swarm"), N_PEERS, log=sys.stderr)
    try:
        s.start()
        asyncio.run(s.wait_connected())
        yield s
    finally:
        s.stop()


def run_job(
    swarm: LocalSwarm, spec: JobSpec, sync: SyncConfig, shares=None, on_event=None
) -> tuple[dict, list[dict]]:
    async def go():
        events = []
        params = {
            "spec": spec.to_dict(),
            "stages": 2,
            "replicas": 2,
            "shares": shares,
            "offload": "on",
            "optimizer_hosts": 2,
            "sync": sync.to_dict(),
        }
        async for obj in control.call_stream(swarm.control(0), "train", params, timeout=600):
            if "event" in obj:
                events.append(obj["event"])
                if on_event is not None:
                    on_event(obj["event"])
            else:
                return obj["result"], events
        raise AssertionError("no result")

    return asyncio.run(go())


def spec(**kw) -> JobSpec:
    base = dict(
        model="gpt2-tiny",
        steps=STEPS,
        batch_size=8,
        micro_batches=2,
        seq_len=32,
        seed=5,
        lr=3e-3,
        warmup_steps=3,
    )
    base.update(kw)
    return JobSpec(**base)


def _check_records(steps: list[dict], sync: SyncConfig) -> None:
    """Every record names both hosts with cumulative bytes received (only pseudo-gradients here:
    none before the first round closes, more after every round, the same inside a round) and sent."""
    h = sync.inner_steps
    received, sent = [], []
    for rec in steps:
        hosts = rec["optimizer_hosts"]
        assert len(hosts) == 2
        received.append(sum(x["received_bytes"] for x in hosts))
        sent.append(sum(x["sent_bytes"] for x in hosts))
    assert received[: h - 1] == [0] * (h - 1)
    for k in range(h - 1, STEPS, h):
        assert received[k] > (received[k - 1] if k else 0), k
        assert sent[k] > (sent[k - 1] if k else 0), k
        assert received[k : k + h] == [received[k]] * len(received[k : k + h])
    assert sent == sorted(sent)
    assert all(x["rounds_closed"] == -(-STEPS // h) for x in steps[-1]["optimizer_hosts"])


def test_diloco_follows_the_local_reference(swarm):
    s = spec()
    sync = SyncConfig("diloco", inner_steps=5)
    _res, events = run_job(swarm, s, sync)
    dist = [e["loss"] for e in events if e["type"] == "step"]
    ref = train_local_replicas(s, sync, replicas=2).losses
    assert len(dist) == len(ref) == STEPS
    for i, (a, b) in enumerate(zip(dist, ref, strict=True)):
        assert abs(a - b) < 1e-4, f"step {i}: swarm {a:.6f} vs local {b:.6f}"
    _check_records([e for e in events if e["type"] == "step"], sync)


def test_overlapped_diloco_follows_the_local_reference(swarm):
    # --sync-overlap --overlap-steps 2 over real daemons: each round's exchange runs beside the next
    # round's first 2 inner steps (its own thread); the swarm follows the reference within 1e-4
    s = spec()
    sync = SyncConfig("diloco", inner_steps=5, overlap=True, overlap_steps=2)
    _res, events = run_job(swarm, s, sync)
    steps = [e for e in events if e["type"] == "step"]
    ref = train_local_replicas(s, sync, replicas=2).losses
    assert len(steps) == len(ref) == STEPS
    for i, (a, b) in enumerate(zip([e["loss"] for e in steps], ref, strict=True)):
        assert abs(a - b) < 1e-4, f"step {i}: swarm {a:.6f} vs local {b:.6f}"
    # a round's bytes come back with the commit that applies it (the next round's 2nd step)
    assert [e["rounds_applied"] for e in steps[:12]] == [0] * 6 + [1] * 5 + [2]
    assert all(x["rounds_closed"] == STEPS // 5 for x in steps[-1]["optimizer_hosts"])


def test_diloco_with_a_warmup_follows_the_local_reference(swarm):
    # --sync-warmup 10 over real daemons: 10 one-step rounds, each installed at its close, then
    # rounds of 5 overlapped by 2 steps; within 1e-4 of the reference at every step. The averaged
    # outer step (fusionnode-dp's DiLoCo): with the paper's Nesterov 0.7/0.9, one-step rounds make
    # an outer step of up to 7x the inner one, and this job drifts from step 7 (4e-4 in memory, 2.5e-3
    # over daemons; 1.3e-5 with --inner-steps 1 and no warm-up); exact without grad clipping
    s = spec()
    sync = SyncConfig(
        "diloco",
        inner_steps=5,
        outer_lr=1.0,
        outer_momentum=0.0,
        overlap=True,
        overlap_steps=2,
        warmup_steps=10,
    )
    _res, events = run_job(swarm, s, sync)
    steps = [e for e in events if e["type"] == "step"]
    ref = train_local_replicas(s, sync, replicas=2).losses
    assert len(steps) == len(ref) == STEPS
    for i, (a, b) in enumerate(zip([e["loss"] for e in steps], ref, strict=True)):
        assert abs(a - b) < 1e-4, f"step {i}: swarm {a:.6f} vs local {b:.6f}"
    closed = [e.get("round_closed") for e in steps]
    assert closed[:10] == list(range(10)) and [c for c in closed[10:] if c is not None] == [10, 11, 12, 13]
    assert all(x["rounds_closed"] == 14 for x in steps[-1]["optimizer_hosts"])


def test_replicas_of_different_shares_weigh_by_tokens(swarm):
    # 2 and 6 sequences per step: the outer step weighs the replicas 1:3, as the reference does
    s = spec(steps=10)
    sync = SyncConfig("diloco", inner_steps=5, outer_lr=1.0, outer_momentum=0.0)
    _res, events = run_job(swarm, s, sync, shares=[2, 6])
    dist = [e["loss"] for e in events if e["type"] == "step"]
    ref = train_local_replicas(s, sync, shares=[2, 6]).losses
    even = train_local_replicas(s, sync, replicas=2).losses
    for i, (a, b) in enumerate(zip(dist, ref, strict=True)):
        assert abs(a - b) < 1e-4, f"step {i}: swarm {a:.6f} vs local {b:.6f}"
    assert abs(dist[-1] - even[-1]) > 1e-3  # the shares matter: not the even split's trajectory


def test_sparseloco_follows_the_local_reference(swarm, tmp_path):
    """Within 1e-3 per step, and in every round at least 99% of the positions transmitted (the union
    of the replicas' top-k indices: where the round's outer step changed θ, read from the driver's
    checkpoint at every round boundary) are the reference's (Jaccard index; top-k and 2-bit bins may
    flip on near-ties)."""
    h = 5
    s = spec(save_dir=str(tmp_path / "ckpt"), save_every=h)
    sync = SyncConfig("sparseloco", inner_steps=h, topk_density=1 / 16, chunk=256)
    seen: dict[int, dict] = {}

    def collect(_ev: dict) -> None:  # the driver keeps 3 checkpoints: read each as it appears
        for step, path in list_checkpoints(tmp_path / "ckpt"):
            if step not in seen:
                seen[step] = read_checkpoint(path).params

    _res, events = run_job(swarm, s, sync, on_event=collect)
    collect({})
    dist = [e["loss"] for e in events if e["type"] == "step"]
    ref_theta: dict[int, dict] = {}
    ref = train_local_replicas(
        s.replace(save_dir=None), sync, replicas=2, on_round=lambda r, th: ref_theta.__setitem__(r, th)
    )
    for i, (a, b) in enumerate(zip(dist, ref.losses, strict=True)):
        assert abs(a - b) < 1e-3, f"step {i}: swarm {a:.6f} vs local {b:.6f}"
    _check_records([e for e in events if e["type"] == "step"], sync)
    assert sorted(seen) == list(range(h, STEPS + 1, h))
    before = {n: p.detach().float() for n, p in build_job_model(s).named_parameters()}
    ref_before = dict(before)
    for r in range(STEPS // h):
        after = seen[(r + 1) * h]
        both = either = 0
        for name, p0 in before.items():
            sent_swarm = after[name].float() != p0
            sent_ref = ref_theta[r][name] != ref_before[name]
            both += int((sent_swarm & sent_ref).sum())
            either += int((sent_swarm | sent_ref).sum())
        assert either > 0 and both / either >= 0.99, f"round {r}: {both / either:.4f} of the indices agree"
        print(
            f"sparseloco round {r}: {both}/{either} = {both / either:.5f} of the indices agree",
            file=sys.stderr,
        )
        before, ref_before = {n: after[n].float() for n in before}, ref_theta[r]


def test_step_records_carry_host_bytes(swarm):
    _res, events = run_job(swarm, spec(steps=3), SyncConfig())
    steps = [e for e in events if e["type"] == "step"]
    got = [sum(h["received_bytes"] for h in e["optimizer_hosts"]) for e in steps]
    assert got[0] > 0 and got == sorted(got) and got[2] > got[1] > got[0]
    assert all(h["sent_bytes"] > 0 for h in steps[-1]["optimizer_hosts"])
