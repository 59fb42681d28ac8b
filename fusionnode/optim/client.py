"""The driver's client of its optimizer hosts: shard them, load or resume them, apply steps, pull parameters.

The other side of `optim/host.py`, over the typed messages of `wire/job.py`. It knows hosts, shards
and parameter names, not pipelines or stages (the driver computes who contributes what), so the
optimizer package does not import `train/`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from fusionnode.errors import PeerError, PlanError
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked, tensor_message
from fusionnode.wire.job import Rpc, TensorKind

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # seconds a host has to answer `opt.held`

Expected = dict[
    str, dict[str, dict[str, Any]]
]  # parameter name -> contributor key -> {replica, samples, peer}


@dataclass(frozen=True)
class Shards:
    """Where each trained parameter lives: its host's peer id and that host's index."""

    host_of: dict[str, str]
    host_index: dict[str, int]


def shard(full: dict[str, torch.Tensor], hosts: list[str]) -> Shards:
    """Parameters over `hosts`, balanced by bytes (optim/sharding.py)."""
    from fusionnode.optim.sharding import shard_params

    host_of = shard_params({n: t.numel() * 4 for n, t in full.items()}, hosts)
    index = {h: i for i, h in enumerate(hosts)}
    return Shards(host_of, {n: index[h] for n, h in host_of.items()})


@dataclass
class Applied:
    """What one step's application on the hosts gave: the global gradient norm, the clip factor,
    and each host's counters (accepted and rejected pushes, with reasons)."""

    grad_norm: float
    clip: float
    counters: list[dict[str, Any]]


class OptimizerClient:
    """One driver's calls to the optimizer hosts of its jobs."""

    def __init__(self, transport: Any, step_timeout_s: float):
        self.t = transport
        self.step_timeout_s = step_timeout_s
        self._tags = itertools.count(1)  # pull tags of the driver's own parameter fetches
        # this peer's own optimizer host service (node.py), when it has one: a pull from it reads
        # its store directly instead of sending each tensor to itself as a message
        self.local: Any = None

    async def holders(self, candidates: list[str], job_id: str, secret: str, n: int) -> list[str] | None:
        """On resume: the candidates that hold the job's shards (host index i at position i), when they
        hold a shard for each of the n indices (the newest checkpoint of each index wins); else None."""
        req = jp.OptHeld(job=job_id, secret=secret)
        res = await asyncio.gather(
            *(jp.call(self.t, c, Rpc.OPT_HELD, req, timeout=PROBE_TIMEOUT_S) for c in candidates),
            return_exceptions=True,
        )
        best: dict[int, tuple[int, str]] = {}
        for peer, r in zip(candidates, res, strict=True):
            if isinstance(r, jp.OptHeldReply):
                for idx, steps in r.held.items():
                    if str(idx).isdigit() and steps:
                        best[int(idx)] = max(best.get(int(idx), (-1, "")), (max(int(x) for x in steps), peer))
        chosen = [best[i][1] for i in range(n) if i in best]
        if len(chosen) == n and len(set(chosen)) == len(chosen):
            return chosen
        return None

    async def init(
        self,
        job_id: str,
        secret: str,
        spec: dict[str, Any],
        save_every: int,
        hosts: list[str],
        full: dict[str, torch.Tensor],
        host_of: dict[str, str],
        expected: Expected,
        *,
        resume: bool,
        start_step: int | None,
        sync: dict[str, Any] | None = None,
        replicas: int = 1,
        contrib: dict[str, Any] | None = None,
    ) -> tuple[list[int], bool]:
        """Gives each host its shard (opt.init, the parameters, opt.load); returns the hosts' applied
        steps and whether they started with new optimizer state. With `resume`, every host loads its
        checkpoint of the newest step that all of them have (an older one if that fails to load);
        with none, the hosts start from `full` at `start_step` with new optimizer state (None: that
        is an error)."""
        names_of = {h: sorted(n for n, hh in host_of.items() if hh == h) for h in hosts}
        timeout = self.step_timeout_s

        async def announce(i: int, host: str) -> list[int]:
            names = names_of[host]
            req = jp.OptInit(
                job=job_id,
                driver=self.t.peer_id,
                secret=secret,
                host_index=i,
                spec=spec,
                param_specs={n: {"shape": list(full[n].shape), "dtype": "float32"} for n in names},
                expected={n: expected[n] for n in names},
                step_deadline_s=self.step_timeout_s,
                save_every=save_every,
                resume=resume,
                sync=sync,  # --sync (issue 19): a round mode closes rounds on the host
                replicas=replicas,
                contrib=contrib,  # --contrib-policy: the rounds' norm floor, held for the driver's verdict
            )
            return (await jp.call(self.t, host, Rpc.OPT_INIT, req, timeout=timeout)).steps

        async def load(i: int, host: str, step: int | None) -> int:
            for idx, name in enumerate(names_of[host]):
                meta = {"job": job_id, "stage": i, "step": -1, "mb": idx}
                await self.t.send(host, tensor_message(TensorKind.OPT_PARAMS, meta, {name: full[name]}))
            fresh = start_step if step is None and start_step else None
            req = jp.OptLoad(job=job_id, resume_step=step, start_step=fresh)
            return (await jp.call(self.t, host, Rpc.OPT_LOAD, req, timeout=timeout)).applied_step

        indexed = list(enumerate(hosts))
        steps = await asyncio.gather(*(announce(i, h) for i, h in indexed))
        common = sorted(set.intersection(*(set(x) for x in steps)), reverse=True) if resume and steps else []
        if resume and len({tuple(x) for x in steps}) > 1:
            logger.warning(
                "the optimizer hosts keep different checkpoint steps %s; using %s", steps, common[:1]
            )
        for n, step in enumerate([*common, None]):
            if step is None and start_step is None:
                raise PlanError(f"the optimizer hosts have no checkpoint step in common ({steps})")
            if n > 0:  # a load failed: announce again (each host builds its shard anew)
                await asyncio.gather(*(announce(i, h) for i, h in indexed))
            try:
                applied = list(await asyncio.gather(*(load(i, h, step) for i, h in indexed)))
                fresh = resume and step is None
                if fresh:
                    logger.warning(
                        "job %s: no optimizer checkpoint common to all hosts; they start from the "
                        "driver's step-%s checkpoint with new optimizer state",
                        job_id,
                        start_step,
                    )
                return applied, fresh
            except PeerError as exc:
                if step is None:
                    raise
                logger.warning("optimizer hosts could not load their step-%d checkpoint: %s", step, exc)
        raise AssertionError("unreachable")

    async def apply(
        self,
        job_id: str,
        hosts: list[str],
        step: int,
        lr: float,
        grad_clip: float | None,
        save: bool,
        keep: bool = False,
        mark: bool = False,
    ) -> Applied:
        """Waits for the hosts to have every contribution of `step` (the stores count from 1), clips
        globally, applies; `save`: the hosts checkpoint their shards at this step; `keep`: they keep
        the state before it, so that `rollback` can undo it."""
        ready = await asyncio.gather(
            *(
                jp.call(
                    self.t,
                    h,
                    Rpc.OPT_READY,
                    jp.OptReady(job=job_id, step=step),
                    timeout=self.step_timeout_s + 5,
                    idempotent=True,
                )
                for h in hosts
            )
        )
        for h, r in zip(hosts, ready, strict=True):
            if not r.complete:
                logger.warning(
                    "step %d: host %s applies without %s (deadline passed)", step - 1, h[:12], r.missing
                )
        grad_norm = math.sqrt(sum(r.grad_sq for r in ready))
        clip = 1.0 if grad_clip is None else min(1.0, grad_clip / (grad_norm + 1e-6))
        applied = await asyncio.gather(
            *(
                jp.call(
                    self.t,
                    h,
                    Rpc.OPT_APPLY,
                    jp.OptApply(
                        job=job_id,
                        step=step,
                        lr=lr,
                        clip_coef=clip,
                        force=not r.complete,
                        save=save,
                        keep=keep,
                        mark=mark,
                    ),
                    timeout=self.step_timeout_s,
                    idempotent=True,  # a host re-applying an applied step answers with the earlier result
                )
                for h, r in zip(hosts, ready, strict=True)
            )
        )
        counters = [
            {
                "host": h,
                **res.counters,
                "rejected": res.rejected,
                "received_bytes": res.received_bytes,  # cumulative (issue 19)
                "sent_bytes": res.sent_bytes,
            }
            for h, res in zip(hosts, applied, strict=True)
        ]
        return Applied(grad_norm, clip, counters)

    async def rollback(self, job_id: str, hosts: list[str], step: int) -> bool:
        """Every host back to the state after `step` (the stores' count): the step after it, applied
        with `keep`, is undone, or every step since the mark when `step` is the marked one. Returns
        whether any host undid a step."""
        replies = await asyncio.gather(
            *(
                jp.call(
                    self.t,
                    h,
                    Rpc.OPT_ROLLBACK,
                    jp.OptRollback(job=job_id, step=step),
                    timeout=self.step_timeout_s,
                    idempotent=True,  # a second rollback to the same step answers undone=False
                )
                for h in hosts
            )
        )
        return any(r.undone for r in replies)

    async def pull(
        self, job_id: str, hosts: list[str], host_of: dict[str, str] | None, specs: dict[str, dict[str, Any]]
    ) -> dict[str, torch.Tensor]:
        """The current values of the parameters `specs` names, from their hosts."""
        out: dict[str, torch.Tensor] = {}
        for host in hosts:
            names = sorted(n for n in specs if (host_of or {}).get(n, host) == host)
            if not names:
                continue
            if host == self.t.peer_id and self.local is not None:
                out.update(await self.local.local_params(job_id, names, specs))
                continue
            tag = -next(self._tags)  # distinct from any pull a worker makes (those are step numbers)
            req = jp.OptPull(job=job_id, names=names, tag=tag, stage=-1)
            res = await jp.call(self.t, host, Rpc.OPT_PULL, req, timeout=self.step_timeout_s, idempotent=True)
            for idx in range(res.count):
                msg, src = await self.t.mailbox.get(
                    (TensorKind.PULLED, job_id, tag, idx, -1), self.step_timeout_s, sender=host
                )  # exactly the name asked for at this index, in its shape
                out.update(decode_checked(msg, {names[idx]: specs[names[idx]]}, None, src))
        return out

    async def replan(
        self, job_id: str, hosts: list[str], host_of: dict[str, str], expected: Expected
    ) -> list[int]:
        """Points the hosts at a new plan's contributors (their pending contributions are dropped);
        returns each host's applied step (under --sync diloco|sparseloco: the steps its closed rounds
        cover, the round ledger)."""
        replies = await asyncio.gather(
            *(
                jp.call(
                    self.t,
                    h,
                    Rpc.OPT_REPLAN,
                    jp.OptReplan(job=job_id, expected={n: expected[n] for n in expected if host_of[n] == h}),
                    timeout=self.step_timeout_s,
                )
                for h in hosts
            )
        )
        return [r.applied_step for r in replies]

    def release(self, job_id: str, hosts: list[str]) -> list[Any]:
        """The calls that drop the job's shards (to be gathered with the workers' releases)."""
        return [jp.call(self.t, h, Rpc.OPT_RELEASE, jp.OptRelease(job=job_id), timeout=5) for h in hosts]
