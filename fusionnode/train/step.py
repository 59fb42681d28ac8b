"""One training step on the plan in force: feed the micro-batches, run `job.step` on every stage, apply
the optimizer (on the hosts, or sum shared gradients and commit locally), commit.

`Stepper.run` returns the stages' typed reports (wire/job.py `StepReport`) or raises a typed
failure: `StepFailed` (which peers' calls failed, each as a `Failure` with its error code and the
peer to blame, and which peers did not answer a probe) or `HostFailed` (an optimizer host died).
The order of forward and backward passes inside a step (1F1B) is the workers' (runtime/); the
driver only sends inputs and targets and waits for the reports.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from typing import Any

import torch

from fusionnode.errors import FusionNodeError, PeerError
from fusionnode.optim.client import OptimizerClient
from fusionnode.optim.optimizers import FlatOptimizer
from fusionnode.optim.rounds import contributing_names, round_of, round_tokens
from fusionnode.train.checkpoint import save_at
from fusionnode.train.placement import PING_TIMEOUT_S, Placement
from fusionnode.train.state import Job, Run
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked, tensor_message
from fusionnode.wire.job import ErrorCode, Failure, Rpc, StageAssignment, StepReport, TensorKind

logger = logging.getLogger(__name__)

MARK_EVERY = 100  # steps: a checked job's hosts keep the state at the start of its plan, renewed this often
FAILURE_GRACE_S = 0.5  # seconds to let other calls of a failing step report before cancelling them


class StepFailed(FusionNodeError):
    """A step did not complete: which peers' calls failed (and why), which did not answer a probe."""

    def __init__(self, step: int, errors: dict[str, list[Failure]], unreachable: list[str]):
        self.step = step
        self.errors = errors  # peer -> the failures of the calls to it (code, peer to blame, text)
        self.unreachable = unreachable
        self.t0 = time.perf_counter()
        super().__init__(self.summary())

    def reason(self, peer: str) -> str:
        """Why `peer` is to blame: its own calls' failures, else the failures that blame it."""
        own = [f.text for f in self.errors.get(peer, ())]
        named = [f.text for fs in self.errors.values() for f in fs if f.blame == peer]
        return " | ".join(own or named)

    def summary(self) -> str:
        parts = [f"{p[:12]}…: {self.reason(p)[:300]}" for p in sorted(self.errors)]
        if self.unreachable:
            parts.append(f"unreachable: {[p[:12] for p in self.unreachable]}")
        return "; ".join(parts)


class Rollback(StepFailed):
    """A spot-check that ran while the next step did found a lie in `step`, already applied: the
    optimizer hosts undo it (they kept the state before it), the liar is banned, and the job replays
    from `step` on a new plan (train/checks.py)."""


class HostFailed(StepFailed):
    """An optimizer host died: restore every host from the last shard checkpoint and replay."""


def step_loss(job: Job, stage_args: list[StageAssignment], reports: list[StepReport]) -> float:
    """The batch's mean loss: each replica's mean micro-batch loss weighted by its samples."""
    total, weight = 0.0, 0
    for a, r in zip(stage_args, reports, strict=True):
        if a.pos == a.num_stages - 1:
            n = job.pipelines[a.replica].samples
            total += n * sum(r.losses) / len(r.losses)
            weight += n
    return total / weight


class Stepper:
    """Runs the steps of the driver's jobs."""

    def __init__(self, transport: Any, step_timeout_s: float, placement: Placement, hosts: OptimizerClient):
        self.t = transport
        self.step_timeout_s = step_timeout_s
        self.placement = placement
        self.hosts = hosts

    async def run(
        self, job: Job, run: Run, step: int, lr: float
    ) -> tuple[list[StepReport], float, StepFailed | None]:
        """One step on the plan in force: inputs, `job.step` everywhere, the optimizer, commits.

        Raises StepFailed when the step did not reach the optimizer (it is to be replayed); returns
        a StepFailed as its third value when only a commit failed after the step was applied."""
        spec = job.spec
        jid = spec.job_id
        stage_args = run.stage_args
        input_name = next(iter(stage_args[0].recv_specs))
        timeout = self.step_timeout_s
        sends: dict[str, list[Any]] = {}
        checks = run.checks
        if checks is not None:
            checks.before_step()
        shards = run.source.shard_batches(step, [p.samples for p in job.pipelines])
        for pipe, (xs, ys) in zip(job.pipelines, shards, strict=True):
            first, last = pipe.first_stage, pipe.first_stage + len(pipe.peers) - 1
            for mb, (x, y) in enumerate(
                zip(xs.chunk(pipe.micro_batches), ys.chunk(pipe.micro_batches), strict=True)
            ):
                meta = {"job": jid, "step": step, "mb": mb}
                msg_in = tensor_message(TensorKind.INPUT, {**meta, "stage": first}, {input_name: x})
                msg_target = tensor_message(TensorKind.TARGET, {**meta, "stage": last}, {"target": y})
                sends.setdefault(pipe.peers[0], []).append(msg_in)
                sends.setdefault(pipe.peers[-1], []).append(msg_target)
                if checks is not None:  # their digests, for the cross-check of the stages' commitments
                    checks.fed(first, mb, "in", msg_in)
                    checks.fed(last, mb, "target", msg_target)

        async def feed(peer: str, msgs: list[Any]) -> None:
            for msg in msgs:
                await self.t.send(peer, msg)

        # inputs first (as a step always did: the stages find them waiting), then the steps
        phases: dict[str, float] = {}
        t_phase = time.perf_counter()
        await self.gather_or_fail(
            job,
            run,
            step,
            {("send", p): feed(p, msgs) for p, msgs in sends.items()},
            {("send", p): p for p in sends},
        )
        calls = {
            **{
                ("step", a.stage): jp.call(
                    self.t,
                    a.peer,
                    Rpc.JOB_STEP,
                    jp.StepRequest(
                        job=jid,
                        stage=a.stage,
                        step=step,
                        micro_batches=job.pipelines[a.replica].micro_batches,
                        mb_size=job.pipelines[a.replica].mb_size,
                        target_time_s=run.target_time_s,
                        verify=checks is not None,
                    ),
                    timeout=timeout * 2,
                    recall=Rpc.JOB_STEP_RESULT,  # a reply lost to a stream reset: fetch it, the step ran
                )
                for a in stage_args
            },
        }
        peer_of = {("step", a.stage): a.peer for a in stage_args}
        if checks is not None:  # the checked stages' parameters, fetched while the stages compute
            checks.prefetch(job, run, step)
        phases["feed_s"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        results = await self.gather_or_fail(job, run, step, calls, peer_of)
        reports = [results[("step", a.stage)] for a in stage_args]
        phases["stages_s"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        keep = mark = False
        if checks is not None and job.sync.rounds:  # checked within the round (train/checks.py)
            await checks.round_step(job, run, step, reports, StepFailed)
            phases["verify_s"] = time.perf_counter() - t_phase
            t_phase = time.perf_counter()
        elif checks is not None and checks.deferred(job):
            # earlier steps' checks ran while this step did: a lie there rolls back to the mark; this
            # step's checks then start (the draw, the parameters it computed with) and run on while
            # the next steps do; the hosts keep the state at the plan's start (the mark)
            mark = run.mark is None or run.mark[1] != job.plan_version or step - run.mark[0] >= MARK_EVERY
            settled = await checks.settle(everything=mark)  # no unjudged step before a new mark
            if settled is not None:
                await checks.judge(job, run, settled[0], settled[1], Rollback)
            await checks.launch(job, run, step, reports)
            phases["verify_s"] = time.perf_counter() - t_phase
            t_phase = time.perf_counter()
        elif checks is not None:  # before the optimizer: nothing of a caught worker's step is applied
            await checks.check(job, run, step, reports, StepFailed)
            phases["verify_s"] = time.perf_counter() - t_phase
            t_phase = time.perf_counter()
        if run.params.get("dump_grads") and step == run.first_step:
            await self.dump_grads(job, stage_args, run.params["dump_grads"])
        commit_by_stage: dict[int, dict[str, Any]] | None = None
        if job.sync.rounds:  # issue 19: each replica steps its own inner optimizer; rounds on the hosts
            # the tied-weight sums go to the stages: a stage that died since its report fails the
            # step (a StepFailed, recovered as any other), not the job
            key = ("round_args", 0)
            got = await self.gather_or_fail(
                job,
                run,
                step,
                {key: self.round_commit_args(job, run, stage_args, reports, step, lr)},
                {key: self.t.peer_id},
            )
            grad_norm, commit_by_stage = got[key]
            commit_extra: dict[str, Any] = {}
        elif job.offload:
            try:
                applied = await self.hosts.apply(
                    jid,
                    job.hosts,
                    step + 1,
                    lr,
                    spec.grad_clip,
                    save_at(spec, step + 1),
                    keep=keep,
                    mark=mark,
                )  # the stores count steps from 1
                if mark:
                    run.mark = (step, job.plan_version)
                grad_norm, job.host_counters = applied.grad_norm, applied.counters
            except (TimeoutError, FusionNodeError, OSError) as exc:
                dead, _leaving = await self.placement.probe(list(job.hosts))
                if not dead:
                    raise
                raise HostFailed(step, {h: [Failure.of(exc)] for h in dead}, dead) from None
            commit_extra = {}
        else:
            shared_sum = await self.sum_shared(job, stage_args, step)
            sq = sum(r.grad_sq for r in reports) + FlatOptimizer.grad_sq_norm(shared_sum)
            grad_norm = math.sqrt(sq)
            clip = 1.0 if spec.grad_clip is None else min(1.0, spec.grad_clip / (grad_norm + 1e-6))
            sums = {}  # kept: a commit re-sent after a failure may need its sum again
            for a in stage_args:
                mine = {k: shared_sum[k] for k in a.shared_names}
                if mine:
                    meta = {"job": jid, "step": step, "mb": -1, "stage": a.stage}
                    sums[a.stage] = tensor_message(TensorKind.SHARED_SUM, meta, mine)
            # a stage gone since its report fails the step here, before any commit (it is replayed)
            await self.gather_or_fail(
                job,
                run,
                step,
                {("sum", s): self.t.send(a.peer, sums[s]) for a in stage_args if (s := a.stage) in sums},
                {("sum", a.stage): a.peer for a in stage_args},
            )
            commit_extra = {"lr": lr, "clip_coef": clip}
        phases["optimizer_s"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        commits = {
            ("commit", a.stage): jp.call(
                self.t,
                a.peer,
                Rpc.JOB_COMMIT,
                jp.CommitRequest(
                    job=jid,
                    stage=a.stage,
                    step=step,
                    **(commit_by_stage[a.stage] if commit_by_stage else commit_extra),
                ),
                timeout=timeout,
                idempotent=True,  # a commit already applied answers so
            )
            for a in stage_args
        }
        late = None
        scoring = None  # --contrib-policy score: the hosts hold the round until the driver's verdict
        if run.scorer is not None and (rid := round_of(job.sync, step, spec.steps)) is not None:
            scoring = run.scorer.launch(job, run, rid)
        try:
            committed = await self.gather_or_fail(
                job, run, step, commits, {("commit", a.stage): a.peer for a in stage_args}
            )
            if job.sync.rounds:
                known = None
                if job.sync.overlap and job.sync.round_closes(step, job.spec.steps):
                    # the commit awaited the previous round (a settled one: this one too)
                    settled = job.sync.settles_at_close(
                        step, job.spec.steps, job.spec.save_every if job.spec.save_dir else 0
                    )
                    known = job.sync.round_index(step) + int(settled)
                job.count_round(step, [r.round_bytes for r in committed.values()], known)
        except StepFailed as fail:
            if not job.offload and job.sync.rounds:
                raise PeerError(f"step {step}: a worker failed while applying it: {fail.summary()}") from None
            if not job.offload:  # every survivor applies the step: then the job is re-planned
                await self.finish_commits(job, run, step, commit_extra, sums, fail)
            if job.sync.rounds:  # recorded; the driver then asks the hosts whether the round closed
                if isinstance(fail, HostFailed):  # a host died at the round's end: restored first
                    raise
                job.round_bytes = 0
            late = fail
        finally:
            if scoring is not None:
                if not scoring.done() and (late is not None or sys.exc_info()[1] is not None):
                    scoring.cancel()  # the round is redone on the new plan (its contributions dropped)
                await asyncio.gather(scoring, return_exceptions=True)
                if run.scorer.caught:  # its replica's round was dropped: ban it, go on without it
                    caught = await self.caught_at_round_end(job, run, step, sys.exc_info()[1])
                    if late is not None:
                        caught.errors.update(late.errors)
                    late = caught
        phases["commit_s"] = time.perf_counter() - t_phase
        job.phases = {k: round(v, 4) for k, v in phases.items()}
        return reports, grad_norm, late

    async def finish_commits(
        self, job: Job, run: Run, step: int, extra: dict[str, Any], sums: dict[int, Any], fail: StepFailed
    ) -> None:
        """Offload off, a commit failed: every ring had finished (all stages reported), so every
        surviving stage holds the step's reduced gradients; each is sent the commit again (idempotent,
        with its tied-weight sum, should the first never have arrived) so that all survivors stand
        after `step`. A stage that still does not confirm is added to `fail.unapplied` and its state
        is not used (train/ringrecovery.py)."""
        fail.unapplied = set()
        alive = [a for a in run.stage_args if a.peer not in fail.unreachable]

        async def again(a: StageAssignment) -> None:
            if a.stage in sums:
                await self.t.send(a.peer, sums[a.stage])
            req = jp.CommitRequest(job=job.spec.job_id, stage=a.stage, step=step, **extra)
            await jp.call(self.t, a.peer, Rpc.JOB_COMMIT, req, timeout=self.step_timeout_s, idempotent=True)

        results = await asyncio.gather(*(again(a) for a in alive), return_exceptions=True)
        for a, res in zip(alive, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, FusionNodeError | OSError | TimeoutError):
                    raise res
                fail.unapplied.add(a.peer)

    async def caught_at_round_end(
        self, job: Job, run: Run, step: int, raised: BaseException | None = None
    ) -> StepFailed:
        """The workers a round-end check caught (their replicas got no weight in the round): out of
        the job, and the failure recovery bans them for (the round is applied: the job goes on).

        `raised`: the closing commit's own error, going up instead of the returned failure (a host
        that died recovers the hosts only; any other error ends the job): the caught are banned
        here, as recovery would have, so the catch is not lost with the returned failure."""
        caught, run.scorer.caught = dict(run.scorer.caught), {}
        for peer, why in sorted(caught.items()):
            run.gone.add(peer)
            await run.event(job, "caught", peer=peer, step=step, reason=why)
        blame = {
            p: [Failure(ErrorCode.BAD_TENSOR, f"verification: {why}", blame=p)] for p, why in caught.items()
        }
        failed = StepFailed(step, blame, [])
        if raised is not None:
            now = time.monotonic()
            for peer in sorted(caught):
                ban_s = run.bans.fail(peer, now)
                run.recent.forget(peer)
                await run.event(job, "failure", peer=peer, step=step, reason=failed.reason(peer), ban_s=ban_s)
        return failed

    async def gather_or_fail(
        self, job: Job, run: Run, step: int, calls: dict[Any, Any], peer_of: dict[Any, str]
    ) -> dict[Any, Any]:
        """Awaits every call; at the first failure waits a moment for others, cancels the rest, probes
        the plan's peers and raises StepFailed (so a dead peer is detected as soon as a stream to it
        breaks, not after the step deadline)."""
        tasks = {key: asyncio.ensure_future(coro) for key, coro in calls.items()}
        pending = set(tasks.values())
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if any(t.exception() is not None for t in done if not t.cancelled()):
                    break
            if pending:
                _done, pending = await asyncio.wait(pending, timeout=FAILURE_GRACE_S)
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        errors: dict[str, list[Failure]] = {}
        for key, t in tasks.items():
            if t.cancelled():
                continue
            exc = t.exception()
            if exc is None:
                continue
            if not isinstance(exc, FusionNodeError | OSError | asyncio.TimeoutError):
                raise exc
            peer = peer_of[key]
            errors.setdefault(peer, []).append(Failure.of(exc))
        if not errors:
            return {key: t.result() for key, t in tasks.items()}
        unreachable, draining = await self.placement.probe(
            sorted({a.peer for a in run.stage_args} | set(job.hosts))
        )
        dead_hosts = [h for h in job.hosts if h in unreachable]
        if dead_hosts:
            unanswered = [Failure(ErrorCode.DEADLINE, "did not answer a liveness probe")]
            raise HostFailed(step, {h: errors.get(h, unanswered) for h in dead_hosts}, dead_hosts)
        for p in draining:  # its calls failed because it is leaving (a pause released its stages, say)
            errors.setdefault(p, []).append(
                Failure(ErrorCode.LEAVING, "the peer answered a probe that it is leaving")
            )
        raise StepFailed(step, errors, unreachable)

    async def round_commit_args(
        self,
        job: Job,
        run: Run,
        stage_args: list[StageAssignment],
        reports: list[StepReport],
        step: int,
        lr: float,
    ) -> tuple[float, dict[int, dict[str, Any]]]:
        """--sync diloco|sparseloco: per replica, its tied-weight gradient sums and its own clip factor
        (each replica steps alone, as the local reference does); at a round's end, what each stage
        sends. Returns (the replicas' mean gradient norm, the commit arguments per stage)."""
        spec = job.spec
        if run.names_by_stage is None:
            run.names_by_stage = contributing_names(stage_args)
        round_id = round_of(job.sync, step, spec.steps)
        out: dict[int, dict[str, Any]] = {}
        norms = []
        for pipe in job.pipelines:
            mine = [(a, r) for a, r in zip(stage_args, reports, strict=True) if a.replica == pipe.replica]
            shared_sum = await self.sum_shared(job, [a for a, _ in mine], step)
            norm = math.sqrt(sum(r.grad_sq for _, r in mine) + FlatOptimizer.grad_sq_norm(shared_sum))
            norms.append(norm)
            clip = 1.0 if spec.grad_clip is None else min(1.0, spec.grad_clip / (norm + 1e-6))
            for a, _ in mine:
                part = {k: shared_sum[k] for k in a.shared_names}
                if part:
                    meta = {"job": spec.job_id, "step": step, "mb": -1, "stage": a.stage}
                    await self.t.send(a.peer, tensor_message(TensorKind.SHARED_SUM, meta, part))
                out[a.stage] = {"lr": lr, "clip_coef": clip}
                if run.checks is not None:  # for the transition check of this inner step
                    run.checks.inner_checks().record_args(step, a.stage, lr, clip, part)
                if round_id is not None:
                    out[a.stage]["round"] = {
                        "id": round_id,
                        "tokens": round_tokens(job.sync, step, pipe.samples, run.seq_len),
                        "names": run.names_by_stage[a.stage],
                        # --sync-overlap: install it now (the job's end, a checkpointed boundary)
                        "final": job.sync.settles_at_close(
                            step, spec.steps, spec.save_every if spec.save_dir else 0
                        ),
                    }
        return sum(norms) / len(norms), out

    async def sum_shared(
        self, job: Job, stage_args: list[StageAssignment], step: int
    ) -> dict[str, torch.Tensor]:
        """The sum of the gradients of tied parameters over the stages holding them; over several
        replicas (offload off, ring all-reduce) each replica's sum weighted by its share of the batch."""
        total: dict[str, torch.Tensor] = {}
        replicas = {a.replica for a in stage_args}
        samples = {p.replica: p.samples for p in job.pipelines}
        batch = sum(samples[r] for r in replicas)
        for a in stage_args:
            if not a.shared_names:
                continue
            msg, src = await self.t.mailbox.get(
                (TensorKind.SHARED_GRAD, job.spec.job_id, step, -1, a.stage),
                self.step_timeout_s,
                sender=a.peer,
            )
            got = decode_checked(msg, {k: a.param_specs[k] for k in a.shared_names}, None, src)
            for name, g in got.items():
                if len(replicas) > 1:
                    g = g * (samples[a.replica] / batch)
                total[name] = total[name] + g if name in total else g.clone()
        return total

    async def keep_alive(self, job: Job, run: Run) -> None:
        """Renews the stages' leases while steps or plan changes take long (a ping a third of a lease)."""
        while True:
            await asyncio.sleep(job.lease_s / 3)
            peers = sorted({a.peer for a in run.stage_args})
            await asyncio.gather(
                *(
                    jp.call(
                        self.t, p, Rpc.JOB_PING, jp.PingRequest(job=job.spec.job_id), timeout=PING_TIMEOUT_S
                    )
                    for p in peers
                ),
                return_exceptions=True,
            )

    async def dump_grads(self, job: Job, stage_args: list[StageAssignment], path: str) -> None:
        from safetensors.torch import save_file

        grads = await self.placement.fetch(job, stage_args, "grads")
        await asyncio.to_thread(save_file, {k: v.contiguous() for k, v in grads.items()}, path)
