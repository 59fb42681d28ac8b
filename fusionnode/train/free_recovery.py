"""Faults and checkpoints of rounds closed by time (`--round-close time`, issue 19; the rounds
themselves: train/free_rounds.py).

The replicas run as tasks of a *segment*: from its first round until the job ends, or a failure ends
it, after which the job is re-planned (train/recovery.py's machinery) and a new segment starts at
the round the hosts' ledger gives (`Recovery.adopt` and `recover_hosts` answer the hosts' applied
step, (rounds applied) x H).

- **A worker dies mid-round** (its replica's step, commit or feed fails, StepFailed): that replica
  loses its round. The driver counts it 0 steps, so its verdict weight is 0 (`opt.round_verdict`),
  and the hosts close the round with the other replicas' pseudo-gradients only
  (`RoundCombiner.complete(verdict)`): whatever part of it reached them is left out, and a part
  arriving later is refused (the round is closed). The other replicas finish the round, the segment
  stops there (the replicas already past it under --sync-overlap stop at their next step, having
  sent nothing of the next round), the peers to blame are banned (`Recovery.recover`, which
  re-plans over the survivors) and the job goes on at the next round. Under --contrib-policy score
  (the scorer reads complete rounds), or when every replica lost the round, the round gets no
  verdict: the re-plan drops what the hosts hold of it and it is redone from its start.
- **An optimizer host dies** (HostFailed, from any replica's or the verdict's calls): the segment
  is cancelled, every host restarts from its newest shard checkpoint (`Recovery.recover_hosts`; the
  driver's checkpoint with new outer state when no shard checkpoint is common), the workers are
  re-planned, and the rounds since that checkpoint are redone: the hosts rolled them back, so each
  is applied once in the trajectory kept.
- **A replica dying in its round's closing commit** after the verdict went out: the verdict is sent
  again with its weight 0; a host that closed the round with it already answers the weights it
  applied, and the record counts the replica's steps when every host applied them (when the hosts
  differ, each name's update is still applied once, and a `notice` event says so).

- **Fused replicas** (train/fused_rounds.py: a round's close rides on the replica's next step):
  a failed call that carried a close loses the round of that close unless its verdict already
  answered (else the round the replica was in), and a replica that stops after the lost round sends
  that round's close it still holds (`close_only`): train/free_rounds.py `replica`. Under scored
  rounds a verdict still being judged of a round complete on the hosts is awaited first (`judged`):
  the hosts close that round with the replica, so it loses the next one (redone), and no round is
  both recorded and redone.

Every round of a segment that follows a recovery (or a resume) runs on new stages: new inner
optimizers, every replica from the hosts' θ, and under sparseloco the error feedback of the driver's
checkpoint of that round boundary when there is one, else new accumulators (per stage: a stage
the checkpoint holds no feedback of starts new ones, the others keep theirs: train/feedback_ckpt.py).
Its record says so (`restart`, `fresh_outer`, `fresh_feedback`: true, or per replica the names that
started new), which `--local --round-steps FILE` replays (train/free_rounds_local.py `load_restarts`).

Checkpoints: after round q's record, when (q+1)·H is due (`SyncConfig.checkpoint_due`), the
driver saves the hosts' parameters (the hosts save their shards as they close the round) and, under
sparseloco, each replica's error feedback as it was after round q (a stage may have folded round
q + 1 in by then: it keeps the accumulators of the round before, `FetchRequest.round`; a stage that
cannot answer is left out with a notice, the others' saved); the next
round's verdict waits for it, so no later round can change the parameters being saved, and a
checkpoint never holds a round without its record.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fusionnode.errors import FusionNodeError, PeerError, PlanError
from fusionnode.train import feedback_ckpt
from fusionnode.train.checkpoint import save_job
from fusionnode.train.step import HostFailed, StepFailed

POLL_S = 0.05  # seconds between looks at a round's verdict while its replicas run
MAX_RECOVERIES = 6  # segments a job may lose in a row to failures before it gives up


class Redo(Exception):
    """The round a replica lost gets no verdict (scored rounds, or every replica lost it): the
    segment ends at once (the other replicas would wait for its update) and the round is redone."""


class Segment:
    """One run of the replica tasks: from round `first` until the job's end or the round a failure
    stopped it (`stop`)."""

    def __init__(
        self,
        first: int,
        *,
        restart: bool = False,
        fresh_outer: bool = False,
        fresh_feedback: bool | dict[str, list[str]] = False,
    ):
        self.first = first
        self.stop: int | None = None  # the last round the replicas run (a replica lost its round in it)
        self.lost: dict[int, StepFailed] = {}  # replica index -> why it lost its round
        self.host: HostFailed | None = None  # an optimizer host died: the segment is cancelled
        self.redo = False  # the stopped round gets no verdict: redone after the re-plan
        self.stopped: Any = None  # the round a replica lost (`_Round`)
        self.ending = False  # a failure cancelled the replicas: the records of the rounds closed only
        self.flags = {"restart": restart, "fresh_outer": fresh_outer, "fresh_feedback": fresh_feedback}

    def failed(self) -> bool:
        return self.host is not None or bool(self.lost)

    def runs(self, q: int) -> bool:
        """Whether round `q` is run (the replicas stop after the round a failure hit)."""
        return self.stop is None or q <= self.stop

    def record_flags(self, q: int) -> dict[str, Any]:
        """What the record of round `q` says of its start: on new stages (the segment's first round
        after a recovery or a resume); `fresh_feedback` true, or per replica the names whose error
        feedback started new (train/feedback_ckpt.py `fresh_flag`)."""
        if q != self.first or not self.flags["restart"]:
            return {}
        return {k: v for k, v in self.flags.items() if v}

    def lose(self, rd: Any, idx: int, fail: StepFailed, scorer: Any) -> None:
        """Replica `idx` failed in round `rd`: it loses the round (0 steps, weight 0), and the segment
        stops after it. A dead host is raised (the whole segment recovers). `scorer`: the job's
        RoundScorer under --contrib-policy score, else None."""
        if isinstance(fail, HostFailed):
            raise fail
        self.lost[idx] = fail
        if self.stop is None or rd.q < self.stop:
            self.stop, self.stopped = rd.q, rd
        if rd.verdict is not None and rd.verdict.done() and not rd.verdict.cancelled():
            return  # the hosts closed the round with it already: its steps were applied
        if sending(rd, scorer):
            return  # the hosts are closing the round with it: as above (the records await it)
        rd.lost[idx] = int(rd.counts[idx] or 0)
        rd.counts[idx] = 0
        if scorer is not None or not any(c is None or c for c in rd.counts):
            self.redo = True
            if rd.verdict is not None:  # being judged (scored, nothing sent): none, no record
                rd.verdict.cancel()
            raise Redo
        if rd.verdict is not None:  # sent with its steps: again, without (see the module's docstring)
            rd.verdict.cancel()
            rd.verdict = None

    def may_close(self, rd: Any) -> bool:
        """Whether round `rd` gets its verdict now: every replica's count known, and not a round to redo."""
        if self.redo and self.stop is not None and rd.q >= self.stop:
            return False
        return all(c is not None for c in rd.counts)


def verdict_ok(rd: Any) -> bool:
    """Whether round `rd`'s verdict went through (the hosts closed it)."""
    v = rd.verdict
    return v is not None and v.done() and not v.cancelled() and v.exception() is None


def sending(rd: Any, scorer: Any) -> bool:
    """Whether round `rd`'s scored verdict is past its judgement and going out to the hosts: a host
    may have closed the round with it already, so it is awaited, never cancelled (a cancel there
    left the round closed on some hosts and redone by the driver)."""
    v = rd.verdict
    return scorer is not None and v is not None and not v.done() and rd.q in scorer.sending


async def judged(scorer: Any, rd: Any, timeout: float) -> None:
    """--contrib-policy score, a fused replica's step carrying round `rd`'s close failed: when the
    scorer already holds that round complete (the close reached every host before the worker died),
    its verdict is on its way and is awaited (within the scorer's budget, bounded by `timeout`), so
    the replica loses the round its step was in, not one the hosts close with it; a round not
    complete on the hosts is the one it loses (its verdict is dropped with it). A verdict that is
    being sent when `timeout` runs out is awaited to its end (each host's call has its own
    deadline): counted once, or, judging still, dropped before any host saw it."""
    v = rd.verdict
    if v is None or v.done() or scorer.complete < rd.q:
        return
    with contextlib.suppress(Exception):  # its error is the records' and the segment's to raise
        await asyncio.wait_for(asyncio.shield(v), timeout)
    if sending(rd, scorer):
        with contextlib.suppress(Exception):
            await asyncio.shield(v)


async def flush(seg: Segment, replicas: list[asyncio.Future], records: asyncio.Future, rounds: dict) -> None:
    """A failure ended the segment at once: the replicas are cancelled; the verdicts of the rounds
    before the one to redo, which the hosts close whatever follows, are awaited (not under a dead
    host: its rounds since the checkpoint are redone anyway); the records of every round closed are
    emitted, in order, before the recovery."""
    seg.ending = True
    for t in replicas:
        t.cancel()
    await asyncio.gather(*replicas, return_exceptions=True)
    if seg.host is None:
        before = [rd.verdict for q, rd in rounds.items() if rd.verdict is not None and q < (seg.stop or 0)]
        await asyncio.gather(*before, return_exceptions=True)
    for rd in rounds.values():
        rd.done.set()
    await asyncio.gather(records, return_exceptions=True)


async def round_done(rd: Any) -> None:
    """Waits until every replica is done with round `rd`; raises its verdict's error as soon as it
    fails (a dead host: the replicas would wait out their pulls of the round's update)."""
    while not rd.done.is_set():
        v = rd.verdict
        if v is not None and v.done() and not v.cancelled() and v.exception() is not None:
            raise v.exception()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(rd.done.wait(), POLL_S)


async def wait_verdict(rd: Any) -> None:
    """Awaits round `rd`'s verdict, following it when it is sent again (`Segment.lose`); returns at
    once when there is none."""
    while rd.verdict is not None:
        task = rd.verdict
        try:
            await asyncio.shield(task)
            return
        except asyncio.CancelledError:
            if not task.cancelled() or task is rd.verdict:
                raise  # this caller was cancelled, not the verdict replaced


async def applied(job: Any, run: Any, rd: Any, replies: list[Any]) -> None:
    """The hosts' weights of round `rd` (their verdict replies): a replica counted lost that every
    host applied all the same (it closed the round before the verdict was sent again) gets its
    steps back in the record."""
    for idx, steps in sorted(rd.lost.items()):
        took = [len(r.weights) > idx and r.weights[idx] > 0 for r in replies]
        if took and all(took):
            rd.counts[idx] = steps
            del rd.lost[idx]
        elif any(took):
            await run.event(
                job,
                "notice",
                what="round_split",
                step=rd.q * job.sync.inner_steps,
                reason=f"round {rd.q}: some optimizer hosts applied replica {idx}'s pseudo-gradient "
                "(it arrived before it died), others closed the round without it",
            )


async def checkpoint(driver: Any, job: Any, run: Any, q: int) -> None:
    """After round q's record: the driver's checkpoint of step (q+1)·H when one is due (the hosts'
    parameters, which are θ after round q until the next round's verdict); a failure to write is
    an event and the job goes on with its earlier checkpoints."""
    spec, h = job.spec, job.sync.inner_steps
    at = (q + 1) * h
    if not spec.save_dir or at >= spec.steps or not job.sync.checkpoint_due(at, spec.save_every):
        return
    try:
        params = await driver.placement.current_params(job, run.stage_args, run.host_of)
        # sparseloco: the feedback after round q, of every stage that has it (a stage of a replica
        # that lost round q, or a dead one, does not: only its names start new ones on resume)
        feedback = await feedback_ckpt.saved(driver.placement, job, run, at, q)
        await asyncio.to_thread(save_job, job, at, run.source, params, feedback)
    except (OSError, FusionNodeError) as exc:
        await run.event(job, "failure", peer=None, step=at, reason=f"checkpoint: {exc}")


async def run(driver: Any, job: Any, run_: Any, source: Any, start_step: int, segment: Any) -> None:
    """The job's segments (`segment(driver, job, run, seg)` runs one) from `start_step` (a round
    boundary), each failure recovered and the next segment started where the hosts' ledger says."""
    h = job.sync.inner_steps
    if start_step % h:
        raise PlanError(f"--round-close time resumes at a round boundary (H = {h}), not step {start_step}")
    seg = Segment(
        start_step // h,
        restart=start_step > 0,
        fresh_outer=start_step > 0 and job.fresh_optimizer,
        fresh_feedback=start_step > 0 and feedback_ckpt.fresh_flag(job),
    )
    recoveries = 0
    while True:
        await segment(driver, job, run_, seg)
        if not seg.failed():
            return
        recoveries += 1
        if recoveries > MAX_RECOVERIES:
            why = seg.host or next(iter(seg.lost.values()))
            raise PlanError(f"rounds closed by time: {recoveries} failures in a row ({why.summary()})")
        seg = await recover(driver, job, run_, source, seg)


async def recover(driver: Any, job: Any, run: Any, source: Any, seg: Segment) -> Segment:
    """The failure that ended `seg`: hosts restored (a dead host) or the replicas' failed peers
    banned and the job re-planned over the survivors; the next segment, from the hosts' ledger."""
    h = job.sync.inner_steps
    if seg.host is not None:
        fail: StepFailed = seg.host
        resume_at = await driver.recovery.recover_hosts(job, run, fail.step, fail)
        applied_steps = [resume_at]
        fresh_outer = bool(job.fresh_optimizer)
    else:
        errors: dict[str, list[Any]] = {}
        unreachable: set[str] = set()
        for f in seg.lost.values():
            for peer, fs in f.errors.items():
                errors.setdefault(peer, []).extend(fs)
            unreachable.update(f.unreachable)
        fail = StepFailed(min(f.step for f in seg.lost.values()), errors, sorted(unreachable))
        if seg.stopped is not None:  # the ledger as the hosts have it (a re-plan that fails saves it)
            job.rounds_closed = seg.stop + int(verdict_ok(seg.stopped))
        await driver.recovery.recover(job, run, source, fail.step, fail)
        applied_steps, fresh_outer = list(job.hosts_applied), False
    if len(set(applied_steps)) != 1 or applied_steps[0] % h:
        raise PlanError(
            f"step {fail.step}: the optimizer hosts' applied steps {applied_steps} are not one round "
            f"boundary (H = {h}); restart with --resume from the last checkpoint"
        )
    first = applied_steps[0] // h
    job.rounds_closed = first
    job.step = min(first * h, job.spec.steps)
    lost = sorted(seg.stopped.lost) if seg.host is None and seg.stopped is not None else []
    await run.event(
        job,
        "recovered",
        step=fail.step,
        role="rounds",
        replay_from=job.step,
        rounds_applied=first,
        lost_replicas=lost,
        reason=(
            f"rounds 0..{first - 1} applied once; "
            + (f"round {seg.stop} closed without replica(s) {lost}, " if lost and first > seg.stop else "")
            + f"the job goes on at round {first} on the new plan"
        ),
    )
    fresh_feedback = feedback_ckpt.fresh_flag(job)  # Recovery.round_feedback shipped all, part or none
    return Segment(first, restart=True, fresh_outer=fresh_outer, fresh_feedback=fresh_feedback)


def ended_by_verdict(fail: StepFailed) -> PeerError:
    """A verdict that failed with every host alive: the job ends (not a worker's fault to recover)."""
    return PeerError(
        f"the optimizer hosts refused a round's verdict under --round-close time ({fail.summary()})"
    )
