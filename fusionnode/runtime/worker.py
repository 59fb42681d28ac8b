"""The worker side of a job: accept a stage, run it in the pipeline, apply the optimizer step.

Protocol (RPCs from the job's driver, data messages peer to peer; see protocol/SPEC.md):

- ``job.assign``: a stage proposal (portable sub-DAG, neighbours, sizes). The worker
  accepts only what fits the capacity its user offered, and holds it under a lease
  that expires unless the driver renews it (any RPC of the job renews it).
- ``params`` data messages, one per parameter, then ``job.start`` builds the stage.
- ``job.step``: run one step's micro-batches with a 1F1B schedule. Activations
  (``act``) go to the next stage, their gradients (``grad``) to the previous one,
  the last stage turns ``target`` messages into a loss. Returns timings and losses.
- ``job.commit``: apply the optimizer step (gradients of parameters shared with
  other stages are summed by the driver first and arrive as ``shared_sum``).
- ``job.fetch``: send parameters or gradients to the driver (checkpoints, checks).
- ``job.step_result``: the report of a step whose ``job.step`` reply was lost in transit.
- ``job.release``: drop the stage (``abort``: cancel a step in progress first, for a re-plan).
- ``job.ping``: liveness probe (any peer); answers whether this peer is draining.

Faults. A worker that is leaving (``drain``) finishes the step in progress and refuses the
next ones with the error code ``leaving``, so the driver re-plans without it. The messages and
their checks are in ``wire/job.py``. Tests and benchmarks inject a compute hook (runtime/hooks.py:
a straggler slow-down, device pacing); without one the worker reads nothing and sleeps on nothing
beyond its work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fusionnode.compress.link import LinkOptions
from fusionnode.errors import ConfigError, GraphError
from fusionnode.runtime import fused, optstate, queued
from fusionnode.runtime.allreduce import reweigh
from fusionnode.runtime.audit import StageAudit
from fusionnode.runtime.hooks import DEBUG_ENV, ComputeHook
from fusionnode.runtime.offload import HostLink
from fusionnode.runtime.pipeline_step import run_step
from fusionnode.runtime.rounds import StageRounds
from fusionnode.runtime.stage import StageModule, state_bytes
from fusionnode.runtime.stagejob import StageJob, make_optimizer
from fusionnode.runtime.transport import Transport
from fusionnode.security.limits import MAILBOX_SLACK_BYTES, MAX_STAGES_PER_DRIVER
from fusionnode.sync import state_copies
from fusionnode.verify import inner
from fusionnode.verify.compat import advertised
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked, tensor_message
from fusionnode.wire.job import ErrorCode, JobError, Rpc, TensorKind
from fusionnode.wire.messages import TensorMessage

logger = logging.getLogger(__name__)

MEMORY_OVERHEAD = 1.2  # multiplier on the estimated stage memory, for allocator slack
KEPT_LEDGERS = 2  # steps whose messages a worker keeps for audits (the driver checks one while the next runs)


def _retrieve(fut: asyncio.Future) -> None:
    """Reads a finished start's exception: its callers may all have left (a reset stream, a drop)."""
    if not fut.cancelled():
        fut.exception()


class WorkerService(StageAudit, HostLink):
    def __init__(
        self,
        transport: Transport,
        *,
        capacity_bytes: int,
        config: Any,
        can_work: bool = True,
        can_host: bool = True,
        state_dir: Any = None,
        on_jobs_changed: Callable[[list[str]], None] | None = None,
        hook: ComputeHook | None = None,
    ):
        self.t = transport
        self.capacity_bytes = capacity_bytes
        self.config = config
        self.can_work = can_work
        self.can_host = can_host
        self.state_dir = state_dir
        self.jobs: dict[tuple[str, int], StageJob] = {}
        self.on_jobs_changed = on_jobs_changed
        self.draining = False
        self.hook = hook  # tests and benchmarks only (runtime/hooks.py); None in production
        # the check capabilities job.ping advertises (verify/compat.py; a debug daemon may pose as older)
        self.caps = advertised(os.environ.get(DEBUG_ENV) == "1")
        self.push_slots: asyncio.Semaphore | None = None
        # torch work runs off the event loop so streams keep moving while we compute
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        for name, fn in {
            Rpc.JOB_ASSIGN: self.rpc_assign,
            Rpc.JOB_START: self.rpc_start,
            Rpc.JOB_STEP: self.rpc_step,
            Rpc.JOB_STEP_RESULT: self.rpc_step_result,
            Rpc.JOB_COMMIT: self.rpc_commit,
            Rpc.JOB_FETCH: self.rpc_fetch,
            Rpc.JOB_RELEASE: self.rpc_release,
            Rpc.JOB_PING: self.rpc_ping,
            Rpc.JOB_AUDIT: self.rpc_audit,
            Rpc.JOB_RESIZE: self.rpc_resize,
            Rpc.JOB_WITHDRAW: self.rpc_withdraw,
            Rpc.DEBUG_SLOW: self.rpc_debug_slow,
        }.items():
            jp.serve(transport, name, fn)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Expires stages whose driver stopped renewing their lease."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for key, sj in list(self.jobs.items()):
                if now > sj.lease_until and not sj.busy.locked():
                    logger.warning("lease of job %s stage %d expired: the driver is gone; dropping it", *key)
                    self._drop(key)

    async def drain(self) -> None:
        """Graceful leave: refuse new work and new steps, let the steps in progress finish (their
        micro-batches drain through the pipeline and their gradients reach the optimizer hosts)."""
        self.draining = True
        for sj in list(self.jobs.values()):
            async with sj.busy:
                pass
            if sj.pull_task is not None:
                await asyncio.gather(sj.pull_task, return_exceptions=True)

    async def rpc_ping(self, req: jp.PingRequest, sender: str) -> jp.PingReply:
        """Liveness; with "job", also renews the leases of that job's stages its driver holds here
        (the driver's keep-alive while it waits on optimizer hosts or re-plans)."""
        job = req.job
        held = 0
        if req.caps and self.caps is None:  # a test's peer from before the capabilities
            raise JobError(ErrorCode.BAD_REQUEST, "PingRequest: unknown field(s) ['caps']")
        if job is not None:
            for sj in self.jobs.values():
                if sj.job == job and sj.driver == sender:
                    sj.renew()
                    held += 1
        caps = self.caps if req.caps else None
        return jp.PingReply(alive=True, draining=self.draining, jobs=len(self.jobs), stages=held, caps=caps)

    async def rpc_debug_slow(self, req: jp.DebugSlow, sender: str) -> jp.DebugSlow:
        if sender != self.t.peer_id or self.hook is None:
            raise JobError(ErrorCode.FORBIDDEN, f"{Rpc.DEBUG_SLOW} is local only and needs {DEBUG_ENV}=1")
        return jp.DebugSlow(factor=self.hook.set_slow_factor(req.factor))

    def release_all(self) -> None:
        """Drops every stage this worker holds (the owner wants the device back); their drivers re-plan."""
        for key in list(self.jobs):
            self._drop(key)

    def undrain(self) -> None:
        """Accepts work again after a pause."""
        self.draining = False

    def status(self) -> list[dict[str, Any]]:
        return [
            {
                "job": sj.job,
                "stage": sj.stage,
                "num_stages": sj.num_stages,
                "driver": sj.driver,
                "last_step": sj.last_step,
                "params": len(sj.param_specs),
                "need_bytes": sj.need_bytes,
                "lease_left_s": round(sj.lease_until - time.monotonic(), 1),
            }
            for sj in self.jobs.values()
        ]

    def _drop(self, key: tuple[str, int]) -> None:
        sj = self.jobs.pop(key, None)
        if sj is not None:
            self.t.mailbox.release(sj.job, ("stage", sj.stage))
            if sj.rounds is not None:
                sj.rounds.cancel()  # --sync-overlap: an exchange still under way
            if sj.starting is not None and not sj.starting.done():
                sj.starting.cancel()  # a start still waiting for its parameters
            queued.close(sj)  # queued steps waiting their turn: refused (not_held) now
            sj.module = sj.opt = None
            sj.params = {}
            if self.on_jobs_changed:
                self.on_jobs_changed(sorted({j for j, _ in self.jobs}))

    def _get(self, req: Any, sender: str) -> StageJob:
        key = (req.job, req.stage)
        sj = self.jobs.get(key)
        if sj is None:
            raise JobError(
                ErrorCode.NOT_HELD,
                f"no stage {key[1]} of job {key[0]} here (lease expired or never assigned)",
            )
        if sender != sj.driver:
            raise JobError(
                ErrorCode.FORBIDDEN, f"only the job's driver may control it (got a call from {sender[:12]}…)"
            )
        sj.renew()
        return sj

    def used_bytes(self) -> int:
        return sum(sj.need_bytes for sj in self.jobs.values())

    # ---- RPCs ----------------------------------------------------------------------------------
    async def rpc_assign(self, a: jp.StageAssignment, sender: str) -> jp.AssignReply:
        """Accepts a stage that fits (lease_s and need_bytes bounds: StageAssignment checks them)."""
        if not self.can_work:
            raise JobError(ErrorCode.FORBIDDEN, "this peer does not offer the worker role")
        if self.draining:
            raise JobError(ErrorCode.LEAVING, "this peer is leaving")
        if a.driver != sender:
            raise JobError(ErrorCode.FORBIDDEN, "an assignment must come from the job's driver")
        key = (a.job, a.stage)
        held = self.jobs.get(key)
        if held is not None and held.driver != sender:
            raise JobError(ErrorCode.FORBIDDEN, f"stage {key[1]} of job {key[0]} belongs to another driver")
        try:  # an option this version does not know is refused, not dropped (compress/link.py)
            LinkOptions.from_wire(a.link_options)
        except ConfigError as exc:
            raise JobError(ErrorCode.BAD_REQUEST, f"job.assign: {exc}") from None
        need = self._need_bytes(a)
        lease_s = self.config.lease_s if a.lease_s is None else a.lease_s
        mine = sum(1 for k, sj in self.jobs.items() if sj.driver == sender and k != key)
        if mine >= MAX_STAGES_PER_DRIVER:
            raise JobError(
                ErrorCode.NO_ROOM,
                f"this peer holds {mine} stages of that driver already (limit {MAX_STAGES_PER_DRIVER})",
            )
        free = self.capacity_bytes - self.used_bytes() + (held.need_bytes if held is not None else 0)
        if need * MEMORY_OVERHEAD > free:
            raise JobError(
                ErrorCode.NO_ROOM,
                f"stage needs about {need * MEMORY_OVERHEAD / 2**20:.0f} MiB but this peer offers "
                f"{free / 2**20:.0f} MiB (capacity {self.capacity_bytes / 2**20:.0f} MiB)",
            )
        if held is not None:
            self._drop(key)
        sj = StageJob(a, need, lease_s=lease_s)
        self.jobs[key] = sj
        peers = {sj.driver, sj.prev, sj.next, *(sj.offload.hosts.values() if sj.offload else ())}
        peers |= {m for ring in sj.rings for m in ring.members}  # offload off: the other replicas
        self.t.mailbox.accept(sj.job, ("stage", sj.stage), peers, 2 * need + MAILBOX_SLACK_BYTES)
        if self.on_jobs_changed:
            self.on_jobs_changed(sorted({j for j, _ in self.jobs}))
        return jp.AssignReply(accepted=True, free_bytes=free - need)

    @staticmethod
    def _need_bytes(a: jp.StageAssignment) -> int:
        """Bytes the stage will take here: the larger of what the driver declares and what the
        description's own parameters and buffers take (`sync.state_copies`: x2 with offload, x4 with a
        local optimizer, x5-x6 in a sync round mode), checked before anything is allocated."""
        try:
            state = state_bytes(a.description)
        except (GraphError, TypeError, ValueError) as exc:
            raise JobError(ErrorCode.BAD_REQUEST, f"invalid stage description: {exc}") from exc
        return max(a.need_bytes, state * state_copies(a.sync, a.offload is not None))

    async def rpc_start(self, req: jp.StageRef, sender: str) -> jp.StartReply:
        """Builds the stage once per assignment: a second `job.start` for it (the driver asks again when
        the first call's stream closed unanswered) answers what the first answers, awaiting it if it
        still runs, instead of waiting for parameters the first took; one that names other `feedback`
        or `optim` counts is refused (a new plan comes with a new `job.assign`, which starts afresh)."""
        sj = self._get(req, sender)
        ref = (req.feedback, req.optim)
        if sj.starting is None:
            sj.start_ref = ref
            sj.starting = asyncio.ensure_future(self._start(sj, req))
            sj.starting.add_done_callback(_retrieve)  # a start whose callers all left: not "never retrieved"
        elif ref != sj.start_ref:
            raise JobError(
                ErrorCode.BAD_REQUEST,
                f"job.start of stage {sj.stage} of job {sj.job} with feedback={ref[0]} optim={ref[1]} conflicts "
                f"with the start already made for this assignment (feedback={sj.start_ref[0]} "
                f"optim={sj.start_ref[1]}); a new plan is sent with job.assign first",
            )
        starting = sj.starting
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if starting.cancelled() and not (me is not None and me.cancelling()):  # _drop cancelled it
                raise JobError(
                    ErrorCode.NOT_HELD, f"stage {sj.stage} of job {sj.job} dropped while starting"
                ) from None
            raise

    async def _start(self, sj: StageJob, req: jp.StageRef) -> jp.StartReply:
        timeout = self.config.step_timeout_s
        params: dict[str, torch.Tensor] = {}
        for idx in range(len(sj.param_specs)):
            msg, src = await self.t.mailbox.get(
                (TensorKind.PARAMS, sj.job, -1, idx, sj.stage), timeout, sender=sj.driver
            )
            sj.renew()
            params.update(decode_checked(msg, sj.param_specs, None, src))
        if set(params) != set(sj.param_specs):
            raise JobError(
                ErrorCode.BAD_TENSOR,
                f"parameters missing: {sorted(set(sj.param_specs) - set(params))[:5]}",
                sj.driver,
            )

        def build() -> None:
            module = StageModule.from_description(sj.description, params, device=sj.device)
            sj.module = module
            frozen = set(sj.args_frozen)  # a LoRA job's base: no gradient, not optimized, not pushed
            for name, p in module.named_stage_parameters().items():
                if name in frozen:
                    p.requires_grad_(False)
            sj.params = {n: p for n, p in module.named_stage_parameters().items() if n not in frozen}
            sj.opt = None if sj.offload and not sj.sync.rounds else make_optimizer(sj.params, sj.spec)
            if sj.sync.rounds:
                sj.rounds = StageRounds(sj.sync, sj.params)

        await asyncio.get_running_loop().run_in_executor(self.executor, build)
        if req.optim:  # offload off: a stage moved with its optimizer state
            await optstate.load(self, sj, req.optim)
        if req.feedback:  # a resumed --sync sparseloco job: the replica's error feedback
            if sj.rounds is None:
                raise JobError(ErrorCode.BAD_REQUEST, "error feedback for a stage that keeps none")
            await sj.rounds.load_feedback(self, sj, req.feedback)
        if sj.offload and not sj.sync.rounds:
            self._install_push_hooks(sj, asyncio.get_running_loop())
        return jp.StartReply(ready=True, params=len(sj.params))

    async def rpc_resize(self, req: jp.ResizeRequest, sender: str) -> jp.AssignReply:
        """A new batch share for the stage from its next step (rebalancing between pipelines: no
        parameter moves): its gradient pushes report `samples`, and it is counted at `need_bytes`
        (at least what its description's state takes) if that fits."""
        sj = self._get(req, sender)
        rings = reweigh(sj, req.weights)  # offload off: the rings' new weights (the shares' move)
        async with sj.busy:  # between steps
            copies = state_copies(sj.sync.to_dict(), sj.offload is not None)
            need = max(req.need_bytes, state_bytes(sj.description) * copies)
            free = self.capacity_bytes - self.used_bytes() + sj.need_bytes
            if need * MEMORY_OVERHEAD > free:
                raise JobError(
                    ErrorCode.NO_ROOM, f"stage needs about {need * MEMORY_OVERHEAD / 2**20:.0f} MiB"
                )
            sj.need_bytes, sj.rings = need, rings
            if sj.offload is not None:
                sj.offload = dataclasses.replace(sj.offload, samples=req.samples)
            peers = {sj.driver, sj.prev, sj.next, *(sj.offload.hosts.values() if sj.offload else ())}
            peers |= {m for ring in sj.rings for m in ring.members}
            self.t.mailbox.accept(sj.job, ("stage", sj.stage), peers, 2 * need + MAILBOX_SLACK_BYTES)
        return jp.AssignReply(accepted=True, free_bytes=free - need)

    async def rpc_release(self, req: jp.ReleaseRequest, sender: str) -> jp.ReleaseReply:
        sj = self._get(req, sender)
        if req.abort:
            for task in (sj.step_task, sj.pull_task):
                if task is not None and not task.done():
                    task.cancel()
        async with sj.busy:
            self._drop((sj.job, sj.stage))
        return jp.ReleaseReply(released=True)

    async def rpc_fetch(self, req: jp.FetchRequest, sender: str) -> jp.CountReply:
        """Sends this stage's parameters (what="params"), gradients (what="grads") or --sync sparseloco
        error feedback (what="feedback") to the driver."""
        sj = self._get(req, sender)
        what = req.what
        if what == "optim":  # offload off: the local optimizer's state, for a move of the stage
            return jp.CountReply(count=await optstate.send(self, sj))
        if what == "feedback":  # --sync sparseloco: the accumulators, for the job's checkpoint
            # in a thread: a round's encode may hold the feedback's lock (runtime/rounds.py)
            rid = -1 if req.round is None else req.round
            tensors = await asyncio.to_thread(sj.rounds.feedback_state, rid) if sj.rounds is not None else {}
        elif what == "inner":  # a transition check of its last inner step (verify/inner.py)
            from fusionnode.verify.feedback import feedback_fetch

            tensors = inner.inner_fetch(sj)
            if tensors:  # a round end's under sparseloco: its error feedback too (verify/feedback.py)
                tensors.update(feedback_fetch(sj))
        else:
            zero = torch.zeros_like
            tensors = {
                n: p.detach() if what == "params" else (zero(p) if p.grad is None else p.grad)
                for n, p in sj.params.items()
            }
        names = sorted(tensors)
        for idx, name in enumerate(names):
            t = tensors[name]
            meta = {"job": sj.job, "stage": sj.stage, "step": req.tag, "mb": idx}
            await self.t.send(sj.driver, tensor_message(jp.FETCH_KIND[what], meta, {name: t}))
        return jp.CountReply(count=len(names))

    async def rpc_step(self, req: jp.StepRequest, sender: str) -> jp.StepReport:
        sj = self._get(req, sender)
        if sj.module is None:
            raise JobError(ErrorCode.NOT_HELD, "stage not started")
        if self.draining:
            raise JobError(ErrorCode.LEAVING, "this peer is leaving: no new steps")
        if self.hook is not None:
            self.hook.before_step()
        if req.commit_lr is not None and (why := fused.refusal(sj, req)) is not None:
            raise JobError(ErrorCode.BAD_REQUEST, why)
        if req.after_step is None:
            return await self._step_locked(sj, req)
        queued.check_cap(self.caps)  # queued ahead: starts once the step it follows ends (queued.py)
        await queued.wait_turn(sj, req)
        try:
            return await self._step_locked(sj, req)
        finally:
            queued.leave(sj, req.step)  # held for the recall (rpc_step_result) until it runs or fails

    async def _step_locked(self, sj: StageJob, req: jp.StepRequest) -> jp.StepReport:
        async with sj.busy:
            if req.commit_lr is not None and sj.last_step >= req.step:  # a fused step sent again
                if sj.last_report is not None and sj.last_report[0] == req.step:
                    return sj.last_report[1]
                raise JobError(ErrorCode.BAD_REQUEST, f"fused step {req.step}: stage {sj.stage} is past it")
            if sj.pull_task is not None:  # parameters prefetched since the last commit
                task, sj.pull_task = sj.pull_task, None
                await task
            sj.step_now = req.step
            sj.micro_batches_now = req.micro_batches
            sj.grad_counts = {}
            sj.ledger = None
            if req.verify:  # commitments in the report, messages kept for the driver's checks
                sj.ledger = await self._open_ledger(sj, req.step, req.micro_batches)
                sj.ledgers[req.step] = sj.ledger  # the driver checks a step while the next one runs
                for old in sorted(sj.ledgers)[:-KEPT_LEDGERS]:
                    del sj.ledgers[old]
            task = asyncio.ensure_future(
                fused.fused_step(self, sj, req)  # with its inner optimizer step (runtime/fused.py)
                if req.commit_lr is not None
                else self._run_step(sj, req.step, req.micro_batches, req.mb_size, req.target_time_s)
            )
            sj.step_task, sj.step_task_step = task, req.step
            if req.after_step is not None:
                queued.leave(sj, req.step)  # it runs: a recall waiting for it awaits step_task now
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                sj.step_task = None
                if req.commit_lr is not None:  # a step queued after this one may start (or fail)
                    queued.ended(
                        sj, req.step, task.done() and not task.cancelled() and task.exception() is None
                    )
            if task.cancelled():
                raise JobError(
                    ErrorCode.ABORTED, f"step {req.step} of stage {sj.stage} aborted by the driver"
                )
            sj.last_report = (req.step, task.result())
            return sj.last_report[1]

    async def rpc_step_result(self, req: jp.StepRequest, sender: str) -> jp.StepReport:
        """The report of a step whose `job.step` reply was lost (its stream closed unanswered while
        the step ran on): the transport re-sends the `job.step` request under this name; waits for
        the step if it is still running, or still queued (`aborted` if the queue refused it)."""
        sj = self._get(req, sender)
        step = req.step
        if req.after_step is not None:  # a queued step: waits while it waits its turn (queued.recall)
            await queued.recall(sj, step)
        task = sj.step_task
        if task is not None and sj.step_task_step == step:
            await asyncio.wait({task})
            if task.cancelled():
                raise JobError(ErrorCode.ABORTED, f"step {step} of stage {sj.stage} was aborted")
            return task.result()
        if sj.last_report is not None and sj.last_report[0] == step:
            return sj.last_report[1]
        raise JobError(ErrorCode.NO_REPORT, f"stage {sj.stage} has no report of step {step}")

    async def rpc_withdraw(self, req: jp.WithdrawRequest, sender: str) -> jp.WithdrawReply:
        return queued.withdraw(self._get(req, sender), req)

    async def rpc_commit(self, req: jp.CommitRequest, sender: str) -> jp.CommitReply:
        sj = self._get(req, sender)
        if req.close_only:  # the job's last round after fused steps (runtime/fused.py)
            return await fused.close_only(self, sj, req)
        step = req.step
        if sj.last_step >= step:  # a retried commit whose first reply was lost: applied (or pulling) already
            return jp.CommitReply(applied=step, again=True)
        if sj.offload and not sj.sync.rounds:
            # the hosts applied the step: prefetch the new parameters while the driver prepares the next one
            sj.pull_task = asyncio.ensure_future(self._pull(sj, step))
            sj.last_step = step
            return jp.CommitReply(applied=step, prefetching=True)
        shared = sorted(sj.shared_names & set(sj.params))
        summed: dict[str, torch.Tensor] = {}
        if shared:
            msg, src = await self.t.mailbox.get(
                (TensorKind.SHARED_SUM, sj.job, step, -1, sj.stage),
                self.config.step_timeout_s,
                sender=sj.driver,
            )
            summed = decode_checked(msg, {n: sj.param_specs[n] for n in shared}, None, src)
        if req.lr is None:
            raise JobError(ErrorCode.BAD_REQUEST, "a commit with a local optimizer needs lr")
        lr, clip = req.lr, req.clip_coef

        def apply() -> None:
            if sj.rounds is not None and sj.ledger is not None and sj.ledger.step == step:
                inner.snapshot(sj, step)  # shown to a transition check at the next step (verify/inner.py)
            with torch.no_grad():
                for name, p in sj.params.items():
                    if name in summed:
                        p.grad = summed[name].to(device=p.device, dtype=p.dtype).clone()
                    if p.grad is not None and clip != 1.0:
                        p.grad.mul_(clip)
                inner.step(sj, lr, self._liar())
                sj.opt.zero_grad()

        async with sj.busy:
            if sj.last_step >= step:  # a retried commit that waited for the first one (a long round end)
                return jp.CommitReply(applied=step, again=True)
            await asyncio.get_running_loop().run_in_executor(self.executor, apply)
            round_bytes: dict[str, list[int]] = {}
            if sj.rounds is not None:  # a round's end, or --sync-overlap's delayed update
                round_bytes = await sj.rounds.after_step(self, sj, step, req.round)
            sj.last_step = step
        return jp.CommitReply(applied=step, round_bytes=round_bytes)

    async def _hook_delay(self, compute_s: float, flops: float = 0.0) -> None:
        if self.hook is not None:
            await self.hook.after_compute(compute_s, flops)

    # ---- the pipeline schedule (runtime/pipeline_step.py) ----------------------------------------
    async def _run_step(
        self, sj: StageJob, step: int, m: int, mb_size: int, target_time_s: float | None
    ) -> jp.StepReport:
        return await run_step(self, sj, step, m, mb_size, target_time_s)

    async def _allreduce(self, sj: StageJob, step: int) -> int:
        """Averages the stage's gradients with the other replicas (runtime/allreduce.py)."""
        from fusionnode.runtime.allreduce import reduce_stage

        return await reduce_stage(sj, step, self.t, self.config.step_timeout_s)

    @staticmethod
    def _record_received(ledger: Any, kind: str, mb: int, msg: TensorMessage, src: str) -> None:
        """Keeps a received message for the driver's checks; refuses one whose attached digest (the
        sender's commitment) is not that of the tensors that arrived (`check_claim`: a digest of
        another algorithm is a version skew, not a lie)."""
        from fusionnode.verify.commitment import DIGEST_KEY, check_claim, digest_encoded
        from fusionnode.verify.ledger import RECEIVED_PART

        digest = digest_encoded(msg.tensors)
        if kind in (TensorKind.ACT, TensorKind.GRAD):
            check_claim(msg.meta.get(DIGEST_KEY), digest, src, kind)
        ledger.record(mb, RECEIVED_PART[kind], msg, digest)
