"""The optimizer-host service: the network face of a `ParameterStore` (LuWu-style offload).

A job's driver names the hosts and gives each a shard of the parameters (by
name, balanced by bytes). Workers push each parameter's gradient as a ``push``
data message as soon as their backward produces it, keyed (job, step, replica,
stage, name): a retried push is not counted twice. The driver asks every host
whether the step is complete (``opt.ready``: waits for the contributions or the
step deadline, returns the shard's squared gradient norm for global clipping),
then ``opt.apply``; workers then ``opt.pull`` the new parameters. Hosts write
their shard to disk every N steps and resume from the last complete one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import torch

from fusionnode.errors import PeerError
from fusionnode.optim.checkpoint import load_latest_shard, save_shard
from fusionnode.optim.optimizers import job_optimizer_config
from fusionnode.optim.store import Contributor, ExpectedContributions, ParameterStore
from fusionnode.runtime.transport import Transport
from fusionnode.runtime.worker import decode_checked, tensor_message
from fusionnode.security.guard import BanList, GuardConfig, NormBound
from fusionnode.wire.messages import TensorMessage
from fusionnode.wire.tensors import decode_tensor

logger = logging.getLogger(__name__)

READY_POLL_S = 0.005  # seconds between checks of a step's completeness
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
    ):
        self.job = job
        self.driver = driver
        self.store = store
        self.specs = specs
        self.peers = peers  # contributor key -> the peer id allowed to push for it
        self.save_dir = save_dir
        self.save_every = save_every
        self.host_index = host_index
        self.rejected: dict[str, int] = {}


class OptimizerHostService:
    def __init__(
        self,
        transport: Transport,
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
        for name, fn in {
            "opt.init": self.rpc_init,
            "opt.ready": self.rpc_ready,
            "opt.apply": self.rpc_apply,
            "opt.pull": self.rpc_pull,
            "opt.release": self.rpc_release,
            "opt.replan": self.rpc_replan,
        }.items():
            transport.add_rpc(name, fn)
        transport.on_data("push", self._on_push)

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

    def _shard(self, args: dict[str, Any], sender: str, *, driver_only: bool = True) -> HostedShard:
        shard = self.shards.get(str(args.get("job")))
        if shard is None:
            raise PeerError(f"this host holds no shard of job {args.get('job')!r}")
        if driver_only and sender != shard.driver:
            raise PeerError("only the job's driver may do that")
        return shard

    async def rpc_init(self, args: dict[str, Any], sender: str) -> dict[str, Any]:
        job = str(args["job"])
        if args.get("driver") != sender:
            raise PeerError("a shard must be assigned by the job's driver")
        held = self.shards.get(job)
        if held is not None and held.driver != sender:
            raise PeerError(f"job {job!r} here belongs to another driver")
        specs: dict[str, dict[str, Any]] = args["param_specs"]
        expected = ExpectedContributions(
            {
                name: {key: Contributor(str(c["replica"]), int(c["samples"])) for key, c in contribs.items()}
                for name, contribs in args["expected"].items()
            }
        )
        peers = {key: c["peer"] for contribs in args["expected"].values() for key, c in contribs.items()}
        params: dict[str, torch.Tensor] = {}
        for idx in range(len(specs)):
            msg, src = await self.t.mailbox.get(
                ("opt_params", job, -1, idx, int(args["host_index"])), self.step_deadline_s
            )
            params.update(decode_checked(msg, specs, None, src))
        cfg = job_optimizer_config(args["spec"], specs)
        store = ParameterStore(
            job,
            params,
            cfg,
            expected,
            step_deadline_s=float(args.get("step_deadline_s", self.step_deadline_s)),
        )
        save_dir = Path(args["save_dir"]) if args.get("save_dir") else self.state_dir / "optim"
        resumed = 0
        if args.get("resume"):
            found = await asyncio.to_thread(load_latest_shard, save_dir, job, f"h{args['host_index']}")
            if found is not None:
                resumed, state = found
                store.load_state_dict(state)
        self.shards[job] = HostedShard(
            job,
            sender,
            store,
            specs,
            peers,
            save_dir,
            int(args.get("save_every", 0)),
            int(args["host_index"]),
        )
        return {"ready": True, "applied_step": store.applied_step, "resumed": resumed}

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
                self.norms.record((shard.job, name), norm)
            elif not res.accepted and not res.duplicate:
                if res.reason in BANNABLE:
                    self._offence(shard, sender, res.reason, f"{name} as {enc.dtype}{list(enc.shape)}")
                    return
                logger.warning("push of %s from %s rejected: %s", name, sender[:12], res.reason)

    async def rpc_ready(self, args: dict[str, Any], sender: str) -> dict[str, Any]:
        """Waits until every expected contribution of the step arrived, or its deadline passed."""
        shard = self._shard(args, sender)
        step = int(args["step"])
        deadline = time.monotonic() + float(args.get("timeout", self.step_deadline_s))
        while not shard.store.ready(step) and time.monotonic() < deadline:
            await asyncio.sleep(READY_POLL_S)
        complete = shard.store.ready(step)
        return {
            "complete": complete,
            "grad_sq": shard.store.pending_grad_sq_norm(step),
            "missing": {k: list(v) for k, v in shard.store.missing(step).items()} if not complete else {},
        }

    async def rpc_apply(self, args: dict[str, Any], sender: str) -> dict[str, Any]:
        shard = self._shard(args, sender)
        step = int(args["step"])
        force = bool(args.get("force", False))
        res = await asyncio.to_thread(
            shard.store.apply,
            step,
            float(args["lr"]),
            force=force,
            clip_coef=float(args.get("clip_coef", 1.0)),
        )
        if shard.save_every and step % shard.save_every == 0:
            try:
                await asyncio.to_thread(
                    save_shard, shard.save_dir, shard.job, f"h{shard.host_index}", step, shard.store
                )
            except OSError as exc:  # the previous checkpoint stays intact; training goes on
                logger.error("could not write the optimizer shard checkpoint of step %d: %s", step, exc)
        return {
            "applied": res.applied,
            "step": res.step,
            "forced": res.forced,
            "updated": len(res.updated),
            "missing": list(res.missing),
            "counters": dict(shard.store.counters),
            "rejected": shard.rejected,
        }

    async def rpc_pull(self, args: dict[str, Any], sender: str) -> dict[str, Any]:
        """Sends the requested parameters, one message each, to the caller (any worker of the plan)."""
        shard = self._shard(args, sender, driver_only=False)
        if sender not in set(shard.peers.values()) and sender != shard.driver:
            raise PeerError("only the job's workers may pull its parameters")
        names = [str(n) for n in args["names"]]
        unknown = [n for n in names if n not in shard.specs]
        if unknown:
            raise PeerError(f"this host does not hold {unknown[:3]}")
        step, values = await asyncio.to_thread(shard.store.get_params, names)
        tag = int(args.get("tag", 0))
        for idx, name in enumerate(names):
            meta = {
                "job": shard.job,
                "step": tag,
                "mb": idx,
                "stage": int(args.get("stage", -1)),
                "host": shard.host_index,
            }
            await self.t.send(sender, tensor_message(f"pulled{shard.host_index}", meta, {name: values[name]}))
        return {"count": len(names), "step": step}

    async def rpc_replan(self, args: dict[str, Any], sender: str) -> dict[str, Any]:
        """The driver adopted a new plan: new contributors (and the peers allowed to push for them);
        pending contributions are dropped so a replayed step is applied once, under the new plan."""
        shard = self._shard(args, sender)
        expected = ExpectedContributions(
            {
                name: {key: Contributor(str(c["replica"]), int(c["samples"])) for key, c in contribs.items()}
                for name, contribs in args["expected"].items()
            }
        )
        dropped = shard.store.replan(expected)
        shard.peers = {
            key: c["peer"] for contribs in args["expected"].values() for key, c in contribs.items()
        }
        return {"applied_step": shard.store.applied_step, "dropped": dropped}

    async def rpc_release(self, args: dict[str, Any], sender: str) -> dict[str, Any]:
        shard = self._shard(args, sender)
        self.shards.pop(shard.job, None)
        self.norms.forget(lambda k: k[0] == shard.job)
        self.t.mailbox.drop_job(shard.job)
        return {"released": True}
