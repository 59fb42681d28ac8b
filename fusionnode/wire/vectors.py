"""JSON meaning of wire values, tensors and messages, as used by the golden vectors in protocol/vectors/.

msgpack values map to JSON one to one, except: bin -> {"$bytes": "<hex>"}, and non-finite floats ->
{"$float": "nan" | "inf" | "-inf"}. A tensor is {"dtype", "shape", "codec", "params", "values"} with
`values` the decoded tensor flattened in C order. A message is {"type": <class name>, "fields": {...}}.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.messages import Call, Hello, Message, Reply, TensorMessage
from fusionnode.wire.tensors import decode_tensor


def json_value(v: Any) -> Any:
    """A msgpack wire value as JSON-able data."""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(v).hex()}
    if isinstance(v, float) and not math.isfinite(v):
        return {"$float": repr(v)}
    if isinstance(v, dict):
        return {k: json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    return v


def tensor_json(enc: EncodedTensor, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The decoded meaning of one encoded tensor."""
    t = decode_tensor(enc, limits).reshape(-1)
    if t.dtype is torch.bool:
        values: list[Any] = [bool(x) for x in t.tolist()]
    elif t.is_floating_point():
        values = [json_value(x) for x in t.to(torch.float64).tolist()]
    else:
        values = t.tolist()
    return {
        "dtype": enc.dtype,
        "shape": list(enc.shape),
        "codec": enc.codec,
        "params": json_value(enc.params),
        "values": values,
    }


def message_json(msg: Message, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The decoded meaning of one message."""
    if isinstance(msg, Hello):
        fields: dict[str, Any] = {
            "peer_id": msg.peer_id,
            "software": msg.software,
            "protocol": list(msg.protocol),
        }
    elif isinstance(msg, Call):
        fields = {"method": msg.method, "args": json_value(msg.args)}
    elif isinstance(msg, Reply):
        fields = {"ok": msg.ok, "result": json_value(msg.result), "error": msg.error}
    elif isinstance(msg, TensorMessage):
        fields = {
            "kind": msg.kind,
            "meta": json_value(msg.meta),
            "tensors": {name: tensor_json(enc, limits) for name, enc in msg.tensors.items()},
        }
    else:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    return {"type": type(msg).__name__, "fields": fields}
