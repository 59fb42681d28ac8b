"""Fused inner steps under `--round-close time` (issue 19's utilisation; the driver's side, used by
train/free_rounds.py; the worker's is runtime/fused.py; protocol/ROUNDS.md, "Fused inner steps").

A replica's inner step otherwise takes two calls per stage: `job.step`, then (once the driver has its
gradient norm and its tied-weight sums) `job.commit`, which applies the inner optimizer step; the
device idles for the commit's round trip and the driver's turn, 10-20% of a step on the
home-volunteer testbed. A replica that needs nothing from the driver between the two (`fuses`) sends
one `job.step` per stage with `commit_lr` and, with a clip, `commit_clip`: the stage applies its
optimizer step after its backward, with the coefficient the driver would have given it. The driver
still feeds every micro-batch and target (tokens stay counted by the driver) and decides the rounds:
a round a replica closes after step t is closed by its next step's `close_round`, before that step's
forward (so a slow replica that must stop mid-round pays no extra round trip), the job's last round
by `job.commit` with `close_only`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fusionnode.train.state import Job, Run
from fusionnode.wire import job as jp
from fusionnode.wire.job import Rpc

T = TypeVar("T")


def fuses(job: Job, mine: list[Any]) -> bool:
    """Whether the replica of stages `mine` runs fused steps: no tied parameters summed over stages,
    and its clip computable by one stage alone (one stage, or no clip)."""
    if any(a.shared_names for a in mine):
        return False
    return len(mine) == 1 or job.spec.grad_clip is None


def _round(run: Run, stage: int, info: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if info is None else {**info, "names": run.names_by_stage[stage]}


async def step_reports(
    driver: Any,
    job: Job,
    run: Run,
    pipe: Any,
    mine: list[Any],
    step: int,
    lr: float | None = None,
    clip: float | None = None,
    close: dict[str, Any] | None = None,
    after: int | None = None,
) -> list[Any]:
    """`job.step` `step` on a replica's stages `mine` (its inputs fed), fused when `lr` is given
    (`commit_lr`, `commit_clip`, `close_round`; `after_step`: queued ahead, train/queued_rounds.py);
    their reports in `mine` order."""
    calls = {
        ("step", a.stage): jp.call(
            driver.t,
            a.peer,
            Rpc.JOB_STEP,
            jp.StepRequest(
                job=job.spec.job_id,
                stage=a.stage,
                step=step,
                micro_batches=pipe.micro_batches,
                mb_size=pipe.mb_size,
                commit_lr=lr,
                commit_clip=clip,
                close_round=_round(run, a.stage, close),
                after_step=after,
            ),
            timeout=driver.stepper.step_timeout_s * 2,
            recall=Rpc.JOB_STEP_RESULT,  # a reply lost to a stream reset: fetch it, the step ran
        )
        for a in mine
    }
    got = await driver.stepper.gather_or_fail(
        job, run, step, calls, {("step", a.stage): a.peer for a in mine}
    )
    return [got[("step", a.stage)] for a in mine]


async def fused_step(
    driver: Any,
    job: Job,
    run: Run,
    pipe: Any,
    mine: list[Any],
    step: int,
    lr: float,
    close: dict[str, Any] | None,
    after: int | None = None,
) -> tuple[list[Any], float, float, list[dict[str, list[int]]]]:
    """A replica's fused inner step `step` (its inputs fed), closing round `close` first if given
    (queued after the replica's step `after` if given). Returns (reports in `mine` order, its mean
    micro-batch loss, its gradient norm, each stage's round bytes per host)."""
    clip = job.spec.grad_clip
    reports = await step_reports(
        driver, job, run, pipe, mine, step, lr, None if clip is None else float(clip), close, after
    )
    norm = math.sqrt(sum(r.grad_sq for r in reports))
    losses = reports[-1].losses
    return reports, sum(losses) / len(losses), norm, [r.round_bytes or {} for r in reports]


async def close_last(
    driver: Any, job: Job, run: Run, mine: list[Any], step: int, info: dict[str, Any]
) -> list[dict[str, list[int]]]:
    """Closes the job's last round `info` after the replica's fused step `step` (`job.commit` with
    `close_only`); each stage's round bytes per host."""
    timeout = driver.stepper.step_timeout_s
    calls = {
        ("commit", a.stage): jp.call(
            driver.t,
            a.peer,
            Rpc.JOB_COMMIT,
            jp.CommitRequest(
                job=job.spec.job_id,
                stage=a.stage,
                step=step,
                round=_round(run, a.stage, info),
                close_only=True,
            ),
            timeout=timeout,
            idempotent=True,
        )
        for a in mine
    }
    got = await driver.stepper.gather_or_fail(
        job, run, step, calls, {("commit", a.stage): a.peer for a in mine}
    )
    return [r.round_bytes for r in got.values()]


async def fused_step_fed(
    step: Awaitable[T], feeding: asyncio.Future, guess: Callable[[], Awaitable[None]] | None
) -> tuple[T, asyncio.Future | None]:
    """A replica's `fused_step` (the coroutine `step`) sent while its inputs (`feeding`) go out; once
    they are out, the inputs of the step most likely next (`guess`: the next of the round, or the next
    round's first when this one ends it) go out while the step runs, so the stage finds them there. A
    guess the round's close proves wrong (another replica ended the round during this step) is fed in
    vain: the stage drops it at its next step (runtime/fused.py, `Mailbox.drop_before`). Returns
    (`step`'s result, the guess's feed)."""
    call = asyncio.ensure_future(step)
    ahead: asyncio.Future | None = None
    try:
        await feeding
        if guess is not None:
            ahead = asyncio.ensure_future(guess())
        return await call, ahead
    except BaseException:
        for f in (call, ahead):
            if f is not None and not f.done():
                f.cancel()
        await asyncio.gather(*(f for f in (call, ahead) if f is not None), return_exceptions=True)
        raise


def drop(fut: asyncio.Future | None) -> None:
    """A guessed feed not needed: left to finish (its bytes are partly out), its outcome ignored."""
    if fut is not None:
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
