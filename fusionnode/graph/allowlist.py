"""What a portable stage may use: the allowlist of operators, tensor methods, attributes, leaf
module types (with their parameter and buffer names) and dtypes, each by a stable name that the
worker resolves with its own torch, and the guard on arithmetic over constants.

`graph/portable.py` describes a stage with these names (a model using anything else fails there,
with GraphError); `runtime/stage.py` rebuilds and runs it through the same tables. Split from
graph/portable.py.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fusionnode.errors import GraphError
from fusionnode.wire.codec_api import DTYPE_NAMES

TENSOR_DTYPES: dict[torch.dtype, str] = dict(DTYPE_NAMES)  # dtypes a node output / parameter may have

# call_function targets a stage may use, by stable name (resolved with the worker's own torch)
FUNCTION_NAMES: tuple[str, ...] = (
    # python operators on tensors (and on ints from sizes)
    "operator.add",
    "operator.sub",
    "operator.mul",
    "operator.truediv",
    "operator.floordiv",
    "operator.mod",
    "operator.pow",
    "operator.neg",
    "operator.matmul",
    "operator.getitem",
    "operator.eq",
    "operator.ne",
    "operator.lt",
    "operator.le",
    "operator.gt",
    "operator.ge",
    "operator.and_",
    "operator.or_",
    "operator.invert",
    "builtins.getattr",
    # torch namespace
    "torch.add",
    "torch.sub",
    "torch.mul",
    "torch.div",
    "torch.neg",
    "torch.pow",
    "torch.exp",
    "torch.log",
    "torch.sqrt",
    "torch.rsqrt",
    "torch.abs",
    "torch.tanh",
    "torch.sigmoid",
    "torch.relu",
    "torch.erf",
    "torch.sin",
    "torch.cos",
    "torch.clamp",
    "torch.where",
    "torch.masked_fill",
    "torch.matmul",
    "torch.bmm",
    "torch.mm",
    "torch.addmm",
    "torch.baddbmm",
    "torch.einsum",
    "torch.outer",
    "torch.cat",
    "torch.stack",
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
    "torch.cumsum",
    "torch.sum",
    "torch.mean",
    "torch.amax",
    "torch.softmax",
    "torch.tril",
    "torch.triu",
    "torch.ones_like",
    "torch.zeros_like",
    "torch.ones",
    "torch.zeros",
    "torch.full",
    "torch.arange",
    # torch.nn.functional
    "torch.nn.functional.linear",
    "torch.nn.functional.embedding",
    "torch.nn.functional.layer_norm",
    "torch.nn.functional.rms_norm",
    "torch.nn.functional.group_norm",
    "torch.nn.functional.batch_norm",
    "torch.nn.functional.normalize",
    "torch.nn.functional.conv2d",
    "torch.nn.functional.max_pool2d",
    "torch.nn.functional.avg_pool2d",
    "torch.nn.functional.adaptive_avg_pool2d",
    "torch.nn.functional.dropout",
    "torch.nn.functional.gelu",
    "torch.nn.functional.relu",
    "torch.nn.functional.silu",
    "torch.nn.functional.sigmoid",
    "torch.nn.functional.tanh",
    "torch.nn.functional.softmax",
    "torch.nn.functional.log_softmax",
    "torch.nn.functional.pad",
    "torch.nn.functional.scaled_dot_product_attention",
)

# call_method names a stage may call on a tensor
METHOD_NAMES: frozenset[str] = frozenset(
    {
        "view",
        "reshape",
        "transpose",
        "permute",
        "contiguous",
        "narrow",
        "unflatten",
        "flatten",
        "split",
        "chunk",
        "unbind",
        "size",
        "dim",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "repeat",
        "t",
        "float",
        "half",
        "bfloat16",
        "to",
        "type_as",
        "clone",
        "masked_fill",
        "softmax",
        "log_softmax",
        "sum",
        "mean",
        "amax",
        "cumsum",
        "pow",
        "sqrt",
        "rsqrt",
        "exp",
        "tanh",
        "sigmoid",
        "relu",
        "add",
        "sub",
        "mul",
        "div",
        "matmul",
        "new_zeros",
        "new_ones",
        "tril",
        "triu",
    }
)

# attributes `getattr(tensor, name)` may read inside a stage
GETATTR_NAMES: frozenset[str] = frozenset({"shape", "dtype", "device", "ndim", "T", "mT"})

# keyword arguments dropped on rebuild: in-place variants break autograd on stage inputs
DROPPED_KWARGS: frozenset[str] = frozenset({"inplace"})

LEAF_MODULE_TYPES: dict[type[nn.Module], str] = {
    nn.Linear: "torch.nn.Linear",
    nn.LayerNorm: "torch.nn.LayerNorm",
    nn.Embedding: "torch.nn.Embedding",
    nn.Conv2d: "torch.nn.Conv2d",
    nn.BatchNorm2d: "torch.nn.BatchNorm2d",
    nn.Dropout: "torch.nn.Dropout",
}
MODULE_NAMES: frozenset[str] = frozenset(LEAF_MODULE_TYPES.values())

# local parameter / buffer names each leaf module type may carry
MODULE_PARAMS: dict[str, tuple[str, ...]] = {
    "torch.nn.Linear": ("weight", "bias"),
    "torch.nn.LayerNorm": ("weight", "bias"),
    "torch.nn.Embedding": ("weight",),
    "torch.nn.Conv2d": ("weight", "bias"),
    "torch.nn.BatchNorm2d": ("weight", "bias"),
    "torch.nn.Dropout": (),
}
MODULE_BUFFERS: dict[str, tuple[str, ...]] = {
    "torch.nn.BatchNorm2d": ("running_mean", "running_var", "num_batches_tracked"),
}


def _resolve(name: str) -> Any:
    module_name, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


@functools.lru_cache(maxsize=1)
def allowed_functions() -> dict[str, Callable[..., Any]]:
    """Stable name -> this process's callable, for every allowlisted function it has."""
    table: dict[str, Callable[..., Any]] = {}
    for name in FUNCTION_NAMES:
        try:
            table[name] = _resolve(name)
        except (ImportError, AttributeError):
            continue  # an older torch without this op: descriptions using it are refused
    return table


SCALAR_ARITH = frozenset(
    {"operator.add", "operator.sub", "operator.mul", "operator.truediv", "operator.floordiv", "operator.mod",
     "operator.pow", "operator.neg", "operator.and_", "operator.or_", "operator.invert"}
)  # fmt: skip
MAX_SCALAR_BITS = 64  # bits of an int operand or result of arithmetic on constants (sizes, not bignums)


def check_scalar_arith(target: str, args: Any, kwargs: dict[str, Any]) -> None:
    """Arithmetic without a tensor operand runs in Python on the worker's event loop thread: only on
    numbers, ints within MAX_SCALAR_BITS, and a power whose result stays within them (a description's
    `operator.pow(3, 4_000_000)` or `"x" * 10**9` would stall or fill the worker)."""
    if target not in SCALAR_ARITH or kwargs or any(isinstance(a, torch.Tensor) for a in args):
        return
    for a in args:
        if not isinstance(a, (int, float)):
            raise GraphError(f"{target} on a constant of type {type(a).__name__} is not allowed")
        if isinstance(a, int) and a.bit_length() > MAX_SCALAR_BITS:
            raise GraphError(f"{target} on an integer of {a.bit_length()} bits (limit {MAX_SCALAR_BITS})")
    if target == "operator.pow" and len(args) == 2 and isinstance(args[1], int):
        base, exp = args
        bits = abs(base).bit_length() if isinstance(base, int) else 0
        if exp > MAX_SCALAR_BITS or bits * max(exp, 0) > MAX_SCALAR_BITS:
            raise GraphError(f"{target}({base}, {exp}) exceeds {MAX_SCALAR_BITS} bits")


@functools.lru_cache(maxsize=1)
def _names_by_callable() -> dict[Any, str]:
    out: dict[Any, str] = {}
    for name, fn in allowed_functions().items():
        out.setdefault(fn, name)
    return out


def op_name(target: Any) -> str:
    """Stable name of a call_function target: its allowlist name, else module.name for messages."""
    try:
        known = _names_by_callable().get(target)
    except TypeError:  # unhashable target
        known = None
    if known is not None:
        return known
    module = getattr(target, "__module__", None) or "?"
    return f"{module}.{getattr(target, '__name__', repr(target))}"


def module_type_name(cls: type) -> str:
    return LEAF_MODULE_TYPES.get(cls) or f"{cls.__module__}.{cls.__qualname__}"
