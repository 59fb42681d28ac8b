"""The driver's spot-checks of a job's work (fusionnode/verify/), wired into its steps.

`job_policy` resolves `--verify-policy` / `--verify-rate` for a job (off with a notice when its links
use error feedback or its rounds close by time; lossy codecs are checked within their own bounds: verify/lossy.py); `start` makes the job's `Verifier`; the stepper calls `before_step`, `fed` (each input
and target it sends), `prefetch` (once the stages run), then after the stages reported:

- with offload (`deferred`): `launch` before the optimizer (the draw, the checked stages'
  parameters); the audits run in the background while the next step runs, which waits for them
  before its own update (`settle`: the workers keep two steps' messages); the recomputes run on in
  the daemon's low-priority check process, up to MAX_LAG steps behind. The optimizer hosts keep the
  state at the start of the plan (`opt.apply` with `mark`, renewed every MARK_EVERY steps, after
  every earlier step was judged). A lie found raises `Rollback` for the lied step: the hosts go back
  to the mark (`opt.rollback`: every step the liar computed since is undone), the liar is banned,
  and the job replays from the mark on a new plan; nothing of the liar's stays in the model, and
  honest steps are applied exactly as without checks;
- without offload: `check` before the optimizer, on the critical path (the workers update their
  own parameters at commit, which cannot be rolled back).

Under `--sync diloco|sparseloco` the workers step their own inner optimizer: the checked stages'
parameters are fetched from the workers (bound by their commitments) before the step's commit, the
audits and recomputes run on within the round and are all judged before the round's closing commit
(`round_step`); the transition check of the inner step before runs at each step
(train/inner_checks.py). A lie found fails the step: recovery redoes the round on a new plan.

A caught worker is out of the job (`caught` event, `run.gone`) and the step fails with `bad_tensor`
blaming it, so recovery bans it, drops the step's contributions and replays the step on a new plan;
a dispute nobody can be blamed for replays the step with the same peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import time
from typing import Any

import torch

from fusionnode.compress.link import LinkOptions
from fusionnode.errors import ConfigError, FusionNodeError
from fusionnode.sync import SyncConfig, time_close_checks_refusal
from fusionnode.wire import job as jp
from fusionnode.wire.job import ErrorCode, Failure, Rpc, StageAssignment


def job_policy(params: dict[str, Any], config: Any, spec: Any) -> tuple[Any, str | None]:
    """(the policy in force, why checks are off despite it, or None); ConfigError on bad options."""
    from fusionnode.config import loopback_only
    from fusionnode.security.keys import SWARM_KEY_ENV
    from fusionnode.verify.policy import resolve_policy

    # a private swarm (swarm key), or a local one (this peer listens on loopback only, so every peer
    # it can reach runs on this machine: the user's own processes): auto leaves checks off
    local = loopback_only(tuple(getattr(config, "listen", ()) or ()))
    private = local or bool(getattr(config, "swarm_key_file", None) or os.environ.get(SWARM_KEY_ENV))
    try:
        policy = resolve_policy(
            params.get("verify_policy"),
            params.get("verify_rate"),
            private=private,
            grad_rate=params.get("verify_grad_rate"),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    sync = SyncConfig.from_dict(params.get("sync"))
    if sync.round_close == "time":
        time_close_checks_refusal(params.get("verify_policy"))  # sample|all: refused up front
        if policy.on:  # auto in a public swarm
            reason = (
                "spot-checks are off for this job: --round-close time closes rounds without them "
                "(use --round-close steps to check the work)"
            )
            return dataclasses.replace(policy, policy="off", rate=0.0, grad_rate=0.0), reason
        return policy, None
    if policy.on and sync.rounds and params.get("verify_policy") is None:
        # the round modes' checks (verify/inner.py) are opt-in: asked for (--verify-policy sample|all)
        # they run; auto leaves them off until they have held in every recovery path
        reason = (
            f"spot-checks are off for this job: under --sync {sync.mode} they are opt-in "
            "(--verify-policy sample); the replicas' pseudo-gradients are still weighed (--contrib-policy)"
        )
        return dataclasses.replace(policy, policy="off", rate=0.0, grad_rate=0.0), reason
    feedback = LinkOptions.from_dict(params.get("link_options")).error_feedback
    if not policy.on or spec.compress == "none" or not feedback:
        # lossy links are checked as their codec makes of the recompute (verify/lossy.py); a round
        # mode's workers commit to their inner parameters, which the recompute takes (verify/inner.py)
        return policy, None
    # error feedback sends what earlier messages dropped: no recompute can reproduce a message
    if params.get("verify_policy") in ("sample", "all"):
        raise ConfigError(
            f"--verify-policy {params['verify_policy']} cannot check links with error feedback (what "
            "they send depends on earlier messages): turn error_feedback off with checks"
        )
    reason = "spot-checks are off for this job: its links use error feedback, which no recompute reproduces"
    return dataclasses.replace(policy, policy="off", rate=0.0, grad_rate=0.0), reason


def _cpu_stage(description: dict[str, Any], params: dict[str, torch.Tensor]) -> Any:
    from fusionnode.runtime.stage import StageModule

    return StageModule.from_description(description, params, device="cpu")


MAX_LAG = 8  # checked steps whose recomputes may still run while the job goes on
CHECK_NICE = 10  # the check process's niceness where it could not be lifted from SCHED_IDLE (not undone)
# in the check process: (job, stage, description digest) -> its module. A job id names a spec, not a
# layout: the same spec run again on other cuts (the testbed's configurations, a user's rerun) reuses
# the id and the stage numbers, so the description is part of the key
_child_modules: dict[tuple[str, int, str], Any] = {}


def can_lift(euid: int | None = None, nice_limit: int | None = None) -> bool:
    """Whether a process of this user may be lifted from SCHED_IDLE back to SCHED_OTHER (`urgent`):
    root, or an RLIMIT_NICE soft limit of at least 20 (the kernel treats SCHED_IDLE as nice 20 and
    lets a process leave it only as far as RLIMIT_NICE allows). Defaults: this process's."""
    import resource

    if euid is None:
        euid = os.geteuid()
    if nice_limit is None:
        nice_limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return euid == 0 or nice_limit == resource.RLIM_INFINITY or nice_limit >= 20


def idle_priority(pid: int = 0, liftable: bool | None = None) -> str:
    """Puts process `pid` (0: this one) at idle priority: SCHED_IDLE where the OS has it and the
    process can be lifted from it while a step waits for it (`can_lift`: otherwise the step would
    wait on a process that barely runs on a loaded machine), else nice CHECK_NICE; which one it got."""
    if liftable is None:
        liftable = can_lift()
    if liftable:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, pid, CHECK_NICE)
        return f"nice {CHECK_NICE}"
    return "normal"


def normal_priority(pid: int) -> bool:
    """Process `pid` back from SCHED_IDLE to the normal policy while the driver waits for it (the step
    is waiting: it is the critical path then); whether the OS allowed it (an unprivileged process
    needs RLIMIT_NICE for it)."""
    try:
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def _child_init() -> None:
    torch.set_num_threads(1)
    idle_priority()


def _child_ready() -> int:
    from fusionnode.runtime.stage import StageModule  # noqa: F401 - imported once, before the first check

    return os.getpid()


def _child_module(job_id: str, a: dict[str, Any], mine: dict[str, torch.Tensor]) -> Any:
    """In the check process: the module of stage `a` holding `mine`, kept across steps, rebuilt when
    the job or the stage's description (its cut) changes."""
    digest = hashlib.sha256(json.dumps(a["description"], sort_keys=True, default=str).encode()).hexdigest()
    key = (job_id, a["stage"], digest)
    for old in [k for k in _child_modules if (k[:2] == key[:2] and k != key) or k[0] != job_id]:
        del _child_modules[old]  # another job's modules, or this stage's under an earlier cut
    module = _child_modules.get(key)
    if module is None:
        module = _child_modules[key] = _cpu_stage(a["description"], dict(mine))
    else:
        module.bind_state(mine)  # views of this check's shared buffer: no copy (runtime/stage.py)
    return module


def _child_check(job_id: str, audit: Any, packed: Any) -> str:
    """In the check process: verify.audit.judge_audit of one stage's audit."""
    from fusionnode.verify.audit import join_payloads, judge_audit, unpack_tensors

    storage = packed[0].untyped_storage()  # a lent buffer comes back (the same segment): kept mapped
    _kept.setdefault(storage.data_ptr(), storage)
    while len(_kept) > 4 * MAX_LAG:
        del _kept[next(iter(_kept))]
    audit.chunks, mine = join_payloads(audit.chunks, unpack_tensors(packed))
    return judge_audit(audit, mine, lambda a, mine: _child_module(job_id, a, mine))


class SharedBuffers:
    """uint8 buffers in shared memory lent to the check process's calls and taken back when each
    call ended (`CheckProcess.pack`); at most as many as checks run at once (MAX_LAG steps' worth)."""

    def __init__(self) -> None:
        import threading

        self.free: list[torch.Tensor] = []
        self.lent: dict[int, torch.Tensor] = {}  # storage address -> its whole buffer
        self._lock = threading.Lock()  # packing runs on threads (verify/verifier.py `_recompute`)

    def take(self, n: int) -> torch.Tensor:
        """A buffer of at least `n` bytes, not lent to a call still running."""
        with self._lock:
            fits = [i for i, b in enumerate(self.free) if b.numel() >= n]
            # the smallest that fits (by position: `==` on tensors compares their values)
            buf = self.free.pop(min(fits, key=lambda i: self.free[i].numel())) if fits else None
        if buf is None:
            buf = torch.empty(max(n, 1), dtype=torch.uint8).share_memory_()
        with self._lock:
            self.lent[buf.untyped_storage().data_ptr()] = buf
        return buf

    def give(self, view: torch.Tensor) -> None:
        """Takes back the buffer `view` is part of (a buffer it did not lend is ignored)."""
        with self._lock:
            buf = self.lent.pop(view.untyped_storage().data_ptr(), None)
            if buf is not None:
                self.free.append(buf)
                if len(self.free) > MAX_LAG + 2:  # past a lag's worth: the smallest freed (by position)
                    self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].numel()))


_BUFFERS = SharedBuffers()  # this daemon's (one check process per daemon)
_kept: dict[int, Any] = {}  # in the check process: the buffers' storages, kept mapped across checks


class CheckProcess:
    """One process of this daemon (spawned at its first checked job, at idle priority) that judges the
    checks' audits (digests, decoding, recomputes): on a thread of the daemon they would hold its GIL
    against the driver's own stage and optimizer host (latency on every step), and compete at the
    same priority for cores. `urgent` lifts its priority while the driver waits for it."""

    _pool: Any = None
    _pid: int | None = None

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        CheckProcess._start()

    @staticmethod
    def _start() -> None:
        """The pool's process spawned, if none runs (at the first check, or after it broke)."""
        import concurrent.futures
        import multiprocessing

        if CheckProcess._pool is None:
            CheckProcess._pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_init
            )
            started = CheckProcess._pool.submit(_child_ready)  # starts it (and imports torch) now
            started.add_done_callback(
                lambda f: setattr(CheckProcess, "_pid", f.result() if not f.exception() else None)
            )

    def pack(self, tensors: dict[str, torch.Tensor]) -> Any:
        """`tensors` packed (verify.audit.pack_tensors) into a buffer of shared memory kept for
        the next checks once this one ended: handing a new buffer over costs a new shared-memory
        segment (created, filled, mapped by the check process) on every check."""
        from fusionnode.verify.audit import pack_tensors

        return pack_tensors(tensors, _BUFFERS.take)

    @staticmethod
    def give(packed: Any) -> None:
        """`pack`'s buffer back, unused (the check was cancelled while it was being packed)."""
        _BUFFERS.give(packed[0])

    async def __call__(self, audit: Any, packed: Any) -> str:
        import concurrent.futures

        loop = asyncio.get_running_loop()
        CheckProcess._start()
        pool = CheckProcess._pool
        try:
            return await loop.run_in_executor(pool, _child_check, self.job_id, audit, packed)
        except concurrent.futures.BrokenExecutor:
            if CheckProcess._pool is pool:  # the next check starts a new process (this one fails)
                CheckProcess._pool, CheckProcess._pid = None, None
                pool.shutdown(wait=False)
            raise
        finally:  # the check process is done with it (or never got it)
            _BUFFERS.give(packed[0])

    @contextlib.contextmanager
    def urgent(self) -> Any:
        """While the driver waits for the checks: the process at normal policy (if allowed)."""
        pid = CheckProcess._pid
        lifted = pid is not None and normal_priority(pid)
        try:
            yield
        finally:
            if lifted and pid is not None:
                idle_priority(pid)


def start(
    transport: Any,
    job_id: str,
    policy: Any,
    timeout_s: float,
    elsewhere: bool = True,
    verifier: str | None = None,
    warn: Any = None,
) -> Any:
    """The job's Verifier; `elsewhere`: its recomputes in the daemon's check process, or where
    `verifier` (`--verifier`: process, local or a verifier peer's id) says (train/verifier_peer.py;
    `warn(text)` when a verifier peer fails and its checks fall back to the check process)."""
    from fusionnode.train.verifier_peer import run_elsewhere as where
    from fusionnode.verify.verifier import Verifier

    run_elsewhere = where(transport, job_id, verifier, warn) if elsewhere and policy.on else None
    return Verifier(
        transport, job_id, policy, timeout_s=timeout_s, build_stage=_cpu_stage, run_elsewhere=run_elsewhere
    )


def summary(step_checks: Any, job: Any) -> dict[str, Any]:
    """The checks' totals for the job's result, and the secret their choices came from."""
    from fusionnode.train.verifier_peer import verifier_totals

    v = step_checks.v
    return {
        **v.policy.to_dict(),
        **v.totals,
        "deferred": step_checks.deferred(job),
        "wait_s": step_checks.wait_s,
        "commitment": v.selector.commitment,
        "secret": v.selector.reveal(),
        **verifier_totals(v.run_elsewhere),
    }


def _as_map(a: StageAssignment) -> dict[str, Any]:
    """What the verifier reads of a stage (it takes plain maps)."""
    return {
        "stage": a.stage,
        "pos": a.position,
        "num_stages": a.num_stages,
        "replica": a.replica,
        "peer": a.peer,
        "description": a.description,
        "send_specs": a.send_specs,
        "param_specs": a.param_specs,
        "frozen": a.frozen,
        "offload": a.offload,
        # the link codec the driver set: what the checks expect the stage to send (verify/lossy.py)
        "compress": str((a.spec or {}).get("compress") or "none"),
        "link_options": dict(a.link_options or {}),
        # --sync diloco|sparseloco: the worker steps its own inner optimizer, so the parameters it
        # computed with are its own (bound by its commitment), not the hosts'
        "rounds": bool(SyncConfig.from_dict(a.sync).rounds),
    }


class StepChecks:
    """The checks of one job's steps (one per run, `Run.checks`)."""

    def __init__(self, verifier: Any, placement: Any, membership: Any, step_timeout_s: float) -> None:
        self.v = verifier
        self.placement = placement
        self.membership = membership
        self.timeout_s = step_timeout_s
        self.last: dict[str, Any] | None = None  # what the last step's checks covered (its record)
        self.auditing: tuple[int, asyncio.Future] | None = None  # (step, its audits running)
        self.lagging: list[tuple[int, Any]] = []  # (step, Verdict) audited, recomputes maybe running
        self.wait_s = 0.0  # time steps waited for a background check to end (on the critical path)
        self.inner: Any = None  # --sync diloco|sparseloco: train/inner_checks.Transitions

    def before_step(self) -> None:
        self.v.start_step()

    def fed(self, stage: int, mb: int, part: str, msg: Any) -> None:
        self.v.record_fed(stage, mb, part, msg)

    def _micro_batches(self, job: Any) -> Any:
        return lambda a: job.pipelines[a["replica"]].micro_batches

    async def _params(self, job: Any, run: Any, stages: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """The values the stages should have computed with: the hosts' with offload; else each
        worker's own (bound by its commitment only)."""
        by_id = {a.stage: a for a in run.stage_args}
        wanted = [by_id[s["stage"]] for s in stages]
        if job.sync.rounds:  # each replica's own inner parameters, per stage (verify/inner.py)
            from fusionnode.train.inner_checks import fetch_stage
            from fusionnode.verify.inner import scoped

            out = dict(job.frozen)
            jid = job.spec.job_id
            parts = await asyncio.gather(
                *(fetch_stage(self.v.t, jid, a, "params", self.timeout_s) for a in wanted)
            )
            for a, got in zip(wanted, parts, strict=True):
                out.update({scoped(a.stage, n): t for n, t in got.items()})
            return out
        if job.offload:
            return await self.placement.current_params(job, wanted, run.host_of)
        out: dict[str, torch.Tensor] = dict(job.frozen)
        for a in wanted:
            out.update(await self.placement.fetch(job, [dataclasses.replace(a, replica=0)], "params"))
        return out

    def prefetch(self, job: Any, run: Any, step: int) -> None:
        stages = [_as_map(a) for a in run.stage_args]
        planned = self.v.planned(step, stages, self._micro_batches(job))
        self.v.prefetch(planned, lambda s: self._params(job, run, s))

    async def _pushed(self, job: Any, step: int) -> dict[str, dict[str, str]]:
        """contributor -> parameter -> digest of the gradient the hosts received from it."""
        replies = await asyncio.gather(
            *(
                jp.call(
                    self.v.t,
                    h,
                    Rpc.OPT_READY,
                    jp.OptReady(job=job.spec.job_id, step=step + 1, digests=True),
                    timeout=self.timeout_s + 5,
                    idempotent=True,
                )
                for h in job.hosts
            )
        )
        out: dict[str, dict[str, str]] = {}
        for r in replies:
            for contributor, names in (r.digests or {}).items():
                out.setdefault(contributor, {}).update(names)
        return out

    async def _device_kinds(self, stages: list[dict[str, Any]]) -> None:
        if any(s["peer"] not in self.v.device_kinds for s in stages):
            with contextlib.suppress(FusionNodeError, OSError, asyncio.TimeoutError):
                self.v.device_kinds = {p.peer_id: p.device.kind for p in await self.membership.peers()}

    async def _prepare(self, job: Any, run: Any, step: int, reports: list[Any]) -> Any:
        stages = [_as_map(a) for a in run.stage_args]
        await self._device_kinds(stages)
        prep = await self.v.prepare(
            step,
            stages,
            [r.to_wire() for r in reports],
            self._micro_batches(job),
            lambda s: self._params(job, run, s),
            check_grads=True,
        )
        self.last = {
            "step": step,
            "checked": {str(k): v for k, v in prep.verdict.plan.items()},
            "grads": prep.verdict.grads,
        }
        return prep

    def _finish(self, job: Any, prep: Any, lag: bool = False) -> Any:
        pushed = job.offload and not job.sync.rounds  # round modes push no gradients to the hosts
        return self.v.finish(prep, (lambda st: self._pushed(job, st)) if pushed else None, lag=lag)

    async def check(self, job: Any, run: Any, step: int, reports: list[Any], failed: type) -> None:
        """Checks the step now; raises `failed` (StepFailed) when a worker is caught or a dispute
        stands (the path without offload: the workers apply their own updates, nothing to roll back)."""
        prep = await self._prepare(job, run, step, reports)
        await self.judge(job, run, step, await self._finish(job, prep), failed)

    def inner_checks(self) -> Any:
        """The transition checks of a round mode's inner steps (made at first use)."""
        if self.inner is None:
            from fusionnode.train.inner_checks import Transitions

            self.inner = Transitions(self.v, self.timeout_s)
        return self.inner

    def deferred(self, job: Any) -> bool:
        """Whether this job's steps are checked while the next step runs (off the critical path): with
        offload, where the optimizer hosts keep the state before the last step and can roll it back;
        under a round mode, within a round (nothing leaves a worker before the round's close)."""
        return bool(job.offload)

    async def round_step(self, job: Any, run: Any, step: int, reports: list[Any], failed: type) -> None:
        """Under --sync diloco|sparseloco, before step `step`'s commit: the earlier steps' checks that
        ended (a lie found fails the step: recovery redoes the round from the hosts' parameters), the
        transition check of the step before (train/inner_checks.py), then this step's checks start
        and run on while the next steps do; a step closing a round waits for all of them (nothing
        unjudged leaves a worker)."""
        from fusionnode.verify.verifier import Verdict

        settled = await self.settle()
        if settled is not None:
            await self.judge(job, run, settled[0], settled[1], failed)
        caught = await self.inner_checks().check(job, run, step, reports)
        if caught:
            self.cancel()
            await self.judge(job, run, step, Verdict(caught=caught), failed)
        await self.launch(job, run, step, reports)
        if job.sync.round_closes(step, job.spec.steps):
            settled = await self.settle(everything=True)
            if settled is not None:
                await self.judge(job, run, settled[0], settled[1], failed)

    async def launch(self, job: Any, run: Any, step: int, reports: list[Any]) -> None:
        """Before the step's update: the draw and the checked stages' parameters; the audits then run
        in the background while the next step does, and the recomputes after them, for as long as
        they take (`settle` collects their verdicts)."""
        prep = await self._prepare(job, run, step, reports)
        self.auditing = (step, asyncio.ensure_future(self._finish(job, prep, lag=True)))

    def busy(self) -> bool:
        return self.auditing is not None or bool(self.lagging)

    async def settle(self, everything: bool = False) -> tuple[int, Any] | None:
        """(step, verdict) of the first checked step found wrong, None when none is: waits for the
        last step's audits (the workers keep two steps), judges the steps whose recomputes ended,
        and waits for the oldest while more than MAX_LAG steps are unjudged; with `everything`,
        for all of them (before a new mark, a checkpoint, a re-plan or the end of the job)."""
        t0 = time.perf_counter()
        try:
            if self.auditing is not None:
                step, task = self.auditing
                self.auditing = None
                self.lagging.append((step, await task))
            while self.lagging:
                step, verdict = self.lagging[0]
                if not (everything or verdict.done or len(self.lagging) > MAX_LAG):
                    break
                self.lagging.pop(0)
                if verdict.done:
                    await self.v.conclude(verdict)
                else:  # the step waits for the check process: at normal priority meanwhile
                    urgent = getattr(self.v.run_elsewhere, "urgent", contextlib.nullcontext)
                    with urgent():
                        await self.v.conclude(verdict)
                if not verdict.ok:
                    self.cancel()  # the steps after it are undone with it
                    return step, verdict
            return None
        finally:
            self.wait_s += time.perf_counter() - t0

    def cancel(self) -> None:
        """Forgets the checks still running (the steps they check are undone, or the hosts were
        restored from a checkpoint and the steps after it run again)."""
        if self.auditing is not None:
            self.auditing[1].cancel()
            self.auditing = None
        for _step, verdict in self.lagging:
            for _a, f in verdict.later:
                f.cancel()
        self.lagging = []

    async def judge(self, job: Any, run: Any, step: int, verdict: Any, failed: type) -> None:
        """Nothing when the step's checks passed; else the caught peers are out of the job (`caught`
        event, `run.gone`) and `failed(step, ...)` (StepFailed or its Rollback) is raised, blaming them."""
        if verdict.ok:
            return
        for peer, why in sorted(verdict.caught.items()):
            run.gone.add(peer)  # out of this job for good (recovery also bans it)
            await run.event(job, "caught", peer=peer, step=step, reason=why)
        if verdict.disputes and not verdict.caught:
            await run.event(job, "dispute", peer=None, step=step, reason="; ".join(verdict.disputes[:4]))
        raise failed(
            step,
            {
                p: [Failure(ErrorCode.BAD_TENSOR, f"verification: {why}", blame=p)]
                for p, why in verdict.caught.items()
            },
            [],
        )


__all__ = ["StepChecks", "job_policy", "start"]
