"""Fused inner steps (rounds closed by time, issue 19): the worker's side of `job.step` with
`commit_lr` (protocol/ROUNDS.md, "Fused inner steps"; the driver's side is train/fused_rounds.py).

A replica whose inner steps need nothing from the driver between the backward and the optimizer step
(one stage, or several without tied parameters across stages nor a gradient clip) has its stages
apply the inner optimizer step right after the backward, in the same call: no `job.commit` round trip
per step, during which the device would idle. What follows the optimizer step is what `job.commit`
does for a commit without `round` (`--sync-overlap`'s delayed update, runtime/rounds.py); a round is
closed by the replica's next step (`close_round`, before its forward) or, for the job's last round,
by a `job.commit` with `close_only` (`close_only`, below).

The clip: the driver's coefficient for a replica of one stage is min(1, clip / (sqrt(grad_sq) +
1e-6)) with grad_sq the stage's report; the same floats here give the same coefficient.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch

from fusionnode.verify import inner
from fusionnode.wire import job as jp
from fusionnode.wire.job import ErrorCode, JobError, TensorKind


def refusal(sj: Any, req: jp.StepRequest) -> str | None:
    """Why stage job `sj` cannot run `req` fused (None: it can)."""
    if sj.rounds is None or sj.opt is None:
        return "a fused step (commit_lr) needs a round mode's inner optimizer (--sync diloco|sparseloco)"
    if sj.shared_names & set(sj.params):
        return "a fused step cannot sum tied parameters over stages: the driver commits them"
    if req.verify:
        return "a fused step (commit_lr) is not spot-checked: verify must be false"
    if req.close_round is not None and not req.close_round:
        return "close_round: an empty round"
    if req.after_step is not None and not req.after_step < req.step:
        return f"after_step must be below step, got {req.after_step} >= {req.step}"
    return None


async def fused_step(worker: Any, sj: Any, req: jp.StepRequest) -> jp.StepReport:
    """`req`'s inner step with its optimizer step: close the pending round (`close_round`), run
    the 1F1B schedule, clip, apply the inner optimizer step, then the delayed update if due."""
    round_bytes: dict[str, list[int]] = {}
    # inputs fed ahead for a step the round's close skipped (train/fused_rounds.py `fused_step_fed`):
    # a stage's fused steps only go up, so what is held of an earlier step is never read
    worker.t.mailbox.drop_before(sj.job, sj.stage, req.step, (TensorKind.INPUT, TensorKind.TARGET))
    if req.close_round is not None:  # the round whose last inner step was this stage's previous one
        _add(round_bytes, await sj.rounds.after_step(worker, sj, sj.last_step, req.close_round))
    report = await worker._run_step(sj, req.step, req.micro_batches, req.mb_size, req.target_time_s)
    clip = 1.0
    if req.commit_clip is not None:
        clip = min(1.0, req.commit_clip / (math.sqrt(report.grad_sq) + 1e-6))
    lr, liar = float(req.commit_lr), worker._liar()

    def apply() -> None:
        with torch.no_grad():
            for p in sj.params.values():
                if p.grad is not None and clip != 1.0:
                    p.grad.mul_(clip)
            inner.step(sj, lr, liar)
            sj.opt.zero_grad()

    await asyncio.get_running_loop().run_in_executor(worker.executor, apply)
    _add(round_bytes, await sj.rounds.after_step(worker, sj, req.step, None))
    sj.last_step = req.step
    return report.replace(round_bytes=round_bytes)


async def close_only(worker: Any, sj: Any, req: jp.CommitRequest) -> jp.CommitReply:
    """`job.commit` with `close_only`: close `req.round`, whose last inner step `req.step` was applied
    by its fused `job.step` (no inner step here); a retried one finds the round closed already."""
    if sj.rounds is None or not req.round:
        raise JobError(ErrorCode.BAD_REQUEST, "close_only: a round mode's commit with a round")
    async with sj.busy:
        if sj.last_step != req.step:
            raise JobError(
                ErrorCode.BAD_REQUEST,
                f"close_only for step {req.step}: stage {sj.stage}'s last applied step is {sj.last_step}",
            )
        round_bytes = await sj.rounds.after_step(worker, sj, req.step, req.round)
    return jp.CommitReply(applied=req.step, round_bytes=round_bytes)


def _add(acc: dict[str, list[int]], more: dict[str, list[int]]) -> None:
    for host, (sent, received) in more.items():
        cur = acc.setdefault(host, [0, 0])
        cur[0] += sent
        cur[1] += received
