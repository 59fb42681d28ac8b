"""Trace a torch module into an annotated OP-DAG (`OpGraph`).

Tracing: torch.fx symbolic tracing with a small set of standard layers kept as
`call_module` leaves (`allowlist.LEAF_MODULE_TYPES`: Linear, LayerNorm, Embedding,
Conv2d, BatchNorm2d, Dropout, exact types only); every other module, including
other torch.nn modules (ReLU, MaxPool2d, Sequential, ...) and subclasses of the
leaf types, is traced through into functions and methods.

Node ids: the fx graph order, which is topological, INCLUDING the placeholder
(model input) nodes at the start and the single output node at the end. A stage
range [lo, hi) is any contiguous slice: the stage holding node 0 is fed by the
driver, the stage holding node n-1 produces the model output (the loss is
computed there by the caller).

Costs are per sample: the sample input must have batch size 1. Annotation runs
the graph once on the sample (an fx Interpreter, like ShapeProp, that also
computes FLOPs, see `flops.py`); it works on the meta device, so huge models are
annotated without allocating their weights.

Parameters: `OpNode.param_names` lists each parameter by its canonical state-dict
name (the first name `named_parameters()` gives it, so a tied lm_head lists
"transformer.wte.weight"). A leaf module node owns its parameters' bytes. A
parameter read through `get_attr` is owned (bytes) by the get_attr node, and every
node consuming it also lists its name (with 0 bytes); edges out of get_attr nodes
carry 0 bytes, since parameter values travel by name, not as activations.

Non-tensor values (ints from `x.size()`, tuples from `split`) are edges like any
other but cannot cross a stage boundary: `tensor_only_cuts` tells the planner
which cuts carry tensors only; `describe_stage` refuses the others.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import traceback
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fusionnode.errors import ConfigError, GraphError
from fusionnode.graph import flops as flops_mod
from fusionnode.graph.allowlist import LEAF_MODULE_TYPES, TENSOR_DTYPES, module_type_name, op_name
from fusionnode.graph.dag import OpEdge, OpGraph, OpNode

log = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclasses.dataclass(frozen=True)
class TracedModel:
    gm: fx.GraphModule  # the traced module (shares parameters with the original model)
    graph: OpGraph  # annotated OP-DAG, node ids aligned with node_names
    node_names: list[str]  # fx node names in topological order: node_names[i] is graph.nodes[i]
    module_params: dict[str, dict[str, str]]  # call_module node name -> {local param name: canonical name}
    module_buffers: dict[str, dict[str, str]]  # call_module node name -> {local buffer name: state-dict name}
    attr_names: dict[str, tuple[str, str]]  # get_attr node name -> ("param" | "buffer", state-dict name)
    param_meta: dict[str, tuple[tuple[int, ...], str]]  # canonical param name -> (shape, dtype name)
    buffer_meta: dict[str, tuple[tuple[int, ...], str]]  # buffer name -> (shape, dtype name)


class _Tracer(fx.Tracer):
    """fx tracer that keeps the portable leaf modules and remembers where tracing failed."""

    def __init__(self) -> None:
        super().__init__()
        self._stack: list[str] = []
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return type(m) in LEAF_MODULE_TYPES

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            path = self.path_of_module(m)
        except NameError:
            path = "?"
        self._stack.append(f"{path or '<root>'} ({type(m).__name__})")
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self._stack[-1]
            raise
        finally:
            self._stack.pop()


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback line outside torch: the model code that failed."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno}: {(f.line or '').strip()}"


def _describe_value(value: Any) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype name, bytes) of a node's output for the OP-DAG."""
    if isinstance(value, torch.Tensor):
        dtype = TENSOR_DTYPES.get(value.dtype, str(value.dtype))
        return tuple(value.shape), dtype, value.numel() * value.element_size()
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return (), "tuple", sum(v.numel() * v.element_size() for v in value)
    if isinstance(value, torch.Size):
        return (), "torch.Size", 0
    return (), type(value).__name__, 0


class _Annotator(fx.Interpreter):
    """Runs the graph once and records per-node output metadata and FLOPs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.records: dict[fx.Node, tuple[float, tuple[int, ...], str, int]] = {}

    def run_node(self, n: fx.Node) -> Any:
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            try:
                result = getattr(self, n.op)(n.target, args, kwargs)
            except Exception as exc:
                raise GraphError(
                    f"node {n.name!r} ({n.op} {_target_name(self.module, n)}) failed on the sample input: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        op = _target_name(self.module, n)
        if n.op == "call_module":
            f = flops_mod.module_flops(op, self.module.get_submodule(n.target), result)
        elif n.op in ("call_function", "call_method"):
            f = flops_mod.function_flops(op, args, kwargs, result)
        else:
            f = 0.0
        shape, dtype, nbytes = _describe_value(result)
        if n.op in ("get_attr", "output"):
            nbytes = 0  # parameters travel by name; the output node has no consumer
        self.records[n] = (f, shape, dtype, nbytes)
        return result


def _target_name(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return module_type_name(type(gm.get_submodule(n.target)))
    if n.op == "call_function":
        return op_name(n.target)
    if n.op in ("call_method", "placeholder", "get_attr"):
        return str(n.target)
    return "output"


def trace_model(model: nn.Module, sample_input: torch.Tensor, model_name: str = "") -> TracedModel:
    """Trace `model` with torch.fx and annotate every node from one sample (batch size 1)."""
    if not isinstance(sample_input, torch.Tensor) or sample_input.dim() == 0:
        raise GraphError("sample_input must be a tensor with a batch dimension")
    if sample_input.shape[0] != 1:
        raise GraphError(
            f"trace with batch size 1 (costs are per sample), got shape {tuple(sample_input.shape)}"
        )
    label = model_name or type(model).__name__
    tracer = _Tracer()
    try:
        fx_graph = tracer.trace(model)
    except Exception as exc:
        where = tracer.failed_in or f"<root> ({type(model).__name__})"
        raise GraphError(
            f"cannot trace {label}: module {where}{_user_frame(exc)}: {type(exc).__name__}: {exc}"
        ) from exc
    gm = fx.GraphModule(tracer.root, fx_graph, label)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise GraphError(f"{label}: forward must take exactly one tensor input, got {len(placeholders)}")

    canon_params = {id(p): name for name, p in model.named_parameters()}  # first name of a tied weight
    canon_buffers = {id(b): name for name, b in model.named_buffers()}
    saved_buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    annotator = _Annotator(gm)
    was_training = model.training
    try:
        with torch.no_grad():
            annotator.run(sample_input)
    finally:
        with torch.no_grad():  # a BatchNorm in training mode must not keep stats from the sample
            for name, b in model.named_buffers():
                b.copy_(saved_buffers[name])
        model.train(was_training)

    nodes = list(gm.graph.nodes)
    ids = {n: i for i, n in enumerate(nodes)}
    module_params: dict[str, dict[str, str]] = {}
    module_buffers: dict[str, dict[str, str]] = {}
    attr_names: dict[str, tuple[str, str]] = {}
    param_meta: dict[str, tuple[tuple[int, ...], str]] = {}
    buffer_meta: dict[str, tuple[tuple[int, ...], str]] = {}

    def note_param(p: torch.Tensor) -> str:
        name = canon_params[id(p)]
        param_meta[name] = (tuple(p.shape), TENSOR_DTYPES.get(p.dtype, str(p.dtype)))
        return name

    def note_buffer(b: torch.Tensor) -> str:
        name = canon_buffers[id(b)]
        buffer_meta[name] = (tuple(b.shape), TENSOR_DTYPES.get(b.dtype, str(b.dtype)))
        return name

    op_nodes: list[OpNode] = []
    edges: list[OpEdge] = []
    for n in nodes:
        f, shape, dtype, nbytes = annotator.records[n]
        names: list[str] = []
        pbytes = 0
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            local = {k: note_param(p) for k, p in mod.named_parameters()}
            module_params[n.name] = local
            module_buffers[n.name] = {k: note_buffer(b) for k, b in mod.named_buffers() if b is not None}
            names = list(dict.fromkeys(local.values()))
            pbytes = sum(p.numel() * p.element_size() for p in dict.fromkeys(mod.parameters()))
        elif n.op == "get_attr":
            value = gm.get_parameter(n.target) if _is_param(gm, n.target) else None
            if value is not None:
                attr_names[n.name] = ("param", note_param(value))
                names = [attr_names[n.name][1]]
                pbytes = value.numel() * value.element_size()
            else:
                try:
                    buf = gm.get_buffer(n.target)
                except AttributeError as exc:
                    raise GraphError(
                        f"{label}: get_attr {n.target!r} is neither a parameter nor a buffer"
                    ) from exc
                attr_names[n.name] = ("buffer", note_buffer(buf))
        else:
            for inp in n.all_input_nodes:
                if inp.name in attr_names and attr_names[inp.name][0] == "param":
                    names.append(attr_names[inp.name][1])
        for inp in n.all_input_nodes:
            edges.append(OpEdge(src=ids[inp], dst=ids[n], bytes=annotator.records[inp][3]))
        op_nodes.append(
            OpNode(
                id=ids[n],
                name=n.name,
                kind=n.op,
                target=_target_name(gm, n),
                flops=f,
                param_bytes=pbytes,
                param_names=tuple(dict.fromkeys(names)),
                out_bytes=nbytes,
                out_shape=shape,
                out_dtype=dtype,
            )
        )
    seq_len = int(sample_input.shape[1]) if sample_input.dim() == 2 else 0
    graph = OpGraph(model_name=label, nodes=tuple(op_nodes), edges=tuple(edges), seq_len=seq_len)
    return TracedModel(
        gm=gm,
        graph=graph,
        node_names=[n.name for n in nodes],
        module_params=module_params,
        module_buffers=module_buffers,
        attr_names=attr_names,
        param_meta=param_meta,
        buffer_meta=buffer_meta,
    )


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


def tensor_only_cuts(graph: OpGraph) -> list[bool]:
    """ok[c] for c in 0..n: True when every edge crossing the cut before node c carries a tensor
    (or a parameter by name), so a stage boundary may be placed there."""
    n = graph.num_nodes
    bad = [0] * (n + 2)
    for e in graph.edges:
        src = graph.nodes[e.src]
        if src.kind == "get_attr" or src.out_dtype in TENSOR_DTYPES.values():
            continue
        bad[e.src + 1] += 1
        bad[e.dst + 1] -= 1
    out, acc = [], 0
    for c in range(n + 1):
        acc += bad[c]
        out.append(acc == 0)
    return out


def sample_for(spec: str, seq_len: int | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """A batch-1 sample input on the meta device for the model named by `spec`."""
    from fusionnode.models import model_info

    info = model_info(spec, vocab_size=vocab_size)
    if info.kind == "lm":
        t = info.seq_len if seq_len is None else seq_len
        if not 0 < t <= info.seq_len:
            raise ConfigError(f"seq_len {t} is outside 1..{info.seq_len} (max context of {spec!r})")
        return torch.zeros((1, t), dtype=torch.int64, device="meta")
    if seq_len is not None:
        raise ConfigError(f"seq_len does not apply to the vision model {spec!r}")
    return torch.zeros((1, *info.sample_shape), dtype=torch.float32, device="meta")


@functools.lru_cache(maxsize=16)
def trace_spec(spec: str, seq_len: int | None = None, vocab_size: int | None = None) -> TracedModel:
    """Build `spec` on the meta device and trace it at `seq_len` tokens (default: max context).
    Cached: callers must not mutate the result."""
    from fusionnode.models import build_model

    sample = sample_for(spec, seq_len, vocab_size)
    with torch.device("meta"):
        model = build_model(spec, vocab_size=vocab_size)
    traced = trace_model(model, sample, model_name=spec)
    log.debug(
        "traced %s: %d nodes, %.3g GFLOP/sample",
        spec,
        traced.graph.num_nodes,
        traced.graph.total_flops() / 1e9,
    )
    return traced


def graph_for(spec: str, seq_len: int | None = None, vocab_size: int | None = None) -> OpGraph:
    """The annotated OP-DAG of `spec` (built on meta, traced, cached); used by the planner."""
    return trace_spec(spec, seq_len, vocab_size).graph
