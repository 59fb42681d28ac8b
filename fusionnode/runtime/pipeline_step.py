"""One step of a stage's pipeline schedule on a worker (`job.step`): receive inputs or activations,
run forward and backward passes in the 1F1B order (runtime/schedule.py), send activations on and
gradients back through the stage's link compressors, push gradients to the optimizer hosts or
all-reduce them among the replicas, and report timings, losses and commitments.

Split from runtime/worker.py, whose `WorkerService` owns the stage jobs this function runs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from fusionnode.compress.link import LinkCompressor
from fusionnode.errors import PeerError
from fusionnode.optim.optimizers import FlatOptimizer
from fusionnode.runtime.schedule import DEFAULT_SCHEDULE, FORWARD, peak_in_flight, schedule
from fusionnode.runtime.stage import StageRunner
from fusionnode.runtime.stagejob import StageJob, mb_rows
from fusionnode.verify import inner
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked, tensor_message
from fusionnode.wire.job import ErrorCode, JobError, TensorKind
from fusionnode.wire.messages import TensorMessage


async def run_step(
    w: Any, sj: StageJob, step: int, m: int, mb_size: int, target_time_s: float | None
) -> jp.StepReport:
    loop = asyncio.get_running_loop()
    timeout = w.config.step_timeout_s
    module = sj.module
    losses: list[float] = []
    compute_s = wait_s = 0.0
    sends: list[asyncio.Task] = []
    t_start = time.perf_counter()
    ledger = sj.ledger

    send_failed: list[BaseException] = []

    def check_sent(task: asyncio.Task) -> None:
        # a send that failed would leave a neighbour waiting for its deadline: fail this step now
        if task.cancelled() or task.exception() is None or send_failed:
            return
        send_failed.append(task.exception())
        w.t.mailbox.fail_job(sj.job, PeerError(f"step {step} of stage {sj.stage}: {task.exception()}"))

    async def receive(kind: str, mb: int) -> tuple[TensorMessage, str]:
        nonlocal wait_s
        if send_failed:
            raise PeerError(f"step {step} of stage {sj.stage}: {send_failed[0]}")
        t0 = time.perf_counter()
        planned = {TensorKind.ACT: sj.prev, TensorKind.GRAD: sj.next}.get(kind, sj.driver)  # input, target
        out = await w.t.mailbox.get((kind, sj.job, step, mb, sj.stage), timeout, sender=planned)
        wait_s += time.perf_counter() - t0
        if ledger is not None:
            w._record_received(ledger, kind, mb, *out)
        return out

    def send(
        peer: str, kind: str, mb: int, stage: int, tensors: dict[str, torch.Tensor], link: LinkCompressor
    ) -> None:
        meta = {"job": sj.job, "step": step, "mb": mb, "stage": stage}
        # the link must carry one micro-batch's tensors in the time the slowest stage computes one
        target = target_time_s or (compute_s / max(1, f + b) if f + b else None)
        # the wire carries float32 activations and gradients whatever precision this device computes in
        tensors = {n: t.float() if t.is_floating_point() else t for n, t in tensors.items()}
        liar = w._liar()
        if liar is not None:
            tensors = liar.tamper(kind, sj.stage, step, mb, sj.is_last, tensors)
        enc = link.encode(tensors, step, kind, target, mb=mb)
        msg = TensorMessage(kind=kind, meta=meta, tensors=enc)
        if ledger is not None:  # the commitment travels with the tensors
            from fusionnode.verify.commitment import DIGEST_KEY

            meta[DIGEST_KEY] = ledger.record(mb, "out" if kind == "act" else "gout", msg)
        task = asyncio.ensure_future(w.t.send(peer, msg, observe=link.observe))
        task.add_done_callback(check_sent)
        sends.append(task)

    # the tested executor (runtime/stage.py) keeps each micro-batch's graph between its passes
    ops = list(schedule(DEFAULT_SCHEDULE, sj.num_stages, sj.pos, m))
    runner = StageRunner(
        module,
        max_in_flight=max(1, peak_in_flight(DEFAULT_SCHEDULE, sj.num_stages, sj.pos, m)),
        passthrough=sj.send_names,
        autocast=sj.autocast,
        zero_unused_grads=False,  # an input without a gradient is not sent back
    )
    rows: dict[int, int] = {}  # samples of each micro-batch in flight (for the pace hook)

    async def forward(mb: int) -> None:
        nonlocal compute_s
        if sj.is_first:
            msg, src = await receive(TensorKind.INPUT, mb)
            recv = decode_checked(msg, sj.recv_specs, mb_size, src)
        else:
            msg, src = await receive(TensorKind.ACT, mb)
            recv = decode_checked(msg, sj.recv_specs, mb_size, src)
        target = None
        if sj.is_last:
            tmsg, tsrc = await receive(TensorKind.TARGET, mb)
            target = decode_checked(tmsg, None, None, tsrc)["target"]

        def run() -> tuple[dict[str, torch.Tensor], float | None]:
            if target is not None:
                return {}, runner.forward_loss(mb, recv, target, loss_scale=1.0 / m)
            return runner.forward(mb, recv), None

        t0 = time.perf_counter()
        outs, loss_val = await loop.run_in_executor(w.executor, run)
        await w._hook_delay(time.perf_counter() - t0, sj.flops_per_sample * mb_rows(recv))
        compute_s += time.perf_counter() - t0
        rows[mb] = mb_rows(recv)
        if loss_val is not None:
            losses.append(loss_val)
        if not sj.is_last:
            send(sj.next, TensorKind.ACT, mb, sj.next_stage, {n: outs[n] for n in sj.send_names}, sj.fwd)

    async def backward(mb: int) -> None:
        nonlocal compute_s
        grads: dict[str, torch.Tensor] = {}
        if not sj.is_last:
            msg, src = await receive(TensorKind.GRAD, mb)
            specs = {n: sj.send_specs[n] for n in msg.tensors if n in sj.send_specs}
            if len(specs) != len(msg.tensors):
                raise JobError(
                    ErrorCode.BAD_TENSOR,
                    f"peer {src[:12]}… sent gradients for tensors this stage did not send",
                    src,
                )
            grads = decode_checked(msg, specs, mb_size, src)

        def run() -> dict[str, torch.Tensor]:
            return runner.backward_loss(mb) if sj.is_last else runner.backward(mb, grads)

        t0 = time.perf_counter()
        in_grads = await loop.run_in_executor(w.executor, run)
        await w._hook_delay(time.perf_counter() - t0, 2.0 * sj.flops_per_sample * rows.pop(mb, 0))
        compute_s += time.perf_counter() - t0
        if not sj.is_first:  # even with no gradient (only integer tensors came in): the previous
            # stage waits for this message to finish its backward
            send(sj.prev, TensorKind.GRAD, mb, sj.prev_stage, in_grads, sj.bwd)

    f = b = 0  # passes done so far (the links' target time is per pass)
    for op in ops:
        if op.kind == FORWARD:
            await forward(op.mb)
            f += 1
        else:
            await backward(op.mb)
            b += 1
    sent_bytes = sum(await asyncio.gather(*sends))
    optimizer_bytes = 0  # gradient bytes pushed to the optimizer hosts
    if sj.offload and not sj.sync.rounds:
        pushes, sj.push_tasks = sj.push_tasks, []
        optimizer_bytes += sum(await asyncio.gather(*pushes))
        missing = [n for n in sj.params if sj.grad_counts.get(n, 0) < m]
        if missing:  # parameters this step did not touch still owe the host a (zero) contribution
            for name in missing:
                w._push(sj, name, torch.zeros_like(sj.params[name]))
            pushes, sj.push_tasks = sj.push_tasks, []
            optimizer_bytes += sum(await asyncio.gather(*pushes))
        sent_bytes += optimizer_bytes
    ring_share: dict[str, float] = {}  # each replica reports 1/k of a ring's squared norm
    if sj.rings and not sj.offload and not sj.sync.rounds:
        sent_bytes += await w._allreduce(sj, step)
        ring_share = {n: 1.0 / len(r.members) for r in sj.rings for n in r.names}

    # gradients of parameters other stages also hold (tied weights) go to the driver to be summed
    shared = [] if sj.offload and not sj.sync.rounds else sorted(sj.shared_names & set(sj.params))
    if shared:
        g = {
            n: (sj.params[n].grad if sj.params[n].grad is not None else torch.zeros_like(sj.params[n]))
            for n in shared
        }
        sent_bytes += await w.t.send(
            sj.driver,
            tensor_message(
                TensorKind.SHARED_GRAD, {"job": sj.job, "step": step, "mb": -1, "stage": sj.stage}, g
            ),
        )
    if ledger is not None and sj.rounds is not None:  # the gradients its inner step is to apply
        ledger.extra.update(inner.commit_step_end(sj, ledger))
    own = [n for n, p in sj.params.items() if n not in sj.shared_names and p.grad is not None]
    sq = sum(
        FlatOptimizer.grad_sq_norm({n: sj.params[n].grad.detach() for n in own if ring_share.get(n) == w})
        * (w or 1.0)
        for w in {ring_share.get(n) for n in own}
    )
    return jp.StepReport(
        step=step,
        stage=sj.stage,
        losses=losses,
        compute_s=compute_s,
        wait_s=wait_s,
        total_s=time.perf_counter() - t_start,
        sent_bytes=sent_bytes,
        optimizer_bytes=optimizer_bytes,
        grad_sq=float(sq),
        links={"fwd": sj.fwd.counters(), "bwd": sj.bwd.counters()},
        verify=ledger.commitments() if ledger is not None else None,
    )
