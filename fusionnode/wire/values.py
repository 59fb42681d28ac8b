"""The msgpack value model of protocol/SPEC.md: what may appear in a message body, packed and checked.

Allowed values: nil, bool, int (-2**63 .. 2**64-1), float, str (UTF-8), bin, array, and maps whose
keys are str. No extension types. Every container counts one level of nesting; strings, maps and
arrays are capped by `Limits`, and msgpack's own caps reject an oversized length before allocating.
"""

from __future__ import annotations

from typing import Any

import msgpack

from fusionnode.errors import ProtocolError
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits

INT_MIN = -(1 << 63)  # smallest msgpack int
INT_MAX = (1 << 64) - 1  # largest msgpack int


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed on the wire")


def _pairs_to_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("map with a duplicate key")
    return out


class _ContainerCount:
    """msgpack hooks that count the maps and arrays decoded and stop at `cap`: empty containers cost
    ~64 bytes of Python objects for each byte on the wire, so a byte cap alone does not bound memory."""

    def __init__(self, cap: int):
        self.left = cap

    def _take(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError("envelope holds more maps and arrays than max_containers")

    def map(self, pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
        self._take()
        return _pairs_to_map(pairs)

    def list(self, items: list[Any]) -> list[Any]:
        self._take()
        return items


def pack(obj: Any) -> bytes:
    """Canonical msgpack: str as str, bytes as bin, floats as float64, ints in their shortest form."""
    try:
        return msgpack.packb(obj, use_bin_type=True, use_single_float=False, datetime=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"value cannot be encoded as msgpack: {exc}") from exc


def unpack(buf: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode exactly one msgpack value from `buf`, within `limits`; ProtocolError on anything else."""
    count = _ContainerCount(limits.max_containers)
    try:
        obj = msgpack.unpackb(
            buf,
            raw=False,
            use_list=True,
            strict_map_key=True,
            object_pairs_hook=count.map,
            list_hook=count.list,
            timestamp=0,
            ext_hook=_refuse_ext,
            max_str_len=limits.max_string,
            max_bin_len=limits.max_frame_bytes,
            max_array_len=limits.max_container_len,
            max_map_len=limits.max_container_len,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed msgpack: {type(exc).__name__}: {exc}") from exc
    check_value(obj, limits)
    return obj


def check_value(obj: Any, limits: Limits = DEFAULT_LIMITS, depth: int = 0) -> None:
    """Raise ProtocolError unless `obj` is an allowed wire value within `limits` (depth = enclosing containers)."""
    if obj is None or isinstance(obj, (bool, float)):
        return
    if isinstance(obj, int):
        if not INT_MIN <= obj <= INT_MAX:
            raise ProtocolError(f"integer {obj} does not fit msgpack's 64-bit range")
        return
    if isinstance(obj, str):
        check_string(obj, limits)
        return
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return
    if isinstance(obj, (list, tuple, dict)):
        if depth + 1 > limits.max_depth:
            raise ProtocolError(f"nesting deeper than max_depth={limits.max_depth}")
        if len(obj) > limits.max_container_len:
            raise ProtocolError(
                f"container of {len(obj)} entries exceeds max_container_len={limits.max_container_len}"
            )
        if isinstance(obj, dict):
            for key, value in obj.items():
                if not isinstance(key, str):
                    raise ProtocolError(f"map keys must be strings, got {type(key).__name__}")
                check_string(key, limits)
                check_value(value, limits, depth + 1)
        else:
            for value in obj:
                check_value(value, limits, depth + 1)
        return
    raise ProtocolError(f"type {type(obj).__name__} is not a wire value")


def check_string(s: str, limits: Limits = DEFAULT_LIMITS) -> None:
    # a str of n code points takes at least n UTF-8 bytes: only encode when that bound could pass
    if len(s) > limits.max_string:
        raise ProtocolError(f"string of {len(s)} characters exceeds max_string={limits.max_string} bytes")
    if len(s) * 4 > limits.max_string and len(s.encode("utf-8", "surrogatepass")) > limits.max_string:
        raise ProtocolError(f"string exceeds max_string={limits.max_string} bytes of UTF-8")


def check_map(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} must be a map, got {type(obj).__name__}")
    return obj


def field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """Required field `key` of map `body`, of msgpack type `kind` (bool is not an int here)."""
    try:
        value = body[key]
    except KeyError:
        raise ProtocolError(f"{what}: missing field {key!r}") from None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ProtocolError(f"{what}: field {key!r} must be {_names(kinds)}, got bool")
    if not isinstance(value, kinds):
        raise ProtocolError(f"{what}: field {key!r} must be {_names(kinds)}, got {type(value).__name__}")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)
