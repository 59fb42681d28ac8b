"""The tensor-codec registry: the contract between `wire/` and `compress/`.

A codec turns a torch tensor into an `EncodedTensor` (codec name, msgpack-able
parameters, one bytes payload) and back. The wire layer frames EncodedTensors
without knowing what is inside; `decode` must validate everything it reads
against the declared dtype/shape and the limits, raising ProtocolError, never
allocating more than the limits allow.
"""

from __future__ import annotations

import dataclasses
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
