"""Forward FLOPs of one operator, from its concrete (or meta) inputs and output.

Conventions (all counts are for the tensors actually passed, so trace with batch 1
to get per-sample costs):

- matrix products count 2 FLOPs per multiply-accumulate (2 * MACs):
  linear:   2 * in_features * numel(out)            (+ numel(out) for the bias add)
  conv2d:   2 * (C_in / groups) * kH * kW * numel(out)   (+ numel(out) for the bias)
  matmul/bmm/mm/@: 2 * K * numel(out), K the contracted size (a.shape[-1])
  addmm/baddbmm:   2 * K * numel(out) + numel(out)
  scaled_dot_product_attention, q [.., L, E], k [.., S, E], v [.., S, Ev], n = prod(batch dims):
            2 * n * L * S * E  (q @ k^T)  +  2 * n * L * S * Ev  (attn @ v)  +  5 * n * L * S
            (scale, mask, softmax: ~5 per score). Causal attention is counted in full,
            as the math kernel computes it; a fused kernel skipping masked blocks does ~half.
- normalisation: layer_norm / batch_norm / group_norm: 5 * numel(out)
  (mean, variance, normalise, scale, shift)
- embedding lookup, dropout with p = 0, and views (view, reshape, transpose, permute,
  narrow, unflatten, flatten, getitem, split, contiguous, size, ...): 0
- pooling: max/avg_pool2d: kH * kW * numel(out); adaptive pooling: numel(in)
- reductions (sum, mean, amax, softmax, log_softmax, cumsum ...): numel(in) (softmax: 3 * numel(in))
- any other elementwise op (add, mul, gelu, relu, ...): numel(out), summed over outputs
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

# ops that only re-index or re-describe memory: free
ZERO_FLOP_OPS = frozenset(
    {
        "placeholder",
        "output",
        "get_attr",
        "torch.nn.Embedding",
        "torch.nn.functional.embedding",
        "operator.getitem",
        "builtins.getattr",
        "torch.flatten",
        "torch.reshape",
        "torch.transpose",
        "torch.permute",
        "torch.narrow",
        "torch.split",
        "torch.chunk",
        "torch.unbind",
        "torch.unsqueeze",
        "torch.squeeze",
        "torch.cat",
        "torch.stack",
        "torch.ones_like",
        "torch.zeros_like",
        "torch.ones",
        "torch.zeros",
        "torch.arange",
        "torch.full",
        "view",
        "reshape",
        "transpose",
        "permute",
        "narrow",
        "unflatten",
        "flatten",
        "split",
        "chunk",
        "unbind",
        "contiguous",
        "size",
        "dim",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "t",
        "to",
        "float",
        "half",
        "bfloat16",
        "type_as",
        "clone",
        "detach",
        "new_zeros",
        "new_ones",
        "repeat",
    }
)
NORM_OPS = frozenset(
    {
        "torch.nn.LayerNorm",
        "torch.nn.BatchNorm2d",
        "torch.nn.functional.layer_norm",
        "torch.nn.functional.batch_norm",
        "torch.nn.functional.group_norm",
        "torch.nn.functional.rms_norm",
        "torch.nn.functional.normalize",
    }
)
NORM_FLOPS_PER_ELEMENT = 5
SOFTMAX_FLOPS_PER_ELEMENT = 3
ATTENTION_SCORE_FLOPS = 5  # scale + mask + softmax, per attention score
REDUCTION_OPS = frozenset(
    {
        "torch.sum",
        "torch.mean",
        "torch.amax",
        "torch.cumsum",
        "sum",
        "mean",
        "amax",
        "cumsum",
        "torch.nn.functional.adaptive_avg_pool2d",
    }
)
SOFTMAX_OPS = frozenset(
    {
        "torch.softmax",
        "torch.nn.functional.softmax",
        "torch.nn.functional.log_softmax",
        "softmax",
        "log_softmax",
    }
)
MATMUL_OPS = frozenset({"operator.matmul", "torch.matmul", "torch.bmm", "torch.mm", "matmul", "bmm", "mm"})
ADDMM_OPS = frozenset({"torch.addmm", "torch.baddbmm"})


def numel_of(value: Any) -> int:
    """Elements of a tensor, or summed over a tuple/list of tensors; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)):
        return sum(numel_of(v) for v in value)
    return 0


def _first_tensor(args: Sequence[Any]) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    return int(v[0]), int(v[-1])


def module_flops(op: str, module: torch.nn.Module, out: Any) -> float:
    """FLOPs of a leaf module call (op is its stable type name)."""
    n = numel_of(out)
    if op == "torch.nn.Linear":
        return 2.0 * module.in_features * n + (n if module.bias is not None else 0)
    if op == "torch.nn.Conv2d":
        kh, kw = module.kernel_size
        return 2.0 * (module.in_channels // module.groups) * kh * kw * n + (
            n if module.bias is not None else 0
        )
    if op in NORM_OPS:
        return float(NORM_FLOPS_PER_ELEMENT * n)
    if op == "torch.nn.Dropout":
        return float(n) if module.p > 0 else 0.0
    if op in ZERO_FLOP_OPS:
        return 0.0
    return float(n)


def function_flops(op: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> float:
    """FLOPs of a call_function / call_method node (op is its stable name, methods by bare name)."""
    if op in ZERO_FLOP_OPS:
        return 0.0
    n = numel_of(out)
    if op == "torch.nn.functional.linear":
        w = args[1] if len(args) > 1 else kwargs["weight"]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return 2.0 * w.shape[-1] * n + (n if bias is not None else 0)
    if op == "torch.nn.functional.conv2d":
        w = args[1] if len(args) > 1 else kwargs["weight"]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return 2.0 * w.shape[1] * w.shape[2] * w.shape[3] * n + (n if bias is not None else 0)
    if op == "torch.nn.functional.scaled_dot_product_attention":
        q = args[0] if args else kwargs["query"]
        k = args[1] if len(args) > 1 else kwargs["key"]
        v = args[2] if len(args) > 2 else kwargs["value"]
        batch = math.prod(q.shape[:-2])
        L, E, S, Ev = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
        return float(batch * L * S * (2 * E + 2 * Ev + ATTENTION_SCORE_FLOPS))
    if op in MATMUL_OPS:
        a = _first_tensor(args)
        return 2.0 * (a.shape[-1] if a is not None and a.dim() else 1) * n
    if op in ADDMM_OPS:
        mat1 = args[1] if len(args) > 1 else kwargs["mat1"]
        return 2.0 * mat1.shape[-1] * n + n
    if op in NORM_OPS:
        return float(NORM_FLOPS_PER_ELEMENT * n)
    if op in SOFTMAX_OPS:
        a = _first_tensor(args)
        return float(SOFTMAX_FLOPS_PER_ELEMENT * (a.numel() if a is not None else n))
    if op in REDUCTION_OPS:
        a = _first_tensor(args)
        return float(a.numel() if a is not None else n)
    if op in ("torch.nn.functional.max_pool2d", "torch.nn.functional.avg_pool2d"):
        kh, kw = _pair(args[1] if len(args) > 1 else kwargs["kernel_size"])
        return float(kh * kw * n)
    if op == "torch.nn.functional.dropout":
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
        return float(n) if (p > 0 and training) else 0.0
    return float(n)
