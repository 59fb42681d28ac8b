"""Recomputing one micro-batch of one stage: the forward, and for gradients the backward, exactly as a
worker runs them (the same sub-DAG, loss and scaling), from the inputs and parameters it committed to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Recomputed:
    outputs: dict[str, torch.Tensor]  # what a non-last stage sends on (the tensors of its "act" message)
    loss: float | None  # the last stage's micro-batch loss (before the 1/m scaling)
    input_grads: dict[str, torch.Tensor]  # what it sends back (the tensors of its "grad" message)


def recompute(
    module: Any,
    *,
    inputs: Mapping[str, torch.Tensor],
    send_names: list[str],
    is_last: bool,
    is_first: bool,
    micro_batches: int,
    target: torch.Tensor | None = None,
    output_grads: Mapping[str, torch.Tensor] | None = None,
    accumulate: bool = False,
) -> Recomputed:
    """One micro-batch through `module` (a runtime.stage.StageModule, built by the caller: this
    package does not import the runtime, which imports it): forward from `inputs` (what the stage
    received), the loss with `target` on the last stage, the backward from `output_grads` (what the
    next stage sent back) elsewhere. Mirrors the worker's schedule (runtime/worker.py); with
    `accumulate` the parameters' .grad keep what earlier micro-batches left."""
    input_names = set(module.input_names)
    leaves: dict[str, torch.Tensor] = {}
    for name, t in inputs.items():
        t = t.detach().clone()
        if t.is_floating_point():
            t.requires_grad_(True)
        leaves[name] = t
    if not accumulate:  # else parameter gradients add up over micro-batches, as on the worker
        for p in module.parameters():
            p.grad = None
    outs = module({n: leaves[n] for n in module.input_names})
    loss_val = None
    if is_last:
        if target is None:
            raise ValueError("the last stage's recompute needs the target")
        logits = next(iter(outs.values())) if len(outs) == 1 else outs[module.output_names[0]]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1).to(logits.device)
        )
        loss_val = float(loss.detach())
        (loss / micro_batches).backward()
        sent: dict[str, torch.Tensor] = {}
    else:
        for name in send_names:
            if name not in outs and name in leaves:
                outs[name] = leaves[name]
        sent = {
            n: outs[n].detach().float() if outs[n].is_floating_point() else outs[n].detach()
            for n in send_names
        }
        grads = dict(output_grads or {})
        pairs = [
            (outs[n], g.to(dtype=outs[n].dtype))
            for n, g in grads.items()
            if n in outs and outs[n].requires_grad
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
    in_grads = {}
    if not is_first:
        in_grads = {
            n: t.grad.detach().float()
            for n, t in leaves.items()
            if (n in input_names or n in send_names) and t.grad is not None
        }
    return Recomputed(outputs=sent, loss=loss_val, input_grads=in_grads)


__all__ = ["Recomputed", "recompute"]
