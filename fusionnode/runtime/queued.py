"""Fused steps queued ahead (rounds closed by time, issue 19's utilisation; the worker's side, the
driver's is train/queued_rounds.py; protocol/ROUNDS.md, "Steps queued ahead").

A fused `job.step` with `after_step` is sent while the stage still runs its fused step `after_step`,
so that it starts the moment that step ends, not a report-and-call round trip later. It waits here for
its turn: it starts once the stage's last fused step is `after_step`, and is refused (`aborted`) when
that step failed, or when the driver withdrew it first (`job.withdraw`: another replica closed the
round, so the step would belong to a round already closed). Whether a queued step starts or is
withdrawn is decided here, in one place and once: a `job.withdraw` that finds it started (or ran)
answers `withdrawn: false` and the driver counts it in its round; one that finds it waiting or not
arrived yet answers `true`, and the step never runs, whenever its request comes.

A queued step's call stays open for two steps, so its stream is the likelier to reset: the recall
(`job.step_result`, `recall` here) waits while the queue holds the step (waiting its turn, or started
and waiting for the stage), and answers `aborted` when it was refused. A dropped stage (`close`:
release, lease expiry, a new assignment) refuses the steps it holds with `not_held` at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fusionnode.wire import job as jp
from fusionnode.wire.job import ErrorCode, JobError

KEPT = 16  # steps remembered below the stage's last fused step (withdrawn, started, failed)
WAIT_LIMIT_S = 900.0  # a queued step whose turn never comes (its driver gone) stops waiting then


class StepQueue:
    """A stage's queued-ahead steps: which started, which were withdrawn, which fused steps failed."""

    def __init__(self) -> None:
        self.started: set[int] = set()
        self.withdrawn: set[int] = set()
        self.failed: set[int] = set()
        self.held: set[int] = set()  # in wait_turn, or started and not yet running (rpc_step's `leave`)
        self.refused: dict[int, JobError] = {}  # step -> wait_turn's refusal of it (the recall's answer)
        self.closed = False  # the stage was dropped: its queued steps are refused (`not_held`)
        self.wake = asyncio.Event()  # set (and replaced) whenever a fused step ends or one is withdrawn

    def notify(self) -> None:
        self.wake.set()
        self.wake = asyncio.Event()

    def prune(self, last: int) -> None:
        for s in (self.started, self.withdrawn, self.failed):
            s.difference_update([x for x in s if x < last - KEPT])
        for x in [x for x in self.refused if x < last - KEPT]:
            del self.refused[x]


def check_cap(caps: dict[str, list[str]] | None) -> None:
    """A worker that does not advertise ``steps: queued`` (a test's daemon posing as older,
    verify/compat.py) refuses `after_step` as a version from before it does: an unknown field."""
    if "queued" not in ((caps or {}).get("steps") or []):
        raise JobError(ErrorCode.BAD_REQUEST, "StepRequest: unknown field(s) ['after_step']")


def of(sj: Any) -> StepQueue:
    q = getattr(sj, "step_queue", None)
    if q is None:
        q = sj.step_queue = StepQueue()
    return q


async def wait_turn(sj: Any, req: jp.StepRequest) -> None:
    """Waits until the fused step `req` (queued after `req.after_step`) may start, and marks it
    started; `aborted` if it was withdrawn or the step it follows did not complete, `not_held` if the
    stage was dropped. The step stays held (for the recall) until rpc_step calls `leave`."""
    q = of(sj)
    q.held.add(req.step)
    try:
        await _turn(sj, q, req)
    except BaseException as exc:
        q.held.discard(req.step)
        if isinstance(exc, JobError):
            q.refused[req.step] = exc
        q.notify()
        raise


async def _turn(sj: Any, q: StepQueue, req: jp.StepRequest) -> None:
    after = req.after_step
    while True:
        if q.closed:
            raise _dropped(sj)
        if sj.last_step >= req.step:  # sent again: rpc_step answers its report (or refuses it)
            return
        if req.step in q.withdrawn:
            raise JobError(ErrorCode.ABORTED, f"step {req.step} of stage {sj.stage} withdrawn by the driver")
        if sj.last_step == after:
            break
        if after in q.failed or sj.last_step > after:
            raise JobError(
                ErrorCode.ABORTED,
                f"step {req.step} of stage {sj.stage} was queued after step {after}, which did not complete "
                f"(last step {sj.last_step})",
            )
        await _woken(sj, q, f"step {req.step} of stage {sj.stage}: step {after} never ended")
    q.started.add(req.step)


def _dropped(sj: Any) -> JobError:
    return JobError(ErrorCode.NOT_HELD, f"stage {sj.stage} was dropped (released, expired or assigned again)")


async def _woken(sj: Any, q: StepQueue, why: str) -> None:
    try:
        await asyncio.wait_for(q.wake.wait(), WAIT_LIMIT_S)
    except TimeoutError:
        raise JobError(ErrorCode.DEADLINE, why) from None


def leave(sj: Any, step: int) -> None:
    """rpc_step is done with the queued step `step`: it runs (`sj.step_task`), ran, or was refused."""
    q = of(sj)
    if step in q.held:
        q.held.discard(step)
        q.notify()


def close(sj: Any) -> None:
    """The stage was dropped: the steps waiting their turn are refused now, not at WAIT_LIMIT_S."""
    q = of(sj)
    q.closed = True
    q.notify()


async def recall(sj: Any, step: int) -> None:
    """`job.step_result` of a queued step: waits while the queue holds it (then the caller answers
    from `sj.step_task` or `sj.last_report`); `aborted` if it was refused (withdrawn, or the step it
    follows failed), `not_held` if the stage was dropped meanwhile."""
    q = of(sj)
    while step in q.held:
        if q.closed:
            raise _dropped(sj)
        await _woken(sj, q, f"step {step} of stage {sj.stage} still waits for its turn")
    if step in q.refused:
        exc = q.refused[step]
        raise JobError(exc.code, str(exc))


def ended(sj: Any, step: int, ok: bool) -> None:
    """The fused step `step` ended (`ok`: applied): the step queued after it may start (or fail)."""
    q = of(sj)
    if not ok:
        q.failed.add(step)
    q.prune(sj.last_step)
    q.notify()


def withdraw(sj: Any, req: jp.WithdrawRequest) -> jp.WithdrawReply:
    """`job.withdraw`: the queued step `req.step` never runs, unless it started (or ran) already."""
    q = of(sj)
    if req.step in q.started or sj.last_step >= req.step:
        return jp.WithdrawReply(withdrawn=False)
    q.withdrawn.add(req.step)
    q.notify()
    return jp.WithdrawReply(withdrawn=True)
