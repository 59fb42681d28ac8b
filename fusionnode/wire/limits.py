"""Hard limits a decoder enforces before it allocates anything (protocol/SPEC.md, "Limits")."""

from __future__ import annotations

import dataclasses

DEFAULT_MAX_FRAME_BYTES = 256 << 20  # bytes: a whole frame, header included (256 MiB)
DEFAULT_MAX_TENSOR_ELEMENTS = 64 << 20  # elements in one tensor (64 Mi)
DEFAULT_MAX_TENSORS = 256  # tensors in one message
DEFAULT_MAX_STRING = 64 << 10  # bytes of UTF-8 in one string (64 KiB)
DEFAULT_MAX_DEPTH = 16  # nesting of maps/arrays inside a message body
DEFAULT_MAX_CONTAINER_LEN = 65536  # entries in one map or array
DEFAULT_MAX_NDIM = 32  # dimensions of one tensor
DEFAULT_MAX_ENVELOPE_BYTES = 1 << 20  # bytes: a frame's msgpack envelope (meta_len), read before the
# peer's byte budget is charged for the rest of the frame (1 MiB; a GPT-2-XL stage description is ~0.3 MiB)
DEFAULT_MAX_CONTAINERS = 65536  # maps and arrays decoded from one envelope (empty ones expand ~70x)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Caps on what a peer may make us allocate. A frame over any of them is a ProtocolError."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_tensor_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS
    max_tensors: int = DEFAULT_MAX_TENSORS
    max_string: int = DEFAULT_MAX_STRING
    max_depth: int = DEFAULT_MAX_DEPTH
    max_container_len: int = DEFAULT_MAX_CONTAINER_LEN
    max_ndim: int = DEFAULT_MAX_NDIM
    max_envelope_bytes: int = DEFAULT_MAX_ENVELOPE_BYTES
    max_containers: int = DEFAULT_MAX_CONTAINERS

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits.{field.name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()
