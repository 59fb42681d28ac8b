"""Frames over a real asyncio TCP connection on loopback: big messages, truncation, refusals, deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import torch

from fusionnode.errors import DeadlineError, ProtocolError, VersionMismatchError
from fusionnode.wire import (
    Call,
    Hello,
    Limits,
    Reply,
    TensorMessage,
    encode_message,
    read_message,
    write_message,
)
from fusionnode.wire.frames import pack_header
from fusionnode.wire.values import pack

torch.set_num_threads(1)

DEADLINE = 20.0  # seconds: any single test step that takes longer is a hang

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def loopback(handler: Handler) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A TCP server on 127.0.0.1 (port 0) running `handler` per connection, and a client connected to it."""
    tasks: list[asyncio.Task] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        server.close()
        await server.wait_closed()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read frames and send each one back re-encoded, until the client closes."""
    while True:
        try:
            msg = await read_message(reader)
        except ProtocolError:
            return
        await write_message(writer, msg)


def test_big_tensor_message_round_trips_over_tcp() -> None:
    async def main() -> None:
        big = torch.randn(5 << 20)  # 20 MiB of float32
        msg = TensorMessage.from_tensors(
            "activation", {"job": "j", "step": 1, "micro_batch": 0, "stage": 0, "plan_version": 1}, {"x": big}
        )
        async with loopback(echo) as (reader, writer):
            for sent in (Hello("me", "test"), msg, Call("ping", {"n": 1})):
                n = await asyncio.wait_for(write_message(writer, sent, chunk_bytes=256 << 10), DEADLINE)
                assert n == len(encode_message(sent))
                back = await read_message(reader, timeout=DEADLINE)
                assert back == sent
            await write_message(writer, msg)
            back_tensor = await read_message(reader, timeout=DEADLINE)
            back_x = back_tensor.decode_tensors()["x"]
            assert back_x.dtype == torch.float32 and back_x.shape == big.shape and torch.equal(back_x, big)
            back_x.mul_(2.0)  # frames read from a stream decode to writable tensors

    asyncio.run(main())


def _send_then(data: bytes, close: bool) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        if not close:
            await reader.read()  # hold the connection open until the client goes away

    return handler


def _read_from(data: bytes, close: bool, limits: Limits = Limits(), timeout: float = DEADLINE):
    async def main():
        async with loopback(_send_then(data, close)) as (reader, _):
            return await read_message(reader, limits, timeout=timeout)

    return asyncio.run(main())


@pytest.mark.parametrize("cut", [0, 3, 10, 24, 40, -1])
def test_truncated_stream_raises_protocol_error(cut: int) -> None:
    frame = encode_message(TensorMessage.from_tensors("g", {"step": 1}, {"x": torch.ones(1000)}))
    with pytest.raises(ProtocolError, match="truncated"):
        _read_from(frame[: cut % len(frame)], close=True)


def test_oversized_declared_length_is_refused_before_reading_the_body() -> None:
    header = pack_header(4, 0, 16, 1 << 40, 0)  # claims a 1 TiB body, then sends nothing more
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        _read_from(header, close=False)  # the connection stays open: a reader that waited would hang


def test_bad_envelope_is_refused_before_the_payload_is_allocated() -> None:
    desc = {"dtype": "float32", "shape": [1 << 40], "codec": "raw", "params": {}, "nbytes": 200 << 20}
    env = pack({"kind": "g", "meta": {}, "tensors": {"x": desc}})
    header = pack_header(4, 0, len(env), 210 << 20, 0)  # within max_frame_bytes, body never sent
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="elements"):
            _read_from(header + env, close=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"refusing the frame allocated {peak} bytes"


def test_other_major_version_is_refused_from_the_prefix() -> None:
    frame = bytearray(encode_message(Reply(ok=True)))
    frame[4] = 9
    with pytest.raises(VersionMismatchError, match=r"9\.0"):
        _read_from(bytes(frame[:6]), close=False)  # refused without waiting for the rest of the header


def test_silent_peer_hits_the_deadline() -> None:
    with pytest.raises(DeadlineError):
        _read_from(b"", close=False, timeout=0.2)


def test_write_message_rejects_a_bad_chunk_size() -> None:
    async def main() -> None:
        async with loopback(echo) as (_, writer):
            with pytest.raises(ValueError):
                await write_message(writer, Call("m"), chunk_bytes=0)

    asyncio.run(main())
