"""`--sync diloco|sparseloco` through the driver, workers and optimizer hosts on the in-memory network
(tests/memnet.py): the fast counterpart of tests/test_sync_swarm_e2e.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_components import Swarm, round_job, small_spec

from fusionnode.errors import ConfigError
from fusionnode.sync import SyncConfig
from fusionnode.train.replicas import train_local_replicas
from fusionnode.wire.job import Rpc

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("sync", "tol"),
    [
        (SyncConfig("diloco", inner_steps=2), 1e-4),
        (SyncConfig("sparseloco", inner_steps=2, topk_density=1 / 16, chunk=256), 1e-3),
    ],
    ids=["diloco", "sparseloco"],
)
def test_two_replicas_of_two_stages_follow_the_local_reference(tmp_path, sync, tol):
    spec = small_spec(steps=5, micro_batches=2)
    s = Swarm(tmp_path, workers=4, hosts=2)
    params = round_job(spec, sync)
    asyncio.run(s.driver.run_job(params, s.emit))
    got = [e["loss"] for e in s.steps()]
    ref = train_local_replicas(spec, sync, replicas=2).losses
    assert len(got) == len(ref) == spec.steps
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) < tol, f"step {i}: swarm {a:.6f} vs local {b:.6f}"
    # rounds close at steps 1, 3 and 4 (the last); every host counts its bytes, cumulative
    hosts = [e["optimizer_hosts"] for e in s.steps()]
    received = [sum(h["received_bytes"] for h in step) for step in hosts]
    assert received[0] == 0 and received[1] > 0 and received[2] == received[1] < received[3] < received[4]
    assert all(h["rounds_closed"] == 3 and h["sent_bytes"] > 0 for h in hosts[-1])
    # no per-step gradient pushes or opt.apply in a round mode: rounds only
    for pid in s.hosts:
        calls = s.net.peers[pid].calls
        assert Rpc.OPT_APPLY not in calls
    for pid in s.workers:
        assert s.net.peers[pid].calls.count(Rpc.JOB_COMMIT) == spec.steps


def slow_homes_job(s: Swarm, spec, sync: SyncConfig) -> dict:
    """A `--planner fusion` round-mode job on `s` (4 workers, the rest optimizer hosts) whose cluster
    document puts 20 Mbit/s links between every two peers."""
    n = len(s.ids)
    cluster = {
        "version": 1,
        "name": "slow-homes",
        "devices": [
            {"id": pid, "tflops": 0.05, "memory_gb": 4.0, "roles": ["worker"] if i < 4 else ["optimizer"]}
            for i, pid in enumerate(s.ids)
        ],
        "links": {
            "matrix": {
                "bandwidth_gbps": [[1.0 if i == j else 0.02 for j in range(n)] for i in range(n)],
                "latency_ms": [[0.0] * n for _ in range(n)],
            }
        },
    }
    return {
        "spec": spec.to_dict(),
        "planner": "fusion",
        "offload": "on",
        "cluster": cluster,
        "sync": sync.to_dict(),
    }


def test_the_fusion_planner_lays_out_replicas_for_a_round_mode(tmp_path):
    # `--planner fusion --sync sparseloco`: the planner prices the replicas' sync once per round of
    # H steps (plan/syncprice.py), so over 20 Mbit/s links it runs data-parallel replicas
    spec = small_spec(steps=4, micro_batches=2)
    s = Swarm(tmp_path, workers=4, hosts=1)
    sync = SyncConfig("sparseloco", inner_steps=2, topk_density=1 / 16, chunk=256)
    params = slow_homes_job(s, spec, sync)
    asyncio.run(s.driver.run_job(params, s.emit))
    plan = next(e for e in s.events if e["type"] == "plan")
    assert plan["planner"] == "fusion"
    assert plan["prediction"]["sync"] == {
        "mode": "sparseloco",
        "inner_steps": 2,
        "wire_ratio": sync.wire_ratio,
    }
    # replicas across the slow links (priced every step, the same cluster gets one pipeline of 8)
    assert len({st["replica"] for st in plan["stages"]}) > 1
    steps = s.steps()
    assert len(steps) == spec.steps and all(torch.isfinite(torch.tensor(e["loss"])) for e in steps)
    assert all(h["rounds_closed"] == 2 for h in steps[-1]["optimizer_hosts"])


@pytest.mark.parametrize(
    ("sync", "steps", "tol"),
    [
        (SyncConfig("diloco", inner_steps=5, overlap=True), 30, 1e-4),
        (SyncConfig("diloco", inner_steps=4, overlap=True, overlap_steps=2), 30, 1e-4),
        (SyncConfig("sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256, overlap=True), 10, 1e-3),
        (
            SyncConfig(
                "sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256, overlap=True, overlap_steps=1
            ),
            10,
            1e-3,
        ),
    ],
    ids=["diloco-D=H", "diloco-D=2", "sparseloco-D=H", "sparseloco-D=1"],
)
def test_overlapped_rounds_follow_the_local_reference(tmp_path, sync, steps, tol):
    # --sync-overlap: a round's exchange runs beside the next round's inner steps and its outer update
    # is applied D of them late (D = H: one round; the last round, of 1 step with sparseloco, is
    # closed before D steps passed); the swarm (2 replicas x 2 stages, fp32) follows the reference (the
    # spec of tests/test_sync_swarm_e2e.py: float noise does not grow past 1e-4 in its 30 steps)
    spec = small_spec(steps=steps, micro_batches=2, seed=5, warmup_steps=3)
    s = Swarm(tmp_path, workers=4, hosts=2)
    params = round_job(spec, sync)
    asyncio.run(s.driver.run_job(params, s.emit))
    got = [e["loss"] for e in s.steps()]
    ref = train_local_replicas(spec, sync, replicas=2)
    assert len(got) == len(ref.losses) == spec.steps
    for i, (a, b) in enumerate(zip(got, ref.losses, strict=True)):
        assert abs(a - b) < tol, f"step {i}: swarm {a:.6f} vs local {b:.6f}"
    # the delayed update is a different trajectory from the blocking rounds' (the test can fail)
    blocking = train_local_replicas(
        spec, SyncConfig(**{**sync.to_dict(), "overlap": False, "overlap_steps": None}), replicas=2
    )
    h = sync.inner_steps
    assert ref.losses[:h] == blocking.losses[:h]  # identical until the first round closes
    assert max(abs(a - b) for a, b in zip(ref.losses, blocking.losses, strict=True)) > 10 * tol
    # every round applied once, the last one installed before the job ended
    rounds = -(-spec.steps // h)
    assert [x["rounds_closed"] for x in s.steps()[-1]["optimizer_hosts"]] == [rounds, rounds]
    assert ref.rounds == rounds


def test_overlap_is_refused_where_it_cannot_work():
    with pytest.raises(ConfigError, match="--sync-overlap"):
        SyncConfig("step", overlap=True)
    with pytest.raises(ConfigError, match="--sync-overlap"):
        SyncConfig("diloco", inner_steps=2, overlap=1)
    sync = SyncConfig("diloco", inner_steps=2, overlap=True)
    with pytest.raises(ConfigError, match=r"--overlap-steps 3: must lie in \[1, H = 2\]"):
        SyncConfig("diloco", inner_steps=2, overlap=True, overlap_steps=3)
    with pytest.raises(ConfigError, match="--overlap-steps 1: an integer, with --sync-overlap only"):
        SyncConfig("diloco", inner_steps=2, overlap_steps=1)
    # D = 1: the update is applied after each round's first step, D = H at the next close
    d1 = SyncConfig("diloco", inner_steps=3, overlap=True, overlap_steps=1)
    assert [t for t in range(9) if d1.applies_delayed(t)] == [0, 3, 6]
    assert [t for t in range(9) if sync.applies_delayed(t)] == [1, 3, 5, 7]
