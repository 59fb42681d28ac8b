"""Rounds closed by time (`train --sync diloco|sparseloco --round-close time`, issue 19).

Under `--round-close steps` (the default) the driver steps every replica together, so a device
computes at most its share of the slowest replica's step. Here each replica (pipeline) runs its own
inner steps at its own pace, a task per replica, and round q closes when the fastest replica has
done H inner steps (fewer in the job's last round: the job's `steps` are the fastest replica's).
That is the round's time budget: the time the fastest replica needs for H steps, measured as the
round runs rather than planned, so a replica slower than planned (or a loaded machine) changes the
counts, not the budget's meaning, and no clock is compared across peers. Each other replica
finishes the step it is in and closes too; then every replica's pseudo-gradient goes to the hosts.

Replica r's k-th step of round q is the job's step q·H + k (its share of that step's batch, that
step's learning rate and seeds): with replicas of equal pace this is exactly `--round-close steps`.
The driver counts the steps it fed each replica; the hosts hold every round (`opt.init`'s contrib
`score`, `HeldRounds`) until the driver's `opt.round_verdict` gives each replica its steps over the
round's most (`free_rounds_local.token_verdict`), which the hosts multiply by the plan's samples per
step: each pseudo-gradient weighs the tokens the driver fed that replica, never what a worker
claims (the `tokens` a stage puts in its messages stay informational). Under `--contrib-policy
score` the scorer's verdict (1 kept, 0 dropped: train/scoring.py) is multiplied by those fractions.

Records: one per round, emitted in round order when every replica has closed it: `step` is the
round's last step of the fastest replica, `loss` the token-weighted mean of the replicas' step
losses, `tokens` every token fed in the round, `step_time_s` the time since the previous round's
record, each stage's compute, wait and link seconds summed over its steps in the round, and
`replicas`: each replica's steps, tokens and mean loss (the schedule `train --local --round-steps`
replays: train/free_rounds_local.py) and whether its inner steps were fused (one `job.step` each,
the optimizer step on the stage: train/fused_rounds.py; a one-stage fused replica's next step is
queued ahead of its report and withdrawn if another replica closes the round: train/queued_rounds.py).

Faults, checkpoints and `--resume`: train/free_recovery.py (a replica that loses a worker loses
only its round; a dead host restores the hosts from their checkpoints; no round applied twice).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from fusionnode.errors import ConfigError
from fusionnode.optim.optimizers import FlatOptimizer
from fusionnode.optim.rounds import contributing_names
from fusionnode.train import free_recovery, fused_rounds, queued_rounds
from fusionnode.train.free_rounds_local import round_count, round_limit, token_verdict
from fusionnode.train.spec import lr_at
from fusionnode.train.state import HISTORY_KEPT, Job, Run
from fusionnode.train.step import HostFailed, StepFailed
from fusionnode.wire import job as jp
from fusionnode.wire.checked import tensor_message
from fusionnode.wire.job import Rpc, TensorKind


@dataclass(frozen=True)
class HeldRounds:
    """The job's contrib settings under --round-close time: the hosts hold every round for the
    driver's token verdict, with the norm floor of `inner` (--contrib-policy clip) when it is on."""

    inner: Any = None  # verify.contrib.ContribPolicy | None

    score = False  # no RoundScorer: the verdict is the driver's token count

    @property
    def floor(self) -> bool:
        return self.inner is not None and self.inner.floor

    def host_config(self) -> dict[str, object]:
        return {"clip": self.inner.clip if self.floor else None, "score": True}

    def to_dict(self) -> dict[str, object]:
        base = self.inner.to_dict() if self.inner is not None else {"policy": "off"}
        return {**base, "weights": "tokens fed (--round-close time)"}


class _Round:
    """What the driver knows of one round while its replicas run it."""

    def __init__(self, q: int, limit: int, job: Job, run: Run) -> None:
        self.q, self.limit = q, limit
        self.closing = False  # a replica did `limit` steps: the others finish the step they are in
        self.counts: list[int | None] = [None] * len(job.pipelines)
        self.losses: list[list[float]] = [[] for _ in job.pipelines]
        self.norms: list[float] = []
        self.stages = {
            a.stage: {"stage": a.stage, "peer": a.peer, "compute_s": 0.0, "wait_s": 0.0, "link_s": 0.0,
                      "sent_bytes": 0, "optimizer_bytes": 0, "links": {}, "steps": 0}
            for a in run.stage_args
        }  # fmt: skip
        self.wire = 0
        self.finished = 0
        self.done = asyncio.Event()
        self.t_done = 0.0
        self.verdict: asyncio.Task | None = None
        self.saved = asyncio.Event()  # recorded, and checkpointed when due: the next round may close
        self.lost: dict[int, int] = {}  # replica index -> the steps it did before it lost the round

    def add(self, reports: list[Any], args: list[Any]) -> None:
        for a, r in zip(args, reports, strict=True):
            st = self.stages[a.stage]
            st["compute_s"] += r.compute_s
            st["wait_s"] += r.wait_s
            st["link_s"] += max(0.0, r.total_s - r.compute_s - r.wait_s)
            st["sent_bytes"] += r.sent_bytes
            st["optimizer_bytes"] += r.optimizer_bytes
            st["links"] = r.links
            st["steps"] += 1
            self.wire += r.sent_bytes


async def run_rounds(driver: Any, job: Job, run: Run, source: Any, start_step: int) -> None:
    """The job's rounds closed by time from `start_step` (a round boundary), failures recovered."""
    if run.checks is not None or not job.offload:
        raise ConfigError("--round-close time: runs on optimizer hosts, without spot-checks")
    await free_recovery.run(driver, job, run, source, start_step, _segment)


async def _segment(driver: Any, job: Job, run: Run, seg: free_recovery.Segment) -> None:
    """Rounds `seg.first`.. until the job's end or a failure (train/free_recovery.py): a task per
    replica, the records in round order."""
    spec, sync = job.spec, job.sync
    if run.names_by_stage is None:
        run.names_by_stage = contributing_names(run.stage_args)
    n_rounds = round_count(spec, sync)
    rounds: dict[int, _Round] = {}
    closed = [seg.first]  # rounds the hosts closed (their verdicts answered)
    fused_of = {  # replicas whose inner steps take one call each (train/fused_rounds.py)
        p.replica: fused_rounds.fuses(job, [a for a in run.stage_args if a.replica == p.replica])
        for p in job.pipelines
    }
    ahead_of: dict[int, queued_rounds.Ahead] = {}  # replica -> its step of the round queued ahead
    if any(fused_of.values()):  # which workers take steps queued ahead (their capabilities)
        await queued_rounds.ask(driver, job, [a.peer for a in run.stage_args])
    stage_of = {
        i: next(a for a in run.stage_args if a.replica == p.replica) for i, p in enumerate(job.pipelines)
    }

    def round_at(q: int) -> _Round:
        if q not in rounds:
            rounds[q] = _Round(q, round_limit(spec, sync, q), job, run)
        return rounds[q]

    async def verdict(rd: _Round) -> None:
        if rd.q - 1 in rounds:  # the round before recorded and checkpointed first
            await rounds[rd.q - 1].saved.wait()
        weights = token_verdict([int(c or 0) for c in rd.counts])
        if run.scorer is not None:  # --contrib-policy score: its verdict (kept 1, dropped 0) x these
            await run.scorer.launch(job, run, rd.q, weights)
        else:
            req = jp.OptRoundVerdict(job=spec.job_id, round=rd.q, weights=weights)
            timeout = driver.stepper.step_timeout_s
            calls = {
                ("verdict", h): jp.call(driver.t, h, Rpc.OPT_ROUND_VERDICT, req, timeout=timeout + 5)
                for h in job.hosts
            }
            got = await driver.stepper.gather_or_fail(
                job, run, rd.q * sync.inner_steps, calls, {k: k[1] for k in calls}
            )
            await free_recovery.applied(job, run, rd, list(got.values()))
        closed[0] = max(closed[0], rd.q + 1)

    async def replica(idx: int) -> None:
        pipe = job.pipelines[idx]
        mine = sorted((a for a in run.stage_args if a.replica == pipe.replica), key=lambda a: a.pos)
        # the next step's inputs go out while this step's commit runs (its step id is known once this
        # step decided whether it closes the round)
        feeding: asyncio.Future | None = asyncio.ensure_future(
            _feed(driver, job, run, pipe, idx, mine, seg.first * sync.inner_steps)
        )
        rd = None
        fused = fused_of[pipe.replica]
        feed_args, ahead, guess = (driver, job, run, pipe, idx, mine), None, -1
        close: dict[str, Any] | None = None  # fused: the round this replica's next step closes first
        close_step = -1  # fused: the step whose round `close` is (its last inner step)
        queue = queued_rounds.queues(fused, mine, job.caps)  # its next step sent before this one reports
        pend: queued_rounds.Ahead | None = None  # that step (train/queued_rounds.py)

        def info_of(q: int, k: int) -> dict[str, Any]:  # the close of round q after the replica's k steps
            tokens = pipe.samples * run.seq_len * k  # informational: the hosts take the verdict
            return {"id": q, "tokens": tokens, "final": sync.overlap and q == n_rounds - 1}

        def queue_next(q: int, k: int, step: int) -> queued_rounds.Ahead | None:
            """The step after `step` (the replica's k-th of round q, running), sent queued ahead."""
            if not (k + 1 >= rd.limit or rd.closing):
                nxt, nq, nclose = step + 1, q, None
            elif q + 1 < n_rounds and seg.runs(q + 1):  # the next round's first carries this one's close
                nxt, nq, nclose = (q + 1) * sync.inner_steps, q + 1, info_of(q, k + 1)
            else:
                return None
            feed = asyncio.ensure_future(_feed(*feed_args, nxt))
            call = asyncio.ensure_future(
                fused_rounds.fused_step(driver, job, run, pipe, mine, nxt, lr_at(nxt, spec), nclose, step)
            )
            a = queued_rounds.Ahead(nxt, nq, nclose, call, feed)
            if a.same_round:  # another replica closing round q withdraws it
                ahead_of[idx] = a
            return a

        async def settle() -> None:
            """The segment stops: the step queued ahead is withdrawn, or (it started) its report
            awaited (a close it carried reached the stage)."""
            nonlocal pend, close
            if pend is None:
                return
            a, pend = pend, None
            ahead_of.pop(idx, None)
            if await a.withdrawn(driver, job, run, mine[0]):
                await a.drop()
                return
            *_, round_bytes = await a.call
            if a.close is not None and close is not None:
                job.count_round(a.step, round_bytes, closed[0])
                round_at(close["id"]).wire += job.round_bytes
                close = None

        async def send_close() -> None:
            """The segment stops: a pending close of a round it runs is sent by itself (close_only);
            one of a later round is dropped (nothing of that round reaches the hosts)."""
            nonlocal close
            if close is not None and seg.runs(close["id"]):
                round_bytes = await fused_rounds.close_last(driver, job, run, mine, close_step, close)
                job.count_round(close_step, round_bytes, closed[0])
                round_at(close["id"]).wire += job.round_bytes
            close = None

        try:
            for q in range(seg.first, n_rounds):
                rd = round_at(q)
                k = 0
                while True:
                    if not seg.runs(q):  # a replica lost round q - 1 (--sync-overlap ran ahead)
                        await settle()
                        await send_close()
                        return
                    step = q * sync.inner_steps + k
                    lr = lr_at(step, spec)
                    assert feeding is not None
                    if queue:  # the step's call went out queued ahead (or goes now), the next one's after it
                        if pend is not None and pend.step == step:
                            call, pend = pend.call, None
                            ahead_of.pop(idx, None)
                        else:
                            call = asyncio.ensure_future(
                                fused_rounds.fused_step(driver, job, run, pipe, mine, step, lr, close)
                            )
                        try:
                            await feeding
                            pend = queue_next(q, k, step)
                            reports, loss, norm, round_bytes = await call
                        except BaseException:
                            call.cancel()
                            raise
                        job.count_round(step, round_bytes, closed[0])
                        rd.wire += job.round_bytes
                        close = None
                    elif fused:  # the step's call goes out with its inputs, the likely next's after them
                        ends = k + 1 >= rd.limit
                        guess = (q + 1) * sync.inner_steps if ends else step + 1
                        feed_next = None if ends and q == n_rounds - 1 else partial(_feed, *feed_args, guess)
                        got, ahead = await fused_rounds.fused_step_fed(
                            fused_rounds.fused_step(driver, job, run, pipe, mine, step, lr, close),
                            feeding,
                            feed_next,
                        )
                        reports, loss, norm, round_bytes = got
                        job.count_round(step, round_bytes, closed[0])
                        rd.wire += job.round_bytes
                        close = None
                    else:
                        await feeding
                        reports, loss, norm, clip = await _compute(driver, job, run, pipe, mine, step)
                    rd.add(reports, mine)
                    rd.losses[idx].append(loss)
                    rd.norms.append(norm)
                    k += 1
                    if pend is not None and pend.same_round:  # withdrawn if another replica closed
                        last = rd.closing and await pend.withdrawn(driver, job, run, mine[0])
                        if last:  # it never runs: this step was the replica's last of the round
                            withdrawn, pend = pend, None
                            ahead_of.pop(idx, None)
                            await withdrawn.drop()
                    else:  # a step queued ahead is the next round's first: this one ends the round
                        last = pend is not None or k >= rd.limit or rd.closing
                    if not rd.closing and k >= rd.limit:  # this replica closes the round
                        rd.closing = True
                        queued_rounds.withdraw_others(ahead_of, idx, q, driver, job, run, stage_of)
                    info = None
                    if last:
                        rd.counts[idx] = k
                        if seg.may_close(rd):
                            rd.verdict = asyncio.ensure_future(verdict(rd))
                        info = info_of(q, k)
                        assert pend is None or pend.close == info, (pend.close, info)
                    following = (q + 1) * sync.inner_steps if last else step + 1
                    feeding = None
                    if pend is not None:
                        assert pend.step == following, (pend.step, following)
                        feeding = pend.feed
                    elif fused and ahead is not None and guess == following:
                        feeding, ahead = ahead, None
                    fused_rounds.drop(ahead if fused else None)
                    if feeding is None and not (last and q == n_rounds - 1):
                        feeding = asyncio.ensure_future(_feed(driver, job, run, pipe, idx, mine, following))
                    if not fused:
                        await _commit(driver, job, run, mine, step, lr, clip, info, closed)
                        rd.wire += job.round_bytes
                    elif last and q == n_rounds - 1:  # no later step closes the job's last round
                        assert info is not None
                        round_bytes = await fused_rounds.close_last(driver, job, run, mine, step, info)
                        job.count_round(step, round_bytes, closed[0])
                        rd.wire += job.round_bytes
                    else:
                        close, close_step = info, step
                    if last:
                        break
                finish(rd)
                if not seg.runs(q + 1):
                    await settle()
                    await send_close()
                    return
        except StepFailed as fail:  # this replica loses its round (a dead host: the segment's)
            assert rd is not None
            if close is not None and run.scorer is not None:  # its close may have reached the hosts
                await free_recovery.judged(run.scorer, round_at(close["id"]), driver.stepper.step_timeout_s)
            if close is not None and not free_recovery.verdict_ok(round_at(close["id"])):
                # fused: the call that failed carried the close of a round counted (and finished) with
                # this replica's steps and not closed by the hosts yet: that round is the one it loses
                rd = round_at(close["id"])
                seg.lose(rd, idx, fail, run.scorer)
            else:
                seg.lose(rd, idx, fail, run.scorer)
                finish(rd)
            if seg.may_close(rd) and rd.verdict is None:
                rd.verdict = asyncio.ensure_future(verdict(rd))
        finally:
            if feeding is not None and not feeding.done():
                feeding.cancel()
                await asyncio.gather(feeding, return_exceptions=True)
            if pend is not None:  # a failure: the segment ends, and the next one runs on new stages
                ahead_of.pop(idx, None)
                pend.cancel()  # not awaited: the Redo (or failure) this replica raises goes first,
                pend.forget()  # before the records find the round's verdict cancelled by `lose`

    def finish(rd: _Round) -> None:
        rd.finished += 1
        if rd.finished == len(job.pipelines):
            rd.t_done = time.perf_counter()
            rd.done.set()

    async def records() -> None:
        t_prev = time.perf_counter()
        sent0 = driver.t.bytes_sent.get(spec.job_id, 0)
        tokens_total, time_total = 0, 0.0
        for q in range(seg.first, n_rounds):
            rd = round_at(q)
            await free_recovery.round_done(rd)
            if not seg.runs(q) or rd.verdict is None:  # stopped before it, or it is to be redone
                return
            if seg.ending and not free_recovery.verdict_ok(rd):  # a failure: the rounds closed only
                return
            await free_recovery.wait_verdict(rd)
            t_done = max(rd.t_done, t_prev)
            if job.rounds_closed < closed[0]:  # fused: its close's bytes come with a later step's report
                job.count_round(rd.q * sync.inner_steps, [], closed[0])
            sent = driver.t.bytes_sent.get(spec.job_id, 0)
            rec = _record(job, run, rd, t_done - t_prev, rd.wire + sent - sent0, closed[0])
            rec.update(seg.record_flags(q))
            t_prev, sent0 = t_done, sent
            for rep in rec["replicas"]:
                rep["fused"] = fused_of[rep["replica"]]
            tokens_total += rec["tokens"]
            time_total += rec["step_time_s"]
            run.metrics.step(rec)
            job.history.append(rec)
            if len(job.history) > 2 * HISTORY_KEPT:
                del job.history[:-HISTORY_KEPT]
            job.step, job.loss = rec["step"] + 1, rec["loss"]
            job.tokens_per_s = tokens_total / max(time_total, 1e-9)
            await run.emit({"type": "step", **rec, "steps": spec.steps})
            await free_recovery.checkpoint(driver, job, run, q)  # a checkpoint holds recorded rounds
            rd.saved.set()
            if not seg.runs(q + 1):
                return

    tasks = [asyncio.ensure_future(replica(i)) for i in range(len(job.pipelines))]
    tasks.append(asyncio.ensure_future(records()))
    try:
        await asyncio.gather(*tasks)
    except (HostFailed, free_recovery.Redo) as fail:
        # a dead host: the hosts are restored, the rounds since their checkpoint redone; a round
        # without a verdict: redone on the new plan. The rounds the hosts closed get their records.
        seg.host = fail if isinstance(fail, HostFailed) else None
        await free_recovery.flush(seg, tasks[:-1], tasks[-1], rounds)
    except StepFailed as fail:  # the verdict, every host alive
        raise free_recovery.ended_by_verdict(fail) from None
    finally:
        for t in tasks:
            t.cancel()
        pending = [rd.verdict for rd in rounds.values() if rd.verdict is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, *pending, return_exceptions=True)


async def _feed(driver: Any, job: Job, run: Run, pipe: Any, idx: int, mine: list[Any], step: int) -> None:
    """Replica `idx`'s share of step `step`'s batch to its first stage (inputs) and last (targets)."""
    jid = job.spec.job_id
    xs, ys = run.source.shard_batches(step, [p.samples for p in job.pipelines])[idx]
    first, last = mine[0], mine[-1]
    input_name = next(iter(first.recv_specs))
    msgs: dict[str, list[Any]] = {}
    for mb, (x, y) in enumerate(zip(xs.chunk(pipe.micro_batches), ys.chunk(pipe.micro_batches), strict=True)):
        meta = {"job": jid, "step": step, "mb": mb}
        msgs.setdefault(first.peer, []).append(
            tensor_message(TensorKind.INPUT, {**meta, "stage": first.stage}, {input_name: x})
        )
        msgs.setdefault(last.peer, []).append(
            tensor_message(TensorKind.TARGET, {**meta, "stage": last.stage}, {"target": y})
        )

    async def send(peer: str, batch: list[Any]) -> None:
        for msg in batch:
            await driver.t.send(peer, msg)

    calls = {("send", p): send(p, b) for p, b in msgs.items()}
    await driver.stepper.gather_or_fail(job, run, step, calls, {("send", p): p for p in msgs})


async def _compute(
    driver: Any, job: Job, run: Run, pipe: Any, mine: list[Any], step: int
) -> tuple[list[Any], float, float, float]:
    """A replica's inner step `step` up to its optimizer (its inputs fed: `_feed`): `job.step` on its
    stages, its tied-weight sums out. Returns (reports in `mine` order, its mean micro-batch loss,
    its gradient norm, its clip factor)."""
    spec, jid = job.spec, job.spec.job_id
    gather = driver.stepper.gather_or_fail
    reports = await fused_rounds.step_reports(driver, job, run, pipe, mine, step)
    shared_sum = await driver.stepper.sum_shared(job, mine, step)
    norm = math.sqrt(sum(r.grad_sq for r in reports) + FlatOptimizer.grad_sq_norm(shared_sum))
    clip = 1.0 if spec.grad_clip is None else min(1.0, spec.grad_clip / (norm + 1e-6))
    sends = {}  # a stage gone by now fails the step (StepFailed), as its feed would
    for a in mine:
        part = {n: shared_sum[n] for n in a.shared_names}
        if part:
            meta = {"job": jid, "step": step, "mb": -1, "stage": a.stage}
            sends[("shared", a.stage)] = driver.t.send(
                a.peer, tensor_message(TensorKind.SHARED_SUM, meta, part)
            )
    if sends:
        await gather(job, run, step, sends, {("shared", a.stage): a.peer for a in mine})
    losses = reports[-1].losses
    return reports, sum(losses) / len(losses), norm, clip


async def _commit(
    driver: Any,
    job: Job,
    run: Run,
    mine: list[Any],
    step: int,
    lr: float,
    clip: float,
    info: dict[str, Any] | None,
    closed: list[int],
) -> None:
    """The replica's commits of `step` (its inner optimizer; `info`: it closes its round); the round
    bytes they report folded into the job's host counters."""
    timeout = driver.stepper.step_timeout_s
    calls = {}
    for a in mine:
        rnd = {**info, "names": run.names_by_stage[a.stage]} if info is not None else None
        req = jp.CommitRequest(
            job=job.spec.job_id, stage=a.stage, step=step, lr=lr, clip_coef=clip, round=rnd
        )
        calls[("commit", a.stage)] = jp.call(
            driver.t, a.peer, Rpc.JOB_COMMIT, req, timeout=timeout, idempotent=True
        )
    got = await driver.stepper.gather_or_fail(
        job, run, step, calls, {("commit", a.stage): a.peer for a in mine}
    )
    job.count_round(step, [r.round_bytes for r in got.values()], closed[0])


def _record(job: Job, run: Run, rd: _Round, seconds: float, wire: int, closed: int) -> dict[str, Any]:
    """Round `rd`'s record (see the module's docstring)."""
    spec = job.spec
    reps = []
    for idx, pipe in enumerate(job.pipelines):
        steps = int(rd.counts[idx] or 0)
        losses = rd.losses[idx]
        reps.append(
            {
                "replica": pipe.replica,
                "steps": steps,
                "tokens": pipe.samples * run.seq_len * steps,
                "loss": sum(losses) / len(losses) if steps else None,
            }
        )
        if not steps:  # it lost its round (a worker died): no part in the outer step
            reps[-1]["lost"] = True
    tokens = sum(r["tokens"] for r in reps)
    step = rd.q * job.sync.inner_steps + rd.limit - 1
    return {
        "step": step,
        "loss": sum(r["loss"] * r["tokens"] for r in reps if r["tokens"]) / tokens,
        "tokens": tokens,
        "step_time_s": seconds,
        "wire_bytes": wire,
        "plan_version": job.plan_version,
        "lr": lr_at(step, spec),
        "grad_norm": sum(rd.norms) / len(rd.norms),
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "phases": {},
        "stages": [
            {k: round(v, 4) if isinstance(v, float) else v for k, v in st.items()}
            for st in rd.stages.values()
        ],
        "optimizer_hosts": job.host_counters,
        "rounds_applied": job.rounds_closed,
        "round_closed": rd.q,
        "round_close": "time",
        "replicas": reps,
    }
