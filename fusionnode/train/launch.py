"""A job's launch, from a `train` request to its stages shipped: the phases `Driver.run_job` calls
before its first step, in the order it calls them.

1. `parse`: the request checked (spec, checkpoint, defaults, choices) -> a `Request`.
   (`Driver._new_job` then lists the job, a `Job`, on the driver.)
2. `build`: the model built and traced, the data source opened, a checkpoint's parameters
   loaded -> a `Built`.
3. `choose`: offload or not, the candidate workers, the planner and the stage count -> a `Planning`.
4. `Planning.place`: the stages laid out over the workers and proposed until every one is
   accepted (a refusing worker is left out), the plan announced -> the accepted `StageAssignment`s.
5. `start`: the optimizer hosts started (on a resume, the step they go on from), the stages'
   parameters, error feedback and optimizer state shipped; the job is running.

Then the driver makes the job's `Run` (train/state.py) and runs its steps (train/driver.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from typing import Any

import torch

from fusionnode.errors import ConfigError, PlanError
from fusionnode.optim.client import OptimizerClient, shard
from fusionnode.sync import SyncConfig
from fusionnode.train import checks, feedback_ckpt, ringrecovery
from fusionnode.train.checkpoint import checkpoint_feedback, checkpoint_worker_optim, load_resume, read_resume
from fusionnode.train.finish import canonical_names
from fusionnode.train.jobdefaults import job_defaults
from fusionnode.train.layout import layout
from fusionnode.train.placement import PLANNERS, Placement
from fusionnode.train.rebalance import Bans, PeerBook
from fusionnode.train.state import Job, stage_rows
from fusionnode.train.swarm_cluster import cluster_links
from fusionnode.verify import compat
from fusionnode.wire.job import StageAssignment

OFFLOAD_CHOICES = ("auto", "on", "off")


@dataclasses.dataclass
class Request:
    """A `train` request, checked: what `parse` hands to the driver and to every later phase."""

    spec: Any  # train.spec.JobSpec, after its defaults (a resume's job id, --compress auto, H)
    params: dict[str, Any]  # the request's parameters, after job_defaults
    ckpt: Any  # the checkpoint `--resume` continues from, or None
    offload_choice: str  # one of OFFLOAD_CHOICES
    shares: list[int] | None  # samples per pipeline when asked (--shares)
    replicas: int  # pipelines asked
    verify_policy: Any  # train.checks' policy: whether and how steps are spot-checked
    verify_off: str | None  # why checks are off for this job, when they are
    needs: dict[str, str]  # the check capabilities a peer must advertise (verify/compat.py)


async def parse(params: dict[str, Any], config: Any, book: PeerBook) -> Request:
    """Checks a `train` request and applies its defaults (reading the checkpoint a `--resume`
    continues from); with `debug_forget_bans` (a daemon started with --debug) it clears `book`'s
    bans. Raises ConfigError on a bad choice. Hands the driver a `Request`."""
    from fusionnode.train.spec import JobSpec, trajectory_mismatch

    spec = JobSpec.from_dict(params.get("spec") or {})
    ckpt = await asyncio.to_thread(read_resume, spec) if params.get("resume") else None
    if ckpt is not None and spec.job_id != ckpt.spec.job_id and not trajectory_mismatch(spec, ckpt.spec):
        # more steps, a longer schedule, another metrics file: the same job, whose optimizer shards
        # the hosts keep under the checkpoint's job id
        spec = dataclasses.replace(spec, job_id=ckpt.spec.job_id)
    spec, params = job_defaults(spec, params, ckpt, config)  # --compress auto, a resume's H
    offload_choice = params.get("offload") or "auto"
    if offload_choice not in OFFLOAD_CHOICES:
        raise ConfigError(f"offload must be one of {OFFLOAD_CHOICES}, got {offload_choice!r}")
    shares = [int(n) for n in params["shares"]] if params.get("shares") else None
    verify_policy, verify_off = checks.job_policy(params, config, spec)
    needs = compat.needs(verify_policy.on, spec.compress, params.get("link_options"))  # mixed versions
    if params.get("debug_forget_bans"):  # `bench verify`'s seeded runs: each starts with no bans
        from fusionnode.runtime.hooks import DEBUG_ENV

        if os.environ.get(DEBUG_ENV) != "1":
            raise ConfigError("debug_forget_bans needs a daemon started with --debug")
        book.bans = Bans()
    replicas = len(shares) if shares else int(params.get("replicas") or 1)
    return Request(spec, params, ckpt, offload_choice, shares, replicas, verify_policy, verify_off, needs)


@dataclasses.dataclass
class Built:
    """The job's model and data, what `build` hands to the later phases. `start` replaces `full`
    and `start_step` when the optimizer hosts resume from a checkpoint of their own."""

    model: torch.nn.Module
    seq_len: int
    source: Any  # train.data.BatchSource
    sample: torch.Tensor  # a (1, seq_len) batch of token ids, what the model was traced with
    traced: Any  # graph.trace's traced model (its OP-DAG in .graph)
    canonical: dict[str, str]  # parameter name -> canonical name (tied weights share one)
    full: dict[str, torch.Tensor]  # every parameter, as the job starts
    start_step: int  # the first step to run (0, or a checkpoint's)


async def build(req: Request, job: Job, metrics: Any) -> Built:
    """Builds and traces the job's model, opens its data source and, on a resume, loads the
    checkpoint's parameters (and secret) into it; fills the job's aliases, model bytes and frozen
    parameters. Hands a `Built`."""
    from fusionnode.graph.trace import trace_model
    from fusionnode.train.data import BatchSource
    from fusionnode.train.local import build_job_model
    from fusionnode.train.spec import resolve_seq_len

    spec, params = req.spec, req.params
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
        start_step, full, secret = load_resume(req.ckpt, source, full)
        job.secret = secret or job.secret
        metrics.event("recovered", reason="resumed from checkpoint", step=start_step)
    return Built(model, seq_len, source, sample, traced, canonical, full, start_step)


async def choose(
    placement: Placement,
    hosts: OptimizerClient,
    req: Request,
    job: Job,
    built: Built,
    metrics: Any,
    emit: Any,
    plan_asks: contextlib.ExitStack,
) -> Planning:
    """Decides what the plan is made of: whether the optimizer is offloaded (job.offload), the
    candidate workers, the planner and the number of stages; each peer's check capabilities are
    asked once until `plan_asks` closes. Raises ConfigError or PlanError when the request cannot be
    met. Hands a `Planning`, which places the stages."""
    params, replicas, offload_choice = req.params, req.replicas, req.offload_choice
    # auto: offload whenever an optimizer host is available, which also lets the job survive a
    # failed worker (its step is replayed on a new plan); a local optimizer cannot
    placement.left_out.clear()  # what an earlier plan left out is not this job's
    job.caps = plan_asks.enter_context(compat.one_ask_per_plan(job.sync.round_close == "time"))
    hosts_available = bool(
        await placement.candidates(params.get("optimizer_peers"), "optimizer", compat.host_needs(req.needs))
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
    workers = await placement.candidates(params.get("peers"), "worker", req.needs)
    if not workers:
        skew = "; ".join(f"{p[:12]}: {why}" for p, why in sorted(placement.left_out.items()))
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
        reason = "--rebalance-every is off for this job: its --sync rounds run without optimizer hosts"
        metrics.event("notice", what="rebalance_off", reason=reason)
        await emit({"type": "event", "kind": "notice", "what": "rebalance_off", "reason": reason})
    flops = [node.flops for node in built.traced.graph.nodes]
    return Planning(placement, hosts, req, job, built, metrics, emit, workers, strategy, n_stages, flops)


class Planning:
    """The plan being made: the workers, planner and stage count `choose` picked, and what the last
    `lay` chose (the planner's prediction, the optimizer hosts' shards) for `assign` to ship."""

    def __init__(
        self,
        placement: Placement,
        hosts: OptimizerClient,
        req: Request,
        job: Job,
        built: Built,
        metrics: Any,
        emit: Any,
        workers: list[str],
        strategy: str,
        n_stages: int,
        flops: list[float],
    ):
        self.placement, self.hosts, self.req, self.job, self.built = placement, hosts, req, job, built
        self.metrics, self.emit = metrics, emit
        self.workers = workers  # the candidates; after `place`, the workers still in the running
        self.strategy = strategy
        self.n_stages = n_stages
        self.flops = flops
        self.prediction: dict[str, Any] = {}
        self.host_of: dict[str, str] | None = None
        self.host_index: dict[str, int] = {}

    async def place(self, plan_asks: contextlib.ExitStack) -> list[StageAssignment]:
        """Lays the job out and proposes its stages until the workers accept them (Placement.place),
        then closes `plan_asks`, reports the peers left out for older check versions, accepts the
        plan and announces it (the `plan` message, the `replan` event of version 1). Hands the
        accepted stage assignments; `self.workers` are then the workers still in the running."""
        job, metrics, emit = self.job, self.metrics, self.emit
        stage_args, self.workers = await self.placement.place(
            self.workers, self.lay, self.assign, metrics, emit
        )
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
                "planner": self.strategy,
                "prediction": self.prediction,
                "plan_version": 1,
                "stages": job.stages,
                "num_nodes": self.built.traced.graph.num_nodes,
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
        return stage_args

    async def lay(self, workers: list[str]) -> None:
        """The first plan over `workers` (fewer stages when some refused), and the hosts."""
        req, job, params, spec, needs = self.req, self.job, self.req.params, self.req.spec, self.req.needs
        if len(workers) < req.replicas:
            raise PlanError("every worker refused the job's stages (see the events for the reasons)")
        self.host_of, self.host_index = None, {}
        if self.strategy == "simple":
            fewer = max(1, min(self.n_stages, len(workers) // req.replicas))
            if fewer != self.n_stages:
                reason = f"{self.n_stages} stages planned, {fewer} placed: some workers refused (see above)"
                self.metrics.event("notice", what="fewer_stages", reason=reason)
                await self.emit({"type": "event", "kind": "notice", "what": "fewer_stages", "reason": reason})
            self.n_stages = fewer
            job.pipelines = layout(
                spec, self.flops, workers, self.n_stages, req.replicas, req.shares, params.get("bounds")
            )
            if job.offload:
                job.hosts = await self.placement.pick_hosts(params, workers, needs)
                if params.get("resume"):
                    job.hosts = await self.holders(job.hosts)
        else:
            # --offload auto with hosts at hand: the plan prices them against a ring all-reduce
            # among the replicas and the job follows its choice (no hosts where they do not pay);
            # the round modes need the hosts
            auto = req.offload_choice == "auto" and job.offload and not job.sync.rounds
            job.pipelines, job.hosts, self.prediction = await self.placement.planned_layout(
                self.strategy,
                spec,
                self.built.traced.graph,
                workers,
                params,
                job.offload,
                self.built.seq_len,
                dp_sync="auto" if auto else None,
                needs=needs,
            )
            job.offload = self.prediction.get("dp_sync", "hosts" if job.offload else "ring") == "hosts"
            job.sync = SyncConfig.from_dict(params.get("sync"))  # H chosen for a --sync-budget
            if len(job.pipelines) > 1 and not job.offload and job.sync.rounds:
                raise ConfigError(
                    f"the plan has several pipelines: under --sync {job.sync.mode} they need "
                    "optimizer hosts (--offload)"
                )
        if job.offload:
            full = self.built.full
            shards = shard({n: t for n, t in full.items() if n not in job.frozen}, job.hosts)
            self.host_of, self.host_index = shards.host_of, shards.host_index

    async def assign(self) -> list[StageAssignment]:
        """The stage assignments of the last `lay`, over the links given (--cluster) or measured."""
        params, built = self.req.params, self.built
        links = (
            cluster_links(params["cluster"])
            if params.get("cluster")
            else await self.placement.measured_links()
        )
        return self.placement.assignments(
            self.job,
            built.traced,
            built.canonical,
            built.full,
            built.sample,
            self.host_of,
            self.host_index,
            links,
            params.get("link_options"),
        )

    async def holders(self, hosts: list[str]) -> list[str]:
        """On resume: the optimizer peers that hold the job's shards (host index i at position i), when
        they hold a shard for each of the len(hosts) indices; else `hosts`. With checks on, only
        peers that can check (`needs`, as `pick_hosts` screens them)."""
        candidates = await self.placement.candidates(
            self.req.params.get("optimizer_peers"), "optimizer", compat.host_needs(self.req.needs)
        )
        held = await self.hosts.holders(candidates, self.job.spec.job_id, self.job.secret, len(hosts))
        return held or hosts


async def start(
    placement: Placement,
    req: Request,
    job: Job,
    built: Built,
    planning: Planning,
    stage_args: list[StageAssignment],
    metrics: Any,
    emit: Any,
) -> float:
    """Starts the job on its peers: the optimizer hosts (offload on; on a resume they go on from
    the newest step they all checkpointed, which replaces `built.start_step` and `built.full`),
    then ships each stage its parameters, a resume's error feedback (sparseloco) and workers'
    optimizer state (offload off); the job is running. Hands the time the move began
    (perf_counter), from which the run measures what a plan change costs."""
    params, ckpt, full, start_step = req.params, req.ckpt, built.full, built.start_step
    t_move = time.perf_counter()
    if job.offload:
        resume = bool(params.get("resume"))
        applied = await placement.start_hosts(
            job, stage_args, full, planning.host_of, resume=resume, start_step=start_step
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
            full = await placement.current_params(job, stage_args, planning.host_of, all_names=full)
            if job.sync.rounds:  # the hosts' ledger: the rounds their checkpoint had applied
                job.rounds_closed = job.sync.rounds_before(start_step)
    built.full, built.start_step = full, start_step
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
    await placement.ship(job, stage_args, full, feedback, optim)
    job.state = "running"
    return t_move
