"""Frozen, tagged wire messages and their frames (protocol/SPEC.md, "Messages").

A frame is the 24-byte header of `frames`, a msgpack envelope (a map, one schema per message type)
and, for TensorMessage, the tensor payloads laid out after the envelope: big payloads never pass
through msgpack, so decoding hands out zero-copy views of the frame.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from typing import Any, ClassVar, Union

import torch

from fusionnode.errors import ProtocolError
from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.frames import (
    FLAG_CRC32,
    HEADER_LEN,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Header,
    pack_header,
    parse_header,
    payload_offsets,
)
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.tensors import (
    check_encoded,
    decode_tensor,
    descriptor,
    encode_tensor,
    parse_descriptor,
)
from fusionnode.wire.values import check_map, check_value, field, pack, unpack

__all__ = [
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "Call",
    "Hello",
    "Message",
    "Reply",
    "TensorMessage",
    "decode_message",
    "encode_message",
    "frame_parts",
]

logger = logging.getLogger(__name__)

BytesLike = bytes | bytearray | memoryview


@dataclasses.dataclass(frozen=True)
class Hello:
    """First message on a connection: who I am and which protocol version I speak."""

    TYPE: ClassVar[int] = 1
    peer_id: str  # libp2p peer id (base58) of the sender
    software: str  # e.g. "fusionnode/0.1.0"
    protocol: tuple[int, int] = (PROTOCOL_MAJOR, PROTOCOL_MINOR)  # (major, minor) the sender speaks


@dataclasses.dataclass(frozen=True)
class Call:
    """A request: run `method` with keyword `args`; answered by one Reply."""

    TYPE: ClassVar[int] = 2
    method: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Reply:
    """The answer to one Call: `result` when ok, else a human-readable `error`."""

    TYPE: ClassVar[int] = 3
    ok: bool
    result: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str = ""


@dataclasses.dataclass(frozen=True)
class TensorMessage:
    """Named tensors with metadata: activations, gradients, parameters.

    `kind` says what they are (a training job's kinds: `wire.job.TensorKind`); `meta` carries job id,
    step, micro-batch, stage, ...; `tensors` maps a name to its encoded form.
    """

    TYPE: ClassVar[int] = 4
    kind: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    tensors: dict[str, EncodedTensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_tensors(
        cls,
        kind: str,
        meta: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        codec: str = "raw",
        **options: Any,
    ) -> TensorMessage:
        """Encode every tensor with the same codec."""
        return cls(kind, meta, {name: encode_tensor(t, codec, **options) for name, t in tensors.items()})

    def decode_tensors(self, limits: Limits = DEFAULT_LIMITS) -> dict[str, torch.Tensor]:
        return {name: decode_tensor(enc, limits) for name, enc in self.tensors.items()}


Message = Union[Hello, Call, Reply, TensorMessage]  # noqa: UP007 - a runtime alias, also for Python 3.10
MESSAGE_TYPES: dict[int, type] = {cls.TYPE: cls for cls in (Hello, Call, Reply, TensorMessage)}
MESSAGE_TYPE_CODES = frozenset(MESSAGE_TYPES)


# ---------------------------------------------------------------- envelopes


def _envelope(msg: Message, limits: Limits) -> tuple[dict[str, Any], list[EncodedTensor]]:
    """The msgpack map of `msg` (canonical key order) and the tensors whose payloads follow it."""
    if isinstance(msg, Hello):
        proto = msg.protocol
        if (
            not isinstance(proto, (tuple, list))
            or len(proto) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in proto)
        ):
            raise ProtocolError(f"Hello.protocol must be (major, minor) with 0..255 each, got {proto!r}")
        _expect(msg.peer_id, str, "Hello.peer_id")
        _expect(msg.software, str, "Hello.software")
        return {"peer_id": msg.peer_id, "software": msg.software, "protocol": list(proto)}, []
    if isinstance(msg, Call):
        _expect(msg.method, str, "Call.method")
        _expect(msg.args, dict, "Call.args")
        return {"method": msg.method, "args": msg.args}, []
    if isinstance(msg, Reply):
        _expect(msg.ok, bool, "Reply.ok")
        _expect(msg.result, dict, "Reply.result")
        _expect(msg.error, str, "Reply.error")
        return {"ok": msg.ok, "result": msg.result, "error": msg.error}, []
    if isinstance(msg, TensorMessage):
        _expect(msg.kind, str, "TensorMessage.kind")
        _expect(msg.meta, dict, "TensorMessage.meta")
        _expect(msg.tensors, dict, "TensorMessage.tensors")
        if len(msg.tensors) > limits.max_tensors:
            raise ProtocolError(f"{len(msg.tensors)} tensors exceed max_tensors={limits.max_tensors}")
        descriptors: dict[str, Any] = {}
        for name, enc in msg.tensors.items():
            _expect(name, str, "tensor name")
            check_encoded(enc, limits)
            desc = descriptor(enc)
            desc["nbytes"] = len(enc.data)
            descriptors[name] = desc
        return {"kind": msg.kind, "meta": msg.meta, "tensors": descriptors}, list(msg.tensors.values())
    raise ProtocolError(f"not a wire message: {type(msg).__name__}")


def _expect(value: Any, kind: type, what: str) -> None:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ProtocolError(f"{what} must be {kind.__name__}, got {type(value).__name__}")


def _parse_envelope(msg_type: int, obj: Any, limits: Limits) -> tuple[Message, list[tuple[str, tuple, int]]]:
    """Message from its envelope; TensorMessage gets tensors with empty payloads plus (name, header, nbytes)."""
    cls = MESSAGE_TYPES[msg_type]
    what = cls.__name__
    body = check_map(obj, what)
    if cls is Hello:
        proto = field(body, "protocol", list, what)
        if len(proto) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in proto
        ):
            raise ProtocolError(f"Hello: protocol must be [major, minor] with 0..255 each, got {proto!r}")
        return Hello(
            field(body, "peer_id", str, what), field(body, "software", str, what), (proto[0], proto[1])
        ), []
    if cls is Call:
        return Call(field(body, "method", str, what), field(body, "args", dict, what)), []
    if cls is Reply:
        return Reply(
            field(body, "ok", bool, what), field(body, "result", dict, what), field(body, "error", str, what)
        ), []
    kind = field(body, "kind", str, what)
    meta = field(body, "meta", dict, what)
    raw_tensors = field(body, "tensors", dict, what)
    if len(raw_tensors) > limits.max_tensors:
        raise ProtocolError(f"{len(raw_tensors)} tensors exceed max_tensors={limits.max_tensors}")
    layout = []
    for name, desc in raw_tensors.items():
        header = parse_descriptor(desc, f"tensor {name!r}", limits)
        nbytes = field(desc, "nbytes", int, f"tensor {name!r}")
        if nbytes < 0:
            raise ProtocolError(f"tensor {name!r}: negative nbytes {nbytes}")
        layout.append((name, header, nbytes))
    return TensorMessage(kind, meta, {}), layout


def _check_body_len(header: Header, layout: list[tuple[str, tuple, int]]) -> list[int]:
    offsets, body_len = payload_offsets(header.meta_len, [nbytes for _, _, nbytes in layout])
    if body_len != header.body_len:
        raise ProtocolError(
            f"header body_len {header.body_len} disagrees with the envelope's payload layout ({body_len} bytes)"
        )
    return offsets


def parse_head(
    buf: BytesLike, limits: Limits = DEFAULT_LIMITS
) -> tuple[Header, Message, list[tuple[str, tuple, int]], list[int]]:
    """Header and envelope from `buf` (at least HEADER_LEN + meta_len bytes), checked for consistency.

    Lets a stream reader refuse a frame before it allocates room for the payloads.
    """
    header = parse_header(buf, MESSAGE_TYPE_CODES, limits)
    end = HEADER_LEN + header.meta_len
    if len(buf) < end:
        raise ProtocolError(f"truncated frame: {len(buf)} bytes, the envelope ends at {end}")
    obj = unpack(memoryview(buf)[HEADER_LEN:end], limits)
    msg, layout = _parse_envelope(header.msg_type, obj, limits)
    offsets = _check_body_len(header, layout)
    return header, msg, layout, offsets


# ---------------------------------------------------------------- frames


def frame_parts(msg: Message, *, checksum: bool = False, limits: Limits = DEFAULT_LIMITS) -> list[BytesLike]:
    """The frame of `msg` as a list of buffers (header, envelope, padding and payloads), copying no payload."""
    body, tensors = _envelope(msg, limits)
    check_value(body, limits)
    envelope = pack(body)
    offsets, body_len = payload_offsets(len(envelope), [len(enc.data) for enc in tensors])
    if HEADER_LEN + body_len > limits.max_frame_bytes:
        raise ProtocolError(
            f"frame of {HEADER_LEN + body_len} bytes exceeds max_frame_bytes={limits.max_frame_bytes}"
        )
    parts: list[BytesLike] = [b"", envelope]
    end = HEADER_LEN + len(envelope)
    for enc, offset in zip(tensors, offsets, strict=True):
        if offset > end:
            parts.append(bytes(offset - end))
        parts.append(enc.data)
        end = offset + len(enc.data)
    crc = 0
    if checksum:
        for part in parts[1:]:
            crc = zlib.crc32(part, crc)
    parts[0] = pack_header(msg.TYPE, FLAG_CRC32 if checksum else 0, len(envelope), body_len, crc)
    return parts


def encode_message(msg: Message, *, checksum: bool = False, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """One complete frame: header + envelope + payloads. `checksum` adds a CRC-32 of the body."""
    return b"".join(frame_parts(msg, checksum=checksum, limits=limits))


def decode_message(
    buf: BytesLike,
    limits: Limits = DEFAULT_LIMITS,
    head: tuple[Header, Message, list[tuple[str, tuple, int]], list[int]] | None = None,
) -> Message:
    """Decode exactly one frame. Tensor payloads are memoryviews into `buf` (zero-copy; writable iff buf is).

    Raises VersionMismatchError for another major version and ProtocolError for anything malformed,
    truncated or over `limits`; never allocates more than the limits allow. `head`: what `parse_head`
    returned for this frame's first bytes (a stream reader has it already: the envelope is decoded once).
    """
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected a bytes-like frame, got {type(buf).__name__}")
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        try:
            mv = mv.cast("B")
        except TypeError as exc:
            raise ProtocolError(f"frame buffer is not contiguous: {exc}") from exc
    header, msg, layout, offsets = head if head is not None else parse_head(mv, limits)
    if len(mv) != header.frame_len:
        kind = "truncated" if len(mv) < header.frame_len else "trailing bytes after"
        raise ProtocolError(f"{kind} frame: {len(mv)} bytes, header declares {header.frame_len}")
    if header.flags & FLAG_CRC32:
        crc = zlib.crc32(mv[HEADER_LEN:])
        if crc != header.crc32:
            raise ProtocolError(
                f"body CRC-32 mismatch: computed 0x{crc:08x}, header says 0x{header.crc32:08x}"
            )
    if not layout:
        return msg
    end = HEADER_LEN + header.meta_len
    tensors = {}
    for (name, (dtype, shape, codec, params), nbytes), offset in zip(layout, offsets, strict=True):
        if any(mv[end:offset]):
            raise ProtocolError(f"non-zero padding before tensor {name!r}")
        tensors[name] = EncodedTensor(dtype, shape, codec, params, mv[offset : offset + nbytes])
        end = offset + nbytes
    return TensorMessage(msg.kind, msg.meta, tensors)  # type: ignore[union-attr]
