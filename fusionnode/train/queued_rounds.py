"""Fused steps queued ahead under `--round-close time` (issue 19's utilisation; the driver's side,
used by train/free_rounds.py; the worker's is runtime/queued.py; protocol/ROUNDS.md, "Steps queued
ahead").

A fused replica (train/fused_rounds.py) still idled between its steps for one report-and-call round
trip plus the driver's turn: the stage reported step k, the driver read it and sent step k+1. A
replica of one fused stage now gets step k+1's call (and its inputs) while step k runs, with
`after_step` = k: the stage starts it the moment k ends. Which step comes next is known when it is
sent, except for one event: another replica closing the round while step k runs. Then the queued
step k+1 would belong to a round already closing, and the replica that closed it withdraws it at
once (`job.withdraw`): the stage answers whether it had started. Not started: it never runs, step k
was the replica's last of the round (as when step k's report came after the close), and the close
goes with the next round's first step. Started (step k had ended before the withdrawal arrived): it
is the step the replica was in at the close, so it counts in the round and is the replica's last,
as a step sent before the close is today. Either way the decision is the stage's, made once, and
the driver counts exactly the steps that ran (`Ahead.withdrawn`). The step after a round's last
(the next round's first, carrying the close) is queued as well; a queued step is never withdrawn
because of its own round's close, only because of another replica's.

Only a replica whose workers advertise it (``steps: queued`` in `job.ping`'s capabilities,
verify/compat.py) is queued: an older worker refuses `after_step`, so its replica keeps one call per
step. The plan's liveness pings ask them (`Job.caps`); a peer placed later is asked once (`ask`).

Several fused stages per replica are not queued: their stages would decide apart (one starting the
step, the next one withdrawn), so they keep one call per step (with the inputs fed ahead).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fusionnode.verify import compat
from fusionnode.wire import job as jp
from fusionnode.wire.job import Rpc

CAP = ("steps", "queued")  # the capability a worker advertises (verify/compat.py CAPS)


async def ask(driver: Any, job: Any, peers: list[str]) -> None:
    """The capabilities of `peers` the plan's pings did not ask (placed after it) or got no answer from."""
    todo = [p for p in dict.fromkeys(peers) if job.caps.get(p) is None]  # unanswered: asked again
    if todo:
        job.caps.update(await compat.peer_caps(driver.t, todo))


def queues(fused: bool, mine: list[Any], caps: dict[str, Any]) -> bool:
    """Whether a replica of stages `mine` gets its steps queued ahead: fused, one stage, on a worker
    that advertises it (`caps`: peer -> capabilities)."""
    return fused and len(mine) == 1 and all(compat.has(caps.get(a.peer), *CAP) for a in mine)


class Ahead:
    """A step sent queued ahead: its call, its inputs' feed, and its withdrawal once asked."""

    def __init__(
        self, step: int, q: int, close: dict[str, Any] | None, call: asyncio.Future, feed: asyncio.Future
    ) -> None:
        self.step, self.q, self.close = step, q, close  # `close`: the round's close it carries
        self.same_round = close is None  # a step of the round running (else the next round's first)
        self.call, self.feed = call, feed
        self.asked: asyncio.Future | None = None  # the `job.withdraw` call, once sent

    def withdraw(self, driver: Any, job: Any, run: Any, stage: Any) -> asyncio.Future:
        """Asks the stage to withdraw the step (once); the future answers whether it was."""
        if self.asked is None:
            self.asked = asyncio.ensure_future(_withdraw(driver, job, run, stage, self.step))
            self.asked.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by its owner
        return self.asked

    async def withdrawn(self, driver: Any, job: Any, run: Any, stage: Any) -> bool:
        return await self.withdraw(driver, job, run, stage)

    async def drop(self) -> None:
        """The withdrawn step: its call is given up (the stage answers it `aborted`; a failed call would
        probe the plan's peers), its feed left to end (the stage drops those inputs at its next step:
        runtime/fused.py), its outcome ignored."""
        self.call.cancel()
        await asyncio.gather(self.call, return_exceptions=True)
        self.feed.add_done_callback(lambda f: f.cancelled() or f.exception())

    def cancel(self) -> None:
        for f in (self.call, self.feed, self.asked):
            if f is not None and not f.done():
                f.cancel()

    def forget(self) -> None:
        """Its futures' outcomes (cancelled, or an error) are read when they end, not awaited."""
        for f in (self.call, self.feed):
            f.add_done_callback(lambda f: f.cancelled() or f.exception())


async def _withdraw(driver: Any, job: Any, run: Any, stage: Any, step: int) -> bool:
    req = jp.WithdrawRequest(job=job.spec.job_id, stage=stage.stage, step=step)
    call = jp.call(
        driver.t, stage.peer, Rpc.JOB_WITHDRAW, req, timeout=driver.stepper.step_timeout_s, idempotent=True
    )
    got = await driver.stepper.gather_or_fail(job, run, step, {("withdraw", stage.stage): call},
                                              {("withdraw", stage.stage): stage.peer})  # fmt: skip
    return bool(got[("withdraw", stage.stage)].withdrawn)


def withdraw_others(
    ahead_of: dict[int, Ahead], idx: int, q: int, driver: Any, job: Any, run: Any, stages: dict[int, Any]
) -> None:
    """Replica `idx` closed round `q`: every other replica's step of round q queued ahead is withdrawn
    now (each replica reads the answer when its current step reports)."""
    for j, a in ahead_of.items():
        if j != idx and a.q == q and a.same_round:
            a.withdraw(driver, job, run, stages[j])
