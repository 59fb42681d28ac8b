"""The worker's side of spot-checks (issue 20, fusionnode/verify/): the ledger a checked step keeps
of its messages, and `job.audit`, which shows the driver the kept messages of the checked
micro-batches (and the gradients the stage pushed or computed). Mixed into
`runtime.worker.WorkerService`, which provides `t`, `executor`, `hook` and `_get`."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from fusionnode.runtime.stagejob import StageJob
from fusionnode.wire import job as jp
from fusionnode.wire.checked import tensor_message
from fusionnode.wire.job import ErrorCode, JobError, TensorKind
from fusionnode.wire.messages import TensorMessage


class StageAudit:
    t: Any
    executor: Any
    hook: Any
    _get: Any

    def _liar(self) -> Any:
        """The debug hook's liar (tests, `bench verify`; runtime/hooks.py), None in production."""
        return getattr(self.hook, "liar", None)

    async def _open_ledger(self, sj: StageJob, step: int, m: int) -> Any:
        from fusionnode.verify.commitment import digest_tensors
        from fusionnode.verify.ledger import Ledger

        digest = None  # with offload the driver checks against the optimizer hosts' values
        # else (and in a round mode, whose inner steps run here) only this worker holds them: it
        # commits to them
        if not sj.offload or sj.sync.rounds:
            named = sj.module.named_stage_parameters()
            digest = await asyncio.get_running_loop().run_in_executor(
                self.executor, lambda: digest_tensors({n: named[n] for n in sj.param_specs})
            )
        ledger = Ledger(step, m, digest, device=sj.device.type, autocast=sj.autocast)
        if sj.rounds is not None and sj.opt is not None:  # the inner optimizer's state (verify/inner.py)
            from fusionnode.verify.feedback import feedback_commit
            from fusionnode.verify.inner import commit_step_start

            ledger.extra.update(
                await asyncio.get_running_loop().run_in_executor(self.executor, commit_step_start, sj)
            )
            # sparseloco: its error feedback too (the round-end check's e_prev: verify/feedback.py)
            ledger.extra.update(feedback_commit(sj))
        return ledger

    async def rpc_audit(self, req: jp.AuditRequest, sender: str) -> jp.AuditReply:
        """Sends the driver the kept messages of the checked micro-batches of the last verified step,
        and with ``grads`` the parameter gradients it pushed, packed into as few ``audit`` messages as
        the wire limits allow (see fusionnode/verify/ledger.py)."""
        from fusionnode.verify.ledger import AUDIT_KIND, pack_audit

        sj = self._get(req, sender)
        step, mbs = req.step, req.mbs
        led = sj.ledgers.get(step)
        if led is None or led.step != step:
            raise JobError(ErrorCode.NOT_HELD, f"stage {sj.stage} kept no messages of step {step!r}")
        if not all(0 <= mb < led.micro_batches for mb in mbs):
            raise JobError(
                ErrorCode.BAD_REQUEST, f"mbs must be micro-batch indices below {led.micro_batches}"
            )
        grads = None
        if req.grads and led.pushed:  # with offload: what it pushed (its .grad may be the next step's)
            grads = dict(led.pushed)
        elif req.grads:
            # with a ring all-reduce: this stage's own gradients, as they were before the averaging
            own = led.own_grads or {}
            grads = {
                n: tensor_message(
                    TensorKind.AUDIT,
                    {},
                    {n: own.get(n, p.grad if p.grad is not None else torch.zeros_like(p))},
                ).tensors[n]
                for n, p in sj.params.items()
            }
        parts = {str(mb): led.parts(mb) for mb in sorted(set(mbs))}
        chunks = pack_audit(led, sorted(set(mbs)), grads)
        for idx, tensors in enumerate(chunks):
            meta = {"job": sj.job, "step": step, "mb": idx, "stage": sj.stage}
            await self.t.send(sj.driver, TensorMessage(AUDIT_KIND, meta, tensors))
        return jp.AuditReply(parts=parts, chunks=len(chunks))
