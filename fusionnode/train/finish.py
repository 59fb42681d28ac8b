"""The end of a driver's job: the final parameters into the model, the validation loss, a sample,
the final checkpoint, and the job's result; and the parameter names a job's tensors go by.

Split from train/driver.py, whose `Driver.run_job` calls these.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from fusionnode.errors import FusionNodeError
from fusionnode.train.checkpoint import save_job
from fusionnode.train.state import Job

logger = logging.getLogger(__name__)


async def finish_job(
    job: Job,
    model: Any,
    final: dict[str, torch.Tensor],
    source: Any,
    metrics: Any,
    feedback: dict[int, dict[str, torch.Tensor]] | None = None,
    worker_optim: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    from fusionnode.train.generate import generate
    from fusionnode.train.local import evaluate

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(final[name])
    val_loss = await asyncio.to_thread(evaluate, model, source)
    job.validation.append({"step": job.step, "loss": val_loss})
    sample = await asyncio.to_thread(generate, model, "def ", 160, 0.8, 40, job.spec.seed)
    checkpoint = None
    if job.spec.save_dir:
        try:
            checkpoint = await asyncio.to_thread(
                save_job, job, job.spec.steps, source, final, feedback, worker_optim
            )
        except (OSError, FusionNodeError) as exc:  # the trained result is still reported
            logger.error("job %s: the final checkpoint failed: %s", job.spec.job_id, exc)
            metrics.event("failure", reason=f"final checkpoint: {exc}", step=job.spec.steps)
    return {
        "job": job.spec.job_id,
        "steps": job.step,
        "loss": job.loss,
        "val_loss": val_loss,
        "tokens_per_s": job.tokens_per_s,
        "stages": job.stages,
        "offload": job.offload,
        "optimizer_hosts": job.hosts,
        "checkpoint": checkpoint,
        "metrics_out": job.spec.metrics_out,
        "sample": sample,
        "summary": metrics.summary.as_dict(),
    }


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every state-dict name of a parameter -> the name named_parameters() reports (tied weights share one)."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {name: by_id[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
