"""The fixed 24-byte frame header and the payload layout of protocol/SPEC.md ("Frame").

    offset size field
    0      4    magic      b"FNWP"
    4      1    major      protocol major version (u8)
    5      1    minor      protocol minor version (u8)
    6      1    msg_type   message type code (u8)
    7      1    flags      bit 0: CRC32 of the body present; other bits must be 0
    8      4    meta_len   bytes of the msgpack envelope that starts the body (u32 LE)
    12     8    body_len   bytes after the header: envelope + padded payloads (u64 LE)
    20     4    crc32      CRC-32 (ISO-HDLC, as zlib.crc32) of the body if flag bit 0, else 0 (u32 LE)

Bytes 0..5 (magic, major, minor) keep this meaning in every version, so a reader can refuse another
major version before it trusts anything else.
"""

from __future__ import annotations

import dataclasses
import struct

from fusionnode.errors import ProtocolError, VersionMismatchError
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits

PROTOCOL_MAJOR = 2  # frames of another major version are refused (2: the typed job protocol, wire/job.py)
PROTOCOL_MINOR = 0  # minor versions only add optional fields, types and flags a peer must opt into

MAGIC = b"FNWP"
PREFIX_LEN = 6  # magic + major + minor: readable in every version
HEADER_LEN = 24  # bytes
PAYLOAD_ALIGN = 8  # bytes: every tensor payload starts at a frame offset that is a multiple of this
FLAG_CRC32 = 0x01
KNOWN_FLAGS = FLAG_CRC32
_HEADER = struct.Struct("<4sBBBBIQI")
assert _HEADER.size == HEADER_LEN


@dataclasses.dataclass(frozen=True)
class Header:
    major: int
    minor: int
    msg_type: int
    flags: int
    meta_len: int
    body_len: int
    crc32: int

    @property
    def frame_len(self) -> int:
        return HEADER_LEN + self.body_len


def check_prefix(prefix: bytes | bytearray | memoryview) -> tuple[int, int]:
    """Check magic and major version from the first PREFIX_LEN bytes; return (major, minor)."""
    if len(prefix) < PREFIX_LEN:
        raise ProtocolError(f"truncated frame: {len(prefix)} bytes, the header prefix needs {PREFIX_LEN}")
    magic = bytes(prefix[:4])
    if magic != MAGIC:
        raise ProtocolError(f"not a FusionNode frame: magic {magic!r}, expected {MAGIC!r}")
    major, minor = prefix[4], prefix[5]
    if major != PROTOCOL_MAJOR:
        raise VersionMismatchError(
            f"peer speaks FusionNode wire protocol {major}.{minor}, this node speaks "
            f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}: major versions differ, so the frame is refused "
            f"(upgrade the peer with the older version)"
        )
    return major, minor


def parse_header(
    buf: bytes | bytearray | memoryview, known_types: frozenset[int], limits: Limits = DEFAULT_LIMITS
) -> Header:
    """Parse and check the header in buf[:HEADER_LEN] against the limits; reads nothing past it."""
    check_prefix(buf)
    if len(buf) < HEADER_LEN:
        raise ProtocolError(f"truncated frame: {len(buf)} bytes, the header needs {HEADER_LEN}")
    _, major, minor, msg_type, flags, meta_len, body_len, crc = _HEADER.unpack_from(buf, 0)
    if msg_type not in known_types:
        raise ProtocolError(f"unknown message type {msg_type} (known: {sorted(known_types)})")
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(f"unknown header flags 0x{flags & ~KNOWN_FLAGS:02x}")
    if body_len > limits.max_frame_bytes - HEADER_LEN:
        raise ProtocolError(
            f"frame declares a {body_len}-byte body; max_frame_bytes={limits.max_frame_bytes} (header included)"
        )
    if meta_len > body_len:
        raise ProtocolError(f"envelope length {meta_len} exceeds body length {body_len}")
    if meta_len > limits.max_envelope_bytes:
        raise ProtocolError(
            f"frame declares a {meta_len}-byte envelope; max_envelope_bytes={limits.max_envelope_bytes}"
        )
    if not flags & FLAG_CRC32 and crc != 0:
        raise ProtocolError("crc32 field must be 0 when the CRC flag is clear")
    return Header(major, minor, msg_type, flags, meta_len, body_len, crc)


def pack_header(msg_type: int, flags: int, meta_len: int, body_len: int, crc32: int) -> bytes:
    return _HEADER.pack(MAGIC, PROTOCOL_MAJOR, PROTOCOL_MINOR, msg_type, flags, meta_len, body_len, crc32)


def align(offset: int) -> int:
    return -(-offset // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def payload_offsets(meta_len: int, sizes: list[int]) -> tuple[list[int], int]:
    """Frame offsets of each payload and the resulting body length (see SPEC.md "Payload layout")."""
    end = HEADER_LEN + meta_len
    offsets = []
    for size in sizes:
        start = align(end)
        offsets.append(start)
        end = start + size
    return offsets, end - HEADER_LEN
