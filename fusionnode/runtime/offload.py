"""The worker's side of the optimizer hosts: each parameter's gradient pushed to its host the moment
backward has accumulated it (overlapping the rest of the backward pass), and the parameters pulled
back from the hosts between steps. A mixin of `WorkerService` (runtime/worker.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from fusionnode.runtime.stagejob import StageJob
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked, tensor_message
from fusionnode.wire.job import Rpc, TensorKind
from fusionnode.wire.messages import TensorMessage

MAX_CONCURRENT_PUSHES = 16  # gradient pushes in flight at once (hosts limit streams per peer)


class HostLink:
    """Gradient pushes and parameter pulls of a worker's offloaded stages (needs `t`, `config`,
    `executor`, `push_slots` and `_liar` from the worker)."""

    t: Any
    config: Any
    executor: Any
    push_slots: asyncio.Semaphore | None

    def _liar(self) -> Any:  # the worker's debug liar (verify/liar.py), None in production
        return None

    def _install_push_hooks(self, sj: StageJob, loop: asyncio.AbstractEventLoop) -> None:
        """Pushes each parameter's gradient to its optimizer host the moment the last micro-batch's
        backward has accumulated it, overlapping the push with the rest of the backward pass."""
        off = sj.offload
        assert off is not None

        def make_hook(name: str):
            def hook(p: torch.Tensor) -> None:
                sj.grad_counts[name] = sj.grad_counts.get(name, 0) + 1
                if sj.grad_counts[name] == sj.micro_batches_now:
                    grad = p.grad.detach().clone()
                    liar = self._liar()
                    if liar is not None and liar.kind == "random_pseudo_gradient":
                        grad = liar.pseudo_gradient(grad)
                    loop.call_soon_threadsafe(self._push, sj, name, grad)

            return hook

        for name, p in sj.params.items():
            p.register_post_accumulate_grad_hook(make_hook(name))

    def _push(self, sj: StageJob, name: str, grad: torch.Tensor) -> None:
        off = sj.offload
        meta = {
            "job": sj.job,
            "step": sj.step_now + 1,
            "mb": -1,
            "stage": sj.stage,
            "contributor": off.contributor,
            "samples": off.samples,
        }
        msg = tensor_message(TensorKind.PUSH, meta, {name: grad})
        if sj.ledger is not None:  # the host keeps the digest of what arrives, for the driver's checks
            from fusionnode.verify.commitment import COMMIT_KEY

            msg.meta[COMMIT_KEY] = True
            sj.ledger.pushed[name] = msg.tensors[name]  # shown to a gradient check of this step
        sj.push_tasks.append(asyncio.ensure_future(self._send_push(off.hosts[name], msg)))

    async def _send_push(self, host: str, msg: TensorMessage) -> int:
        """At most MAX_CONCURRENT_PUSHES pushes in flight (a host's per-peer stream limit)."""
        if self.push_slots is None:
            self.push_slots = asyncio.Semaphore(MAX_CONCURRENT_PUSHES)
        async with self.push_slots:
            return await self.t.send(host, msg)

    async def _pull(self, sj: StageJob, step: int) -> None:
        """Fetches this stage's parameters from their optimizer hosts and installs them."""
        off = sj.offload
        by_host: dict[str, list[str]] = {}
        for name in sorted(sj.params):
            by_host.setdefault(off.hosts[name], []).append(name)
        timeout = self.config.step_timeout_s

        async def one(host: str, names: list[str], first: int) -> dict[str, torch.Tensor]:
            req = jp.OptPull(job=sj.job, names=names, tag=step, stage=sj.stage, first=first)
            # a read: at worst its parameters arrive twice
            res = await jp.call(self.t, host, Rpc.OPT_PULL, req, timeout=timeout, idempotent=True)
            got: dict[str, torch.Tensor] = {}
            for idx in range(first, first + res.count):
                msg, src = await self.t.mailbox.get(
                    (TensorKind.PULLED, sj.job, step, idx, sj.stage), timeout, sender=host
                )
                got.update(decode_checked(msg, {n: sj.param_specs[n] for n in names}, None, src))
            return got

        firsts, first = [], 0
        for names in by_host.values():  # each host numbers its messages from its own first index
            firsts.append(first)
            first += len(names)
        parts = await asyncio.gather(
            *(one(h, names, f) for (h, names), f in zip(by_host.items(), firsts, strict=True))
        )
        values = {k: v for part in parts for k, v in part.items()}

        def install() -> None:
            with torch.no_grad():
                for name, p in sj.params.items():
                    p.copy_(values[name])
                    p.grad = None

        await asyncio.get_running_loop().run_in_executor(self.executor, install)
