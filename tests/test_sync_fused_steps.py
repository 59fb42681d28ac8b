"""Fused inner steps under `--round-close time` (train/fused_rounds.py, runtime/fused.py): one
`job.step` per inner step, the stage applying its optimizer step after the backward. The requests'
checks, which replicas fuse, and real daemons following the in-process replay of their schedule as
closely as the unfused path does (tests/test_sync_time_close.py)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from fusionnode.sync import SyncConfig
from fusionnode.train.fused_rounds import fuses
from fusionnode.train.replicas import train_local_replicas
from fusionnode.train.spec import JobSpec
from fusionnode.wire import job as jp
from tests.test_sync_time_close import _run, _timed, swarm  # noqa: F401 (the module's swarm fixture)

torch.set_num_threads(1)


def test_fused_fields_are_checked_and_left_out_unless_set() -> None:
    plain = jp.StepRequest(job="j", stage=0, step=3, micro_batches=2, mb_size=1)
    # what older peers decode: no new key unless the driver fuses the step
    assert set(plain.to_wire()) == {"job", "stage", "step", "micro_batches", "mb_size", "verify"}
    fused = plain.replace(commit_lr=1e-3, commit_clip=1.0, close_round={"id": 0, "tokens": 64})
    assert jp.StepRequest.from_wire(fused.to_wire()) == fused
    for bad, says in [
        ({"commit_clip": 1.0}, "give commit_lr"),
        ({"close_round": {"id": 0}}, "give commit_lr"),
        ({"commit_lr": 1e-3, "commit_clip": 0.0}, "commit_clip must be > 0"),
    ]:
        with pytest.raises(jp.JobError, match=says):
            jp.StepRequest.from_wire({**plain.to_wire(), **bad})
    commit = jp.CommitRequest(job="j", stage=0, step=3, lr=1e-3)
    assert "close_only" not in commit.to_wire()
    assert jp.CommitRequest.from_wire(commit.replace(close_only=True).to_wire()).close_only is True


def test_which_replicas_fuse() -> None:
    def stage(shared=()):
        return SimpleNamespace(shared_names=set(shared))

    def job(clip):
        return SimpleNamespace(spec=SimpleNamespace(grad_clip=clip))

    assert fuses(job(1.0), [stage()])  # one stage: its own norm is the replica's
    assert fuses(job(None), [stage(), stage()])  # no clip: nothing crosses stages
    assert not fuses(job(1.0), [stage(), stage()])  # the clip needs every stage's norm
    assert not fuses(job(None), [stage(["wte"]), stage(["wte"])])  # tied weights summed by the driver


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "tol"),
    [
        (SyncConfig("diloco", inner_steps=4), 1e-4),
        (
            SyncConfig(
                "sparseloco", inner_steps=4, topk_density=1 / 16, chunk=256, overlap=True, overlap_steps=1
            ),
            1e-3,
        ),
    ],
    ids=["diloco", "sparseloco-overlap"],
)
def test_fused_swarm_follows_the_replay_of_its_schedule(swarm, sync, tol) -> None:  # noqa: F811
    spec = JobSpec(
        model="gpt2-tiny",
        steps=20,
        batch_size=8,
        micro_batches=2,
        seq_len=32,
        seed=5,
        lr=3e-3,
        warmup_steps=3,
        grad_clip=0.5,  # clipped on the stage, by its own norm
    )
    sync = _timed(sync)
    shares = [2, 6]
    result, events = _run(swarm, spec, sync, shares, stages=1)
    rounds = [e for e in events if e["type"] == "step"]
    assert len(rounds) == 5 and [r["round_closed"] for r in rounds] == list(range(5))
    assert all(rep["fused"] for r in rounds for rep in r["replicas"])
    schedule = [[rep["steps"] for rep in r["replicas"]] for r in rounds]
    print(f"{sync.mode}: inner steps per round and replica {schedule}", file=sys.stderr)
    assert all(max(c) == 4 for c in schedule)
    assert any(c[1] < c[0] for c in schedule), schedule  # the slowed replica did fewer: a real test
    assert any(r["grad_norm"] > spec.grad_clip for r in rounds)  # the clip did something
    for r in rounds:
        assert [rep["tokens"] for rep in r["replicas"]] == [
            s * 32 * rep["steps"] for s, rep in zip(shares, r["replicas"], strict=True)
        ]
    received = [sum(h["received_bytes"] for h in r["optimizer_hosts"]) for r in rounds]
    assert received == sorted(received) and received[-1] > 0
    assert all(h["rounds_closed"] == 5 for h in rounds[-1]["optimizer_hosts"])
    ref = train_local_replicas(spec, sync, shares=shares, round_steps=schedule)
    for q, (a, b) in enumerate(zip([r["loss"] for r in rounds], ref.losses, strict=True)):
        assert abs(a - b) < tol, f"round {q}: swarm {a:.6f} vs local {b:.6f}"
        for x, y in zip(rounds[q]["replicas"], ref.records[q]["replicas"], strict=True):
            assert abs(x["loss"] - y["loss"]) < tol, (q, x, y)
    assert abs(result["val_loss"] - ref.val_loss) < tol


def test_a_worker_refuses_a_step_it_cannot_fuse() -> None:
    from fusionnode.runtime.fused import refusal

    req = jp.StepRequest(job="j", stage=0, step=1, micro_batches=1, mb_size=1, commit_lr=1e-3)
    rounds = SimpleNamespace(rounds=object(), opt=object(), shared_names=set(), params={"w": 0})
    assert refusal(rounds, req) is None
    assert "round mode" in refusal(SimpleNamespace(**{**vars(rounds), "rounds": None}), req)
    tied = SimpleNamespace(**{**vars(rounds), "shared_names": {"w"}})
    assert "tied parameters" in refusal(tied, req)
    assert "not spot-checked" in refusal(rounds, req.replace(verify=True))
    assert "empty round" in refusal(rounds, req.replace(close_round={}))
