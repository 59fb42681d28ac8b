"""The driver's job life cycle: plan a job, start its stages and optimizer hosts, run its steps, finish it.

It traces the model into an OP-DAG, splits it into contiguous stages, lays one or
more pipelines (data-parallel replicas) over the swarm's workers, proposes the
assignment (each worker may refuse), ships each worker its portable sub-DAG and
parameters, then runs steps: each replica's share of the batch goes to its first
stage as micro-batches, targets to its last stage, and the stages report back.

Optimizer, two ways (the same math):
- local (``offload off``, one pipeline): each worker applies AdamW to its own
  parameters; gradients of parameters two stages share (tied weights) are summed
  by the driver first, and the global gradient norm is clipped exactly.
- replicated (``offload off``, several pipelines): as local, after each stage has averaged its
  gradients with the replicas holding the same layers by ring all-reduce (runtime/allreduce.py);
  tied weights' gradients are summed by the driver, each replica's weighted by its batch share.
- offloaded (``offload on``): workers push
  gradients to optimizer hosts during backward, the hosts aggregate the replicas
  and apply the step, workers pull the new parameters (prefetched).

The life cycle reads top to bottom in `Driver.run_job`; the parts live apart: `train/launch.py`
(the phases before the first step: request, model, plan, start), `train/state.py`
(the job's books), `train/placement.py` (layout -> stage assignments, propose, ship, release),
`train/step.py` (one step: the stages' reports or a typed failure), `train/recovery.py` (blame,
bans, re-plans), `train/checkpoint.py` (what a checkpoint holds), `train/finish.py` (the result)
and `optim/client.py` (the optimizer hosts). The messages between them and the peers are `wire/job.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from fusionnode.errors import ConfigError, FusionNodeError, PeerError, PlanError
from fusionnode.optim.client import OptimizerClient
from fusionnode.runtime.transport import Transport
from fusionnode.sync import SyncConfig, job_refusals
from fusionnode.train import checks, feedback_ckpt, free_rounds, launch, ringrecovery, scoring
from fusionnode.train.checkpoint import job_secret, save_at, save_job
from fusionnode.train.finish import finish_job
from fusionnode.train.placement import Placement
from fusionnode.train.rebalance import DEFAULT_MIN_GAIN, PeerBook
from fusionnode.train.recovery import Recovery
from fusionnode.train.state import FINISHED_HISTORY_POINTS, HISTORY_KEPT, Job, Pipeline, Run
from fusionnode.train.step import HostFailed, Rollback, StepFailed, Stepper, step_loss
from fusionnode.train.swarm_cluster import cluster_from_records
from fusionnode.train.verifier_peer import verifier_warning
from fusionnode.wire.job import StageAssignment

logger = logging.getLogger(__name__)

JOBS_KEPT = 5  # finished jobs the driver's status still lists
MAX_REPLAYS = 6  # failed attempts of one step before the job gives up
# steps between straggler checks when the job can survive a move (offloaded optimizer state, no
# --sync rounds; offload off when asked) and does not say otherwise; a check acts only on
# a gain that clears the measured noise, from a bottleneck that slowed down, at consecutive checks
# (rebalance.Trigger)
DEFAULT_REBALANCE_EVERY = 2


def rebalance_every(params: dict[str, Any], job: Job) -> int:
    """Steps between rebalance checks: as asked (with offload off a moved stage takes its optimizer
    state along), else DEFAULT_REBALANCE_EVERY with offloaded state and no --sync rounds, else never."""
    asked = params.get("rebalance_every")
    if asked is not None:
        return int(asked)
    # offload off (a ring) too: with the trigger's slow-down measured from where it began
    # (SpeedBook.shift) clean 300-step 2 x 2 ring runs make no re-plan (issue 18, s5t5's runs)
    return DEFAULT_REBALANCE_EVERY if not job.sync.rounds else 0


class Driver:
    """The jobs this peer drives."""

    def __init__(self, transport: Transport, membership: Any, *, config: Any, state_dir: Path):
        self.t = transport
        self.membership = membership
        self.config = config
        self.state_dir = state_dir
        self.jobs: dict[str, Job] = {}
        timeout = config.step_timeout_s if config is not None else 60.0
        self.hosts = OptimizerClient(transport, timeout)
        # what this driver learns about peers outlives each job: measured speeds (every job, every
        # layout) replace advertised TFLOPS in the next plans, and a peer banned for a failed step
        # stays banned, longer at each offence, whichever job it fails next (SECURITY.md, attack 8)
        self.book = PeerBook()
        self.placement = Placement(transport, membership, timeout, self.hosts, self.book)
        self.stepper = Stepper(transport, timeout, self.placement, self.hosts)
        self.recovery = Recovery(transport, membership, self.placement, self.hosts, stall_s=2 * timeout)

    def status(self) -> list[dict[str, Any]]:
        return [job.to_dict() for job in self.jobs.values()]

    def _forget_old_jobs(self) -> None:
        """Keeps the status bounded: the newest JOBS_KEPT finished jobs, and every running one."""
        finished = [jid for jid, j in self.jobs.items() if j.state not in ("planning", "running")]
        for jid in finished[: max(0, len(finished) - JOBS_KEPT)]:
            del self.jobs[jid]

    async def run_job(self, params: dict[str, Any], emit: Any) -> dict[str, Any]:
        """Runs one `train` request to its end, phase by phase (train/launch.py holds the phases
        before the first step): check the request, list the job, build its model, choose and place
        its plan, start its peers, run its steps, finish. Whatever happens, the job's stages and
        hosts are released at the end. Returns the job's result (train/finish.py)."""
        from fusionnode.train.metrics import MetricsWriter

        req = await launch.parse(params, self.config, self.book)
        job = self._new_job(req)
        metrics = MetricsWriter(req.spec.metrics_out)
        plan_asks = contextlib.ExitStack()  # each peer's check capabilities asked once for the plan
        try:
            built = await launch.build(req, job, metrics)
            planning = await launch.choose(
                self.placement, self.hosts, req, job, built, metrics, emit, plan_asks
            )
            stage_args = await planning.place(plan_asks)
            t_move = await launch.start(self.placement, req, job, built, planning, stage_args, metrics, emit)
            run = await self._new_run(req, job, built, planning, stage_args, t_move, metrics, emit)
            await self._train(job, run, built.source, built.start_step)
            result = await self._finish(job, run, built, metrics)
            job.state = "done"
            return result
        except (asyncio.CancelledError, Exception) as exc:
            job.state = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
            if isinstance(exc, FusionNodeError):
                metrics.event("failure", reason=str(exc), step=job.step)
            raise
        finally:
            plan_asks.close()
            metrics.close()
            await self._release(job)

    def _new_job(self, req: launch.Request) -> Job:
        """Lists the request's job on this driver (refused when the same job is running here),
        with its sync rounds, contribution policy, lease and secret. Hands the `Job` (state "planning")."""
        spec, params = req.spec, req.params
        if spec.job_id in self.jobs and self.jobs[spec.job_id].state == "running":
            raise ConfigError(f"job {spec.job_id} is already running on this driver")
        self._forget_old_jobs()
        self.jobs.pop(spec.job_id, None)  # a rerun of the same job is listed last
        job = Job(spec, self.t.peer_id)
        job.sync = SyncConfig.from_dict(params.get("sync"))
        job_refusals(job.sync, params)
        job.contrib = scoring.job_contrib(params, self.config, job.sync)  # the rounds' weighing (issue 20)
        job.lease_s = float(params.get("lease_s") or self.config.lease_s)
        job.secret = job_secret(self.state_dir, spec.job_id)
        self.jobs[spec.job_id] = job
        return job

    async def _new_run(
        self,
        req: launch.Request,
        job: Job,
        built: launch.Built,
        planning: launch.Planning,
        stage_args: list[StageAssignment],
        t_move: float,
        metrics: Any,
        emit: Any,
    ) -> Run:
        """The running job's `Run` (what re-plans change), with its step checks started when the
        job's work is spot-checked and its rounds' scorer. Hands the Run to the steps."""
        spec, params = req.spec, req.params
        run = Run(
            traced=built.traced,
            canonical=built.canonical,
            full=built.full,
            sample=built.sample,
            host_of=planning.host_of,
            host_index=planning.host_index,
            params=params,
            metrics=metrics,
            emit=emit,
            flops=planning.flops,
            strategy=planning.strategy,
            n_stages=max(len(p.peers) for p in job.pipelines),
            shares=[p.samples for p in job.pipelines],
            stage_args=stage_args,
            seq_len=built.seq_len,
            known=set(planning.workers),
            move_s=time.perf_counter() - t_move,
            rebalance_every=rebalance_every(params, job),
            min_gain=float(params.get("rebalance_gain", DEFAULT_MIN_GAIN)),
            source=built.source,
            first_step=built.start_step,
            book=self.book,
        )
        if req.verify_off is not None:
            await run.event(job, "notice", what="verify_off", reason=req.verify_off)
        if req.verify_policy.on:
            verifier = checks.start(
                self.t,
                spec.job_id,
                req.verify_policy,
                self.stepper.step_timeout_s,
                verifier=params.get("verifier"),
                warn=verifier_warning(run, job),
            )
            run.checks = checks.StepChecks(verifier, self.placement, self.membership, verifier.timeout_s)
            metrics.event("verify", **req.verify_policy.to_dict(), commitment=verifier.selector.commitment)
        run.scorer = scoring.scorer(
            self.t, self.hosts, job, built.model, built.source, self.stepper.step_timeout_s
        )
        return run

    async def _finish(self, job: Job, run: Run, built: launch.Built, metrics: Any) -> dict[str, Any]:
        """After the last step: the final parameters (and, with a save dir, the error feedback and
        workers' optimizer state) into the job's result, with its checks' and contributions' summary."""
        spec = job.spec
        final = await self.placement.current_params(job, run.stage_args, run.host_of)
        feedback = await feedback_ckpt.saved(self.placement, job, run, spec.steps) if spec.save_dir else None
        optim = (
            await ringrecovery.checkpoint_optim(self.placement, job, run.stage_args)
            if spec.save_dir
            else None
        )
        result = await finish_job(job, built.model, final, built.source, metrics, feedback, optim)
        if run.checks is not None:
            result["verify"] = checks.summary(run.checks, job)
        result["contrib"] = run.scorer.totals() if run.scorer else job.contrib and job.contrib.to_dict()
        return result

    async def _train(self, job: Job, run: Run, source: Any, start_step: int) -> None:
        """Runs the steps. With offload a step that fails (a peer died, left, or sent bad tensors)
        is replayed under a new plan without that peer; every `rebalance_every` steps the measured
        stage speeds decide whether a better layout is worth adopting."""
        keepalive = asyncio.ensure_future(self.stepper.keep_alive(job, run))
        try:
            await self._steps(job, run, source, start_step)
        finally:
            keepalive.cancel()
            await asyncio.gather(keepalive, return_exceptions=True)
            if run.checks is not None:  # a cancelled or failed job: its checks still running
                run.checks.cancel()

    async def _steps(self, job: Job, run: Run, source: Any, start_step: int) -> None:
        from fusionnode.train.spec import lr_at

        if job.sync.round_close == "time":  # each replica at its own pace (issue 19)
            return await free_rounds.run_rounds(self, job, run, source, start_step)
        spec = job.spec
        jid = spec.job_id
        tokens_total, time_total = 0, 0.0
        step = start_step
        failures_in_a_row = 0
        while step < spec.steps or (run.checks is not None and run.checks.busy()):
            if step >= spec.steps:  # the last step's checks, still running in the background
                rollback = await self.recovery.settle(job, run)
                if rollback is not None:
                    failures_in_a_row += 1
                    step = await self.recovery.roll_back(job, run, source, rollback)
                continue
            t0 = time.perf_counter()
            lr = lr_at(step, spec)
            wire0 = self.t.bytes_sent.get(jid, 0)
            try:
                reports, grad_norm, late = await self.stepper.run(job, run, step, lr)
            except HostFailed as fail:
                failures_in_a_row += 1
                if failures_in_a_row > MAX_REPLAYS:
                    raise PlanError(f"step {step}: optimizer hosts keep failing: {fail.summary()}") from None
                if run.checks is not None:  # the hosts restore a checkpoint: the steps after it rerun
                    run.checks.cancel()
                    run.mark = None
                resume_at = await self.recovery.recover_hosts(job, run, step, fail)
                if job.sync.rounds:
                    resume_at = await self.recovery.round_restart(job, run, step, [resume_at])
                step = resume_at
                continue
            except StepFailed as fail:
                failures_in_a_row += 1
                if not isinstance(fail, Rollback):  # the previous step's checks first: a lie there wins
                    fail = await self.recovery.settle(job, run) or fail
                if isinstance(fail, Rollback):
                    if failures_in_a_row > MAX_REPLAYS:
                        raise PlanError(f"step {fail.step}: {fail.summary()}") from None
                    step = await self.recovery.roll_back(job, run, source, fail)
                    continue
                if not job.offload and job.sync.rounds:
                    raise PeerError(
                        f"step {step} failed ({fail.summary()}); recovering from a failed worker needs "
                        "the optimizer state off the workers (--offload on)"
                    ) from None
                if failures_in_a_row > MAX_REPLAYS:
                    raise PlanError(
                        f"step {step} failed {failures_in_a_row} times in a row: {fail.summary()}"
                    ) from None
                step = await self.recovery.recover(job, run, source, step, fail)
                if job.sync.rounds:
                    step = await self.recovery.round_restart(job, run, step, job.hosts_applied)
                continue
            failures_in_a_row = 0
            step_time = time.perf_counter() - t0
            run.target_time_s = max(
                r.compute_s / job.pipelines[a.replica].micro_batches
                for a, r in zip(run.stage_args, reports, strict=True)
            )
            loss = step_loss(job, run.stage_args, reports)
            tokens = spec.batch_size * run.seq_len
            tokens_total += tokens
            time_total += step_time
            wire = sum(r.sent_bytes for r in reports) + self.t.bytes_sent.get(jid, 0) - wire0
            wire += job.round_bytes  # pseudo-gradients sent at a round's end (issue 19)
            record = {
                "step": step,
                "loss": loss,
                "tokens": tokens,
                "step_time_s": step_time,
                "wire_bytes": wire,
                "plan_version": job.plan_version,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens / step_time,
                "phases": job.phases,
                "stages": [
                    {
                        "stage": r.stage,
                        "peer": a.peer,
                        "compute_s": round(r.compute_s, 4),
                        "wait_s": round(r.wait_s, 4),
                        "link_s": round(max(0.0, r.total_s - r.compute_s - r.wait_s), 4),
                        "sent_bytes": r.sent_bytes,
                        "optimizer_bytes": r.optimizer_bytes,
                        "links": r.links,
                    }
                    for a, r in zip(run.stage_args, reports, strict=True)
                ],
            }
            if job.offload:
                record["optimizer_hosts"] = job.host_counters
            if job.sync.rounds:  # the round ledger: the rounds the hosts have applied, and this step's
                record["rounds_applied"] = job.rounds_closed
                if job.sync.round_closes(step, spec.steps):
                    record["round_closed"] = job.sync.round_index(step)
            if run.checks is not None and run.checks.last is not None:
                record["verify"] = run.checks.last
            run.metrics.step(record)
            job.history.append(record)
            if len(job.history) > 2 * HISTORY_KEPT:  # the status shows the last HISTORY_KEPT
                del job.history[:-HISTORY_KEPT]
            job.step, job.loss = step + 1, loss
            job.tokens_per_s = tokens_total / time_total
            await run.emit({"type": "step", **record, "steps": spec.steps})
            run.observe(job, reports)
            step += 1
            if late is not None:  # the step was applied, but a worker failed on commit: re-plan now
                # the checks still running first: the re-plan releases the stages their audits read
                if (replay := await self.recovery.settle_and_roll_back(job, run, source)) is not None:
                    failures_in_a_row, step = failures_in_a_row + 1, replay
                    continue
                step = await self.recovery.recover(job, run, source, step, late)
                if job.sync.rounds:  # the round closed (go on after it) or not (redo it)
                    step = await self.recovery.round_restart(job, run, step - 1, job.hosts_applied)
                continue
            due = job.sync.checkpoint_due(step, spec.save_every) if job.sync.rounds else save_at(spec, step)
            if spec.save_dir and due and step < spec.steps:
                # a checkpoint holds checked steps only
                if (replay := await self.recovery.settle_and_roll_back(job, run, source)) is not None:
                    failures_in_a_row, step = failures_in_a_row + 1, replay
                    continue
                try:
                    await asyncio.to_thread(
                        save_job,
                        job,
                        step,
                        source,
                        await self.placement.current_params(job, run.stage_args, run.host_of),
                        await feedback_ckpt.saved(self.placement, job, run, step),
                        await ringrecovery.checkpoint_optim(self.placement, job, run.stage_args),
                    )
                except (OSError, FusionNodeError) as exc:  # the earlier checkpoints stay; the job goes on
                    await run.event(job, "failure", peer=None, step=step, reason=f"checkpoint: {exc}")
            if (
                (job.offload or not job.sync.rounds)  # offload off: the state moves with the stages
                and run.rebalance_every
                and step < spec.steps
                and run.since_check >= run.rebalance_every
            ):
                # a re-plan starts a new mark
                if (replay := await self.recovery.settle_and_roll_back(job, run, source)) is not None:
                    failures_in_a_row, step = failures_in_a_row + 1, replay
                    continue
                await self.recovery.maybe_rebalance(job, run, step)

    async def _release(self, job: Job) -> None:
        self.t.mailbox.release(job.spec.job_id, "driver")
        # a job that failed or was cancelled (its `train` client hung up) may have a step in flight on
        # the workers, waiting for micro-batches that will not come: abort it rather than let the
        # release (and any later `leave`) wait out the step's deadline
        abort = job.state != "done"
        calls = self.placement.release_calls(job, abort)
        calls += self.hosts.release(job.spec.job_id, job.hosts)
        await asyncio.gather(*calls, return_exceptions=True)


__all__ = [  # with the names other modules and tests know the driver by
    "FINISHED_HISTORY_POINTS",
    "HISTORY_KEPT",
    "JOBS_KEPT",
    "Driver",
    "Job",
    "PeerError",
    "Pipeline",
    "cluster_from_records",
]
