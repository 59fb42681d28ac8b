"""The cheap plan change: a job's batch shares moved between its pipelines at a step boundary, no
stage released and no parameter moved (`Recovery.maybe_rebalance` tries it before re-placing the
job). Split from train/recovery.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from fusionnode.optim.client import OptimizerClient
from fusionnode.train.layout import activation_bytes
from fusionnode.train.placement import PING_TIMEOUT_S, expected
from fusionnode.train.state import Job, Pipeline, Run
from fusionnode.wire import job as jp
from fusionnode.wire.job import Rpc

logger = logging.getLogger(__name__)


async def move_shares(
    transport: Any, hosts: OptimizerClient, job: Job, run: Run, shares: list[int], *, reason: str
) -> bool:
    """Moves the batch shares between pipelines at a step boundary, the cheap move: no stage is
    released and no parameter moves; each stage is told its pipeline's new samples per step and
    memory need (`job.resize`: the activations scale with the micro-batch size), the optimizer
    hosts the contributors' new sample counts (`opt.replan`: nothing is pending between steps).
    False when a stage refuses (no room for the larger micro-batches, or gone): the stages are told
    the old shares back, and the caller must re-place the job (`adopt`), which also clears a stage
    that missed that revert."""
    t0 = time.perf_counter()
    graph = run.traced.graph
    old = [dataclasses.replace(p) for p in job.pipelines]
    new = [dataclasses.replace(p, samples=int(n)) for p, n in zip(job.pipelines, shares, strict=True)]
    if any(p.samples < p.micro_batches or p.samples % p.micro_batches for p in new):
        raise ValueError(f"batch shares {shares} do not split into the pipelines' micro-batches")

    def weights(pipes: list[Pipeline]) -> list[float]:  # offload off: the rings' (pipeline order)
        return [p.samples / sum(q.samples for q in pipes) for p in pipes]

    def resized(pipes: list[Pipeline]) -> list[Any]:
        out = []
        for a in run.stage_args:
            delta = activation_bytes(graph, pipes[a.replica], a.pos) - activation_bytes(
                graph, old[a.replica], a.pos
            )
            offload = {**a.offload, "samples": pipes[a.replica].samples} if a.offload else None
            rings = [{**r, "weights": weights(pipes)} for r in a.allreduce] if a.allreduce else None
            out.append(
                dataclasses.replace(
                    a, need_bytes=max(0, a.need_bytes + delta), offload=offload, allreduce=rings
                )
            )
        return out

    async def tell(args: list[Any], pipes: list[Pipeline]) -> list[Any]:
        return await asyncio.gather(
            *(
                jp.call(
                    transport,
                    a.peer,
                    Rpc.JOB_RESIZE,
                    jp.ResizeRequest(
                        job=job.spec.job_id,
                        stage=a.stage,
                        samples=pipes[a.replica].samples,
                        need_bytes=a.need_bytes,
                        weights=None if job.offload else weights(pipes),
                    ),
                    timeout=PING_TIMEOUT_S,
                )
                for a in args
            ),
            return_exceptions=True,
        )

    args = resized(new)
    replies = await tell(args, new)
    refused = [a.peer for a, r in zip(args, replies, strict=True) if isinstance(r, BaseException)]
    if refused:
        logger.info("share move refused by %s: %s", [p[:12] for p in refused], replies)
        # the stages that took the new share go back to the old; one that misses the revert would
        # keep the new samples, which the caller's re-place (`adopt`: every stage released, new
        # ones laid out) clears: so False whatever the revert's replies, and a miss is said
        back = await tell(run.stage_args, old)
        missed = [a.peer for a, r in zip(run.stage_args, back, strict=True) if isinstance(r, BaseException)]
        if missed:
            logger.warning("share move revert missed by %s: re-placing the job", [p[:12] for p in missed])
        return False
    job.pipelines, run.stage_args, run.shares = new, args, [p.samples for p in new]
    if job.offload:
        job.hosts_applied = await hosts.replan(
            job.spec.job_id, job.hosts, run.host_of, expected(job, run.stage_args)
        )
    run.steps_on_plan = run.since_check = 0
    run.target_time_s = None
    # the speeds measured so far stay: a stage's work counts its samples, and the slow-down that
    # moved the shares is still what a re-split (if the shares were not enough) is measured by
    job.plan_version += 1
    await run.event(
        job,
        "replan",
        reason=reason,
        plan_version=job.plan_version,
        step=job.step,
        peers=[a.peer for a in run.stage_args],
        bounds=[[a.lo, a.hi] for a in run.stage_args],
        shares=run.shares,
        moved="shares",
        move_s=round(time.perf_counter() - t0, 3),
    )
    return True
