"""Frames over asyncio byte streams (hivemind binary streams, plain TCP): chunked writes, capped reads."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import numpy as np

from fusionnode.errors import DeadlineError, ProtocolError
from fusionnode.wire.frames import HEADER_LEN, PREFIX_LEN, check_prefix, parse_header
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.messages import MESSAGE_TYPE_CODES, Message, decode_message, frame_parts, parse_head

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20  # bytes per write before waiting for the transport to drain (1 MiB)
READ_CHUNK_BYTES = 1 << 20  # bytes asked of the reader at a time while filling the payload area (1 MiB)


async def write_message(
    writer: asyncio.StreamWriter,
    msg: Message,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    checksum: bool = False,
    limits: Limits = DEFAULT_LIMITS,
) -> int:
    """Write one frame in chunks of at most `chunk_bytes`, draining after each; return bytes written."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    total = 0
    pending = 0
    for part in frame_parts(msg, checksum=checksum, limits=limits):
        view = memoryview(part)
        for start in range(0, len(view), chunk_bytes):
            piece = view[start : start + chunk_bytes]
            writer.write(piece)
            pending += len(piece)
            total += len(piece)
            if pending >= chunk_bytes:
                await writer.drain()
                pending = 0
    await writer.drain()
    return total


async def read_message(
    reader: asyncio.StreamReader,
    limits: Limits = DEFAULT_LIMITS,
    timeout: float | None = None,
    admit: Callable[[int], Awaitable[None]] | None = None,
) -> Message:
    """Read and decode one frame. `timeout` in seconds for the whole frame (None: wait forever).

    Refuses a frame from its header (version, limits: the envelope at most `max_envelope_bytes`) before
    reading anything more; `admit(frame_len)`, if given, is awaited right after the header, before the
    envelope is read (a per-peer budget may wait or raise there); the envelope (decoded once, its
    containers counted) and its payload layout are checked before room for the payloads is allocated. The frame lands in one writable buffer; its tensors decode as zero-copy views of it. Raises ProtocolError (VersionMismatchError for another major version, 'truncated'
    when the stream ends mid-frame) or DeadlineError.
    """
    if timeout is None:
        return await _read_frame(reader, limits, admit)
    try:
        return await asyncio.wait_for(_read_frame(reader, limits, admit), timeout)
    except TimeoutError:
        raise DeadlineError(f"no complete frame within {timeout} s") from None


async def _readexactly(reader: asyncio.StreamReader, n: int, what: str) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(
            f"truncated frame: stream ended after {len(exc.partial)} of {n} bytes of the {what}"
        ) from None


async def _read_frame(
    reader: asyncio.StreamReader, limits: Limits, admit: Callable[[int], Awaitable[None]] | None = None
) -> Message:
    prefix = await _readexactly(reader, PREFIX_LEN, "header")
    check_prefix(prefix)  # another major version may lay out the rest differently: stop here
    head = prefix + await _readexactly(reader, HEADER_LEN - PREFIX_LEN, "header")
    header = parse_header(head, MESSAGE_TYPE_CODES, limits)  # type, flags, body and envelope lengths
    if admit is not None:
        await admit(header.frame_len)
    envelope = await _readexactly(reader, header.meta_len, "envelope")
    parsed = parse_head(head + envelope, limits)  # envelope schema, descriptors and payload layout
    meta_len = header.meta_len
    frame = np.empty(header.frame_len, dtype=np.uint8)  # numpy memory: huge pages for big frames
    view = memoryview(frame)
    view[:HEADER_LEN] = head
    pos = HEADER_LEN
    view[pos : pos + meta_len] = envelope
    pos += meta_len
    readinto = getattr(reader, "readinto_exactly", None)  # the direct path's reader: one hand-over
    if readinto is not None and pos < len(frame):
        try:
            await readinto(view[pos:])
        except asyncio.IncompleteReadError as exc:
            raise ProtocolError(
                f"truncated frame: stream ended after {len(frame) - exc.expected} of {len(frame)} bytes"
            ) from None
        pos = len(frame)
    while pos < len(frame):
        chunk = await reader.read(min(len(frame) - pos, READ_CHUNK_BYTES))
        if not chunk:
            raise ProtocolError(f"truncated frame: stream ended after {pos} of {len(frame)} bytes")
        view[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return decode_message(view, limits, parsed)
