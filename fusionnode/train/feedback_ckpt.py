"""SparseLoCo's error feedback in the driver's checkpoints, stage by stage (`--sync sparseloco`).

Each replica's accumulators live on its stages (runtime/rounds.py); a checkpoint asks every stage
for its own (`job.fetch what=feedback`, with `round` under `--round-close time`) and saves them per
replica, by name (train/checkpoint.py `save_job`).

- `fetch`: every stage's accumulators. With a `missing` list, a stage that cannot answer (not_held:
  it did not fold the round asked, a replica that lost that round; a dead peer; a timeout) is left
  out and listed there, and what the other stages answered is kept: one stage no longer drops every
  replica's feedback from the checkpoint.
- `saved`: `fetch` for a checkpoint (the periodic ones, the time-closed rounds' and the job's
  last), naming the stages left out in a `checkpoint_feedback` notice.
- `fresh_names`: what a resumed (or re-planned) job's stages get no feedback for, per replica: the
  names each stage sends (`contributing_names`) that the checkpoint does not hold. Only those start
  new accumulators (`Placement.ship` sends each stage the names it has); the driver names them in a
  notice.
- `fresh_flag`: what the first round record after a resume or a recovery says under
  `fresh_feedback`: true (no stage got feedback), a map replica -> the names that started new
  (part of them), or false. `train --local --round-steps FILE` replays the map
  (train/free_rounds_local.py `load_restarts`, `fresh_feedback_names`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch

from fusionnode.errors import FusionNodeError
from fusionnode.optim.rounds import contributing_names
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked
from fusionnode.wire.job import Rpc, StageAssignment, TensorKind

Feedback = dict[int, dict[str, torch.Tensor]]


async def fetch(
    placement: Any,
    job: Any,
    stage_args: list[StageAssignment],
    round_id: int = -1,
    missing: list[tuple[StageAssignment, Exception]] | None = None,
) -> Feedback | None:
    """--sync sparseloco: every replica's error-feedback accumulators, by name (`round_id`: as they
    were after that round, `FetchRequest.round`); None in the other modes. Without `missing` a stage
    that cannot answer fails the whole fetch; with it, that stage is appended there (with why) and
    the others' answers are returned."""
    if job.sync.mode != "sparseloco":
        return None
    t, timeout = placement.t, placement.step_timeout_s

    async def one(a: StageAssignment) -> dict[str, torch.Tensor]:
        req = jp.FetchRequest(
            job=job.spec.job_id, stage=a.stage, what="feedback", round=None if round_id < 0 else round_id
        )
        try:
            res = await jp.call(t, a.peer, Rpc.JOB_FETCH, req, timeout=timeout)
            got: dict[str, torch.Tensor] = {}
            for idx in range(res.count):
                msg, src = await t.mailbox.get(
                    (TensorKind.FEEDBACK, job.spec.job_id, -1, idx, a.stage), timeout, sender=a.peer
                )
                got.update(decode_checked(msg, a.param_specs, None, src))
            return got
        except (FusionNodeError, TimeoutError) as exc:
            if missing is None:
                raise
            missing.append((a, exc))
            return {}

    parts = await asyncio.gather(*(one(a) for a in stage_args))
    out: Feedback = {}
    for a, part in zip(stage_args, parts, strict=True):
        if part:
            out.setdefault(a.replica, {}).update(part)
    return out


async def saved(placement: Any, job: Any, run: Any, step: int, round_id: int = -1) -> Feedback | None:
    """The feedback a checkpoint of `step` saves: `fetch` with every stage that answers; the stages
    that cannot are named in a `checkpoint_feedback` notice (their names start new on resume)."""
    missing: list[tuple[StageAssignment, Exception]] = []
    feedback = await fetch(placement, job, run.stage_args, round_id, missing)
    if missing:
        why = f"not saved for {describe(missing)}; saved for the other stages"
        await run.event(job, "notice", what="checkpoint_feedback", step=step, reason=why)
    return feedback or None


def describe(missing: list[tuple[StageAssignment, Exception]]) -> str:
    """The stages a feedback fetch left out, for a notice: replica, stage and peer, and why."""
    return "; ".join(
        f"replica {a.replica} stage {a.stage} ({a.peer[:16]}): {exc}"
        for a, exc in sorted(missing, key=lambda m: m[0].stage)
    )


def fresh_names(
    stage_args: list[StageAssignment], feedback: Mapping[int, Mapping[str, Any]]
) -> dict[int, list[str]]:
    """Per replica, the names its stages send whose feedback `feedback` does not hold (those stages
    start new accumulators there); {} when it holds every one."""
    senders = contributing_names(stage_args)
    out: dict[int, list[str]] = {}
    for a in stage_args:
        mine = feedback.get(a.replica, {})
        miss = [n for n in senders.get(a.stage, []) if n not in mine]
        if miss:
            out.setdefault(a.replica, []).extend(miss)
    return {r: sorted(names) for r, names in sorted(out.items())}


def fresh_stages(stage_args: list[StageAssignment], feedback: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """The stages (replica, stage, peer) that get none of their names' feedback from `feedback`, or
    part only, for the resume's notice."""
    senders = contributing_names(stage_args)
    out = []
    for a in sorted(stage_args, key=lambda a: a.stage):
        names = senders.get(a.stage, [])
        held = [n for n in names if n in feedback.get(a.replica, {})]
        if len(held) < len(names):
            part = f" ({len(names) - len(held)} of {len(names)} names)" if held else ""
            out.append(f"replica {a.replica} stage {a.stage} ({a.peer[:16]}){part}")
    return out


def fresh_flag(job: Any) -> bool | dict[str, list[str]]:
    """The `fresh_feedback` of the first round record on the stages last shipped: true when they got
    no feedback, replica (a string) -> the names that started new when they got part of it, false
    when they got all of it (or the job keeps none)."""
    if job.sync.mode != "sparseloco":
        return False
    if not job.feedback_shipped:
        return True
    return {str(r): names for r, names in job.feedback_fresh.items()} or False


__all__ = ["describe", "fetch", "fresh_flag", "fresh_names", "fresh_stages", "saved"]
