"""Stage executor for remote autodiff: a portable sub-DAG rebuilt and run with local autograd.

`StageModule` rebuilds a stage from its portable description (protocol/SUBDAG.md)
through the allowlist in `fusionnode.graph.allowlist` (no eval, no pickle) and runs
it on a dict of named tensors. Parameters are keyed by their state-dict name in
the ORIGINAL model, so a tied weight used by two stages is two copies with the same
name whose gradients the optimizer host sums.

`StageRunner` keeps, per micro-batch, the autograd graph between the forward and
the backward pass: inputs become fresh leaves, output gradients that arrive later
are pushed back through the kept graph, and the gradients of the inputs are
returned to be sent upstream.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusionnode.errors import GraphError, ProtocolError
from fusionnode.graph import allowlist, portable
from fusionnode.wire.codec_api import DTYPE_NAMES, DTYPES

log = logging.getLogger(__name__)

MAX_DESCRIPTION_NODES = 200_000  # nodes per stage description
MAX_STAGE_STATE_BYTES = 64 * 2**30  # bytes of parameters + buffers one stage may declare
DEFAULT_MAX_IN_FLIGHT = 8  # micro-batches whose autograd graph a StageRunner keeps at once


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise GraphError(f"invalid stage description: {msg}")


def _tensor_specs(desc: dict, key: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    raw = desc.get(key, {})
    _require(isinstance(raw, dict), f"{key!r} must be a map")
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, spec in raw.items():
        _require(isinstance(name, str) and isinstance(spec, dict), f"{key}: malformed entry {name!r}")
        shape, dtype = spec.get("shape"), spec.get("dtype")
        _require(
            isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape),
            f"{key}.{name}: bad shape {shape!r}",
        )
        _require(dtype in DTYPES, f"{key}.{name}: unknown dtype {dtype!r}")
        out[name] = (tuple(shape), DTYPES[dtype])
    return out


def state_bytes(desc: dict) -> int:
    """Bytes of the parameters and buffers a description declares (GraphError if malformed)."""
    _require(isinstance(desc, dict), "not a map")
    specs = (*_tensor_specs(desc, "params").values(), *_tensor_specs(desc, "buffers").values())
    return sum(math.prod(s) * d.itemsize for s, d in specs)


def _validate(desc: dict) -> None:
    """Structural checks of a description from the wire, before anything is allocated or run."""
    _require(isinstance(desc, dict), "not a map")
    _require(
        desc.get("format") == portable.FORMAT, f"format {desc.get('format')!r} is not {portable.FORMAT!r}"
    )
    _require(
        desc.get("version") == portable.VERSION, f"version {desc.get('version')!r} is not {portable.VERSION}"
    )
    inputs, outputs, nodes = desc.get("inputs"), desc.get("outputs"), desc.get("nodes")
    _require(
        isinstance(inputs, list) and all(isinstance(x, str) for x in inputs), "inputs must be a list of names"
    )
    _require(
        isinstance(outputs, list) and all(isinstance(x, str) for x in outputs),
        "outputs must be a list of names",
    )
    _require(isinstance(nodes, list) and len(nodes) <= MAX_DESCRIPTION_NODES, "nodes must be a bounded list")
    _require(len(set(inputs)) == len(inputs), "duplicate input names")
    params = _tensor_specs(desc, "params")
    buffers = _tensor_specs(desc, "buffers")
    _require(not set(params) & set(buffers), "a name is both a parameter and a buffer")
    total = sum(math.prod(s) * d.itemsize for s, d in (*params.values(), *buffers.values()))
    _require(
        total <= MAX_STAGE_STATE_BYTES, f"declares {total} bytes of state, limit {MAX_STAGE_STATE_BYTES}"
    )
    functions = allowlist.allowed_functions()
    defined = set(inputs)
    for node in nodes:
        _require(isinstance(node, dict) and isinstance(node.get("name"), str), f"malformed node {node!r}")
        name, op, target = node["name"], node.get("op"), node.get("target")
        _require(name not in defined, f"node name {name!r} defined twice")
        if op in ("get_param", "get_buffer"):
            table = params if op == "get_param" else buffers
            _require(target in table, f"node {name!r} reads undeclared {op[4:]} {target!r}")
        else:
            args, kwargs = node.get("args"), node.get("kwargs")
            _require(isinstance(args, list) and isinstance(kwargs, dict), f"node {name!r}: args/kwargs")
            _require(all(isinstance(k, str) for k in kwargs), f"node {name!r}: kwargs keys must be strings")
            if op == "call_function":
                if target not in functions:
                    raise GraphError(f"node {name!r}: function {target!r} is not in this worker's allowlist")
                if target == "builtins.getattr":
                    _require(len(args) == 2 and args[1] in allowlist.GETATTR_NAMES, f"node {name!r}: getattr")
            elif op == "call_method":
                if target not in allowlist.METHOD_NAMES:
                    raise GraphError(f"node {name!r}: tensor method {target!r} is not in the allowlist")
                _require(len(args) >= 1, f"node {name!r}: method call without a receiver")
            elif op == "call_module":
                if target not in allowlist.MODULE_NAMES:
                    raise GraphError(f"node {name!r}: module type {target!r} is not in the allowlist")
                _require(len(args) == 1 and not kwargs, f"node {name!r}: leaf module takes one tensor")
                _require(isinstance(node.get("config"), dict), f"node {name!r}: missing config")
                mp, mb = node.get("params", {}), node.get("buffers", {})
                _require(isinstance(mp, dict) and isinstance(mb, dict), f"node {name!r}: params/buffers maps")
                _require(
                    set(mp) <= set(allowlist.MODULE_PARAMS[target]), f"node {name!r}: unexpected params {mp}"
                )
                _require(
                    set(mb) <= set(allowlist.MODULE_BUFFERS.get(target, ())), f"node {name!r}: buffers {mb}"
                )
                _require(
                    all(v in params for v in mp.values()), f"node {name!r}: undeclared parameter in {mp}"
                )
                _require(all(v in buffers for v in mb.values()), f"node {name!r}: undeclared buffer in {mb}")
            else:
                raise GraphError(f"node {name!r}: op {op!r} is not portable")
            refs = portable.arg_refs(args) + portable.arg_refs(list(kwargs.values()))
            for ref in refs:
                _require(ref in defined, f"node {name!r} uses {ref!r} before it is defined")
        defined.add(name)
    for out in outputs:
        _require(out in defined, f"output {out!r} is never defined")
    mo = desc.get("model_output")
    _require(mo is None or mo in outputs, f"model_output {mo!r} is not an output")


def _check_tensor(name: str, value: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ProtocolError(f"{name}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape or value.dtype != dtype:
        raise ProtocolError(
            f"{name}: expected shape {list(shape)} {DTYPE_NAMES.get(dtype, dtype)}, "
            f"got {list(value.shape)} {DTYPE_NAMES.get(value.dtype, value.dtype)}"
        )
    return value


class StageModule(nn.Module):
    """One stage (a contiguous sub-DAG) of a model, rebuilt from its portable description."""

    def __init__(self, desc: dict, device: torch.device) -> None:
        super().__init__()
        _validate(desc)
        self.description = desc
        self.input_names: list[str] = list(desc["inputs"])
        self.output_names: list[str] = list(desc["outputs"])
        self.model_output: str | None = desc.get("model_output")
        self._nodes: list[dict] = desc["nodes"]
        self._param_specs = _tensor_specs(desc, "params")
        self._buffer_specs = _tensor_specs(desc, "buffers")
        # nn.Module attribute names cannot contain dots: register p0.. / b0.. and keep the map
        self._param_keys: dict[str, str] = {}
        for i, (name, (shape, dtype)) in enumerate(self._param_specs.items()):
            key = f"p{i}"
            self._param_keys[name] = key
            self.register_parameter(key, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        self._buffer_keys: dict[str, str] = {}
        for i, (name, (shape, dtype)) in enumerate(self._buffer_specs.items()):
            key = f"b{i}"
            self._buffer_keys[name] = key
            self.register_buffer(key, torch.zeros(shape, dtype=dtype, device=device))
        self.device = torch.device(device)

    @classmethod
    def from_description(
        cls, desc: dict, params: dict[str, torch.Tensor] | None = None, device: str | torch.device = "cpu"
    ) -> StageModule:
        """Rebuild a stage; `params` (state-dict name -> tensor, parameters AND buffers of the
        stage) must match the description exactly: same name set, shapes and dtypes. Without
        `params` the state is allocated uninitialised, to be filled by `load_state`."""
        if params is not None:  # refuse a mismatch before allocating what the description declares
            _validate(desc)
            expected = set(_tensor_specs(desc, "params")) | set(_tensor_specs(desc, "buffers"))
            if set(params) != expected:
                missing, extra = sorted(expected - set(params)), sorted(set(params) - expected)
                raise ProtocolError(f"stage state mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
        module = cls(desc, torch.device(device))
        if params is not None:
            module.load_state(params)
        return module

    def state_names(self) -> list[str]:
        """State-dict names this stage needs: parameters, then buffers."""
        return [*self._param_specs, *self._buffer_specs]

    def _check_names(self, values: dict[str, torch.Tensor], *, partial: bool) -> None:
        """ProtocolError unless `values` names this stage's state exactly (a subset, if `partial`)."""
        expected, given = set(self._param_specs) | set(self._buffer_specs), set(values)
        if not given <= expected or (not partial and given != expected):
            missing, extra = sorted(expected - given), sorted(given - expected)
            raise ProtocolError(f"stage state mismatch: missing {missing[:5]}, unexpected {extra[:5]}")

    def load_state(self, values: dict[str, torch.Tensor], *, partial: bool = False) -> None:
        """Copy parameter/buffer values in by state-dict name, with exact shape and dtype checks
        (never a broadcast). With partial=True a subset of names may be given."""
        self._check_names(values, partial=partial)
        with torch.no_grad():
            for name, value in values.items():
                if name in self._param_specs:
                    shape, dtype = self._param_specs[name]
                    target = getattr(self, self._param_keys[name])
                else:
                    shape, dtype = self._buffer_specs[name]
                    target = getattr(self, self._buffer_keys[name])
                target.copy_(_check_tensor(name, value, shape, dtype))

    def bind_state(self, values: dict[str, torch.Tensor]) -> None:
        """`load_state` (every name, exact shapes and dtypes) without the copy: the parameters become
        `values` themselves (buffers are still copied). For a caller that holds `values` unchanged for
        as long as it uses the module and binds anew before each use (the check process: each check
        binds the parameters in its own shared buffer; the recompute only reads them)."""
        self._check_names(values, partial=False)
        for name, value in values.items():  # every check before any write: a bad set changes nothing
            _check_tensor(name, value, *(self._param_specs.get(name) or self._buffer_specs[name]))
        with torch.no_grad():
            for name, value in values.items():
                if name in self._param_specs:
                    getattr(self, self._param_keys[name]).data = value
                else:
                    getattr(self, self._buffer_keys[name]).copy_(value)

    def named_stage_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters by their state-dict name in the ORIGINAL model."""
        return {name: getattr(self, key) for name, key in self._param_keys.items()}

    def named_stage_buffers(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, key) for name, key in self._buffer_keys.items()}

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if set(inputs) != set(self.input_names):
            raise ProtocolError(f"stage inputs {sorted(inputs)} differ from the expected {self.input_names}")
        env: dict[str, Any] = dict(inputs)
        dev = self.device
        for node in self._nodes:
            op, target, name = node["op"], node["target"], node["name"]
            if op == "get_param":
                env[name] = getattr(self, self._param_keys[target])
                continue
            if op == "get_buffer":
                env[name] = getattr(self, self._buffer_keys[target])
                continue
            args = portable.decode_arg(node["args"], env, dev)
            kwargs = {k: portable.decode_arg(v, env, dev) for k, v in node["kwargs"].items()}
            if op == "call_function":
                allowlist.check_scalar_arith(target, args, kwargs)
                env[name] = allowlist.allowed_functions()[target](*args, **kwargs)
            elif op == "call_method":
                env[name] = getattr(args[0], target)(*args[1:], **kwargs)
            else:  # call_module, validated
                p = {k: getattr(self, self._param_keys[v]) for k, v in node.get("params", {}).items()}
                b = {k: getattr(self, self._buffer_keys[v]) for k, v in node.get("buffers", {}).items()}
                env[name] = portable.run_module(target, node["config"], p, b, args[0], self.training)
        return {name: env[name] for name in self.output_names}


class StageRunner:
    """Micro-batch bookkeeping of remote autodiff for one stage: the executor the worker runs.

    forward(mb) keeps mb's autograd graph until backward(mb) (or drop(mb)) frees it;
    at most `max_in_flight` micro-batches are kept at once. Inputs move to the module's
    device; with `autocast` (a CUDA device with bf16) the forward runs under bf16 autocast
    while gradients from the wire may stay float32. `passthrough` names inputs that only
    cross this stage: when the module does not produce them they are sent on unchanged
    and their gradients come straight back. With `zero_unused_grads=False` an input that
    receives no gradient is left out of backward's result instead of given zeros."""

    def __init__(
        self,
        module: StageModule,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        *,
        passthrough: tuple[str, ...] | list[str] = (),
        autocast: bool = False,
        zero_unused_grads: bool = True,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.module = module
        self.max_in_flight = max_in_flight
        self.passthrough = [n for n in passthrough if n not in module.output_names]
        self.autocast = autocast
        self.zero_unused_grads = zero_unused_grads
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}
        self._outputs: dict[int, dict[str, torch.Tensor]] = {}
        self._losses: dict[int, torch.Tensor] = {}

    @property
    def in_flight(self) -> list[int]:
        return sorted(self._inputs)

    def _admit(
        self, mb: int, inputs: dict[str, torch.Tensor], requires_grad: bool
    ) -> dict[str, torch.Tensor]:
        if mb in self._inputs:
            raise ValueError(f"micro-batch {mb} is already in flight")
        if len(self._inputs) >= self.max_in_flight:
            raise RuntimeError(
                f"{len(self._inputs)} micro-batches in flight (limit {self.max_in_flight}); "
                f"run backward before forwarding micro-batch {mb}"
            )
        extra = set(inputs) - set(self.module.input_names) - set(self.passthrough)
        if extra:
            raise ProtocolError(
                f"stage inputs {sorted(inputs)} differ from the expected {self.module.input_names}"
            )
        leaves = {}
        for name, t in inputs.items():
            leaf = t.detach().to(self.module.device)
            if requires_grad and leaf.is_floating_point():
                leaf.requires_grad_(True)
            leaves[name] = leaf
        return leaves

    def _run_module(self, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with ctx:
            outputs = self.module({n: leaves[n] for n in self.module.input_names if n in leaves})
        for name in self.passthrough:  # crosses this stage unchanged; its gradient comes back the same way
            if name in leaves:
                outputs[name] = leaves[name]
        return outputs

    def forward(
        self, mb: int, inputs: dict[str, torch.Tensor], requires_grad_inputs: bool = True
    ) -> dict[str, torch.Tensor]:
        """Run the stage on micro-batch `mb`, keep its graph, return detached outputs to send on
        (the module's outputs and the pass-through inputs)."""
        leaves = self._admit(mb, inputs, requires_grad_inputs)
        outputs = self._run_module(leaves)
        self._inputs[mb], self._outputs[mb] = leaves, outputs
        return {k: v.detach() for k, v in outputs.items()}

    def forward_loss(
        self, mb: int, inputs: dict[str, torch.Tensor], targets: torch.Tensor, loss_scale: float = 1.0
    ) -> float:
        """Last stage: loss = cross_entropy(logits.view(-1, V), targets.view(-1)) * loss_scale.
        Keeps the graph for backward_loss; returns the UNSCALED loss value (for metrics)."""
        name = self.module.model_output
        if name is None:
            raise GraphError("forward_loss on a stage that does not produce the model output")
        leaves = self._admit(mb, inputs, True)
        outputs = self._run_module(leaves)
        logits = outputs[name]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1).to(logits.device)
        )
        self._inputs[mb], self._outputs[mb] = leaves, outputs
        self._losses[mb] = loss * loss_scale
        return float(loss.detach())

    def backward(self, mb: int, output_grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Back-propagate `output_grads` (by output name; missing or None = no gradient) through
        mb's graph; accumulate parameter .grad; return gradients of the floating inputs (zeros
        for an input the stage does not differentiate through, or left out when
        zero_unused_grads is off); free mb's graph. A gradient has exactly its output's shape;
        a floating gradient of another precision (float32 from the wire for a bf16 output) is
        cast to the output's dtype."""
        if mb not in self._inputs:
            raise ValueError(f"micro-batch {mb} is not in flight")
        outputs = self._outputs[mb]
        unknown = set(output_grads) - set(outputs)
        if unknown:
            raise ProtocolError(f"gradients for unknown outputs {sorted(unknown)}")
        tensors, grads = [], []
        for name, grad in output_grads.items():
            out = outputs[name]
            if grad is None or not out.is_floating_point() or not out.requires_grad:
                continue
            if isinstance(grad, torch.Tensor) and grad.is_floating_point() and grad.dtype != out.dtype:
                grad = grad.to(out.dtype)
            _check_tensor(f"gradient of {name}", grad, tuple(out.shape), out.dtype)
            tensors.append(out)
            grads.append(grad.to(out.device))
        return self._run_backward(mb, tensors, grads)

    def backward_loss(self, mb: int) -> dict[str, torch.Tensor]:
        """Back-propagate the scaled loss of forward_loss(mb); return the input gradients."""
        if mb not in self._losses:
            raise ValueError(f"micro-batch {mb} has no loss in flight")
        loss = self._losses[mb]
        return self._run_backward(mb, [loss], [torch.ones_like(loss)])

    def _run_backward(
        self, mb: int, tensors: list[torch.Tensor], grads: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        inputs = self._inputs[mb]
        try:
            if tensors:
                torch.autograd.backward(tensors, grads)
            return {
                name: (t.grad if t.grad is not None else torch.zeros_like(t))
                for name, t in inputs.items()
                if t.is_floating_point()
                and t.requires_grad
                and (t.grad is not None or self.zero_unused_grads)
            }
        finally:
            self.drop(mb)

    def drop(self, mb: int) -> None:
        """Forget micro-batch mb (after backward, or when a step is abandoned)."""
        self._inputs.pop(mb, None)
        self._outputs.pop(mb, None)
        self._losses.pop(mb, None)
