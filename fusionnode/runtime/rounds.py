"""A stage's side of the --sync diloco|sparseloco rounds (issue 19), on a worker.

The stage keeps θ at the start of the round. When the driver's `job.commit` closes a round, the
stage sends Δ = θ_start − θ for the names it contributes (a tied parameter is sent by one stage of
the replica only) to the optimizer hosts that own them, as "pseudograd" data messages (SparseLoCo: through
the error feedback kept here), then pulls each host's update of every name it holds
(`opt.round_pull`), applies it to θ_start and installs the result: the next round's start.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from fusionnode.errors import PeerError
from fusionnode.optim.rounds import ReplicaSync, RoundUpdate, apply_update, pseudo_gradient
from fusionnode.sync import SyncConfig
from fusionnode.wire.messages import TensorMessage


class StageRounds:
    """θ_start of a stage's parameters and its replica's pseudo-gradient sender."""

    def __init__(self, cfg: SyncConfig, params: dict[str, torch.nn.Parameter]) -> None:
        self.cfg = cfg
        self.sender = ReplicaSync(cfg)
        self.start = {n: p.detach().to(torch.float32).clone() for n, p in params.items()}
        self.closed = -1  # the last round this stage closed

    async def close_round(self, worker: Any, sj: Any, info: dict[str, Any]) -> int:
        """Send this stage's share of round `info["id"]` and install the round's result; returns the
        bytes sent."""
        round_id = int(info["id"])
        if round_id <= self.closed:
            return 0  # a retried commit: this round is installed already
        off = sj.offload
        mine = [n for n in info.get("names", []) if n in sj.params]
        loop = asyncio.get_running_loop()

        def encode() -> dict[str, Any]:
            delta = pseudo_gradient({n: self.start[n] for n in mine}, {n: sj.params[n] for n in mine})
            return self.sender.encode(delta)

        encs = await loop.run_in_executor(worker.executor, encode)
        by_host: dict[str, dict[str, Any]] = {}
        for name, enc in encs.items():
            by_host.setdefault(off["hosts"][name], {})[name] = enc
        meta = {
            "job": sj.job,
            "step": round_id,
            "mb": -1,
            "stage": sj.stage,
            "replica": sj.replica,
            "tokens": float(info["tokens"]),
            "contributor": off["contributor"],
        }
        sent = sum(
            await asyncio.gather(
                *(worker.t.send(h, TensorMessage("pseudograd", meta, e)) for h, e in by_host.items())
            )
        )
        held: dict[str, list[str]] = {}
        for name in sorted(sj.params):
            held.setdefault(off["hosts"][name], []).append(name)
        timeout = worker.config.step_timeout_s

        async def pull(host: str, names: list[str]) -> None:
            first = off["host_index"][names[0]] << 24  # distinct mailbox keys per host
            res = await worker.t.call(
                host,
                "opt.round_pull",
                {
                    "job": sj.job,
                    "round": round_id,
                    "names": names,
                    "stage": sj.stage,
                    "timeout": timeout,
                    "first": first,
                },
                timeout=timeout + 5,
                idempotent=True,
            )
            got: dict[int, Any] = {}
            for idx in range(int(res["count"])):
                msg, _src = await worker.t.mailbox.get(
                    ("round_update", sj.job, round_id, first + idx, sj.stage), timeout, sender=host
                )
                got[idx] = msg
            update = RoundUpdate(round_id, str(res["mode"]), float(res["outer_lr"]))
            if update.mode == "diloco":
                for msg in got.values():
                    update.updates.update(msg.tensors)
            else:
                weights = [float(w) for w in res["weights"]]
                for r, w in enumerate(weights):
                    encs_r: dict[str, Any] = {}
                    for idx in range(len(names)):
                        encs_r.update(got[r * len(names) + idx].tensors)
                    update.relayed.append((w, encs_r))
            if set(names) - (set(update.updates) | {n for _, e in update.relayed for n in e}):
                raise PeerError(f"round {round_id}: host {host[:12]} did not send every name")
            await loop.run_in_executor(
                worker.executor, apply_update, {n: self.start[n] for n in names}, update
            )

        await asyncio.gather(*(pull(h, names) for h, names in held.items()))

        def install() -> None:
            with torch.no_grad():
                for name, p in sj.params.items():
                    p.copy_(self.start[name].to(p.dtype))

        await loop.run_in_executor(worker.executor, install)
        self.closed = round_id
        return sent
