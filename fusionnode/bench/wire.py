"""`fusionnode bench wire`: throughput of the wire codec and of libp2p streams on this machine.

Method
------
1. Codec. For each size (MiB of float32), build one tensor and time, best of REPEATS runs:
   `memcpy`  one copy of the payload into a new buffer (numpy `copy`, the reference);
   `enc_t`   encode_tensor(raw): one copy; `dec_t` decode_tensor of an immutable payload: one copy;
   `enc_msg` encode_tensor + encode_message -> bytes (two copies);
   `dec_msg` decode_message(bytes) + decode_tensor (one copy: a bytes frame is immutable memory);
   `send`    encode_tensor + frame_parts, the buffers write_message hands to the transport (one copy);
   `recv`    decode_message(writable frame) + decode_tensor, as after read_message (zero-copy).
   Each figure is for steady state: one operation repeated, so the allocator can reuse freed memory.
   `enc_msg` keeps two big buffers alive at once and, with glibc, pays fresh page faults on every
   run (the freed pair goes back to the OS), which is why it trails `send`.
   Ratios are memcpy time / codec time: 1.0 means as fast as one plain copy.
2. Streams. For each --stream-mib size (default 4, 16, 64 MiB) send that many bytes in --chunk-kib
   writes (drain after each) and wait for a one-byte acknowledgement, over (a) a plain asyncio TCP
   socket on 127.0.0.1 (the reference), (b) the direct path (runtime/direct.py: TCP + TLS 1.3, both
   peer identities checked, an I/O thread per direction on each end) and (c) a hivemind libp2p
   binary stream between two local P2P daemons; each as raw bytes and as one framed TensorMessage
   (write_message / read_message), and in two modes: `cold`, every transfer on a fresh stream
   (opening it is not timed; the new connection's first bytes are), and `steady`, every transfer
   on one stream kept open, as the Transport keeps its data stream to a peer. The transports take
   turns transfer by transfer (in a rotating order), so load from other processes falls on all of
   them alike; median of STREAM_REPEATS transfers each after one warm-up; the ratio is to TCP in the
   same mode and run.
   Sender and receiver of every transport run in this one process (p2pd in its own), on one event
   loop: TCP does its I/O on that loop's thread, the direct path in its threads (which is how the
   runtime runs it), so on a loaded machine its share of the CPU differs from TCP's; the `cpu`
   column (this process's CPU per MiB, all threads) is the figure other load skews least.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from fusionnode.wire import (
    TensorMessage,
    decode_message,
    decode_tensor,
    encode_message,
    encode_tensor,
    frame_parts,
    read_message,
    write_message,
)
from fusionnode.wire.limits import Limits

logger = logging.getLogger(__name__)

SIZES_MIB = (1, 4, 16, 64)  # tensor payload sizes of the codec benchmark
QUICK_SIZES_MIB = (1, 4, 16)
REPEATS = 7  # timed runs per codec measurement (best of)
QUICK_REPEATS = 3
STREAM_MIB = (4, 16, 64)  # sizes of one stream transfer (MiB)
QUICK_STREAM_MIB = 16
STREAM_REPEATS = 5  # timed transfers per stream measurement (median; more below 16 MiB)
QUICK_STREAM_REPEATS = 2
CHUNK_KIB = 1024  # write size on streams (KiB)
P2P_STARTUP_TIMEOUT = 30.0  # seconds for a p2pd daemon to start
TRANSFER_TIMEOUT = 120.0  # seconds for one stream transfer
HANDLER_NAME = "fusionnode.bench.wire"
MIB = 1 << 20


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest of `repeats` timed runs after one warm-up: on a shared machine the minimum is the cost of
    the code itself, the rest is other processes' noise (the timeit convention)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_codec(sizes_mib: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    rows = []
    limits = Limits(max_frame_bytes=max(sizes_mib) * MIB + MIB, max_tensor_elements=max(sizes_mib) * MIB // 4)
    for mib in sizes_mib:
        t = torch.randn(mib * MIB // 4, generator=torch.Generator().manual_seed(0))
        src = t.numpy()
        frame = encode_message(TensorMessage.from_tensors("activation", {"step": 0}, {"x": t}), limits=limits)
        frame_rw = bytearray(frame)
        enc = encode_tensor(t)

        def message(t: torch.Tensor = t) -> TensorMessage:
            return TensorMessage("activation", {"step": 0}, {"x": encode_tensor(t)})

        def decode(buf: bytes | bytearray) -> torch.Tensor:
            return decode_tensor(decode_message(buf, limits).tensors["x"], limits)

        if not (torch.equal(decode(frame), t) and torch.equal(decode(frame_rw), t)):
            raise RuntimeError("wire round trip changed the tensor")
        s_copy = _best_seconds(lambda src=src: src.copy(), repeats)
        s_tenc = _best_seconds(lambda t=t: encode_tensor(t), repeats)
        s_tdec = _best_seconds(lambda enc=enc: decode_tensor(enc), repeats)
        s_enc = _best_seconds(lambda: encode_message(message(), limits=limits), repeats)
        s_dec = _best_seconds(lambda frame=frame: decode(frame), repeats)
        s_send = _best_seconds(lambda: frame_parts(message(), limits=limits), repeats)
        s_recv = _best_seconds(lambda frame_rw=frame_rw: decode(frame_rw), repeats)
        rows.append(
            {
                "size_mib": mib,
                "memcpy_mib_s": mib / s_copy,
                "encode_tensor_mib_s": mib / s_tenc,
                "decode_tensor_mib_s": mib / s_tdec,
                "encode_tensor_ratio": s_copy / s_tenc,
                "decode_tensor_ratio": s_copy / s_tdec,
                "encode_message_mib_s": mib / s_enc,
                "decode_message_mib_s": mib / s_dec,
                "message_ratio": s_copy / (s_enc + s_dec),
                "send_mib_s": mib / s_send,
                "recv_mib_s": mib / s_recv,
                "stream_ratio": s_copy / (s_send + s_recv),
            }
        )
    return rows


# ---------------------------------------------------------------- streams

Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
COUNT = struct.Struct(">I")  # the sender's first bytes on a stream: how many transfers follow
MODES = ("cold", "steady")


def _receiver(total: int, framed: bool, limits: Limits) -> Handler:
    """Reads the transfer count, then each transfer (`total` raw bytes or one frame) and acknowledges
    it with one byte."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (count,) = COUNT.unpack(await reader.readexactly(COUNT.size))
            for _ in range(count):
                if framed:
                    await read_message(reader, limits)
                else:
                    left = total
                    while left:
                        chunk = await reader.read(min(left, 1 << 20))
                        if not chunk:
                            raise ConnectionError(f"stream ended {left} bytes early")
                        left -= len(chunk)
                writer.write(b"k")
                await writer.drain()
        finally:
            writer.close()

    return handle


async def _transfer(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    total: int,
    chunk: int,
    msg: TensorMessage | None,
) -> float:
    payload = memoryview(bytes(chunk))
    start = time.perf_counter()
    if msg is not None:
        await write_message(writer, msg, chunk_bytes=chunk, limits=Limits(max_frame_bytes=total + MIB))
    else:
        for offset in range(0, total, chunk):
            writer.write(payload[: min(chunk, total - offset)])
            await writer.drain()
    if await reader.readexactly(1) != b"k":
        raise ConnectionError("bad acknowledgement")
    return time.perf_counter() - start


class _Series:
    """One transport's transfers in one mode: `cold`, each on a fresh stream (opening it is not
    timed; the new connection's first bytes are); `steady`, all on one stream kept open, as the
    Transport keeps its data stream to a peer."""

    def __init__(self, open_stream: Opener, mode: str, count: int):
        self.open_stream, self.mode, self.count = open_stream, mode, count
        self.stream: tuple[Any, Any] | None = None
        self.times: list[float] = []
        self.cpu = 0.0  # CPU seconds of this process during the timed transfers (and cold opens)

    async def one(self, total: int, chunk: int, msg: TensorMessage | None, timed: bool) -> None:
        cpu0 = time.process_time()
        if self.stream is None:
            self.stream = await self.open_stream()
            self.stream[1].write(COUNT.pack(1 if self.mode == "cold" else self.count))
        reader, writer = self.stream
        dt = await asyncio.wait_for(_transfer(reader, writer, total, chunk, msg), TRANSFER_TIMEOUT)
        if self.mode == "cold":
            writer.close()
            self.stream = None
        if timed:
            self.times.append(dt)
            self.cpu += time.process_time() - cpu0

    def close(self) -> None:
        if self.stream is not None:
            self.stream[1].close()
            self.stream = None


async def bench_streams(total_mib: int, chunk_kib: int, repeats: int, with_p2p: bool) -> list[dict[str, Any]]:
    """Every transport's transfers interleaved (tcp, direct, libp2p, then the next round in another
    order), so that load from other processes falls on all of them alike; median of `repeats`
    transfers per transport after one warm-up each."""
    total, chunk = total_mib * MIB, chunk_kib * 1024
    limits = Limits(max_frame_bytes=total + MIB, max_tensor_elements=total // 4)
    msg = TensorMessage.from_tensors("activation", {"step": 0}, {"x": torch.zeros(total // 4)})
    frame_bytes = len(encode_message(msg, limits=limits))
    handlers = {
        framed: _receiver(frame_bytes if framed else total, framed, limits) for framed in (False, True)
    }
    rows: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        openers = {
            "tcp": await _tcp_openers(stack, handlers),
            "direct": await _direct_openers(stack, handlers),
        }
        if with_p2p:
            openers["libp2p"] = await _p2p_openers(stack, handlers)
        names = list(openers)
        for framed in (False, True):
            for mode in MODES:
                series = {t: _Series(openers[t][framed], mode, repeats + 1) for t in names}
                try:
                    for i in range(repeats + 1):  # the first round warms up
                        for t in names[i % len(names) :] + names[: i % len(names)]:
                            await series[t].one(total, chunk, msg if framed else None, timed=i > 0)
                finally:
                    for s in series.values():
                        s.close()
                tcp_rate = total / MIB / statistics.median(series["tcp"].times)
                for t in names:
                    s = series[t]
                    rate = total / MIB / statistics.median(s.times)
                    row = {
                        "transport": t,
                        "payload": "framed" if framed else "raw",
                        "mode": mode,
                        "size_mib": total_mib,
                        "mib_s": rate,
                        "ratio_to_tcp": rate / tcp_rate,
                    }
                    if t != "libp2p":  # most of libp2p's work is in the p2pd processes, not counted here
                        row["cpu_ms_per_mib"] = s.cpu * 1e3 / (total / MIB * repeats)
                    rows.append(row)
    return rows


async def _tcp_openers(stack: contextlib.AsyncExitStack, handlers: dict[bool, Handler]) -> dict[bool, Opener]:
    """Plain asyncio TCP on 127.0.0.1: the reference."""
    openers = {}
    for framed, handler in handlers.items():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        stack.push_async_callback(server.wait_closed)
        stack.callback(server.close)
        port = server.sockets[0].getsockname()[1]
        openers[framed] = lambda port=port: asyncio.open_connection("127.0.0.1", port)
    return openers


async def _direct_openers(
    stack: contextlib.AsyncExitStack, handlers: dict[bool, Handler]
) -> dict[bool, Opener]:
    """The direct path (runtime/direct.py): TCP + TLS 1.3 with both identities checked, on loopback."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    from fusionnode.runtime.direct import DirectPath, direct_addr
    from fusionnode.swarm.identity import peer_id_from_public_key

    keys = [rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(2)]
    ids = [peer_id_from_public_key(k.public_key()).to_base58() for k in keys]
    dialer = DirectPath(keys[1], ids[1], host="127.0.0.1")
    openers = {}
    for framed, receive in handlers.items():

        async def handler(_info: Any, reader: Any, writer: Any, receive: Handler = receive) -> None:
            await receive(reader, writer)

        listener = DirectPath(keys[0], ids[0], host="127.0.0.1")
        port = await listener.start(handler)
        stack.callback(listener.close)
        openers[framed] = lambda port=port: dialer.dial(ids[0], [direct_addr("127.0.0.1", port)])
    return openers


async def _p2p_openers(stack: contextlib.AsyncExitStack, handlers: dict[bool, Handler]) -> dict[bool, Opener]:
    """A hivemind libp2p binary stream between two local p2pd daemons."""
    from fusionnode.config import LOCAL_ONLY
    from fusionnode.swarm.libp2p import create_p2p

    loopback = ["/ip4/127.0.0.1/tcp/0"]
    p2p_a = await create_p2p(loopback, options=LOCAL_ONLY, startup_timeout=P2P_STARTUP_TIMEOUT)
    stack.push_async_callback(p2p_a.shutdown)
    maddrs = await p2p_a.get_visible_maddrs()
    p2p_b = await create_p2p(loopback, maddrs, options=LOCAL_ONLY, startup_timeout=P2P_STARTUP_TIMEOUT)
    stack.push_async_callback(p2p_b.shutdown)
    openers = {}
    for framed, receive in handlers.items():
        name = f"{HANDLER_NAME}.{'framed' if framed else 'raw'}"

        async def handler(
            _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, receive: Handler = receive
        ) -> None:
            await receive(reader, writer)

        await p2p_a.add_binary_stream_handler(name, handler)

        async def open_stream(name: str = name) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            _, reader, writer = await p2p_b.call_binary_stream_handler(p2p_a.peer_id, name)
            return reader, writer

        openers[framed] = open_stream
    return openers


# ---------------------------------------------------------------- CLI


def _print_tables(codec_rows: list[dict[str, Any]], stream_rows: list[dict[str, Any]]) -> None:
    if codec_rows:
        _print_codec(codec_rows)
    if stream_rows:
        _print_streams(stream_rows)


def _print_codec(codec_rows: list[dict[str, Any]]) -> None:
    print("wire codec, one float32 tensor: MiB/s, best of runs; ratio = memcpy time / our time")
    print(
        f"{'size':>6} {'memcpy':>7} | {'enc_t':>7} {'ratio':>5} {'dec_t':>7} {'ratio':>5} |"
        f" {'enc_msg':>7} {'dec_msg':>7} {'ratio':>5} | {'send':>7} {'recv':>7} {'ratio':>5}"
    )
    for r in codec_rows:
        print(
            f"{r['size_mib']:>4}Mi {r['memcpy_mib_s']:>7.0f} | {r['encode_tensor_mib_s']:>7.0f}"
            f" {r['encode_tensor_ratio']:>5.2f} {r['decode_tensor_mib_s']:>7.0f} {r['decode_tensor_ratio']:>5.2f} |"
            f" {r['encode_message_mib_s']:>7.0f} {r['decode_message_mib_s']:>7.0f} {r['message_ratio']:>5.2f} |"
            f" {r['send_mib_s']:>7.0f} {r['recv_mib_s']:>7.0f} {r['stream_ratio']:>5.2f}"
        )
    print("  enc_t/dec_t: encode_tensor / decode_tensor of an immutable payload (one copy each)")
    print("  enc_msg/dec_msg: encode_tensor+encode_message -> bytes / decode_message(bytes)+decode_tensor")
    print("  send/recv: encode_tensor+frame_parts as write_message sends it / decode of the writable frame")
    print("  read_message yields (zero-copy); the pair ratios use the sum of both times")


def _print_streams(rows: list[dict[str, Any]]) -> None:
    by = {(r["size_mib"], r["payload"], r["mode"], r["transport"]): r for r in rows}
    keys = sorted({(r["size_mib"], r["payload"], r["mode"]) for r in rows})
    others = [t for t in ("direct", "libp2p") if any(r["transport"] == t for r in rows)]
    print("streams on loopback: MiB/s (median of transfers) and ratio to plain TCP in the same run")
    head = f"{'size':>6} {'payload':>7} {'mode':>6} {'tcp':>7} {'cpu':>5}"
    for t in others:
        head += f" | {t:>7} {'ratio':>5}" + (f" {'cpu':>5}" if t == "direct" else "")
    print(head)
    for size, payload, mode in keys:
        tcp = by[size, payload, mode, "tcp"]
        line = f"{size:>4}Mi {payload:>7} {mode:>6} {tcp['mib_s']:>7.0f} {tcp['cpu_ms_per_mib']:>5.2f}"
        for t in others:
            r = by.get((size, payload, mode, t))
            if r is None:
                line += f" | {'-':>7} {'-':>5}" + (f" {'-':>5}" if t == "direct" else "")
                continue
            line += f" | {r['mib_s']:>7.0f} {r['ratio_to_tcp']:>5.2f}"
            if t == "direct":
                line += f" {r['cpu_ms_per_mib']:>5.2f}"
        print(line)
    print("  cold: every transfer on a fresh connection/stream (opening it untimed; its first bytes timed);")
    print("  steady: all transfers on one open stream, as the Transport keeps its data stream to a peer")
    print("  cpu: this process's CPU ms per MiB (both ends, all threads); p2pd's own CPU is not counted")
    print("  tcp: asyncio sockets on 127.0.0.1; direct: TCP + TLS 1.3 with both identities checked")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fusionnode bench wire", description="Wire codec and stream throughput."
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--no-p2p", action="store_true", help="skip the hivemind libp2p streams")
    parser.add_argument("--no-streams", action="store_true", help="only the codec")
    parser.add_argument("--no-codec", action="store_true", help="only the streams")
    parser.add_argument(
        "--stream-mib",
        default=None,
        help="MiB per transfer, one size or a comma-separated list (default "
        + ",".join(map(str, STREAM_MIB))
        + f"; --quick: {QUICK_STREAM_MIB})",
    )
    parser.add_argument(
        "--chunk-kib", type=int, default=CHUNK_KIB, help="stream write size in KiB (default %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.chunk_kib < 1:
        parser.error("--chunk-kib must be >= 1")
    stream_mib = (QUICK_STREAM_MIB,) if args.quick else STREAM_MIB
    if args.stream_mib is not None:
        try:
            stream_mib = tuple(int(x) for x in args.stream_mib.split(","))
        except ValueError:
            parser.error(f"--stream-mib: not a list of whole numbers: {args.stream_mib!r}")
        if not stream_mib or min(stream_mib) < 1:
            parser.error("--stream-mib must be >= 1")

    torch.set_num_threads(1)
    sizes = QUICK_SIZES_MIB if args.quick else SIZES_MIB
    codec_rows = [] if args.no_codec else bench_codec(sizes, QUICK_REPEATS if args.quick else REPEATS)
    stream_rows: list[dict[str, Any]] = []
    if not args.no_streams:
        for mib in stream_mib:
            # small transfers take a few ms each: more of them, for a median that means something
            repeats = QUICK_STREAM_REPEATS if args.quick else max(STREAM_REPEATS, 64 // mib)
            stream_rows += asyncio.run(bench_streams(mib, args.chunk_kib, repeats, not args.no_p2p))
    if args.json:
        json.dump(
            {
                "codec": codec_rows,
                "streams": stream_rows,
                "numpy": np.__version__,
                "torch": torch.__version__,
            },
            sys.stdout,
        )
        print()
    else:
        _print_tables(codec_rows, stream_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
