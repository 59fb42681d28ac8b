"""Recovery of jobs whose optimizer state lives on the workers (`--offload off`): several pipelines
synced by the ring all-reduce (runtime/allreduce.py), or one pipeline with no data-parallel sync.

Every replica of a stage holds the stage's full parameters and optimizer state, bit-identical after
each step. When a member dies:

1. **The last completed step.** The optimizer runs only at `job.commit`, and the driver sends the
   commits only once every stage has reported the step, that is once every ring finished on every
   member. A failure before the commits leaves every stage at the step before (the failed step is
   replayed); a failure during them leaves some stages past it: the driver re-sends the commit to
   every surviving stage (`job.commit` is idempotent, and every member holds the same reduced
   gradients), so all survivors stand after it (`Stepper.finish_commits`). No step is applied twice
   or in part.
2. **The state.** For each parameter the driver takes the parameters and optimizer state from one
   surviving holder (`job.fetch` what="params" and "optim", runtime/optstate.py), fewest stages
   first, replica 0 preferred.
3. **The new plan.** The job is re-placed over the live workers (fewer pipelines or stages, or a
   replacement worker) and each new stage starts from that state (`Recovery.adopt(state_=...)`).

A parameter whose every holder died cannot be recovered from the swarm: the job resumes from its
newest driver checkpoint when it keeps one, else it stops with an error that names the lost stage.
Driver checkpoints of these jobs hold the workers' optimizer state too (`checkpoint_optim`, one
holder's per name), so the resumed stages take the AdamW state of the checkpoint's step, as a
`--resume` does (train/driver.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from fusionnode.errors import ConfigError, FusionNodeError, PlanError
from fusionnode.runtime.optstate import STEPS
from fusionnode.security.limits import MAILBOX_SLACK_BYTES
from fusionnode.train.checkpoint import checkpoint_worker_optim, load_resume, read_resume
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked
from fusionnode.wire.job import ErrorCode, JobError, Rpc, StageAssignment

STATE_COPIES = 3  # the driver's mailbox takes a stage's parameters and 2 optimizer-state tensors each


def choose_holders(
    stage_args: list[StageAssignment], gone: set[str], frozen: set[str]
) -> tuple[list[StageAssignment], set[str]]:
    """The surviving stages to take the state from (every trainable name once, replica 0 and the
    earlier positions first) and the names no survivor holds."""
    need = {n for a in stage_args for n in a.param_specs if n not in frozen}
    chosen: list[StageAssignment] = []
    covered: set[str] = set()
    for a in sorted(stage_args, key=lambda a: (a.replica, a.pos)):
        mine = set(a.param_specs) - frozen - covered
        if a.peer not in gone and mine:
            chosen.append(a)
            covered |= mine
    return chosen, need - covered


def describe_lost(stage_args: list[StageAssignment], lost: set[str], gone: set[str]) -> str:
    """'stage 1 (graph nodes 40..80) of pipelines 0, 1 (peers …, …)' for each lost position."""
    parts = []
    by_pos: dict[tuple[int, int, int], list[StageAssignment]] = {}
    for a in stage_args:
        if lost & set(a.param_specs):
            by_pos.setdefault((a.pos, a.lo, a.hi), []).append(a)
    for (pos, lo, hi), holders in sorted(by_pos.items()):
        pipes = ", ".join(str(a.replica) for a in holders)
        peers = ", ".join("…" + a.peer[-8:] for a in holders if a.peer in gone)
        parts.append(f"stage {pos} (graph nodes {lo}..{hi}) of pipeline(s) {pipes} (died: {peers})")
    return "; ".join(parts)


async def fetch_stage(placement: Any, job: Any, a: StageAssignment, what: str) -> dict[str, torch.Tensor]:
    """One stage's parameters (what="params") or optimizer state ("optim"), by tensor name."""
    t = placement.t
    timeout = placement.step_timeout_s
    req = jp.FetchRequest(job=job.spec.job_id, stage=a.stage, what=what)
    res = await jp.call(t, a.peer, Rpc.JOB_FETCH, req, timeout=timeout)
    got: dict[str, torch.Tensor] = {}
    for idx in range(res.count):
        msg, src = await t.mailbox.get(
            (jp.FETCH_KIND[what], job.spec.job_id, -1, idx, a.stage), timeout, sender=a.peer
        )
        if what == "params":
            got.update(decode_checked(msg, a.param_specs, None, src))
            continue
        for key, tensor in decode_checked(msg, None, None, src).items():
            name, _, kind = key.rpartition("|")
            spec = a.param_specs.get(name)
            shape = [1] if kind == STEPS else (spec or {}).get("shape")
            if spec is None or list(tensor.shape) != list(shape) or tensor.dtype != torch.float32:
                raise JobError(ErrorCode.BAD_TENSOR, f"unexpected optimizer state {key!r}", src)
            got[key] = tensor
    return got


def trainable_names(job: Any, stage_args: list[StageAssignment]) -> set[str]:
    """The names whose optimizer state the stages keep (every stage's, less the frozen ones)."""
    return {n for a in stage_args for n in a.param_specs if n not in job.frozen}


async def checkpoint_optim(
    placement: Any, job: Any, stage_args: list[StageAssignment]
) -> dict[str, torch.Tensor] | None:
    """--offload off: the workers' optimizer state for a driver checkpoint, `<name>|<kind>` tensors of
    every trainable name from one holder each (replica 0 first); None with hosts (they checkpoint
    their own shards). The driver's mailbox takes the state for the fetch, then the usual budget."""
    if job.offload:
        return None
    chosen, lost = choose_holders(stage_args, set(), set(job.frozen))
    if lost:
        raise PlanError(f"no stage holds the optimizer state of {sorted(lost)[:3]}")
    placement.t.mailbox.accept(
        job.spec.job_id,
        "driver",
        {a.peer for a in stage_args},
        STATE_COPIES * job.model_bytes + MAILBOX_SLACK_BYTES,
    )
    try:
        parts = await asyncio.gather(*(fetch_stage(placement, job, a, "optim") for a in chosen))
    finally:
        placement.accept(job, stage_args)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, t in part.items():
            out.setdefault(key, t)
    return out


async def survivor_state(
    placement: Any, job: Any, stage_args: list[StageAssignment], gone: set[str]
) -> tuple[dict[str, torch.Tensor] | None, dict[str, dict[str, torch.Tensor]], set[str]]:
    """(parameters, name -> optimizer-state tensors, lost names) from the surviving holders; a holder
    whose fetch fails counts as gone and the next holder of its names is asked."""
    frozen = set(job.frozen)
    gone = set(gone)
    peers = {a.peer for a in stage_args}
    placement.t.mailbox.accept(
        job.spec.job_id, "driver", peers, STATE_COPIES * job.model_bytes + MAILBOX_SLACK_BYTES
    )
    tries = 0
    for _ in range(len(stage_args) + 2):
        chosen, lost = choose_holders(stage_args, gone, frozen)
        if lost:
            return None, {}, lost

        async def both(a: StageAssignment) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
            return await fetch_stage(placement, job, a, "params"), await fetch_stage(
                placement, job, a, "optim"
            )

        results = await asyncio.gather(*(both(a) for a in chosen), return_exceptions=True)
        failed = [a for a, r in zip(chosen, results, strict=True) if isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, FusionNodeError | OSError | TimeoutError):
                raise r
        if failed:
            # a fetch can also fail for a reason of the moment (a ring that broke late wakes this
            # process's waits of the job): a holder that still answers a probe is asked again, twice
            tries += 1
            unreachable, _leaving = await placement.probe(sorted({a.peer for a in failed}))
            gone |= set(unreachable) if tries < 3 else {a.peer for a in failed}
            continue
        params: dict[str, torch.Tensor] = dict(job.frozen)
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for p, o in results:
            for name, t in p.items():
                params.setdefault(name, t)
            for key, t in o.items():
                optim.setdefault(key.rpartition("|")[0], {})[key] = t
        return params, optim, set()
    raise PlanError("no surviving stage answered with its state")


async def recover(
    rec: Any, job: Any, run: Any, source: Any, step: int, gone: set[str], workers: list[str], t0: float
) -> int:
    """Re-plans an offload-off job without the `gone` peers from the survivors' state (or the last
    checkpoint); returns the step to continue from."""
    t_state = time.perf_counter()
    params, optim, lost = await survivor_state(rec.placement, job, run.stage_args, gone)
    names = ", ".join(sorted("…" + p[-8:] for p in gone)) or "no peer (a transient error)"
    if not lost:
        fetch_s = time.perf_counter() - t_state
        await rec.adopt(
            job, run, workers, reason=f"replacing {names} at step {step} (ring)", state_=(params, optim)
        )
        await run.event(
            job,
            "recovered",
            step=step,
            time_to_recover_s=round(time.perf_counter() - t0, 3),
            state_fetch_s=round(fetch_s, 3),
            plan_version=job.plan_version,
            pipelines=len(job.pipelines),
            reason="parameters and optimizer state taken from the surviving replicas; step replayed",
        )
        return step
    where = describe_lost(run.stage_args, lost, gone)
    ckpt = None
    if job.spec.save_dir:
        try:
            ckpt = await asyncio.to_thread(read_resume, job.spec)
            at, full, _secret = load_resume(ckpt, source, run.full)
        except (ConfigError, OSError):
            ckpt = None
    if ckpt is None:
        raise PlanError(
            f"step {step}: {where} is lost: every worker that held it died, and with --offload off "
            "the optimizer state was only on them; the job keeps no checkpoint to resume from "
            "(--save DIR --save-every N, or --offload on)"
        )
    # the checkpoint's optimizer state (None from a checkpoint without it: new state)
    optim = checkpoint_worker_optim(ckpt, trainable_names(job, run.stage_args)) if at == ckpt.step else None
    await rec.adopt(
        job,
        run,
        workers,
        reason=f"{where} lost at step {step}: from the step-{at} checkpoint",
        state_=(full, optim),
    )
    job.step = at
    state = "its optimizer state" if optim is not None else "new optimizer state"
    await run.event(
        job,
        "recovered",
        step=step,
        replay_from=at,
        fresh_optimizer=optim is None,
        time_to_recover_s=round(time.perf_counter() - t0, 3),
        plan_version=job.plan_version,
        reason=f"{where} lost: resumed from the step-{at} checkpoint with {state}; steps {at}..{step} replayed",
    )
    return at
