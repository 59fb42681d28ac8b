"""The single-process reference trainer (`fusionnode train --local`).

It defines what a step IS: the model built from the seed (`build_job_model`), the step's batch
(`BatchSource.microbatches`), the loss (`lm_loss`, each micro-batch weighted by `loss_scale`),
gradient clipping, and the optimizer (`make_optimizer`, stepped at `lr_at(step)`). The
distributed driver calls these same functions, so its losses can be checked against this one.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusionnode.errors import ConfigError, FusionNodeError
from fusionnode.train.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fusionnode.train.data import BatchSource, loss_scale, step_seed
from fusionnode.train.metrics import MetricsWriter
from fusionnode.train.spec import (
    ADAMW_BETAS,
    ADAMW_EPS,
    SGD_MOMENTUM,
    JobSpec,
    lr_at,
    resolve_seq_len,
    trajectory_mismatch,
    weight_decay_for,
)

logger = logging.getLogger(__name__)

EVAL_BATCHES = 4  # validation batches evaluated at the end of a run


class DivergenceError(FusionNodeError, FloatingPointError):
    """The training loss became NaN or infinite."""


@dataclass(frozen=True)
class LocalResult:
    """What a local run produced. `losses[i]` is the loss of step `start_step + i`."""

    spec: JobSpec
    start_step: int  # 0, or the step a resume continued from
    losses: tuple[float, ...]
    val_loss: float
    params: dict[str, torch.Tensor]  # final state_dict (tied names share one tensor)
    tokens_per_s: float  # training tokens / summed step time, this call only
    model: nn.Module
    checkpoint: str | None  # directory of the last checkpoint written, if any


def build_job_model(spec: JobSpec) -> nn.Module:
    """The job's model with its initial weights: `torch.manual_seed(spec.seed)` then `build_model`,
    then, with `spec.init_from`, the weights of that Hugging Face checkpoint, then, with
    `spec.lora_rank`, LoRA adapters on `spec.lora_targets` with every other parameter frozen.

    A bundled or factory model is built with the tokenizer's vocabulary (256 for byte-level data).
    A model from a Hugging Face config keeps its own vocabulary, which must hold the tokenizer's.
    """
    from fusionnode.models import build_model, model_info
    from fusionnode.models.hf_config import looks_like_hf_config
    from fusionnode.train.tokenizer import check_vocab, load_tokenizer

    info = model_info(spec.model)
    if info.kind != "lm":
        raise ConfigError(f"model {spec.model!r} is a {info.kind} model; training needs a language model")
    tokenizer = load_tokenizer(spec.tokenizer)
    kwargs: dict[str, Any] = {}
    if looks_like_hf_config(spec.model):
        check_vocab(tokenizer, info.vocab_size, spec.model)
    elif info.vocab_size != tokenizer.vocab_size:
        kwargs["vocab_size"] = tokenizer.vocab_size
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, **kwargs)
    if spec.init_from is not None:
        from fusionnode.models.hf_checkpoint import load_hf_weights

        load_hf_weights(model, spec.init_from)
    if spec.lora_rank:
        from fusionnode.models.lora import apply_lora, parse_targets

        apply_lora(model, parse_targets(spec.lora_targets), spec.lora_rank, spec.lora_alpha)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of a (micro-)batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(model: nn.Module, spec: JobSpec) -> torch.optim.Optimizer:
    """The reference optimizer: AdamW (betas ADAMW_BETAS) or SGD (momentum SGD_MOMENTUM), with
    decay per `weight_decay_for`; single-tensor kernels so results do not depend on batching."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # a tied parameter is listed once
        if p.requires_grad:
            (decay if weight_decay_for(name, p.ndim, spec) > 0 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    lr0 = lr_at(0, spec)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr0, betas=ADAMW_BETAS, eps=ADAMW_EPS, fused=False, foreach=False)
    return torch.optim.SGD(groups, lr=lr0, momentum=SGD_MOMENTUM, foreach=False)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def evaluate(model: nn.Module, source: BatchSource, n_batches: int = EVAL_BATCHES) -> float:
    """Mean loss over the first `n_batches` fixed validation batches."""
    was_training = model.training
    model.eval()
    try:
        losses = [lm_loss(model(x), y).item() for x, y in (source.eval_batch(i) for i in range(n_batches))]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    source: BatchSource,
    step: int,
    spec: JobSpec,
) -> dict[str, float]:
    """One optimizer step of the reference trajectory; returns loss (mean of micro-batch losses),
    grad_norm (before clipping) and lr."""
    lr = lr_at(step, spec)
    set_lr(optimizer, lr)
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(step_seed(spec.seed, step, "dropout"))  # dropout masks depend on the step only
    losses = []
    for inputs, targets in source.microbatches(step, spec.micro_batches):
        loss = lm_loss(model(inputs), targets)
        (loss * loss_scale(inputs.size(0), spec.batch_size)).backward()
        losses.append(loss.item())
    params = [p for p in model.parameters() if p.grad is not None]
    if spec.grad_clip is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, spec.grad_clip, foreach=False))
    else:
        grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    optimizer.step()
    return {"loss": sum(losses) / len(losses), "grad_norm": grad_norm, "lr": lr}


def _resume(
    spec: JobSpec, save_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, source: BatchSource
) -> int:
    ckpt: Checkpoint | None = load_checkpoint(save_dir)
    if ckpt is None:
        logger.info("no complete checkpoint in %s; starting at step 0", save_dir)
        return 0
    diffs = trajectory_mismatch(ckpt.spec, spec)
    if diffs:
        raise ConfigError(
            f"cannot resume from {ckpt.path}: the job differs in "
            + ", ".join(f"{k} ({getattr(ckpt.spec, k)!r} -> {getattr(spec, k)!r})" for k in diffs)
        )
    if ckpt.spec.steps != spec.steps:
        logger.warning(
            "resuming with steps %d (was %d): the lr schedule changes", spec.steps, ckpt.spec.steps
        )
    model.load_state_dict(ckpt.params, strict=True)
    optimizer.load_state_dict(ckpt.optimizer_state)
    start = source.check_state(ckpt.data_state)
    if start != ckpt.step:
        raise ConfigError(f"{ckpt.path}: data state says step {start}, manifest says {ckpt.step}")
    logger.info("resumed from %s at step %d", ckpt.path, start)
    return start


def _save(
    spec: JobSpec,
    save_dir: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    source: BatchSource,
    step: int,
) -> str:
    path = save_checkpoint(
        save_dir, step, model.state_dict(), optimizer.state_dict(), source.state(step), spec
    )
    return str(path)


def train_local(
    spec: JobSpec,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    resume: bool = False,
) -> LocalResult:
    """Train `spec` in this process. With `resume`, continue from the newest complete checkpoint in
    `spec.save_dir` on exactly the trajectory an uninterrupted run would follow.

    `progress` gets every step record (the same dict that goes to `spec.metrics_out`).
    """
    save_dir = spec.save_dir
    if resume and save_dir is None:
        raise ConfigError("--resume needs a save directory (--save-dir)")
    seq_len = resolve_seq_len(spec)
    model = build_job_model(spec)  # first: a model/tokenizer mismatch is found before data is tokenized
    source = BatchSource.from_spec(spec, seq_len)
    model.train()
    optimizer = make_optimizer(model, spec)
    start = _resume(spec, save_dir, model, optimizer, source) if save_dir is not None and resume else 0
    tokens_per_step = spec.batch_size * seq_len

    losses: list[float] = []
    last_ckpt: str | None = None
    with MetricsWriter(spec.metrics_out, append=resume) as metrics:
        metrics.event("resume" if start else "start", job_id=spec.job_id, step=start, spec=spec.to_dict())
        for step in range(start, spec.steps):
            t0 = time.perf_counter()
            out = train_step(model, optimizer, source, step, spec)
            dt = time.perf_counter() - t0
            if not math.isfinite(out["loss"]):
                metrics.event("failure", step=step, reason="non-finite loss")
                raise DivergenceError(f"step {step}: loss is {out['loss']}; lower --lr or set --grad-clip")
            record = metrics.step(
                {
                    "step": step,
                    "loss": out["loss"],
                    "tokens": tokens_per_step,
                    "step_time_s": dt,
                    "wire_bytes": 0,
                    "plan_version": 0,
                    "lr": out["lr"],
                    "grad_norm": out["grad_norm"],
                }
            )
            losses.append(out["loss"])
            if progress is not None:
                progress(record)
            done = step + 1
            if save_dir is not None and (
                done == spec.steps or (spec.save_every and done % spec.save_every == 0)
            ):
                last_ckpt = _save(spec, save_dir, model, optimizer, source, done)
                metrics.event("checkpoint", step=done, path=last_ckpt)
        val_loss = evaluate(model, source)
        metrics.event("eval", step=spec.steps, val_loss=val_loss)
        summary = metrics.summary
        metrics.event("end", step=spec.steps, **summary.as_dict())
    return LocalResult(
        spec=spec,
        start_step=start,
        losses=tuple(losses),
        val_loss=val_loss,
        params={k: v.detach() for k, v in model.state_dict().items()},
        tokens_per_s=summary.tokens_per_s,
        model=model,
        checkpoint=last_ckpt,
    )
