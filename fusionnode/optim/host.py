"""The optimizer-host service: the network face of a `ParameterStore` (LuWu-style offload).

A job's driver names the hosts and gives each a shard of the parameters (by
name, balanced by bytes). Workers push each parameter's gradient as a ``push``
data message as soon as their backward produces it, keyed (job, step, replica,
stage, name): a retried push is not counted twice. The driver asks every host
whether the step is complete (``opt.ready``: waits for the contributions or the
step deadline, returns the shard's squared gradient norm for global clipping),
then ``opt.apply``; workers then ``opt.pull`` the new parameters. A shard is set
up in two calls: ``opt.init`` announces it (from then on the driver's ``opt_params``
messages for it are accepted), ``opt.load`` builds it from them. Hosts write their
shard every N steps (and at the steps the driver checkpoints) under their own state
directory, in a directory of the job's owner (SECURITY.md, "Job authority"); a resume
loads the step the driver names: the newest one every host of the job has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from fusionnode.optim.checkpoint import drop_shards_after, load_shard, save_shard, shard_steps
from fusionnode.optim.contributions import Contributor, ExpectedContributions
from fusionnode.optim.host_rounds import READY_POLL_S, HostRounds, _data_bytes
from fusionnode.optim.optimizers import job_optimizer_config
from fusionnode.optim.rounds import RoundCombiner, RoundUpdate
from fusionnode.optim.store import ParameterStore, StepOrderError
from fusionnode.security.guard import BanList, GuardConfig, NormBound
from fusionnode.security.limits import MAILBOX_SLACK_BYTES, MAX_SHARDS_PER_DRIVER
from fusionnode.sync import SyncConfig
from fusionnode.verify.commitment import COMMIT_KEY, digest_encoded
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked, tensor_message
from fusionnode.wire.job import ErrorCode, JobError, Rpc, TensorKind
from fusionnode.wire.messages import TensorMessage
from fusionnode.wire.tensors import decode_tensor

logger = logging.getLogger(__name__)

_SAFE_JOB = re.compile(r"^[A-Za-z0-9._-]{1,200}$")  # job ids usable as a directory name
BANNABLE = frozenset({"rejected_shape", "rejected_dtype", "rejected_nonfinite"})  # store refusals = hostile


class HostedShard:
    def __init__(
        self,
        job: str,
        driver: str,
        store: ParameterStore,
        specs: dict[str, dict[str, Any]],
        peers: dict[str, str],
        save_dir: Path | None,
        save_every: int,
        host_index: int,
        owner: dict[str, str] | None = None,
    ):
        self.job = job
        self.owner = owner or {"driver": driver, "tag": owner_tag(None, driver)}
        self.driver = driver
        self.store = store
        self.specs = specs
        self.peers = peers  # contributor key -> the peer id allowed to push for it
        self.save_dir = save_dir
        self.save_every = save_every
        self.host_index = host_index
        self.rejected: dict[str, int] = {}
        # step -> contributor -> name -> digest of the gradient pushed (pushes that carry one: the
        # job's work is spot-checked, fusionnode/verify/); the driver reads them with opt.ready
        self.push_digests: dict[int, dict[str, dict[str, str]]] = {}
        self.received_bytes = 0  # cumulative bytes of the job's data messages this host accepted
        self.sent_bytes = 0  # cumulative bytes this host sent as an optimizer host (pulls, round updates)
        # --sync diloco|sparseloco (issue 19): the rounds of this shard's names, closed updates by round id
        self.rounds: RoundCombiner | None = None
        self.replica_of: dict[str, int] = {}  # contributor key -> its replica, from the plan
        self.replica_samples: dict[int, int] = {}  # samples per step of each replica, from the plan
        self.round_updates: dict[int, RoundUpdate] = {}
        self.saves: set[asyncio.Task[None]] = set()  # round checkpoints being written


@dataclasses.dataclass
class _PendingShard:
    """A shard announced by `opt.init`, waiting for its parameters and `opt.load`."""

    job: str
    driver: str
    args: jp.OptInit
    specs: dict[str, dict[str, Any]]
    expected: ExpectedContributions
    peers: dict[str, str]
    root: Path
    owner: dict[str, str]
    host_index: int
    params: dict[str, torch.Tensor] | None = None


def owner_tag(secret: str | None, driver: str) -> str:
    """The name of an owner's shard directory: a hash of the job secret, else of the driver's peer id."""
    what = f"secret:{secret}" if secret is not None else f"peer:{driver}"
    return hashlib.sha256(b"fusionnode-job-owner\0" + what.encode()).hexdigest()[:32]


def _expected(expected: dict[str, dict[str, dict[str, Any]]]) -> ExpectedContributions:
    return ExpectedContributions(
        {
            name: {key: Contributor(str(c["replica"]), int(c["samples"])) for key, c in contribs.items()}
            for name, contribs in expected.items()
        }
    )


def _spec_bytes(specs: Any) -> int:
    if not isinstance(specs, dict):
        raise JobError(ErrorCode.BAD_REQUEST, "param_specs must be a map")
    total = 0
    for name, spec in specs.items():
        shape = spec.get("shape") if isinstance(spec, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise JobError(ErrorCode.BAD_REQUEST, f"param_specs[{name!r}]: bad shape")
        total += 4 * math.prod(shape)
    return total


class HostMailbox(Protocol):
    """The inbox part of `HostTransport`."""

    def accept(self, job: str, holder: Any, peers: Any, max_bytes: int) -> None: ...

    def release(self, job: str, holder: Any) -> None: ...

    async def get(self, key: tuple, timeout: float, *, sender: str) -> tuple[TensorMessage, str]: ...


class HostTransport(Protocol):
    """What the optimizer host needs of a transport (`fusionnode.runtime.transport.Transport` is one;
    optim/ does not import the runtime)."""

    @property
    def mailbox(self) -> HostMailbox: ...

    def add_rpc(
        self, method: str, handler: Callable[[dict[str, Any], str], Awaitable[dict[str, Any]]]
    ) -> None: ...

    async def send(
        self, peer_id: str, msg: TensorMessage, observe: Callable[[int, float], None] | None = None
    ) -> int: ...


class OptimizerHostService(HostRounds):
    def __init__(
        self,
        transport: HostTransport,
        *,
        state_dir: Path,
        step_deadline_s: float = 60.0,
        guard: GuardConfig = GuardConfig(),
    ):
        self.t = transport
        self.norms = NormBound(guard)  # keyed (job, parameter name)
        self.bans = BanList(guard)
        self.state_dir = state_dir
        self.step_deadline_s = step_deadline_s
        self.shards: dict[str, HostedShard] = {}
        self._pending: dict[str, _PendingShard] = {}
        for name, fn in {
            Rpc.OPT_INIT: self.rpc_init,
            Rpc.OPT_LOAD: self.rpc_load,
            Rpc.OPT_HELD: self.rpc_held,
            Rpc.OPT_READY: self.rpc_ready,
            Rpc.OPT_APPLY: self.rpc_apply,
            Rpc.OPT_PULL: self.rpc_pull,
            Rpc.OPT_RELEASE: self.rpc_release,
            Rpc.OPT_REPLAN: self.rpc_replan,
            Rpc.OPT_ROUND_PULL: self.rpc_round_pull,
            Rpc.OPT_ROUND_HELD: self.rpc_round_held,
            Rpc.OPT_ROUND_VERDICT: self.rpc_round_verdict,
            Rpc.OPT_ROLLBACK: self.rpc_rollback,
        }.items():
            jp.serve(transport, name, fn)
        transport.on_data(TensorKind.PUSH, self._on_push)
        transport.on_data(TensorKind.PSEUDOGRAD, self._on_round)

    def status(self) -> list[dict[str, Any]]:
        return [
            {
                "job": s.job,
                "params": len(s.specs),
                "applied_step": s.store.applied_step,
                "counters": dict(s.store.counters),
                "security": self.security_status(),
            }
            for s in self.shards.values()
        ]

    def security_status(self) -> dict[str, Any]:
        """Offences by kind, peers banned now (and why), pushes dropped from banned peers."""
        return self.bans.status()

    def _offence(self, shard: HostedShard, sender: str, kind: str, detail: str) -> None:
        length = self.bans.ban(sender, kind, detail)
        shard.rejected[kind] = shard.rejected.get(kind, 0) + 1
        logger.warning(
            "SECURITY: peer %s pushed a hostile gradient for job %s (%s: %s); banned for %.0f s",
            sender,
            shard.job,
            kind,
            detail,
            length,
        )

    def _shard(self, job: str, sender: str, *, driver_only: bool = True) -> HostedShard:
        shard = self.shards.get(job)
        if shard is None:
            raise JobError(ErrorCode.NOT_HELD, f"this host holds no shard of job {job!r}")
        if driver_only and sender != shard.driver:
            raise JobError(ErrorCode.FORBIDDEN, "only the job's driver may do that")
        return shard

    # ---- a shard's life: opt.init (announce) -> opt_params messages -> opt.load ----------------------
    def owner_root(self, tag: str) -> Path:
        """Where the shards of one owner live: always under this host's own state directory."""
        return self.state_dir / "optim" / tag

    def _other_owners(self, job: str, tag: str) -> bool:
        base = self.state_dir / "optim"
        if not base.is_dir() or not _SAFE_JOB.match(job) or job in (".", ".."):
            return False
        return any(d.name != tag and (d / job).is_dir() for d in base.iterdir())

    async def rpc_init(self, a: jp.OptInit, sender: str) -> jp.OptInitReply:
        """Announces a shard (its names, shapes, contributors): the driver's ``opt_params`` messages for
        it are accepted from now on, then ``opt.load`` builds it. With "resume", answers the steps of
        this owner's checkpoints of the shard; none if another driver's are all this host has is an
        error. Ownership: the owner tag is a hash of the job secret the driver keeps in its own
        checkpoint (or, without one, of the driver's peer id), so no other peer can read, continue or
        overwrite the shard's checkpoints."""
        job = a.job
        if a.driver != sender:
            raise JobError(ErrorCode.FORBIDDEN, "a shard must be assigned by the job's driver")
        held = self.shards.get(job) or self._pending.get(job)
        if held is not None and held.driver != sender:
            if not (
                a.resume and a.secret is not None and held.owner.get("tag") == owner_tag(a.secret, sender)
            ):
                raise JobError(ErrorCode.FORBIDDEN, f"job {job!r} here belongs to another driver")
            # the job's owner resumes it from another peer (it holds the job secret, from the driver's
            # checkpoint): the old driver's shard in memory goes; its checkpoints are what resume reads
            logger.info(
                "job %s resumed by its owner from peer %s: dropping the old driver's shard", job, sender
            )
            self._release(job)
        mine = {j for j, s in (*self.shards.items(), *self._pending.items()) if s.driver == sender} - {job}
        if len(mine) >= MAX_SHARDS_PER_DRIVER:
            raise JobError(
                ErrorCode.NO_ROOM,
                f"this host holds {len(mine)} shards of that driver (limit {MAX_SHARDS_PER_DRIVER})",
            )
        tag = owner_tag(a.secret, sender)
        specs: dict[str, dict[str, Any]] = a.param_specs
        nbytes = _spec_bytes(specs)
        host_index = a.host_index
        expected = _expected(a.expected)
        peers = {key: c["peer"] for contribs in a.expected.values() for key, c in contribs.items()}
        root = self.owner_root(tag)
        steps: list[int] = []
        if a.resume:
            steps = await asyncio.to_thread(shard_steps, root, job, f"h{host_index}")
            if not steps and await asyncio.to_thread(self._other_owners, job, tag):
                raise JobError(
                    ErrorCode.FORBIDDEN,
                    f"the checkpoints of job {job!r} on this host belong to another driver (resuming "
                    "needs the job secret in the owner's checkpoint, or the owner's identity)",
                )
        if held is not None and job in self.shards:  # the same driver again (a host restore): rebuild
            self._release(job)
        self._pending[job] = _PendingShard(
            job=job,
            driver=sender,
            args=a,
            specs=specs,
            expected=expected,
            peers=peers,
            root=root,
            owner={"driver": sender, "tag": tag},
            host_index=host_index,
        )
        self.t.mailbox.accept(job, ("host",), {sender}, nbytes + MAILBOX_SLACK_BYTES)
        return jp.OptInitReply(announced=True, steps=steps)

    async def rpc_held(self, req: jp.OptHeld, sender: str) -> jp.OptHeldReply:
        """The caller's own checkpoints of a job here: {host index: [steps]} (by its job secret)."""
        job, secret = req.job, req.secret
        if not 16 <= len(secret) <= 256 or not _SAFE_JOB.match(job):
            raise JobError(ErrorCode.BAD_REQUEST, f"{Rpc.OPT_HELD} needs a job id and the job secret")
        base = self.owner_root(owner_tag(secret, sender)) / job
        if job in (".", "..") or not base.is_dir():
            return jp.OptHeldReply(held={})
        held = {}
        for d in base.iterdir():
            if d.name[:1] == "h" and d.name[1:].isdigit():
                steps = await asyncio.to_thread(shard_steps, base.parent, job, d.name)
                if steps:
                    held[d.name[1:]] = steps
        return jp.OptHeldReply(held=held)

    async def rpc_load(self, req: jp.OptLoad, sender: str) -> jp.OptLoadReply:
        """Builds the announced shard from the driver's ``opt_params`` (taken once), then, with a
        "resume_step", loads this owner's checkpoint of that step."""
        job = req.job
        pend = self._pending.get(job)
        if pend is None:
            self._shard(job, sender)  # no shard here, or not the driver's: says so
            raise JobError(ErrorCode.NOT_HELD, f"the shard of job {job!r} is loaded already (init first)")
        if sender != pend.driver:
            raise JobError(ErrorCode.FORBIDDEN, "only the job's driver may do that")
        a = pend.args
        if pend.params is None:
            params: dict[str, torch.Tensor] = {}
            for idx in range(len(pend.specs)):
                msg, src = await self.t.mailbox.get(
                    (TensorKind.OPT_PARAMS, job, -1, idx, pend.host_index),
                    self.step_deadline_s,
                    sender=pend.driver,
                )
                params.update(decode_checked(msg, pend.specs, None, src))
            if set(params) != set(pend.specs):
                raise JobError(
                    ErrorCode.BAD_TENSOR,
                    f"parameters missing: {sorted(set(pend.specs) - set(params))[:5]}",
                    pend.driver,
                )
            pend.params = params
        cfg = job_optimizer_config(a.spec, pend.specs)
        sync = SyncConfig.from_dict(a.sync)
        store = ParameterStore(
            job,
            dict(pend.params),
            cfg,
            pend.expected,
            step_deadline_s=self.step_deadline_s if a.step_deadline_s is None else a.step_deadline_s,
            clip=None if sync.rounds else (a.contrib or {}).get("clip"),  # --contrib-policy clip, per step
        )
        resumed = 0
        step = req.resume_step
        state: dict[str, Any] = {}
        if step is not None:
            state = await asyncio.to_thread(
                load_shard, pend.root, job, f"h{pend.host_index}", int(step), pend.owner["tag"]
            )
            store.load_state_dict(state)
            resumed = int(step)
        elif req.start_step:  # no common checkpoint: the driver's parameters, new optimizer state
            store.start_at(req.start_step)
        del self._pending[job]
        self.shards[job] = HostedShard(
            job,
            sender,
            store,
            pend.specs,
            pend.peers,
            pend.root,
            a.save_every,
            pend.host_index,
            owner=pend.owner,
        )
        if sync.rounds:
            shard = self.shards[req.job]
            shard.rounds = RoundCombiner(sync, a.replicas, set(pend.specs))
            self._set_contrib(shard, a.contrib)
            self._plan_replicas(shard, pend.expected)
            # the outer state: from the shard checkpoint when it holds it, else new (the parameters
            # came from the driver's checkpoint, or the job starts), the ledger at the store's step
            if "rounds" in state:
                shard.rounds.load_state(*state["rounds"])
            else:
                shard.rounds.start_at(sync.rounds_before(store.applied_step))
            if sync.round_start(shard.rounds.round) != store.applied_step:
                raise JobError(
                    ErrorCode.BAD_REQUEST,
                    f"step {store.applied_step} is not a round boundary of --inner-steps {sync.inner_steps}",
                )
        return jp.OptLoadReply(ready=True, applied_step=store.applied_step, resumed=resumed)

    def _on_push(self, msg: TensorMessage, sender: str) -> None:
        m = msg.meta
        shard = self.shards.get(str(m.get("job")))
        if shard is None:
            return
        key = str(m.get("contributor", ""))
        if shard.peers.get(key) != sender:
            shard.rejected["not_in_plan"] = shard.rejected.get("not_in_plan", 0) + 1
            logger.warning("push for %s from %s, which the plan does not name; rejected", key, sender[:12])
            return
        if self.bans.is_banned(sender):
            self.bans.dropped_while_banned += 1
            return
        if m.get(COMMIT_KEY) is True and not self._record_digest(shard, msg, key):
            return
        shard.received_bytes += _data_bytes(msg)
        for name, enc in msg.tensors.items():
            try:
                grad = decode_tensor(enc)
            except Exception as exc:
                self._offence(shard, sender, "undecodable", str(exc)[:200])
                return
            spec = shard.specs.get(name)
            if spec is not None and tuple(grad.shape) == tuple(spec["shape"]) and grad.is_floating_point():
                norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
                why = self.norms.check((shard.job, name), norm)
                if why is not None and "non-finite" not in why:  # non-finite: the store's check counts it
                    self._offence(shard, sender, "grad_norm", f"{name}: {why}")
                    return
            else:
                norm = None
            res = shard.store.push(int(m["step"]), key, name, grad, int(m.get("samples", 0)), owned=True)
            if res.accepted and norm is not None:
                self.norms.record((shard.job, name), norm, int(m["step"]))
            elif not res.accepted and not res.duplicate:
                if res.reason in BANNABLE:
                    self._offence(shard, sender, res.reason, f"{name} as {enc.dtype}{list(enc.shape)}")
                    return
                logger.warning("push of %s from %s rejected: %s", name, sender[:12], res.reason)

    def _record_digest(self, shard: HostedShard, msg: TensorMessage, key: str) -> bool:
        """A push marked as committed (its job is spot-checked): the digest of what arrived is kept
        for the driver, which compares it with the gradient the worker shows when checked."""
        if len(msg.tensors) != 1:
            shard.rejected["commit_malformed"] = shard.rejected.get("commit_malformed", 0) + 1
            return False
        digest = digest_encoded(msg.tensors)
        step = int(msg.meta.get("step", -1))
        # the last applied step's stay: its checks run while the next step pushes
        for old in [s for s in shard.push_digests if s < shard.store.applied_step]:
            del shard.push_digests[old]
        shard.push_digests.setdefault(step, {}).setdefault(key, {})[next(iter(msg.tensors))] = digest
        return True

    async def rpc_ready(self, req: jp.OptReady, sender: str) -> jp.OptReadyReply:
        """Waits until every expected contribution of the step arrived, or its deadline passed."""
        shard = self._shard(req.job, sender)
        step = req.step
        deadline = time.monotonic() + (self.step_deadline_s if req.timeout is None else req.timeout)
        while not shard.store.ready(step) and time.monotonic() < deadline:
            await asyncio.sleep(READY_POLL_S)
        complete = shard.store.ready(step)
        return jp.OptReadyReply(
            complete=complete,
            grad_sq=float(shard.store.pending_grad_sq_norm(step)),
            missing={k: list(v) for k, v in shard.store.missing(step).items()} if not complete else {},
            digests=shard.push_digests.get(step, {}) if req.digests else None,
        )

    async def rpc_apply(self, req: jp.OptApply, sender: str) -> jp.OptApplyReply:
        shard = self._shard(req.job, sender)
        step = req.step
        res = await asyncio.to_thread(
            functools.partial(
                shard.store.apply,
                step,
                req.lr,
                force=req.force,
                clip_coef=req.clip_coef,
                keep=req.keep,
                mark=req.mark,
            )
        )
        if (req.save or (shard.save_every and step % shard.save_every == 0)) and res.applied:
            try:
                await asyncio.to_thread(
                    functools.partial(save_shard, owner=shard.owner),
                    shard.save_dir,
                    shard.job,
                    f"h{shard.host_index}",
                    step,
                    shard.store,
                )
            except OSError as exc:  # the previous checkpoint stays intact; training goes on
                logger.error("could not write the optimizer shard checkpoint of step %d: %s", step, exc)
        return jp.OptApplyReply(
            applied=res.applied,
            step=res.step,
            forced=res.forced,
            updated=len(res.updated),
            missing=list(res.missing),
            counters=dict(shard.store.counters),
            rejected=dict(shard.rejected),
            **self._bytes(shard),
        )

    async def rpc_pull(self, req: jp.OptPull, sender: str) -> jp.OptPullReply:
        """Sends the requested parameters, one `pulled` message each numbered from `first`, to the
        caller (any worker of the plan)."""
        shard = self._shard(req.job, sender, driver_only=False)
        if sender not in set(shard.peers.values()) and sender != shard.driver:
            raise JobError(ErrorCode.FORBIDDEN, "only the job's workers may pull its parameters")
        names = req.names
        unknown = [n for n in names if n not in shard.specs]
        if unknown:
            raise JobError(ErrorCode.NOT_HELD, f"this host does not hold {unknown[:3]}")
        step, values = await asyncio.to_thread(shard.store.get_params, names)
        for idx, name in enumerate(names):
            meta = {
                "job": shard.job,
                "step": req.tag,
                "mb": req.first + idx,
                "stage": req.stage,
                "host": shard.host_index,
            }
            shard.sent_bytes += await self.t.send(
                sender, tensor_message(TensorKind.PULLED, meta, {name: values[name]})
            )
        return jp.OptPullReply(count=len(names), step=step)

    async def local_params(
        self, job: str, names: list[str], specs: dict[str, dict[str, Any]]
    ) -> dict[str, torch.Tensor]:
        """What `rpc_pull` sends, for the driver in this same process (optim/client.py `pull`):
        copies of the current values, each in the shape `specs` gives."""
        shard = self._shard(job, self.t.peer_id)
        unknown = [n for n in names if n not in shard.specs]
        if unknown:
            raise JobError(ErrorCode.NOT_HELD, f"this host does not hold {unknown[:3]}")
        _step, values = await asyncio.to_thread(shard.store.get_params, names)
        for name in names:
            if list(values[name].shape) != list(specs[name]["shape"]):
                raise JobError(ErrorCode.BAD_TENSOR, f"{name!r} is held as {list(values[name].shape)}")
        return values

    def _bytes(self, shard: HostedShard) -> dict[str, int]:
        """Cumulative bytes of the job this host received (its data messages) and sent."""
        return {"received_bytes": shard.received_bytes, "sent_bytes": shard.sent_bytes}

    async def rpc_rollback(self, req: jp.OptRollback, sender: str) -> jp.OptRollbackReply:
        """Back to the kept state (`opt.apply` with `keep` or `mark`): a spot-check found a lie since,
        so the driver replays from there without the liar; the shard's checkpoints of later steps go."""
        shard = self._shard(req.job, sender)
        try:
            undone = await asyncio.to_thread(shard.store.rollback, req.step)
        except StepOrderError as exc:
            raise JobError(ErrorCode.BAD_REQUEST, str(exc)) from None
        for s in [s for s in shard.push_digests if s > req.step]:
            del shard.push_digests[s]
        # the undone steps' norms go too: their replay records them again (security/guard.py)
        self.norms.forget_steps(lambda k: k[0] == shard.job, shard.store.applied_step + 1)
        if undone and shard.save_dir is not None:
            # the shard checkpoints written since (at apply, before those steps' checks were judged)
            # hold the undone steps: a host restored from one would bring the lie back
            await asyncio.to_thread(
                drop_shards_after, shard.save_dir, shard.job, f"h{shard.host_index}", req.step
            )
        return jp.OptRollbackReply(applied_step=shard.store.applied_step, undone=undone)

    async def rpc_replan(self, req: jp.OptReplan, sender: str) -> jp.OptReplanReply:
        """The driver adopted a new plan: new contributors (and the peers allowed to push for them);
        pending contributions are dropped so a replayed step is applied once, under the new plan."""
        shard = self._shard(req.job, sender)
        expected = _expected(req.expected)
        dropped = shard.store.replan(expected)
        # the dropped pushes' norms: the replayed step records them again (security/guard.py)
        self.norms.forget_steps(lambda k: k[0] == shard.job, shard.store.applied_step + 1)
        shard.peers = {key: c["peer"] for contribs in req.expected.values() for key, c in contribs.items()}
        if shard.rounds is not None:
            # the open round is redone by the new plan's stages: its contributions so far are dropped
            # (a closed round stays closed, its id refused: no round is applied twice)
            if shard.rounds.drop_pending():
                dropped = [*dropped, shard.store.applied_step + 1]
            self._plan_replicas(shard, expected)
        return jp.OptReplanReply(applied_step=shard.store.applied_step, dropped=list(dropped))

    async def rpc_release(self, req: jp.OptRelease, sender: str) -> jp.ReleaseReply:
        pend = self._pending.get(req.job)
        if pend is not None and pend.driver == sender and req.job not in self.shards:
            self._release(pend.job)
            return jp.ReleaseReply(released=True)
        shard = self._shard(req.job, sender)
        if shard.saves:  # a round's checkpoint being written: a resume reads it
            await asyncio.gather(*shard.saves, return_exceptions=True)
        self._release(shard.job)
        return jp.ReleaseReply(released=True)

    def _release(self, job: str) -> None:
        self.shards.pop(job, None)
        self._pending.pop(job, None)
        self.norms.forget(lambda k: k[0] == job)
        self.t.mailbox.release(job, ("host",))
