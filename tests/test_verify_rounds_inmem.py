"""Spot-checks under `--sync diloco|sparseloco` asked for (`verify_policy: all`) in the in-memory swarm
(issue 20, fx4c): honest workers are never caught and the run follows the local reference. Two false
catches this found: a stage holding no parameter (the fusion planner lays one out) failed every
transition check (`expected_step` loaded its empty state into an AdamW expecting its kinds), and
under `--sync-overlap` with D = H the round-end check compared a Δ re-based on the previous round's
result at the close with the un-re-based recompute (every stage of rounds 2.. was caught)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_components import Swarm, round_job, small_spec
from test_sync_components import slow_homes_job

from fusionnode.optim.optimizers import FlatOptimizer, job_optimizer_config
from fusionnode.sync import SyncConfig
from fusionnode.train.replicas import train_local_replicas
from fusionnode.verify import inner


def bad_events(s: Swarm) -> list[dict]:
    return [e for e in s.events if e["type"] in ("caught", "failure", "replan")]


@pytest.mark.parametrize(
    ("sync", "tol"),
    [
        (SyncConfig("diloco", inner_steps=3), 1e-4),
        (SyncConfig("diloco", inner_steps=3, overlap=True), 1e-4),  # D = H: the close re-bases
        (SyncConfig("diloco", inner_steps=3, overlap=True, overlap_steps=1), 1e-4),
        (SyncConfig("sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256), 1e-3),
    ],
    ids=["diloco", "diloco-overlap-D=H", "diloco-overlap-D=1", "sparseloco"],
)
def test_honest_round_workers_pass_every_check_and_follow_the_reference(tmp_path, sync, tol):
    spec = small_spec(steps=9, micro_batches=2, seed=5, warmup_steps=2)
    s = Swarm(tmp_path, workers=4, hosts=2)
    result = asyncio.run(s.driver.run_job(round_job(spec, sync, verify_policy="all"), s.emit))
    assert bad_events(s) == []
    v = result["verify"]
    assert v["caught"] == 0 and v["transitions_caught"] == 0
    assert v["transitions"] >= 4 * 4  # the inner steps of 4 stages were recomputed (every one drawn)
    got = [e["loss"] for e in s.steps()]
    ref = train_local_replicas(spec, sync, replicas=2).losses
    assert len(got) == len(ref) == spec.steps
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) < tol, f"step {i}: swarm {a:.6f} vs local {b:.6f}"


def test_a_stage_without_parameters_passes_its_transition_check():
    # what an empty stage commits to and shows: no parameter, no state; its inner step moves nothing
    want = inner.expected_step({}, {}, {}, {}, 1.0, 1e-3, lambda m: FlatOptimizer(m, None))
    assert want == ({}, {})
    assert inner.compare_step({}, want, ({}, {}), 1e-4) == ""
    # a stage of frozen parameters only: unchanged, and showing state for them is a difference
    frozen = {"w": torch.ones(3)}
    assert inner.expected_step(frozen, {}, {}, {}, 1.0, 1e-3, None) == (frozen, {})
    shown = {"exp_avg/w": torch.zeros(3)}
    assert inner.compare_step(frozen, (frozen, {}), (frozen, shown), 1e-4) != ""
    # and a trained parameter is still stepped (the early return is for none only)
    cfg = job_optimizer_config(small_spec().to_dict(), {"w": {"shape": [3]}})
    state = {"steps/w": torch.tensor([0]), "exp_avg/w": torch.zeros(3), "exp_avg_sq/w": torch.zeros(3)}
    p, st = inner.expected_step(
        frozen, state, {"w": torch.ones(3)}, {}, 1.0, 1e-3, lambda m: FlatOptimizer(m, cfg)
    )
    assert not torch.equal(p["w"], frozen["w"]) and int(st["steps/w"]) == 1


def test_the_fusion_planners_empty_stages_pass_their_checks(tmp_path):
    # the slow-links cluster of test_sync_components: the fusion planner gives each replica a first
    # stage of no parameter; with every check on, none is caught and no round is redone
    spec = small_spec(steps=4, micro_batches=2)
    s = Swarm(tmp_path, workers=4, hosts=1)
    sync = SyncConfig("sparseloco", inner_steps=2, topk_density=1 / 16, chunk=256)
    params = {**slow_homes_job(s, spec, sync), "verify_policy": "all"}
    result = asyncio.run(s.driver.run_job(params, s.emit))
    assert bad_events(s) == []
    assert result["verify"]["transitions"] > 0 and result["verify"]["transitions_caught"] == 0
    assert [e["step"] for e in s.steps()] == list(range(spec.steps))
