"""JSON meaning of wire values, tensors and messages, as used by the golden vectors in protocol/vectors/.

msgpack values map to JSON one to one, except: bin -> {"$bytes": "<hex>"}, and non-finite floats ->
{"$float": "nan" | "inf" | "-inf"}. A tensor is {"dtype", "shape", "codec", "params", "values"} with
`values` the decoded tensor flattened in C order. A message is {"type": <class name>, "fields": {...}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.messages import Call, Hello, Message, Reply, TensorMessage
from fusionnode.wire.tensors import decode_tensor, pack_encoded


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


# ---- shared by the golden-vector generators in protocol/vectors/ ------------------------------
def render_vector(vector: dict[str, Any]) -> str:
    """The canonical text of one golden-vector file."""
    return json.dumps(vector, indent=1, ensure_ascii=True) + "\n"


def replace_bytes(data: bytes, offset: int, new: bytes) -> bytes:
    """`data` with `new` written over it at `offset` (for invalid variants of a payload)."""
    return data[:offset] + new + data[offset + len(new) :]


def invalid_variant(description: str, enc: EncodedTensor, **changes: Any) -> dict[str, str]:
    """A variant of `enc` breaking one rule (`params` entries are merged into the original's)."""
    params = changes.pop("params", None)
    if params is not None:
        changes["params"] = {**enc.params, **params}
    return {"description": description, "hex": pack_encoded(dataclasses.replace(enc, **changes)).hex()}


def tensor_vector(description: str, enc: EncodedTensor, invalid: list[dict[str, str]]) -> dict[str, Any]:
    """A codec vector: the encoded bytes, their meaning, and variants a receiver must refuse."""
    return {
        "description": description,
        "kind": "tensor",
        "hex": pack_encoded(enc).hex(),
        "decoded": tensor_json(enc),
        "invalid": invalid,
    }


def write_or_check(
    build: Callable[[], dict[str, dict[str, Any]]], directory: Path, argv: list[str] | None, doc: str
) -> int:
    """A generator script's main: write `build()`'s vectors into `directory`, or with --check report
    the files that differ (exit 1)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the files on disk instead of writing"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    stale = []
    for name, vector in build().items():
        path = directory / f"{name}.json"
        text = render_vector(vector)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale vectors: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0
