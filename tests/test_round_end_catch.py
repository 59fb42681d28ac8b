"""A round-end catch (train/step.py `caught_at_round_end`) is acted on when the round's closing commit
raised as well: the error that goes up replaces the returned failure that recovery bans the caught
for, so the caught are banned on the spot (review 4, finding 7)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import torch

from fusionnode.train.metrics import MetricsWriter
from fusionnode.train.spec import JobSpec
from fusionnode.train.state import Job, Run
from fusionnode.train.step import HostFailed, Stepper

LIAR, HONEST = "12D3KooWliar", "12D3KooWhonest"


def _run() -> tuple[Job, Run, list[dict]]:
    emitted: list[dict] = []

    async def emit(ev: dict) -> None:
        emitted.append(ev)

    run = Run(
        traced=None, canonical={}, full={}, sample=torch.zeros(1), host_of=None, host_index={}, params={},
        metrics=MetricsWriter(None), emit=emit, flops=[], strategy="simple", n_stages=1, shares=[1],
        stage_args=[], seq_len=8, known=set(), move_s=0.0, rebalance_every=0, min_gain=0.0,
    )  # fmt: skip
    run.scorer = SimpleNamespace(caught={LIAR: "pseudo-gradient 1% off"})
    return Job(JobSpec(model="gpt2-tiny"), "driver"), run, emitted


def _kinds(emitted: list[dict], peer: str) -> list[str]:
    return [e["kind"] for e in emitted if e.get("peer") == peer]


def test_a_catch_whose_commit_raised_is_banned_on_the_spot() -> None:
    job, run, emitted = _run()
    stepper = Stepper(None, 5.0, None, None)
    raised = HostFailed(3, {}, ["12D3KooWhost"])  # the closing commit's own failure goes up
    failed = asyncio.run(stepper.caught_at_round_end(job, run, 3, raised))
    now = time.monotonic()
    assert run.bans.banned(LIAR, now) and not run.bans.banned(HONEST, now)
    assert LIAR in run.gone and run.scorer.caught == {}
    assert _kinds(emitted, LIAR) == ["caught", "failure"]
    assert "verification: pseudo-gradient 1% off" in failed.reason(LIAR)


def test_a_catch_on_an_applied_round_is_left_to_recovery() -> None:
    # nothing raised: the returned failure is the step's `late`, which recovery bans the caught for
    job, run, emitted = _run()
    failed = asyncio.run(Stepper(None, 5.0, None, None).caught_at_round_end(job, run, 3))
    assert not run.bans.banned(LIAR, time.monotonic()) and LIAR in run.gone
    assert _kinds(emitted, LIAR) == ["caught"] and set(failed.errors) == {LIAR}
