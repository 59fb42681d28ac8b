"""Frozen typed messages over msgpack maps: each field checked against its annotation on the way in.

`TypedMessage.from_wire` refuses a map with a missing required field, an unknown field, or a value
of the wrong type (a bool is no int; an int is accepted as a float), naming the message and the
field; `to_wire` leaves optional fields that are None out. `wire/job.py` builds the job protocol's
messages on it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar

from fusionnode.errors import ProtocolError


class FieldError(ProtocolError):
    """A map that does not match its message type (missing, unknown or mistyped field)."""


def _bad(what: str) -> FieldError:
    return FieldError(what)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check(value: Any, tp: Any, where: str) -> Any:
    """`value` as the annotation `tp` (bool is no int, an int is a float); FieldError otherwise."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _check(value, inner[0], where)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _bad(f"{where} must be a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _bad(f"{where} must be a map, got {type(value).__name__}")
        kt, vt = typing.get_args(tp)
        return {_check(k, kt, f"{where} key"): _check(v, vt, f"{where}[{k!r:.40}]") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(f"{where} must be a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(f"{where} must be an integer, got {value!r:.40}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise _bad(f"{where} must be {tp.__name__}, got {type(value).__name__}")
        return value
    raise TypeError(f"unsupported annotation {_type_name(tp)} in {where}")


class TypedMessage:
    """Base of typed messages (frozen dataclasses): `to_wire` gives the map that crosses the wire,
    `from_wire` checks one and builds the message (missing, unknown or mistyped fields refused)."""

    _hints: ClassVar[dict[type, dict[str, Any]]] = {}

    @classmethod
    def _fields(cls) -> dict[str, Any]:
        hints = TypedMessage._hints.get(cls)
        if hints is None:
            hints = typing.get_type_hints(cls)
            hints = {f.name: hints[f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
            TypedMessage._hints[cls] = hints
        return hints

    def to_wire(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None:
                continue  # an optional field left out
            out[f.name] = value
        return out

    @classmethod
    def from_wire(cls, args: Any) -> Any:
        name = cls.__name__
        if not isinstance(args, dict):
            raise _bad(f"{name} must be a map, got {type(args).__name__}")
        hints = cls._fields()
        unknown = sorted(str(k) for k in args if k not in hints)
        if unknown:
            raise _bad(f"{name}: unknown field(s) {unknown[:5]}")
        values = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in args:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise _bad(f"{name}: missing field {f.name!r}")
                continue
            values[f.name] = _check(args[f.name], hints[f.name], f"{name}.{f.name}")
        return cls(**values)

    def replace(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


message: Callable[[type], type] = dataclasses.dataclass(frozen=True)
