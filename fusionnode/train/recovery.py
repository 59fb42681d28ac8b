"""Recovery and plan changes: blame by error code and peer id, bans, leaves, dead optimizer hosts, and
adopting a new plan (after a failure, a leave, or when rebalancing pays off).

`Recovery.recover` asks `train/rebalance.blame` whom a failed step's typed failures (wire/job.py
`Failure`) point at, bans them or records their leave, and adopts a plan without them;
`recover_hosts` replaces dead optimizer hosts from the shard checkpoints; `adopt` releases the old
stages and places new ones (`Placement.place`, the one proposal loop); `maybe_rebalance` adopts a
faster layout when the measured speeds say it is worth the move.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from fusionnode.errors import ConfigError, FusionNodeError, PlanError
from fusionnode.optim.client import OptimizerClient
from fusionnode.train.checkpoint import checkpoint_feedback, load_resume, read_resume, save_job
from fusionnode.train.layout import layout
from fusionnode.train.placement import PING_TIMEOUT_S, STAGE_ID_STRIDE, Placement, expected
from fusionnode.train.sharemove import move_shares
from fusionnode.train.state import Job, Pipeline, Run, stage_rows
from fusionnode.train.step import Rollback, StepFailed
from fusionnode.verify import compat
from fusionnode.wire import job as jp
from fusionnode.wire.job import Rpc

logger = logging.getLogger(__name__)


class Recovery:
    """The driver's plan changes of its running jobs."""

    def __init__(
        self,
        transport: Any,
        membership: Any,
        placement: Placement,
        hosts: OptimizerClient,
        *,
        stall_s: float = 120.0,
    ):
        self.t = transport
        self.membership = membership
        self.placement = placement
        self.hosts = hosts
        self.stall_s = stall_s  # what a stalled stage costs a step: the deadline of its job.step call

    async def recover(self, job: Job, run: Run, source: Any, step: int, fail: StepFailed) -> int:
        """Bans (or forgets) the peers to blame, adopts a plan without them; returns the step to go on
        from (`step`, replayed; offload off may fall back to a checkpoint: train/ringrecovery.py)."""
        from fusionnode.train.rebalance import blame

        t0 = time.perf_counter()
        now = time.monotonic()
        peers = sorted({a.peer for a in run.stage_args})
        verdict = blame(fail.errors, peers, fail.unreachable)
        verdict.pop(self.t.peer_id, None)  # the driver's own peer answered (it is running this)
        if not verdict:  # a transient error (a stream reset, say): recorded, and the step replayed
            await run.event(
                job,
                "failure",
                peer=None,
                step=step,
                reason=f"transient, every peer still answers ({fail.summary()}); re-planning the same peers",
            )
        for peer, kind in sorted(verdict.items()):
            if kind == "leave":
                run.gone.add(peer)
                await run.event(job, "leave", peer=peer, step=step, reason=fail.reason(peer) or "it left")
            else:
                # it attracted work and stalled: banned (per driver, doubling at each offence), and
                # its measured speed counts the stall, so it is planned as slow once the ban ends
                ban_s = run.bans.fail(peer, now)
                work = sum(run.work(job, a) for a in run.stage_args if a.peer == peer)
                if work > 0:
                    run.book.speeds.stall(peer, work, self.stall_s)
                run.recent.forget(peer)
                await run.event(
                    job,
                    "failure",
                    peer=peer,
                    step=step,
                    reason=fail.reason(peer) or "did not answer a liveness probe",
                    unreachable=peer in fail.unreachable,
                    ban_s=ban_s,
                )
        workers = await self.live_workers(job, run)
        if not job.offload:  # the state is on the workers: from the surviving replicas
            from fusionnode.train import ringrecovery

            gone = set(verdict) | set(fail.unreachable) | getattr(fail, "unapplied", set())
            return await ringrecovery.recover(self, job, run, source, step, gone, workers, t0)
        try:
            await self.adopt(
                job,
                run,
                workers,
                reason=f"replacing {', '.join(sorted('…' + p[-8:] for p in verdict))} at step {step}",
            )
        except (PlanError, ConfigError) as exc:
            ckpt = None
            # --sync rounds: the hosts' parameters are the open round's start (its inner steps were
            # the workers'), so that is the step they are saved as; unless a checkpoint of it is there
            at = job.sync.round_start(job.rounds_closed) if job.sync.rounds else job.step
            saved = job.sync.rounds and job.spec.save_dir and await asyncio.to_thread(self._saved_at, job, at)
            if job.offload and job.spec.save_dir and not saved:
                with contextlib.suppress(FusionNodeError, OSError):
                    now_params = await self.placement.current_params(job, [], run.host_of, all_names=run.full)
                    ckpt = await asyncio.to_thread(save_job, job, at, source, now_params)
            raise PlanError(
                f"the job cannot go on at step {step} without {sorted(p[:12] for p in verdict)}: {exc}"
                + (f"; checkpoint of step {at} in {ckpt}" if ckpt else "")
            ) from None
        await run.event(
            job,
            "recovered",
            step=step,
            time_to_recover_s=round(time.perf_counter() - t0, 3),
            since_failure_s=round(time.perf_counter() - fail.t0, 3),
            plan_version=job.plan_version,
            reason="the step is replayed under the new plan",
        )
        return step

    @staticmethod
    def _saved_at(job: Job, step: int) -> bool:
        """Whether the job's newest driver checkpoint is of `step`."""
        try:
            return read_resume(job.spec).step == step
        except (ConfigError, OSError):
            return False

    async def recover_hosts(self, job: Job, run: Run, step: int, fail: StepFailed) -> int:
        """Replaces dead optimizer hosts: each takes a dead host's shard (same index, same names),
        every host reloads its latest shard checkpoint (the survivors roll back with it, so all
        hosts agree), the workers are re-planned to the new hosts, and the steps since that
        checkpoint are replayed. Returns the step to continue from."""
        t0 = time.perf_counter()
        spec = job.spec
        if not (spec.save_dir and spec.save_every):
            raise PlanError(
                f"optimizer host(s) {[h[:12] for h in fail.unreachable]} died at step {step} and the job "
                "keeps no optimizer checkpoints to restore them from (--save DIR --save-every N)"
            )
        now = time.monotonic()
        for h in fail.unreachable:
            ban_s = run.bans.fail(h, now)
            await run.event(
                job, "failure", peer=h, step=step, role="optimizer", reason=fail.reason(h), ban_s=ban_s
            )
        peers = await self.membership.peers()
        spares = [
            p.peer_id
            for p in sorted(peers, key=lambda r: r.peer_id)
            if "optimizer" in p.roles
            and p.peer_id not in job.hosts
            and not run.bans.banned(p.peer_id, now)
            and p.peer_id not in run.gone
        ]
        wanted = compat.needs(run.checks is not None, job.spec.compress, run.params.get("link_options"))
        spares, _old = await compat.screen(self.t, spares, compat.host_needs(wanted), "optimizer")
        workers = {a.peer for a in run.stage_args}
        spares.sort(key=lambda h: (h in workers, h))  # prefer peers that are not the job's workers
        hosts = list(job.hosts)
        for i, h in enumerate(hosts):
            if h in fail.unreachable:
                if not spares:
                    raise PlanError(f"no optimizer peer is left to replace host {h[:12]}… at step {step}")
                hosts[i] = spares.pop(0)
        replaced = dict(zip(job.hosts, hosts, strict=True))
        job.hosts = hosts
        run.host_of = {n: replaced[h] for n, h in (run.host_of or {}).items()}
        self.placement.accept(job, run.stage_args)
        # a new host cannot read the dead one's disk: without a shard checkpoint every host has, all
        # start from the driver's own latest checkpoint, with new optimizer state
        fallback, full = None, run.full
        with contextlib.suppress(ConfigError, OSError):
            ckpt = await asyncio.to_thread(read_resume, spec)
            fallback, full, _secret = load_resume(ckpt, run.source, run.full)
        applied = await self.placement.start_hosts(
            job, run.stage_args, full, run.host_of, resume=True, start_step=fallback
        )
        if len(set(applied)) != 1:
            raise PlanError(
                f"the optimizer hosts restored different steps {applied}: cannot replay consistently"
            )
        resume_at = applied[0]
        workers_now = await self.live_workers(job, run)
        await self.adopt(job, run, workers_now, reason=f"new optimizer host(s) at step {step}")
        job.step = resume_at
        await run.event(
            job,
            "recovered",
            step=step,
            role="optimizer",
            replay_from=resume_at,
            time_to_recover_s=round(time.perf_counter() - t0, 3),
            plan_version=job.plan_version,
            reason=(
                f"hosts restored from the step-{resume_at} "
                + (
                    "driver checkpoint, with new optimizer state"
                    if job.fresh_optimizer
                    else "shard checkpoint"
                )
                + f"; steps {resume_at}..{step} replayed"
            ),
            fresh_optimizer=job.fresh_optimizer,
        )
        return resume_at

    async def live_workers(self, job: Job, run: Run) -> list[str]:
        """Worker peers now in the swarm, less the banned and the departed; joins are recorded."""
        now = time.monotonic()
        wanted = run.params.get("peers")
        peers = await self.membership.peers()
        ids = [
            p.peer_id
            for p in peers
            if "worker" in p.roles and getattr(p, "availability", "available") == "available"
        ]
        if wanted:
            ids = [w for w in ids if w in wanted] + [w for w in ids if w not in wanted]
        ids = sorted(ids, key=lambda pid: (pid != self.t.peer_id, pid)) if not wanted else ids
        ids = await compat.screen_joins(self.t, job, run, ids)  # checks on: no peer of older checks
        for pid in ids:
            if pid not in run.known:
                run.known.add(pid)
                await run.event(job, "join", peer=pid, step=job.step, reason="a new worker is in the swarm")
        return [p for p in run.bans.allowed(ids, now) if p not in run.gone]

    async def adopt(
        self,
        job: Job,
        run: Run,
        workers: list[str],
        *,
        reason: str,
        layout_: Any = None,
        shares_: Any = (),
        state_: Any = None,
        pipelines_: Any = None,
    ) -> None:
        """Switches the job to a new plan at a step boundary: releases the old stages (aborting a
        step in progress), lays out new ones (with new stage ids, so no message or contribution of
        the old plan can be taken for the new one), points the optimizer hosts at the new
        contributors (dropping the pending step's partial gradients) and ships each new stage the
        current parameters from the hosts (offload off: `state_`, the parameters and optimizer state
        taken from the stages before, train/ringrecovery.py). `layout_` (one Layout per pipeline,
        `shares_`) or `pipelines_` (Pipelines of any shape: a re-plan by the planner) are the first
        proposal."""
        spec = job.spec
        t0 = time.perf_counter()
        old_args = run.stage_args
        if not job.offload and state_ is None:  # the state is on the stages: taken before they go
            from fusionnode.train.ringrecovery import survivor_state

            params, optim, lost = await survivor_state(self.placement, job, old_args, set())
            if lost:
                raise PlanError(f"no stage answered with the state of {sorted(lost)[:3]}")
            state_ = (params, optim)
        await asyncio.gather(
            *(
                jp.call(
                    self.t,
                    a.peer,
                    Rpc.JOB_RELEASE,
                    jp.ReleaseRequest(job=spec.job_id, stage=a.stage, abort=True),
                    timeout=PING_TIMEOUT_S,
                )
                for a in old_args
            ),
            return_exceptions=True,
        )
        current, optim = state_ or (None, None)
        if current is None:
            current = await self.placement.current_params(job, old_args, run.host_of, all_names=run.full)
        base = job.plan_version * STAGE_ID_STRIDE
        given = [layout_]  # a rebalance's layouts (one per pipeline), for the first proposal only
        planned = [pipelines_]  # an escalation's pipelines (train/escalate.py), the same

        async def lay(candidates: list[str]) -> None:
            if not candidates:
                raise PlanError("no worker is left that accepts the job's stages")
            if planned[0] is not None:
                pipelines, first = [], 0
                for r, pipe in enumerate(planned[0]):
                    pipelines.append(dataclasses.replace(pipe, replica=r, first_stage=first))
                    first += len(pipe.peers)
                job.pipelines, planned[0], given[0] = pipelines, None, None
                run.shares = [p.samples for p in pipelines]
            elif given[0] is not None:
                pipelines, first = [], 0
                samples = list(shares_) or [p.samples for p in job.pipelines]
                for pipe, lay_, n in zip(job.pipelines, given[0], samples, strict=True):
                    pipelines.append(
                        Pipeline(
                            pipe.replica,
                            list(lay_.peers),
                            list(lay_.bounds),
                            int(n),
                            pipe.micro_batches,
                            first,
                        )
                    )
                    first += len(lay_.peers)
                job.pipelines = pipelines
                run.shares = [p.samples for p in pipelines]
                given[0] = None
            elif run.strategy == "simple":
                replicas = len(run.shares)
                n_stages = max(1, min(run.n_stages, len(candidates) // replicas))
                job.pipelines = layout(spec, run.flops, candidates, n_stages, replicas, run.shares)
            else:
                params = dict(run.params)
                if params.get("cluster"):
                    from fusionnode.plan.cluster import subset_doc

                    params["cluster"] = subset_doc(params["cluster"], set(candidates) | set(job.hosts))
                job.pipelines, _hosts, _pred = await self.placement.planned_layout(
                    run.strategy, spec, run.traced.graph, candidates, params, job.offload, run.seq_len
                )
            for p in job.pipelines:
                p.first_stage += base

        async def assign() -> list[jp.StageAssignment]:
            return self.placement.assignments(
                job,
                run.traced,
                run.canonical,
                run.full,
                run.sample,
                run.host_of,
                run.host_index,
                await self.placement.measured_links(),
                run.params.get("link_options"),
            )

        stage_args, _workers = await self.placement.place(list(workers), lay, assign, run.metrics, run.emit)
        self.placement.accept(job, stage_args)
        if job.offload:
            job.hosts_applied = await self.hosts.replan(
                spec.job_id, job.hosts, run.host_of, expected(job, stage_args)
            )
        await self.placement.ship(job, stage_args, current, await self.round_feedback(job), optim)
        run.stage_args = stage_args
        run.names_by_stage = None  # which stage sends which name at a round's end: the new stage ids
        run.recent.clear()  # speeds measured on other stages (flops are not seconds everywhere)
        run.steps_on_plan = run.since_check = 0
        run.target_time_s = None
        run.move_s = time.perf_counter() - t0
        job.plan_version += 1
        job.stages = stage_rows(stage_args)
        await run.emit(
            {
                "type": "plan",
                "planner": run.strategy,
                "prediction": {},
                "plan_version": job.plan_version,
                "stages": job.stages,
                "num_nodes": run.traced.graph.num_nodes,
                "offload": job.offload,
                "optimizer_hosts": job.hosts,
            }
        )
        await run.event(
            job,
            "replan",
            reason=reason,
            plan_version=job.plan_version,
            step=job.step,
            peers=[a.peer for a in stage_args],
            bounds=[[a.lo, a.hi] for a in stage_args],
            shares=[p.samples for p in job.pipelines],
            move_s=round(run.move_s, 3),
        )

    async def round_feedback(self, job: Job) -> dict[int, dict[str, Any]] | None:
        """--sync sparseloco, a round redone on a new plan: the replicas' error feedback at the round's
        start, from the driver's checkpoint of that step when there is one (else the new stages start
        new accumulators)."""
        if job.sync.mode != "sparseloco" or not job.spec.save_dir or len(set(job.hosts_applied)) != 1:
            return None
        try:
            ckpt = await asyncio.to_thread(read_resume, job.spec)
        except (ConfigError, OSError):
            return None
        return checkpoint_feedback(ckpt) or None if ckpt.step == job.hosts_applied[0] else None

    async def maybe_rebalance(self, job: Job, run: Run, step: int) -> None:
        """Straggler rebalancing and use of joined peers, for every layout (one pipeline or several
        data-parallel replicas): each pipeline's peers re-split or swapped by the measured speeds
        (`rebalance.decide_job`, batch shares first), adopted when the job's predicted step gain is
        above the threshold and outweighs the cost of moving, and the run's `Trigger` agrees (the
        gain clears the measured noise, from the same bottleneck peer at consecutive checks, which
        slowed down: train/speeds.py). A share move is cheap (train/sharemove.py)."""
        from fusionnode.train.contention import shared_hosts_of
        from fusionnode.train.escalate import Escalator
        from fusionnode.train.rebalance import Layout, check_job, fill_speeds

        run.since_check = 0  # the next check after `rebalance_every` more measured steps
        workers = await self.live_workers(job, run)
        in_plan = [p for pipe in job.pipelines for p in pipe.peers]
        spares = [w for w in workers if w not in in_plan]
        records = await self.membership.peers()
        advertised = {
            r.peer_id: float(r.device.tflops_fp32)
            for r in records
            if r.peer_id in set(workers) | set(in_plan)
        }
        # this run's recent measurements first; peers it has not measured (spares) from the driver's
        # table of earlier jobs; then advertisements, scaled to the measured unit and capped
        measured = {**run.book.speeds.speeds(), **run.speeds()}
        speeds = fill_speeds(measured, advertised, [*in_plan, *spares])
        c = check_job(
            run.recent,
            run.trigger,
            [Layout(tuple(p.peers), tuple(p.bounds)) for p in job.pipelines],
            [[f * p.samples for f in run.flops] for p in job.pipelines],
            speeds,
            [p.micro_batches for p in job.pipelines],
            spares=spares,
            steps_left=job.spec.steps - step,
            move_cost_s=run.move_s,
            min_gain=run.min_gain,
            shares=[p.samples for p in job.pipelines],
            hosts=shared_hosts_of(records, [*in_plan, *spares]),  # peers sharing a machine's cores
        )
        d = c.decision
        logger.info("rebalance check at step %d: %s; %s", step, d.reason, c.why)
        run.metrics.event(  # the metrics file only: what each check saw (noise, gain, decision)
            "rebalance_check",
            step=step,
            gain=round(d.gain, 4),
            noise=round(c.noise, 4),
            spread=round(c.spread, 4),
            slowed=None if c.slowed is None else round(c.slowed, 4),
            culprit=d.culprit,
            wants=d.adopt,
            acts=c.act,
            reason=f"{d.reason}; {c.why}",
        )
        same = list(d.layouts) == [Layout(tuple(p.peers), tuple(p.bounds)) for p in job.pipelines]
        cheap = same and d.shares
        # a planner's job re-planned by the planner at the measured speeds when that beats the current
        # layout, and the share move this check would make, by a clear margin (train/escalate.py)
        if run.escalator is None:
            run.escalator = Escalator()
        moved = None
        if c.act and cheap:  # what the share move would give, which the planner's layout must beat
            moved = [
                dataclasses.replace(p, samples=int(n)) for p, n in zip(job.pipelines, d.shares, strict=True)
            ]
        if await run.escalator.check(self, job, run, step, workers, c.noise, moved, c.act and d.culprit):
            return
        if not (c.act and d.layouts):
            return
        spare = {p for lay in d.layouts for p in lay.peers} - set(in_plan)
        if spare and not await run.escalator.confirms(self, job, run, step, workers, d.layouts, d.shares):
            return  # a planner's job: the planner's model does not see that spare paying
        # the cheap move first: shares only, no stage re-placed (else, or if a stage refuses: re-placed)
        if cheap and await move_shares(
            self.t, self.hosts, job, run, list(d.shares), reason=f"rebalance: {d.reason}"
        ):
            return
        await self.adopt(
            job, run, workers, reason=f"rebalance: {d.reason}", layout_=d.layouts, shares_=d.shares
        )

    async def round_restart(self, job: Job, run: Run, failed_at: int, applied: list[int]) -> int:
        """--sync diloco|sparseloco after a re-plan: the hosts' applied steps are the round ledger
        (every round they closed, each once); the job goes on from the first step of the round they
        have open, its inner steps redone by the new plan's stages from the hosts' parameters (the
        round's start), with new inner optimizer state. With --sync-overlap the redone round starts
        from them too: the update of the round before, which the old stages would have applied D steps
        into it, is in them from its first step (as in `train_local_replicas(restart_rounds=)`).
        Returns that step."""
        if len(set(applied)) != 1:
            raise PlanError(
                f"step {failed_at}: the optimizer hosts closed different rounds (applied steps {applied}): "
                "a stage died while sending its round; restart with --resume from the last checkpoint"
            )
        if not job.sync.is_boundary(applied[0]):
            raise PlanError(
                f"the optimizer hosts' step {applied[0]} is not a round boundary (H = {job.sync.inner_steps})"
            )
        job.rounds_closed = job.sync.rounds_before(applied[0])
        restart = min(applied[0], job.spec.steps)
        job.step = restart
        await run.event(
            job,
            "recovered",
            step=failed_at,
            role="rounds",
            replay_from=restart,
            rounds_applied=job.rounds_closed,
            reason=f"round {job.rounds_closed} is redone from its start on the new plan (rounds "
            f"0..{job.rounds_closed - 1} were applied once)",
        )
        return restart

    async def settle(self, job: Job, run: Run) -> Rollback | None:
        """Waits for every check still running in the background; the Rollback to do when one caught
        a lie, else None."""
        if run.checks is None:
            return None
        if job.sync.rounds:  # mid-round (a commit failed): the round is redone anyway, not rolled back
            run.checks.cancel()
            return None
        settled = await run.checks.settle(everything=True)
        if settled is None:
            return None
        try:
            await run.checks.judge(job, run, settled[0], settled[1], Rollback)
        except Rollback as rollback:
            return rollback
        return None

    async def roll_back(self, job: Job, run: Run, source: Any, fail: Rollback) -> int:
        """Undoes every step since the hosts' mark (the plan's start, or its last renewal): the liar's
        earlier, unchecked steps may hold lies too; bans the liar, re-plans; returns the step to
        replay from."""
        step = fail.step
        if run.mark is not None and run.mark[0] <= step:  # the hosts' mark: renewed only once all
            step = run.mark[0]  # the steps before it were judged, so the lie is after it
        await self.hosts.rollback(job.spec.job_id, job.hosts, step)  # the stores count from 1
        job.history[:] = [r for r in job.history if r["step"] < step]
        job.step = step
        await run.event(
            job,
            "rollback",
            peer=None,
            step=step,
            lied_step=fail.step,
            reason=(
                f"a spot-check found a lie in step {fail.step}: the optimizer hosts undid steps "
                f"{step}..{fail.step} (the liar's steps since the plan's start or its last mark); replaying"
            ),
        )
        await self.recover(job, run, source, step, fail)
        return step

    async def settle_and_roll_back(self, job: Job, run: Run, source: Any) -> int | None:
        """Waits for the checks still running; when one caught a lie, rolls back (`roll_back`) and
        returns the step to replay from, else None."""
        rollback = await self.settle(job, run)
        return None if rollback is None else await self.roll_back(job, run, source, rollback)
