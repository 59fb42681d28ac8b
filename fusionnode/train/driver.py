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

The life cycle reads top to bottom in `Driver.run_job`; the parts live apart: `train/state.py`
(the job's books), `train/placement.py` (layout -> stage assignments, propose, ship, release),
`train/step.py` (one step: the stages' reports or a typed failure), `train/recovery.py` (blame,
bans, re-plans), `train/checkpoint.py` (what a checkpoint holds), `train/finish.py` (the result)
and `optim/client.py` (the optimizer hosts). The messages between them and the peers are `wire/job.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from fusionnode.errors import ConfigError, FusionNodeError, PeerError, PlanError
from fusionnode.optim.client import OptimizerClient, shard
from fusionnode.runtime.transport import Transport
from fusionnode.sync import SyncConfig, job_refusals
from fusionnode.train import checks, feedback_ckpt, free_rounds, ringrecovery, scoring
from fusionnode.train.checkpoint import (
    checkpoint_feedback,
    checkpoint_worker_optim,
    job_secret,
    load_resume,
    read_resume,
    save_at,
    save_job,
)
from fusionnode.train.finish import canonical_names, finish_job
from fusionnode.train.jobdefaults import job_defaults
from fusionnode.train.placement import (
    PLANNERS,
    STAGE_ID_STRIDE,
    Placement,
    balanced_bounds,
    crossing_names,
    layout,
)
from fusionnode.train.rebalance import DEFAULT_MIN_GAIN, Bans, PeerBook
from fusionnode.train.recovery import Recovery
from fusionnode.train.state import FINISHED_HISTORY_POINTS, HISTORY_KEPT, Job, Pipeline, Run, stage_rows
from fusionnode.train.step import HostFailed, Rollback, StepFailed, Stepper, step_loss
from fusionnode.train.swarm_cluster import cluster_from_records, cluster_links
from fusionnode.train.verifier_peer import verifier_warning
from fusionnode.verify import compat
from fusionnode.wire.job import StageAssignment

logger = logging.getLogger(__name__)

JOBS_KEPT = 5  # finished jobs the driver's status still lists
OFFLOAD_CHOICES = ("auto", "on", "off")
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
        from fusionnode.graph.trace import trace_model
        from fusionnode.train.data import BatchSource
        from fusionnode.train.local import build_job_model
        from fusionnode.train.metrics import MetricsWriter
        from fusionnode.train.spec import JobSpec, resolve_seq_len, trajectory_mismatch

        spec = JobSpec.from_dict(params.get("spec") or {})
        ckpt = await asyncio.to_thread(read_resume, spec) if params.get("resume") else None
        if ckpt is not None and spec.job_id != ckpt.spec.job_id and not trajectory_mismatch(spec, ckpt.spec):
            # more steps, a longer schedule, another metrics file: the same job, whose optimizer shards
            # the hosts keep under the checkpoint's job id
            spec = dataclasses.replace(spec, job_id=ckpt.spec.job_id)
        spec, params = job_defaults(spec, params, ckpt, self.config)  # --compress auto, a resume's H
        offload_choice = params.get("offload") or "auto"
        if offload_choice not in OFFLOAD_CHOICES:
            raise ConfigError(f"offload must be one of {OFFLOAD_CHOICES}, got {offload_choice!r}")
        shares = [int(n) for n in params["shares"]] if params.get("shares") else None
        verify_policy, verify_off = checks.job_policy(params, self.config, spec)
        needs = compat.needs(verify_policy.on, spec.compress, params.get("link_options"))  # mixed versions
        if params.get("debug_forget_bans"):  # `bench verify`'s seeded runs: each starts with no bans
            from fusionnode.runtime.hooks import DEBUG_ENV

            if os.environ.get(DEBUG_ENV) != "1":
                raise ConfigError("debug_forget_bans needs a daemon started with --debug")
            self.book.bans = Bans()
        replicas = len(shares) if shares else int(params.get("replicas") or 1)
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
        metrics = MetricsWriter(spec.metrics_out)
        plan_asks = contextlib.ExitStack()  # each peer's check capabilities asked once for the plan
        try:
            model = await asyncio.to_thread(build_job_model, spec)
            seq_len = resolve_seq_len(spec)
            source = await asyncio.to_thread(BatchSource.from_spec, spec, seq_len)
            sample = torch.zeros(1, seq_len, dtype=torch.long)
            traced = await asyncio.to_thread(trace_model, model, sample, spec.model)
            canonical = canonical_names(model)
            job.aliases = {name: canon for name, canon in canonical.items() if name != canon}
            full = {name: p.detach() for name, p in model.named_parameters()}
            job.model_bytes = sum(t.numel() * 4 for t in full.values())
            job.frozen = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
            start_step = 0
            if params.get("resume"):
                start_step, full, secret = load_resume(ckpt, source, full)
                job.secret = secret or job.secret
                metrics.event("recovered", reason="resumed from checkpoint", step=start_step)
            # auto: offload whenever an optimizer host is available, which also lets the job survive a
            # failed worker (its step is replayed on a new plan); a local optimizer cannot
            self.placement.left_out.clear()  # what an earlier plan left out is not this job's
            plan_asks.enter_context(compat.one_ask_per_plan())
            hosts_available = bool(
                await self.placement.candidates(
                    params.get("optimizer_peers"), "optimizer", compat.host_needs(needs)
                )
            )
            # several pipelines without hosts average their gradients by ring all-reduce among the
            # replicas of each stage (runtime/allreduce.py); the --sync round modes need hosts
            job.offload = offload_choice == "on" or (
                offload_choice == "auto" and (hosts_available or (replicas > 1 and job.sync.rounds))
            )
            if replicas > 1 and not job.offload and job.sync.rounds:
                raise ConfigError(
                    f"several pipelines under --sync {job.sync.mode} synchronise through optimizer hosts: "
                    "use --offload on|auto"
                )
            workers = await self.placement.candidates(params.get("peers"), "worker", needs)
            if not workers:
                skew = "; ".join(f"{p[:12]}: {why}" for p, why in sorted(self.placement.left_out.items()))
                raise PlanError(
                    "no worker peers are available in the swarm"
                    + (f" (left out, older check versions: {skew})" if skew else "")
                )
            strategy = params.get("planner") or "simple"
            if strategy not in PLANNERS:
                raise ConfigError(f"planner must be one of {', '.join(PLANNERS)}, got {strategy!r}")
            if strategy != "simple" and offload_choice != "off":
                job.offload = True
            n_stages = int(params.get("stages") or max(1, len(workers) // replicas))
            if params.get("stages") and n_stages * replicas > len(workers):
                raise PlanError(
                    f"--stages {n_stages} x {replicas} pipeline(s) need {n_stages * replicas} workers; the "
                    f"swarm has {len(workers)} available: start more peers, or ask for fewer stages"
                )
            if int(params.get("rebalance_every") or 0) > 0 and not job.offload and job.sync.rounds:
                # a round job without hosts: its round state does not move; say so, not in silence
                reason = (
                    "--rebalance-every is off for this job: its --sync rounds run without optimizer hosts"
                )
                metrics.event("notice", what="rebalance_off", reason=reason)
                await emit({"type": "event", "kind": "notice", "what": "rebalance_off", "reason": reason})
            flops = [node.flops for node in traced.graph.nodes]
            prediction: dict[str, Any] = {}
            host_of: dict[str, str] | None = None
            host_index: dict[str, int] = {}

            async def lay(workers: list[str]) -> None:
                """The first plan over `workers` (fewer stages when some refused), and the hosts."""
                nonlocal n_stages, prediction, host_of, host_index
                if len(workers) < replicas:
                    raise PlanError("every worker refused the job's stages (see the events for the reasons)")
                host_of, host_index = None, {}
                if strategy == "simple":
                    fewer = max(1, min(n_stages, len(workers) // replicas))
                    if fewer != n_stages:
                        reason = (
                            f"{n_stages} stages planned, {fewer} placed: some workers refused (see above)"
                        )
                        metrics.event("notice", what="fewer_stages", reason=reason)
                        await emit(
                            {"type": "event", "kind": "notice", "what": "fewer_stages", "reason": reason}
                        )
                    n_stages = fewer
                    job.pipelines = layout(
                        spec, flops, workers, n_stages, replicas, shares, params.get("bounds")
                    )
                    if job.offload:
                        job.hosts = await self.placement.pick_hosts(params, workers, needs)
                        if params.get("resume"):
                            job.hosts = await self._holders(job, job.hosts, params, needs)
                else:
                    # --offload auto with hosts at hand: the plan prices them against a ring all-reduce
                    # among the replicas and the job follows its choice (no hosts where they do not pay);
                    # the round modes need the hosts
                    auto = offload_choice == "auto" and job.offload and not job.sync.rounds
                    job.pipelines, job.hosts, prediction = await self.placement.planned_layout(
                        strategy,
                        spec,
                        traced.graph,
                        workers,
                        params,
                        job.offload,
                        seq_len,
                        dp_sync="auto" if auto else None,
                        needs=needs,
                    )
                    job.offload = prediction.get("dp_sync", "hosts" if job.offload else "ring") == "hosts"
                    job.sync = SyncConfig.from_dict(params.get("sync"))  # H chosen for a --sync-budget
                    if len(job.pipelines) > 1 and not job.offload and job.sync.rounds:
                        raise ConfigError(
                            f"the plan has several pipelines: under --sync {job.sync.mode} they need "
                            "optimizer hosts (--offload)"
                        )
                if job.offload:
                    shards = shard({n: t for n, t in full.items() if n not in job.frozen}, job.hosts)
                    host_of, host_index = shards.host_of, shards.host_index

            async def assign() -> list[StageAssignment]:
                links = (
                    cluster_links(params["cluster"])
                    if params.get("cluster")
                    else await self.placement.measured_links()
                )
                return self.placement.assignments(
                    job,
                    traced,
                    canonical,
                    full,
                    sample,
                    host_of,
                    host_index,
                    links,
                    params.get("link_options"),
                )

            stage_args, workers = await self.placement.place(workers, lay, assign, metrics, emit)
            plan_asks.close()  # a later screen (joins, new hosts) asks afresh
            for peer, why in sorted(self.placement.left_out.items()):  # checks on: older check versions
                metrics.event("notice", what="version_skew", peer=peer, reason=why)
                await emit({"type": "event", "kind": "notice", "what": "version_skew", "reason": why})
            self.placement.left_out.clear()
            self.placement.accept(job, stage_args)
            job.stages = stage_rows(stage_args)
            job.plan_version = 1
            await emit(
                {
                    "type": "plan",
                    "planner": strategy,
                    "prediction": prediction,
                    "plan_version": 1,
                    "stages": job.stages,
                    "num_nodes": traced.graph.num_nodes,
                    "offload": job.offload,
                    "optimizer_hosts": job.hosts,
                }
            )
            job.events.append(
                metrics.event(
                    "replan",
                    reason="initial plan",
                    plan_version=1,
                    stages=len(job.stages),
                    pipelines=len(job.pipelines),
                    offload=job.offload,
                )
            )
            t_move = time.perf_counter()
            if job.offload:
                resume = bool(params.get("resume"))
                applied = await self.placement.start_hosts(
                    job, stage_args, full, host_of, resume=resume, start_step=start_step
                )
                if resume:
                    # the hosts hold the masters and optimizer state: continue from the newest step they
                    # all checkpointed (data depend only on the step); with none in common (other hosts,
                    # or none kept) they started from the driver's checkpoint with new optimizer state
                    if len(set(applied)) != 1:
                        raise PlanError(f"the optimizer hosts resumed at different steps {applied}")
                    if job.fresh_optimizer:
                        metrics.event(
                            "resume",
                            reason="no optimizer checkpoint common to the hosts: new optimizer state",
                            step=start_step,
                            fresh_optimizer=True,
                        )
                    if applied[0] != start_step:
                        metrics.event(
                            "resume",
                            reason="optimizer hosts' newest common checkpoint differs from the driver's",
                            step=applied[0],
                            driver_checkpoint_step=start_step,
                        )
                        start_step = applied[0]
                    full = await self.placement.current_params(job, stage_args, host_of, all_names=full)
                    if job.sync.rounds:  # the hosts' ledger: the rounds their checkpoint had applied
                        job.rounds_closed = job.sync.rounds_before(start_step)
            feedback = None
            if job.sync.mode == "sparseloco" and ckpt is not None:
                # the replicas' error feedback, when the checkpoint it came with is the step resumed
                feedback = checkpoint_feedback(ckpt) if start_step == ckpt.step else None
                if not feedback:
                    metrics.event(
                        "resume",
                        reason="no error feedback for this step: the replicas start new ones",
                        step=start_step,
                    )
                elif fresh := feedback_ckpt.fresh_stages(stage_args, feedback):  # a stage left out
                    why = f"no error feedback of {'; '.join(fresh)} in the checkpoint: new ones there only"
                    metrics.event("notice", what="resume_feedback", step=start_step, reason=why)
                    await emit({"type": "event", "kind": "notice", "what": "resume_feedback", "reason": why})
            optim = None
            if not job.offload and ckpt is not None:  # the workers' optimizer state of that step
                optim = checkpoint_worker_optim(ckpt, ringrecovery.trainable_names(job, stage_args))
                if optim is None or start_step != ckpt.step:
                    optim = None
                    metrics.event(
                        "resume",
                        reason="the checkpoint holds no workers' optimizer state: new optimizer state",
                        step=start_step,
                        fresh_optimizer=True,
                    )
            await self.placement.ship(job, stage_args, full, feedback, optim)
            job.state = "running"
            run = Run(
                traced=traced,
                canonical=canonical,
                full=full,
                sample=sample,
                host_of=host_of,
                host_index=host_index,
                params=params,
                metrics=metrics,
                emit=emit,
                flops=flops,
                strategy=strategy,
                n_stages=max(len(p.peers) for p in job.pipelines),
                shares=[p.samples for p in job.pipelines],
                stage_args=stage_args,
                seq_len=seq_len,
                known=set(workers),
                move_s=time.perf_counter() - t_move,
                rebalance_every=rebalance_every(params, job),
                min_gain=float(params.get("rebalance_gain", DEFAULT_MIN_GAIN)),
                source=source,
                first_step=start_step,
                book=self.book,
            )
            if verify_off is not None:
                await run.event(job, "notice", what="verify_off", reason=verify_off)
            if verify_policy.on:
                verifier = checks.start(
                    self.t,
                    spec.job_id,
                    verify_policy,
                    self.stepper.step_timeout_s,
                    verifier=params.get("verifier"),
                    warn=verifier_warning(run, job),
                )
                run.checks = checks.StepChecks(verifier, self.placement, self.membership, verifier.timeout_s)
                metrics.event("verify", **verify_policy.to_dict(), commitment=verifier.selector.commitment)
            run.scorer = scoring.scorer(self.t, self.hosts, job, model, source, self.stepper.step_timeout_s)
            await self._train(job, run, source, start_step)
            final = await self.placement.current_params(job, run.stage_args, run.host_of)
            feedback = (
                await feedback_ckpt.saved(self.placement, job, run, spec.steps) if spec.save_dir else None
            )
            optim = (
                await ringrecovery.checkpoint_optim(self.placement, job, run.stage_args)
                if spec.save_dir
                else None
            )
            result = await finish_job(job, model, final, source, metrics, feedback, optim)
            if run.checks is not None:
                result["verify"] = checks.summary(run.checks, job)
            result["contrib"] = run.scorer.totals() if run.scorer else job.contrib and job.contrib.to_dict()
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

    async def _holders(
        self, job: Job, hosts: list[str], params: dict[str, Any], needs: dict[str, str]
    ) -> list[str]:
        """On resume: the optimizer peers that hold the job's shards (host index i at position i), when
        they hold a shard for each of the len(hosts) indices; else `hosts`. With checks on, only
        peers that can check (`needs`, as `pick_hosts` screens them)."""
        candidates = await self.placement.candidates(
            params.get("optimizer_peers"), "optimizer", compat.host_needs(needs)
        )
        held = await self.hosts.holders(candidates, job.spec.job_id, job.secret, len(hosts))
        return held or hosts

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
    "STAGE_ID_STRIDE",
    "Driver",
    "Job",
    "PeerError",
    "Pipeline",
    "balanced_bounds",
    "cluster_from_records",
    "crossing_names",
]
