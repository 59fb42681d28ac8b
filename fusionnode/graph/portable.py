"""Portable sub-DAG descriptions: a stage of a traced model as msgpack-able data.

The driver describes each stage as plain data (protocol/SUBDAG.md): operators by
stable torch names from a fixed allowlist (graph/allowlist.py), constant arguments, references to
earlier nodes or to named stage inputs, standard leaf modules by type + config,
and parameters/buffers by state-dict name + shape + dtype. No pickle and no code
of the driver's model travel; the worker rebuilds the stage with its own torch
(`fusionnode.runtime.stage.StageModule`), resolving names only through the allowlist's
tables. A model using anything else fails here, at describe time, with GraphError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from fusionnode.errors import GraphError
from fusionnode.graph.allowlist import (
    DROPPED_KWARGS,
    GETATTR_NAMES,
    METHOD_NAMES,
    MODULE_NAMES,
    TENSOR_DTYPES,
    allowed_functions,
    module_type_name,
    op_name,
)
from fusionnode.wire.codec_api import DTYPES

if TYPE_CHECKING:
    from fusionnode.graph.trace import TracedModel

FORMAT = "fusionnode.subdag"
VERSION = 1


def module_config(module: nn.Module) -> dict[str, Any]:
    """Constant configuration of a leaf module, enough to run it functionally."""
    t = module_type_name(type(module))
    if isinstance(module, nn.Linear):
        return {
            "in_features": module.in_features,
            "out_features": module.out_features,
            "bias": module.bias is not None,
        }
    if isinstance(module, nn.LayerNorm):
        return {
            "normalized_shape": list(module.normalized_shape),
            "eps": module.eps,
            "elementwise_affine": module.elementwise_affine,
            "bias": module.bias is not None,
        }
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None or module.sparse:
            raise GraphError(f"{t}: max_norm and sparse embeddings are not portable")
        return {
            "num_embeddings": module.num_embeddings,
            "embedding_dim": module.embedding_dim,
            "padding_idx": module.padding_idx,
            "scale_grad_by_freq": module.scale_grad_by_freq,
        }
    if isinstance(module, nn.Conv2d):
        if module.padding_mode != "zeros":
            raise GraphError(f"{t}: padding_mode {module.padding_mode!r} is not portable (only 'zeros')")
        padding = module.padding if isinstance(module.padding, str) else list(module.padding)
        return {
            "in_channels": module.in_channels,
            "out_channels": module.out_channels,
            "kernel_size": list(module.kernel_size),
            "stride": list(module.stride),
            "padding": padding,
            "dilation": list(module.dilation),
            "groups": module.groups,
            "bias": module.bias is not None,
        }
    if isinstance(module, nn.BatchNorm2d):
        return {
            "num_features": module.num_features,
            "eps": module.eps,
            "momentum": module.momentum,
            "affine": module.affine,
            "track_running_stats": module.track_running_stats,
        }
    if isinstance(module, nn.Dropout):
        return {"p": module.p}
    raise GraphError(f"module type {t} is not in the portable allowlist ({', '.join(sorted(MODULE_NAMES))})")


def run_module(
    type_name: str,
    cfg: dict[str, Any],
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    x: torch.Tensor,
    training: bool,
) -> torch.Tensor:
    """Run a leaf module functionally from its description (the worker side of module_config)."""
    if type_name == "torch.nn.Linear":
        return F.linear(x, params["weight"], params.get("bias"))
    if type_name == "torch.nn.LayerNorm":
        return F.layer_norm(
            x, list(cfg["normalized_shape"]), params.get("weight"), params.get("bias"), cfg["eps"]
        )
    if type_name == "torch.nn.Embedding":
        return F.embedding(
            x, params["weight"], padding_idx=cfg["padding_idx"], scale_grad_by_freq=cfg["scale_grad_by_freq"]
        )
    if type_name == "torch.nn.Conv2d":
        padding = cfg["padding"] if isinstance(cfg["padding"], str) else tuple(cfg["padding"])
        return F.conv2d(
            x,
            params["weight"],
            params.get("bias"),
            tuple(cfg["stride"]),
            padding,
            tuple(cfg["dilation"]),
            cfg["groups"],
        )
    if type_name == "torch.nn.BatchNorm2d":
        momentum = cfg["momentum"]
        use_batch_stats = training or not cfg["track_running_stats"]
        if training and cfg["track_running_stats"]:
            nbt = buffers["num_batches_tracked"]
            nbt.add_(1)
            if momentum is None:  # cumulative moving average, as nn.BatchNorm2d does
                momentum = 1.0 / float(nbt.item())
        return F.batch_norm(
            x,
            buffers.get("running_mean"),
            buffers.get("running_var"),
            params.get("weight"),
            params.get("bias"),
            use_batch_stats,
            0.0 if momentum is None else momentum,
            cfg["eps"],
        )
    if type_name == "torch.nn.Dropout":
        return F.dropout(x, cfg["p"], training)
    raise GraphError(f"module type {type_name!r} is not in the portable allowlist")


# ----------------------------------------------------------------------------- argument encoding
# A value is None, bool, int, float, str, a list of values, or a dict with exactly one
# tag key: {"ref": node_or_input_name} | {"tuple": [...]} | {"slice": [start, stop, step]}
# | {"ellipsis": None} | {"dtype": "float32"} | {"device": "stage"} | {"dict": {str: value}}.
ARG_TAGS: frozenset[str] = frozenset({"ref", "tuple", "slice", "ellipsis", "dtype", "device", "dict"})


def encode_arg(value: Any, where: str) -> Any:
    import torch.fx as fx

    if isinstance(value, fx.Node):
        return {"ref": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, torch.Size)):
        return {"tuple": [encode_arg(v, where) for v in value]}
    if isinstance(value, list):
        return [encode_arg(v, where) for v in value]
    if isinstance(value, slice):
        return {
            "slice": [
                encode_arg(value.start, where),
                encode_arg(value.stop, where),
                encode_arg(value.step, where),
            ]
        }
    if value is Ellipsis:
        return {"ellipsis": None}
    if isinstance(value, torch.dtype):
        if value not in TENSOR_DTYPES:
            raise GraphError(f"{where}: dtype {value} is not portable")
        return {"dtype": TENSOR_DTYPES[value]}
    if isinstance(value, torch.device):
        return {"device": "stage"}  # a device constant means "where the stage runs"
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise GraphError(f"{where}: dict argument with non-string keys is not portable")
        return {"dict": {k: encode_arg(v, where) for k, v in value.items()}}
    raise GraphError(f"{where}: constant of type {type(value).__name__} is not portable")


def decode_arg(value: Any, env: dict[str, Any], device: torch.device) -> Any:
    """Inverse of encode_arg on the worker; refs resolve in `env` (validated beforehand)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode_arg(v, env, device) for v in value]
    ((tag, inner),) = value.items()
    if tag == "ref":
        return env[inner]
    if tag == "tuple":
        return tuple(decode_arg(v, env, device) for v in inner)
    if tag == "slice":
        return slice(*(decode_arg(v, env, device) for v in inner))
    if tag == "ellipsis":
        return Ellipsis
    if tag == "dtype":
        return DTYPES[inner]
    if tag == "device":
        return device
    return {k: decode_arg(v, env, device) for k, v in inner.items()}


def arg_refs(value: Any) -> list[str]:
    """Names referenced by an encoded value; raises GraphError on a malformed value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return []
    if isinstance(value, list):
        return [r for v in value for r in arg_refs(v)]
    if not isinstance(value, dict) or len(value) != 1:
        raise GraphError(f"malformed argument {value!r}: expected a constant, a list or a one-key tag dict")
    ((tag, inner),) = value.items()
    if tag not in ARG_TAGS:
        raise GraphError(f"unknown argument tag {tag!r}")
    if tag == "ref":
        if not isinstance(inner, str):
            raise GraphError(f"malformed reference {inner!r}")
        return [inner]
    if tag in ("tuple", "slice"):
        if not isinstance(inner, list) or (tag == "slice" and len(inner) != 3):
            raise GraphError(f"malformed {tag} {inner!r}")
        return [r for v in inner for r in arg_refs(v)]
    if tag == "dtype":
        if inner not in DTYPES:
            raise GraphError(f"unknown dtype {inner!r}")
        return []
    if tag == "dict":
        if not isinstance(inner, dict) or not all(isinstance(k, str) for k in inner):
            raise GraphError(f"malformed dict argument {inner!r}")
        return [r for v in inner.values() for r in arg_refs(v)]
    if tag == "device" and inner != "stage":
        raise GraphError(f"device argument must be 'stage', got {inner!r}")
    return []


# ----------------------------------------------------------------------------- describe
def _node_where(node: Any) -> str:
    """'node NAME in module PATH (Type)': the model code a refused node came from."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return f"node {node.name!r}"
    path, cls = list(stack.values())[-1]
    return f"node {node.name!r} in module {path or '<root>'} ({getattr(cls, '__name__', cls)})"


def _check_op(op: str, target: Any, args: Any, where: str) -> str:
    if op == "call_function":
        name = op_name(target)
        if name not in allowed_functions():
            raise GraphError(f"{where}: function {name} is not in the portable allowlist")
        if name == "builtins.getattr" and (len(args) != 2 or args[1] not in GETATTR_NAMES):
            raise GraphError(
                f"{where}: getattr of {args[1:]!r} is not portable (allowed: {sorted(GETATTR_NAMES)})"
            )
        return name
    if op == "call_method":
        if target not in METHOD_NAMES:
            raise GraphError(f"{where}: tensor method {target!r} is not in the portable allowlist")
        return str(target)
    raise GraphError(f"{where}: node kind {op!r} is not portable")


def describe_stage(traced: TracedModel, lo: int, hi: int) -> dict:
    """Portable description of nodes [lo, hi) of `traced` (see protocol/SUBDAG.md).

    inputs: exactly the tensors crossing the cut before lo (produced before lo, consumed
    at or after lo), plus the placeholders inside the range (fed by the driver), in node
    order. outputs: exactly the tensors crossing the cut at hi (produced before hi,
    consumed at or after hi), in node order, then, when the range holds the output node,
    the model's output. A tensor crossing several cuts is thus relayed by every stage in
    between, as `OpGraph.cut_bytes` counts it; a relayed input is also an output."""
    gm = traced.gm
    nodes = list(gm.graph.nodes)
    n = len(nodes)
    if not 0 <= lo < hi <= n:
        raise GraphError(f"stage range [{lo}, {hi}) is not inside [0, {n})")
    ids = {node: i for i, node in enumerate(nodes)}
    graph = traced.graph

    def crossing(cut: int) -> list[Any]:
        """Non-parameter values produced before `cut` and consumed at or after it."""
        out = []
        for node in nodes[:cut]:
            if node.op == "get_attr" or not any(ids[u] >= cut for u in node.users):
                continue
            dtype = graph.nodes[ids[node]].out_dtype
            if dtype not in TENSOR_DTYPES.values():
                raise GraphError(
                    f"the cut before node {cut} crosses the non-tensor value {node.name!r} ({dtype}); "
                    "place the stage boundary elsewhere (see tensor_only_cuts)"
                )
            out.append(node)
        return out

    entering = crossing(lo) + [p for p in nodes[lo:hi] if p.op == "placeholder"]
    inputs = [node.name for node in entering]
    outputs = [node.name for node in crossing(hi)] if hi < n else []
    model_output: str | None = None
    if hi == n:
        (ret,) = nodes[-1].args
        if not isinstance(ret, torch.fx.Node):
            raise GraphError("the model must return a single tensor to be split into stages")
        model_output = ret.name
        outputs.append(model_output)
    # get_attr nodes before lo read inside the range: re-read locally, parameters travel by name
    hoisted = list(
        dict.fromkeys(
            inp
            for node in nodes[lo:hi]
            for inp in node.all_input_nodes
            if inp.op == "get_attr" and ids[inp] < lo
        )
    )

    params: dict[str, dict[str, Any]] = {}
    buffers: dict[str, dict[str, Any]] = {}

    def need_param(name: str) -> None:
        shape, dtype = traced.param_meta[name]
        if dtype not in DTYPES:
            raise GraphError(f"parameter {name!r} has dtype {dtype}, which is not portable")
        params.setdefault(name, {"shape": list(shape), "dtype": dtype})

    def need_buffer(name: str) -> None:
        shape, dtype = traced.buffer_meta[name]
        if dtype not in DTYPES:
            raise GraphError(f"buffer {name!r} has dtype {dtype}, which is not portable")
        buffers.setdefault(name, {"shape": list(shape), "dtype": dtype})

    out_nodes: list[dict[str, Any]] = []
    for node in [*hoisted, *nodes[lo:hi]]:
        where = _node_where(node)
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            kind, name = traced.attr_names[node.name]
            (need_param if kind == "param" else need_buffer)(name)
            out_nodes.append({"name": node.name, "op": f"get_{kind}", "target": name})
            continue
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            type_name = module_type_name(type(module))
            if type_name not in MODULE_NAMES:
                raise GraphError(f"{where}: module type {type_name} is not in the portable allowlist")
            if node.kwargs or len(node.args) != 1:
                raise GraphError(
                    f"{where}: leaf module {type_name} must be called with one positional tensor"
                )
            local_params = traced.module_params[node.name]
            local_buffers = traced.module_buffers[node.name]
            for name in local_params.values():
                need_param(name)
            for name in local_buffers.values():
                need_buffer(name)
            out_nodes.append(
                {
                    "name": node.name,
                    "op": "call_module",
                    "target": type_name,
                    "config": module_config(module),
                    "params": dict(local_params),
                    "buffers": dict(local_buffers),
                    "args": [encode_arg(a, where) for a in node.args],
                    "kwargs": {},
                }
            )
            continue
        name = _check_op(node.op, node.target, node.args, f"{where} ({node.op} {node.target})")
        out_nodes.append(
            {
                "name": node.name,
                "op": node.op,
                "target": name,
                "args": [encode_arg(a, where) for a in node.args],
                "kwargs": {
                    k: encode_arg(v, where) for k, v in node.kwargs.items() if k not in DROPPED_KWARGS
                },
            }
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": graph.model_name,
        "range": [lo, hi],
        "inputs": inputs,
        "outputs": outputs,
        "model_output": model_output,
        "params": params,
        "buffers": buffers,
        "nodes": out_nodes,
    }


def check_portable(traced: TracedModel) -> None:
    """Raise GraphError naming the first op of `traced` that cannot be described portably."""
    describe_stage(traced, 0, traced.graph.num_nodes)
