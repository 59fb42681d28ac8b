"""`fusionnode bench wire`: throughput of the wire codec and of libp2p streams on this machine.

Method
------
1. Codec (bench/wire_codec.py; --no-codec skips it). Per size, the encode and decode paths of one
   float32 tensor against one plain memcpy, best of REPEATS runs.
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
   The receiving ends of all transports run in a spawned child process (two peers are two
   processes; --in-process: in this one, on this event loop, where the direct path's I/O threads on
   both ends share one GIL), the sending ends here: TCP does its I/O on the event loop's thread, the
   direct path in its threads (which is how the runtime runs it), so on a loaded machine its share
   of the CPU differs from TCP's; the `cpu` columns (CPU per MiB, all threads, of the sender and of
   the receiver) are the figures other load skews least.
3. Ceiling (bench/wire_ceiling.py; --no-ceiling skips it). Per --stream-mib size, a bare blocking
   plain-TCP socket pair against a bare blocking TLS 1.3 pair (the direct path's own handshake):
   how far TLS in Python's ssl alone falls short of TCP here, printed beside the direct path's ratio.
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
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from fusionnode.bench.wire_ceiling import add_direct_ratios, bench_ceiling, print_ceiling
from fusionnode.bench.wire_codec import (
    QUICK_REPEATS,
    QUICK_SIZES_MIB,
    REPEATS,
    SIZES_MIB,
    bench_codec,
    print_codec,
)
from fusionnode.wire import (
    TensorMessage,
    encode_message,
    read_message,
    write_message,
)
from fusionnode.wire.limits import Limits

logger = logging.getLogger(__name__)

STREAM_MIB = (4, 16, 64)  # sizes of one stream transfer (MiB)
QUICK_STREAM_MIB = 16
STREAM_REPEATS = 5  # timed transfers per stream measurement (median; more below 16 MiB)
QUICK_STREAM_REPEATS = 2
CHUNK_KIB = 1024  # write size on streams (KiB)
P2P_STARTUP_TIMEOUT = 30.0  # seconds for a p2pd daemon to start
TRANSFER_TIMEOUT = 120.0  # seconds for one stream transfer
HANDLER_NAME = "fusionnode.bench.wire"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MIB = 1 << 20


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

    def __init__(
        self, open_stream: Opener, mode: str, count: int, remote_cpu: Callable[[], float] | None = None
    ):
        self.open_stream, self.mode, self.count = open_stream, mode, count
        self.remote_cpu = remote_cpu
        self.stream: tuple[Any, Any] | None = None
        self.times: list[float] = []
        self.cpu = 0.0  # CPU seconds of this process during the timed transfers (and cold opens)
        self.recv_cpu = 0.0  # the same of the receiving process, where it is another one

    async def one(self, total: int, chunk: int, msg: TensorMessage | None, timed: bool) -> None:
        rcpu0 = self.remote_cpu() if self.remote_cpu is not None else 0.0
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
            if self.remote_cpu is not None:
                self.recv_cpu += self.remote_cpu() - rcpu0

    def close(self) -> None:
        if self.stream is not None:
            self.stream[1].close()
            self.stream = None


def _limits(total: int) -> Limits:
    return Limits(max_frame_bytes=total + MIB, max_tensor_elements=total // 4)


def _message(total: int) -> TensorMessage:
    return TensorMessage.from_tensors("activation", {"step": 0}, {"x": torch.zeros(total // 4)})


def _handlers(total: int) -> dict[str, dict[bool, Handler]]:
    """The receiving ends, per transport and payload (framed or not)."""
    limits = _limits(total)
    frame_bytes = len(encode_message(_message(total), limits=limits))
    return {
        t: {framed: _receiver(frame_bytes if framed else total, framed, limits) for framed in (False, True)}
        for t in ("tcp", "direct", "libp2p")
    }


class _Remote:
    """The receiving ends in a spawned child process (as between two peers): it listens, reads and
    acknowledges; `cpu()` asks it for its CPU seconds so far (all threads; answered by a thread of
    its own, outside its event loop)."""

    def __init__(self, total: int, key_pem: bytes, ids: list[str], with_p2p: bool):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main, args=(child_conn, total, key_pem, ids, with_p2p), name="bench-wire-receiver"
        )
        self.proc.start()
        child_conn.close()

    async def info(self) -> dict[str, Any]:
        if not await asyncio.to_thread(self.conn.poll, P2P_STARTUP_TIMEOUT + 60):
            raise RuntimeError("the receiver process did not start")
        try:
            status, info = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the receiver process exited (code {self.proc.exitcode})") from None
        if status != "ready":
            raise RuntimeError(f"the receiver process failed: {info}")
        return info

    def cpu(self) -> float:
        self.conn.send(("cpu",))
        return self.conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("stop",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _child_main(conn: Any, total: int, key_pem: bytes, ids: list[str], with_p2p: bool) -> None:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    torch.set_num_threads(1)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()

        def answer() -> None:  # CPU time on request until told to stop (or the parent goes away)
            with contextlib.suppress(EOFError, OSError):
                while conn.recv()[0] == "cpu":
                    conn.send(time.process_time())
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda: stopped.done() or stopped.set_result(None))

        async with contextlib.AsyncExitStack() as stack:
            try:
                key = load_pem_private_key(key_pem, None)
                info = await _serve(stack, _handlers(total), key, ids[0], with_p2p)
            except Exception as exc:
                conn.send(("error", repr(exc)))
                raise
            conn.send(("ready", info))
            threading.Thread(target=answer, name="bench-wire-cpu", daemon=True).start()
            await stopped

    try:
        asyncio.run(serve())
    finally:
        conn.close()


async def _serve(
    stack: contextlib.AsyncExitStack,
    handlers: dict[str, dict[bool, Handler]],
    key: Any,
    peer_id: str,
    with_p2p: bool,
) -> dict[str, Any]:
    """Starts every receiving end; returns where to reach them (ports, libp2p addresses)."""
    from fusionnode.runtime.direct import DirectPath

    info: dict[str, Any] = {"tcp": {}, "direct": {}}
    for framed, handler in handlers["tcp"].items():  # plain asyncio TCP on 127.0.0.1: the reference
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        stack.push_async_callback(server.wait_closed)
        stack.callback(server.close)
        info["tcp"][framed] = server.sockets[0].getsockname()[1]
    for framed, receive in handlers["direct"].items():  # TCP + TLS 1.3, both identities checked

        async def direct_handler(_info: Any, reader: Any, writer: Any, receive: Handler = receive) -> None:
            await receive(reader, writer)

        listener = DirectPath(key, peer_id, host="127.0.0.1")
        info["direct"][framed] = await listener.start(direct_handler)
        stack.callback(listener.close)
    if with_p2p:  # a hivemind libp2p binary stream between two local p2pd daemons
        from fusionnode.config import LOCAL_ONLY
        from fusionnode.swarm.libp2p import create_p2p

        p2p = await create_p2p(LOOPBACK, options=LOCAL_ONLY, startup_timeout=P2P_STARTUP_TIMEOUT)
        stack.push_async_callback(p2p.shutdown)
        for framed, receive in handlers["libp2p"].items():

            async def p2p_handler(
                _info: Any,
                reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter,
                receive: Handler = receive,
            ) -> None:
                await receive(reader, writer)

            await p2p.add_binary_stream_handler(
                f"{HANDLER_NAME}.{'framed' if framed else 'raw'}", p2p_handler
            )
        info["libp2p"] = {
            "maddrs": [str(a) for a in await p2p.get_visible_maddrs()],
            "peer_id": p2p.peer_id.to_base58(),
        }
    return info


async def _openers(
    stack: contextlib.AsyncExitStack, info: dict[str, Any], key: Any, ids: list[str]
) -> dict[str, dict[bool, Opener]]:
    """The sending ends, from where `_serve` said the receiving ends are."""
    from fusionnode.runtime.direct import DirectPath, direct_addr

    openers: dict[str, dict[bool, Opener]] = {
        "tcp": {
            framed: lambda port=port: asyncio.open_connection("127.0.0.1", port)
            for framed, port in info["tcp"].items()
        }
    }
    dialer = DirectPath(key, ids[1], host="127.0.0.1")
    openers["direct"] = {
        framed: lambda port=port: dialer.dial(ids[0], [direct_addr("127.0.0.1", port)])
        for framed, port in info["direct"].items()
    }
    if "libp2p" in info:
        from hivemind.p2p import PeerID

        from fusionnode.config import LOCAL_ONLY
        from fusionnode.swarm.libp2p import create_p2p

        p2p = await create_p2p(
            LOOPBACK, info["libp2p"]["maddrs"], options=LOCAL_ONLY, startup_timeout=P2P_STARTUP_TIMEOUT
        )
        stack.push_async_callback(p2p.shutdown)
        peer = PeerID.from_base58(info["libp2p"]["peer_id"])

        def p2p_opener(framed: bool) -> Opener:
            async def open_stream() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
                name = f"{HANDLER_NAME}.{'framed' if framed else 'raw'}"
                _, reader, writer = await p2p.call_binary_stream_handler(peer, name)
                return reader, writer

            return open_stream

        openers["libp2p"] = {framed: p2p_opener(framed) for framed in (False, True)}
    return openers


async def bench_streams(
    total_mib: int, chunk_kib: int, repeats: int, with_p2p: bool, in_process: bool = False
) -> list[dict[str, Any]]:
    """Every transport's transfers interleaved (tcp, direct, libp2p, then the next round in another
    order), so that load from other processes falls on all of them alike; median of `repeats`
    transfers per transport after one warm-up each. The receiving ends run in a spawned child process
    (two peers are two processes), or with `in_process` in this one, on this event loop."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from fusionnode.swarm.identity import peer_id_from_public_key

    total, chunk = total_mib * MIB, chunk_kib * 1024
    msg = _message(total)
    keys = [rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(2)]
    ids = [peer_id_from_public_key(k.public_key()).to_base58() for k in keys]
    rows: list[dict[str, Any]] = []
    remote: _Remote | None = None
    async with contextlib.AsyncExitStack() as stack:
        if in_process:
            info = await _serve(stack, _handlers(total), keys[0], ids[0], with_p2p)
        else:
            pem = keys[0].private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            remote = _Remote(total, pem, ids, with_p2p)
            stack.callback(remote.stop)
            info = await remote.info()
        openers = await _openers(stack, info, keys[1], ids)
        names = list(openers)
        for framed in (False, True):
            for mode in MODES:
                remote_cpu = None if remote is None else remote.cpu
                series = {t: _Series(openers[t][framed], mode, repeats + 1, remote_cpu) for t in names}
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
                        "processes": 1 if in_process else 2,
                    }
                    if t != "libp2p":  # most of libp2p's work is in the p2pd processes, not counted here
                        row["cpu_ms_per_mib"] = s.cpu * 1e3 / (total / MIB * repeats)
                    if remote is not None and t != "libp2p":
                        row["recv_cpu_ms_per_mib"] = s.recv_cpu * 1e3 / (total / MIB * repeats)
                    rows.append(row)
    return rows


# ---------------------------------------------------------------- CLI


def _print_tables(codec_rows: list[dict[str, Any]], stream_rows: list[dict[str, Any]]) -> None:
    if codec_rows:
        print_codec(codec_rows)
    if stream_rows:
        _print_streams(stream_rows)


def _print_streams(rows: list[dict[str, Any]]) -> None:
    by = {(r["size_mib"], r["payload"], r["mode"], r["transport"]): r for r in rows}
    keys = sorted({(r["size_mib"], r["payload"], r["mode"]) for r in rows})
    others = [t for t in ("direct", "libp2p") if any(r["transport"] == t for r in rows)]
    remote = all("recv_cpu_ms_per_mib" in r for r in rows if r["transport"] != "libp2p")
    print("streams on loopback: MiB/s (median of transfers) and ratio to plain TCP in the same run")
    head = f"{'size':>6} {'payload':>7} {'mode':>6} {'tcp':>7} {'cpu':>5}" + (
        f" {'rcpu':>5}" if remote else ""
    )
    for t in others:
        head += f" | {t:>7} {'ratio':>5}" + (f" {'cpu':>5}" if t == "direct" else "")
        head += f" {'rcpu':>5}" if t == "direct" and remote else ""
    print(head)
    for size, payload, mode in keys:
        tcp = by[size, payload, mode, "tcp"]
        line = f"{size:>4}Mi {payload:>7} {mode:>6} {tcp['mib_s']:>7.0f} {tcp['cpu_ms_per_mib']:>5.2f}"
        line += f" {tcp['recv_cpu_ms_per_mib']:>5.2f}" if remote else ""
        for t in others:
            r = by.get((size, payload, mode, t))
            if r is None:
                line += f" | {'-':>7} {'-':>5}" + (f" {'-':>5}" if t == "direct" else "")
                line += f" {'-':>5}" if t == "direct" and remote else ""
                continue
            line += f" | {r['mib_s']:>7.0f} {r['ratio_to_tcp']:>5.2f}"
            if t == "direct":
                line += f" {r['cpu_ms_per_mib']:>5.2f}"
                line += f" {r['recv_cpu_ms_per_mib']:>5.2f}" if remote else ""
        print(line)
    print("  cold: every transfer on a fresh connection/stream (opening it untimed; its first bytes timed);")
    print("  steady: all transfers on one open stream, as the Transport keeps its data stream to a peer")
    if remote:
        print(
            "  cpu / rcpu: CPU ms per MiB of the sending process / of the receiving process (spawned), over"
        )
        print("  each transfer (and cold opens), all threads; p2pd's own CPU is not counted")
    else:
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
        "--no-ceiling", action="store_true", help="skip the TLS ceiling (bare TCP vs TLS 1.3 socket pairs)"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the receiving ends in this process too (default: a spawned child process, as two peers)",
    )
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
            stream_rows += asyncio.run(
                bench_streams(mib, args.chunk_kib, repeats, not args.no_p2p, in_process=args.in_process)
            )
    ceiling_rows: list[dict[str, Any]] = []
    if not args.no_streams and not args.no_ceiling:
        ceiling_rows = bench_ceiling(stream_mib)
        add_direct_ratios(ceiling_rows, stream_rows)
    if args.json:
        json.dump(
            {
                "codec": codec_rows,
                "streams": stream_rows,
                "ceiling": ceiling_rows,
                "numpy": np.__version__,
                "torch": torch.__version__,
            },
            sys.stdout,
        )
        print()
    else:
        _print_tables(codec_rows, stream_rows)
        if ceiling_rows:
            print_ceiling(ceiling_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
