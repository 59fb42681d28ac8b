"""A stage's side of the --sync diloco|sparseloco rounds (issue 19), on a worker.

The stage keeps θ at the start of the round. When the driver's `job.commit` closes a round, the
stage sends Δ = θ_start − θ for the names it contributes (a tied parameter is sent by one stage of
the replica only) to the optimizer hosts that own them, as "pseudograd" data messages (SparseLoCo: through
the error feedback kept here), then pulls each host's update of every name it holds
(`opt.round_pull`), applies it to θ_start and installs the result: the next round's start.

With `SyncConfig.overlap` (`--sync-overlap`) the commit only snapshots the round (θ_end) and sends
Δ = θ_start − θ_end: its exchange runs as a task while the next round's inner steps go on from the
stage's own parameters. After D = `overlap_steps` of them (the commit of the round's D-th step; D = H:
the next close) the stage awaits it, θ_global its result, and re-bases: θ ← θ_global + (θ − θ_end),
θ_start ← θ_global (the inner progress since the round's end is kept). The job's last round is
exchanged and installed before its commit answers (`round.final`). `train/replicas.py` does the
same in one process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fusionnode.errors import PeerError
from fusionnode.optim.rounds import (
    ReplicaSync,
    RoundError,
    RoundUpdate,
    apply_update,
    own_message,
    pseudo_gradient,
)
from fusionnode.sync import SyncConfig
from fusionnode.verify.feedback import keep_before_fold
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked
from fusionnode.wire.job import ErrorCode, JobError, Rpc, TensorKind
from fusionnode.wire.messages import TensorMessage
from fusionnode.wire.tensors import pack_encoded


def _lie(worker: Any, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The debug liar's random pseudo-gradient in place of the honest one (tests and `bench verify`
    only: verify/liar.py; production has no hook, so no liar)."""
    liar = getattr(getattr(worker, "hook", None), "liar", None)
    if liar is None or liar.kind != "random_pseudo_gradient":
        return delta
    return {n: liar.pseudo_gradient(d) for n, d in delta.items()}


class StageRounds:
    """θ_start of a stage's parameters and its replica's pseudo-gradient sender."""

    def __init__(self, cfg: SyncConfig, params: dict[str, torch.nn.Parameter]) -> None:
        self.cfg = cfg
        self.sender = ReplicaSync(cfg)
        self.start = {n: p.detach().to(torch.float32).clone() for n, p in params.items()}
        self.closed = -1  # the last round this stage closed
        # sparseloco: the last round folded into the error feedback, and the accumulators as they were
        # before that fold (round, copy): what a checkpoint of the round before is given while this
        # stage closes the next (`feedback_state`); the lock keeps a fetch out of a fold under way
        self.folded = -1
        self.fb_before: tuple[int, dict[str, torch.Tensor]] | None = None
        self.fb_lock = threading.Lock()
        # --sync-overlap: θ_global of the last round installed, θ_end of the round under way, its exchange
        self.glob = {n: t.clone() for n, t in self.start.items()} if cfg.overlap else {}
        self.end: dict[str, torch.Tensor] = {}
        self.pending: asyncio.Task | None = None
        # the exchange's encode and update run in their own thread, beside the stage's compute (the
        # worker's executor): a paced device's idle time, not its next step's, pays for them
        self.side = ThreadPoolExecutor(1, thread_name_prefix="rounds") if cfg.overlap else None

    def cancel(self) -> None:
        """Stops an exchange still under way (the job ends or the stage is dropped)."""
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
        if self.side is not None:
            self.side.shutdown(wait=False, cancel_futures=True)

    def feedback_state(self, round_id: int = -1) -> dict[str, torch.Tensor]:
        """SparseLoCo: the error-feedback accumulators of the names this stage sends (none before its
        first round; diloco keeps none), as they are (`round_id` -1) or as they were once the stage
        had folded round `round_id` in: the last round folded, or the one before (a checkpoint of
        rounds closed by time is taken after round q's record, when a stage may be closing q + 1)."""
        fb = self.sender.feedback
        if fb is None:
            return {}
        with self.fb_lock:
            if round_id >= 0 and self.fb_before is not None and self.fb_before[0] == round_id:
                return dict(self.fb_before[1])
            if round_id < 0 or round_id == self.folded:
                return {n: t.clone() for n, t in fb.acc.items()}
        raise JobError(
            ErrorCode.NOT_HELD,
            f"no error feedback of round {round_id} (the stage folded round {self.folded} in last)",
        )

    def _fold(self, round_id: int, delta: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Round `round_id`'s pseudo-gradient encoded (sparseloco: folded into the error feedback, a
        copy of the accumulators before kept)."""
        if self.sender.feedback is None:
            return self.sender.encode(delta)
        with self.fb_lock:
            self.fb_before = (round_id - 1, {n: t.clone() for n, t in self.sender.feedback.acc.items()})
            encs = self.sender.encode(delta)
            self.folded = round_id
        return encs

    async def load_feedback(self, worker: Any, sj: Any, count: int) -> None:
        """Takes the `count` error-feedback tensors the driver sent before `job.start` (a resumed job)."""
        fb = self.sender.feedback
        if fb is None or not 0 < count <= len(sj.params):
            raise JobError(
                ErrorCode.BAD_REQUEST, f"{count} error-feedback tensors for a stage that takes none"
            )
        state: dict[str, torch.Tensor] = {}
        for idx in range(count):
            msg, src = await worker.t.mailbox.get(
                (TensorKind.FEEDBACK, sj.job, -1, idx, sj.stage),
                worker.config.step_timeout_s,
                sender=sj.driver,
            )
            state.update(decode_checked(msg, sj.param_specs, None, src))
        fb.load_state_dict(state)

    async def after_step(
        self, worker: Any, sj: Any, step: int, info: dict[str, Any] | None
    ) -> dict[str, list[int]]:
        """After inner step `step`'s commit: close the round `info` names, or (--sync-overlap) apply
        the previous round's update when `step` is the round's D-th; per host [sent, received]."""
        if info:
            return await self.close_round(worker, sj, info)
        if self.pending is not None and self.cfg.applies_delayed(step):
            return await self._settle(worker, sj)
        return {}

    async def _settle(self, worker: Any, sj: Any) -> dict[str, list[int]]:
        """--sync-overlap: awaits the exchange under way (θ_global is then its round's result) and
        re-bases: θ ← θ_global + (θ − θ_end), θ_start ← θ_global."""
        task, self.pending = self.pending, None
        assert task is not None
        counted = await task

        def rebase() -> None:
            with torch.no_grad():
                for name, p in sj.params.items():
                    p.copy_((self.glob[name] + (p.detach().to(torch.float32) - self.end[name])).to(p.dtype))
                    self.start[name] = self.glob[name].clone()

        await asyncio.get_running_loop().run_in_executor(worker.executor, rebase)
        return counted

    async def close_round(self, worker: Any, sj: Any, info: dict[str, Any]) -> dict[str, list[int]]:
        """Send this stage's share of round `info["id"]` (`CommitRequest.round`) and install the
        round's result; returns, per host, [bytes sent to it, bytes of encoded tensors received from it]."""
        round_id = int(info["id"])
        if round_id <= self.closed:
            return {}  # a retried commit: this round is installed already
        if self.cfg.overlap:
            return await self._close_overlapped(worker, sj, info, round_id)
        mine = [n for n in info.get("names", []) if n in sj.params]
        loop = asyncio.get_running_loop()

        def encode() -> dict[str, Any]:
            delta = pseudo_gradient({n: self.start[n] for n in mine}, {n: sj.params[n] for n in mine})
            keep_before_fold(sj, round_id)  # sparseloco, checked: e_prev for the round-end check
            return self._fold(round_id, _lie(worker, delta))

        encs = await loop.run_in_executor(worker.executor, encode)
        counted = await self._exchange(worker, sj, info, round_id, encs, self.start)

        def install() -> None:
            with torch.no_grad():
                for name, p in sj.params.items():
                    p.copy_(self.start[name].to(p.dtype))

        await loop.run_in_executor(worker.executor, install)
        self.closed = round_id
        return counted

    async def _close_overlapped(
        self, worker: Any, sj: Any, info: dict[str, Any], round_id: int
    ) -> dict[str, list[int]]:
        """--sync-overlap: apply the previous round's update if still due, send this round's Δ and
        start its exchange as a task (the last round's: awaited and installed)."""
        loop = asyncio.get_running_loop()
        counted = await self._settle(worker, sj) if self.pending is not None else {}
        mine = [n for n in info.get("names", []) if n in sj.params]

        def snapshot() -> dict[str, torch.Tensor]:
            self.end = {n: p.detach().to(torch.float32).clone() for n, p in sj.params.items()}
            return pseudo_gradient({n: self.start[n] for n in mine}, {n: self.end[n] for n in mine})

        delta = await loop.run_in_executor(worker.executor, snapshot)
        glob = self.glob

        async def exchange() -> dict[str, list[int]]:
            encs = await loop.run_in_executor(self.side, self._fold, round_id, _lie(worker, delta))
            return await self._exchange(worker, sj, info, round_id, encs, glob, self.side)  # θ_global

        self.closed = round_id
        self.pending = loop.create_task(exchange())
        if not info.get("final"):
            return counted
        for h, (a, b) in (await self._settle(worker, sj)).items():
            c = counted.setdefault(h, [0, 0])
            c[0] += a
            c[1] += b
        return counted  # θ = θ_global: the stage's parameters were θ_end, not moved since

    async def _exchange(
        self,
        worker: Any,
        sj: Any,
        info: dict[str, Any],
        round_id: int,
        encs: dict[str, Any],
        base: dict[str, torch.Tensor],
        executor: Any = None,
    ) -> dict[str, list[int]]:
        """Sends round `round_id`'s encoded pseudo-gradients and applies every host's update of the
        names this stage holds to `base` in place (in `executor`, default the worker's); returns, per
        host, [bytes sent, bytes received]."""
        off = sj.offload
        loop = asyncio.get_running_loop()
        by_host: dict[str, dict[str, Any]] = {}
        for name, enc in encs.items():
            by_host.setdefault(off.hosts[name], {})[name] = enc
        meta = {
            "job": sj.job,
            "step": round_id,
            "mb": -1,
            "stage": sj.stage,
            "replica": sj.replica,
            "tokens": float(info["tokens"]),  # informational: the host weighs by the plan
            "contributor": off.contributor,
        }
        hosts = sorted({off.hosts[n] for n in sj.params})
        counted = {h: [0, 0] for h in hosts}
        sent = await asyncio.gather(
            *(worker.t.send(h, TensorMessage(TensorKind.PSEUDOGRAD, meta, e)) for h, e in by_host.items())
        )
        for h, n in zip(by_host, sent, strict=True):
            counted[h][0] += n
        held: dict[str, list[str]] = {}
        for name in sorted(sj.params):
            held.setdefault(off.hosts[name], []).append(name)
        timeout = worker.config.step_timeout_s
        mode, outer_lr = self.cfg.mode, self.cfg.outer_lr

        async def pull(host: str, names: list[str]) -> None:
            first = off.host_index[names[0]] << 24  # distinct mailbox keys per host
            kept = [n for n in names if n in encs] if mode == "sparseloco" else []  # it sent those
            req = jp.OptRoundPull(
                job=sj.job,
                round=round_id,
                names=names,
                stage=sj.stage,
                first=first,
                replica=sj.replica,
                kept=kept,
            )
            res = await jp.call(worker.t, host, Rpc.OPT_ROUND_PULL, req, timeout=timeout + 5, idempotent=True)
            got: list[Any] = []
            for idx in range(res.count):
                msg, _src = await worker.t.mailbox.get(
                    (TensorKind.ROUND_UPDATE, sj.job, round_id, first + idx, sj.stage), timeout, sender=host
                )
                counted[host][1] += sum(len(pack_encoded(e)) for e in msg.tensors.values())
                got.append(msg)
            update = RoundUpdate(round_id, mode, outer_lr)
            # diloco: one message holding u of every name; sparseloco: one message per replica
            # holding its pseudo-gradient of every name, its weight in the meta
            if mode == "diloco":
                if res.count != 1:
                    raise PeerError(f"round {round_id}: host {host[:12]} sent {res.count} updates, not 1")
                update.updates.update(got[0].tensors)
            else:
                if res.count < 1:
                    raise PeerError(f"round {round_id}: host {host[:12]} relayed no replica's message")
                owns = sum(msg.meta.get("own") is True for msg in got)
                if owns > 1:
                    raise PeerError(f"round {round_id}: host {host[:12]} sent {owns} own messages")
                for msg in got:
                    weight = msg.meta.get("weight")
                    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not weight > 0:
                        raise PeerError(
                            f"round {round_id}: host {host[:12]} sent a bad weight {weight!r:.40}"
                        )
                    if (
                        msg.meta.get("own") is True
                    ):  # this replica's message: the names it sent, from what it sent
                        try:
                            msg = dataclasses.replace(msg, tensors=own_message(encs, msg.tensors, names))
                        except RoundError as exc:
                            raise PeerError(f"round {round_id}: host {host[:12]}: {exc}") from None
                    if set(msg.tensors) != set(names):
                        raise PeerError(
                            f"round {round_id}: host {host[:12]} relayed a message without every name"
                        )
                    update.relayed.append((float(weight), dict(msg.tensors)))
            if set(names) - (set(update.updates) | {n for _, e in update.relayed for n in e}):
                raise PeerError(f"round {round_id}: host {host[:12]} did not send every name")
            await loop.run_in_executor(
                executor or worker.executor, apply_update, {n: base[n] for n in names}, update
            )

        await asyncio.gather(*(pull(h, names) for h, names in held.items()))
        return counted
