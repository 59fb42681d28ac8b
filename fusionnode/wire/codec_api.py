"""The tensor-codec registry: the contract between `wire/` and `compress/`.

A codec turns a torch tensor into an `EncodedTensor` (codec name, msgpack-able
parameters, one bytes payload) and back. The wire layer frames EncodedTensors
without knowing what is inside; `decode` must validate everything it reads
against the declared dtype/shape and the limits, raising ProtocolError, never
allocating more than the limits allow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import torch

from fusionnode.errors import ProtocolError

# logical dtypes that may cross the wire, by stable name
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")  # what a lossy codec may carry


def float_input(tensor: torch.Tensor, name: str) -> tuple[str, torch.Tensor, tuple[int, ...]]:
    """A lossy codec's input: (dtype name, the tensor detached on the CPU, its shape). Raises
    ValueError for a tensor that is not floating point."""
    dtype_name = DTYPE_NAMES.get(tensor.dtype)
    if dtype_name not in FLOAT_DTYPES:
        raise ValueError(f"{name} encodes floating tensors only, got {tensor.dtype}")
    x = tensor.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    return dtype_name, x, tuple(int(s) for s in x.shape)


def check_float_header(enc: EncodedTensor, name: str, max_elements: int) -> int:
    """A lossy codec's first checks: its codec name, a float dtype, a shape of non-negative ints
    within `max_elements`. Returns the element count; raises ProtocolError."""
    if enc.codec != name:
        raise ProtocolError(f"{name} decoder given codec {enc.codec!r}")
    if enc.dtype not in FLOAT_DTYPES:
        raise ProtocolError(f"{name} tensor dtype must be one of {FLOAT_DTYPES}, got {enc.dtype!r}")
    shape = enc.shape
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise ProtocolError(f"{name} shape must be non-negative ints, got {shape!r}")
    numel = math.prod(shape)
    if numel > max_elements:
        raise ProtocolError(f"{name} tensor of {numel} elements exceeds the limit of {max_elements}")
    return numel


@dataclasses.dataclass(frozen=True)
class EncodedTensor:
    dtype: str  # logical dtype of the decoded tensor, a key of DTYPES
    shape: tuple[int, ...]  # exact shape of the decoded tensor
    codec: str  # registered codec name: "raw", "fp16", "topk", ...
    params: dict[str, Any]  # codec parameters (ints, floats, strings only)
    data: bytes | memoryview  # the codec's payload (raw/fp16 give a read-only memoryview: no copy)


class Codec(Protocol):
    name: str

    def encode(self, tensor: torch.Tensor, **options: Any) -> EncodedTensor: ...

    def decode(self, enc: EncodedTensor, max_elements: int) -> torch.Tensor: ...


_REGISTRY: dict[str, Codec] = {}


def register_codec(codec: Codec) -> Codec:
    if codec.name in _REGISTRY and _REGISTRY[codec.name] is not codec:
        raise ValueError(f"codec {codec.name!r} is already registered")
    _REGISTRY[codec.name] = codec
    return codec


def get_codec(name: str) -> Codec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ProtocolError(f"unknown tensor codec {name!r} (known: {sorted(_REGISTRY)})") from None


def registered_codecs() -> list[str]:
    return sorted(_REGISTRY)
