"""The direct path's connection as an asyncio (reader, writer) pair (runtime/direct.py makes and
authenticates the TLS socket; this drives it).

The TLS socket is blocking and driven by two threads per connection (OpenSSL releases the GIL while it
encrypts, decrypts and waits), so the I/O runs beside the event loop instead of taking turns with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import select
import socket
import ssl
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

HIGH_WATER = 8 << 20  # bytes queued for the writer thread before drain() waits
LOW_WATER = 4 << 20  # a waiting drain() resumes once the queue is down to this
READ_AHEAD = 256 << 10  # bytes the reader thread may read past what was asked (read(), frame headers)
RECORD = 16 << 10  # a full TLS record's plaintext: data arriving in these is a bulk transfer
LINGER_S = 0.0005  # read(n) during a bulk transfer waits this long for more before handing over


# The loop thread and the two I/O threads meet once per message, not once per TLS record: the reader
# thread reads only what the loop asks for, and a frame's payload straight into the frame's own
# buffer (`readinto_exactly`, used by wire.stream.read_message); the writer thread sends whole queued
# buffers and wakes the loop only when the queue runs dry or falls below LOW_WATER. OpenSSL releases
# the GIL while it encrypts, decrypts and waits, so the threads run beside the loop instead of taking
# turns with it (the profile in issue 22: a wake-up per 16 KiB record cost more than TLS itself).


class _Writer:
    """asyncio.StreamWriter's subset the Transport uses, writing through a thread."""

    def __init__(self, sock: ssl.SSLSocket, loop: asyncio.AbstractEventLoop, on_close: Callable[[], None]):
        self._sock = sock
        self._loop = loop
        self._queue: deque[Any] = deque()
        self._cv = threading.Condition()
        self._pending = 0
        self._waiters: list[asyncio.Future] = []
        self._error: BaseException | None = None
        self._closed = False
        self._on_close = on_close
        self._thread = threading.Thread(target=self._run, name="direct-writer", daemon=True)
        self._thread.start()

    def write(self, data: Any) -> None:
        if self._error is not None:
            raise ConnectionResetError(f"direct connection broke: {self._error!r}")
        if self._closed:
            raise ConnectionResetError("direct connection closed")
        view = memoryview(data).cast("B")
        if not len(view):
            return
        with self._cv:
            self._queue.append(view)
            self._pending += len(view)
            self._cv.notify()

    async def drain(self) -> None:
        """Returns at once while at most HIGH_WATER bytes wait for the thread; above that, once the
        thread has sent all but LOW_WATER of them (one wake-up per few MiB, not per write)."""
        while True:
            if self._error is not None:
                raise ConnectionResetError(f"direct connection broke: {self._error!r}")
            with self._cv:
                if self._pending <= HIGH_WATER or self._closed:
                    return
                fut = self._loop.create_future()
                self._waiters.append(fut)
            await fut

    def _wake(self) -> None:
        with self._cv:
            waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    break
                view = self._queue.popleft()
            try:
                self._sock.sendall(view)
            except BaseException as exc:  # the peer went away: every later write fails
                self._error = exc
                with self._cv:
                    self._queue.clear()
                    self._pending = 0
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._wake)
                break
            with self._cv:
                self._pending -= len(view)
                wake = bool(self._waiters) and (self._pending <= LOW_WATER or not self._queue)
            if wake:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._wake)
        self._on_close()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def is_closing(self) -> bool:
        return self._closed or self._error is not None

    async def wait_closed(self) -> None:
        await asyncio.to_thread(self._thread.join, 10)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._sock.getpeername() if name == "peername" else default


class _Reader:
    """asyncio.StreamReader's subset the Transport and read_message use (readexactly, read, at_eof) plus
    `readinto_exactly`, reading through a thread that reads only on request: a receiver that does
    not read holds no more than its last read asked for plus READ_AHEAD bytes (TCP's window then
    holds the sender back, the flow control asyncio's own transports have)."""

    def __init__(self, sock: ssl.SSLSocket, loop: asyncio.AbstractEventLoop, on_close: Callable[[], None]):
        self._sock = sock
        self._loop = loop
        self._on_close = on_close
        self._buf = bytearray()  # received, not yet consumed
        self._eof = False
        self._broken: str | None = None  # why no read can continue (a cancelled read into a caller's buffer)
        self._busy: asyncio.Future | None = None  # the request the thread is working on
        self._lock = threading.Lock()
        self._stopped = False
        self._requests: queue.SimpleQueue[
            tuple[memoryview, int, bool, memoryview | None, asyncio.Future] | None
        ] = queue.SimpleQueue()
        self._scratch = bytearray()  # the thread's target for reads into our own buffer (sized on use)
        self._thread = threading.Thread(target=self._run, name="direct-reader", daemon=True)
        self._thread.start()

    # -- thread side
    def _run(self) -> None:
        try:
            while True:
                req = self._requests.get()
                if req is None:
                    break
                view, need, linger, ahead, fut = req
                n, m, error = 0, 0, None
                try:
                    while n < need:
                        got = self._sock.recv_into(view[n:])
                        if not got:
                            break
                        n += got
                    # what has already arrived: the rest of a decrypted record or more records in
                    # the socket (look-ahead past a frame header, read(n)); for read(n) while a bulk
                    # transfer streams in (full records), what arrives within LINGER_S as well, so
                    # that the loop is woken per READ_AHEAD-sized piece rather than per record
                    while n < len(view) and (
                        self._sock.pending()
                        or select.select([self._sock], [], [], LINGER_S if linger and n >= RECORD else 0)[0]
                    ):
                        got = self._sock.recv_into(view[n:])
                        if not got:
                            break
                        n += got
                    # after a frame's payload: what has arrived of the next frame (its header, as a
                    # rule), so that reading it takes no further hand-over
                    while (
                        ahead is not None
                        and n == need
                        and m < len(ahead)
                        and (self._sock.pending() or select.select([self._sock], [], [], 0)[0])
                    ):
                        got = self._sock.recv_into(ahead[m:])
                        if not got:
                            break
                        m += got
                except (OSError, ValueError) as exc:
                    error = exc
                try:
                    self._loop.call_soon_threadsafe(self._done, fut, n, n < need, error, ahead, m)
                except RuntimeError:  # the loop is gone
                    break
                if n < need:
                    break
        finally:
            with self._lock:
                self._stopped = True
            self._on_close()

    def stop(self) -> None:
        """No more reads (the connection is closing): the thread ends after the request in hand."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._requests.put(None)

    # -- loop side
    def _done(
        self,
        fut: asyncio.Future,
        n: int,
        eof: bool,
        error: BaseException | None,
        ahead: memoryview | None = None,
        m: int = 0,
    ) -> None:
        if eof:
            self._eof = True
        if m and ahead is not None:  # read past a payload: the next bytes of the stream
            self._buf += ahead[:m]
        if not fut.done():
            fut.set_result((n, error))

    async def _idle(self) -> None:
        while self._busy is not None:  # a read cancelled earlier is still in the thread's hands
            await asyncio.shield(self._busy)

    async def _request(
        self, view: memoryview, need: int, own: bool, linger: bool = False, ahead: memoryview | None = None
    ) -> int:
        """The thread reads at least `need` bytes (fewer at the end of the stream) into `view`, part of
        our scratch buffer when `own`, else the caller's."""
        await self._idle()
        if self._eof or self._broken:
            return 0
        fut = self._loop.create_future()
        with self._lock:
            if self._stopped:
                self._eof = True
                return 0
            self._requests.put((view, need, linger, ahead, fut))
        self._busy = fut
        try:
            n, _error = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if own:  # what the thread reads is kept for the next read
                scratch = self._scratch
                fut.add_done_callback(lambda f: self._keep(scratch, f.result()[0]))
            else:  # the bytes land in a buffer nobody will read: the stream is cut mid-frame
                self._broken = "a read into a frame was cancelled"
            fut.add_done_callback(lambda _f: setattr(self, "_busy", None))
            raise
        self._busy = None
        return n

    def _keep(self, scratch: bytearray, n: int) -> None:
        self._buf += memoryview(scratch)[:n]

    async def _fill(self, need: int, limit: int, linger: bool = False) -> None:
        """At least `need` more bytes into our buffer (fewer at the end), up to `limit` at once."""
        await self._idle()
        if limit > len(self._scratch):
            self._scratch = bytearray(limit)
        scratch = self._scratch
        n = await self._request(memoryview(scratch)[:limit], need, own=True, linger=linger)
        self._keep(scratch, n)

    def _check(self) -> None:
        if self._broken:
            raise ConnectionResetError(f"direct connection unusable: {self._broken}")

    async def readexactly(self, n: int) -> bytes:
        self._check()
        await self._idle()
        while len(self._buf) < n:
            if self._eof:
                partial = bytes(self._buf)
                self._buf.clear()
                raise asyncio.IncompleteReadError(partial, n)
            await self._fill(n - len(self._buf), max(n - len(self._buf), READ_AHEAD))
            self._check()
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    async def read(self, n: int = -1) -> bytes:
        self._check()
        if n == 0:
            return b""
        await self._idle()
        if not self._buf and not self._eof:  # straight from the thread's buffer: one copy
            limit = READ_AHEAD if n < 0 else min(n, 4 * READ_AHEAD)
            if limit > len(self._scratch):
                self._scratch = bytearray(limit)
            got = await self._request(memoryview(self._scratch)[:limit], 1, own=True, linger=True)
            self._check()
            return bytes(memoryview(self._scratch)[:got])
        if n < 0 or n >= len(self._buf):
            data = bytes(self._buf)
            self._buf.clear()
        else:
            data = bytes(self._buf[:n])
            del self._buf[:n]
        return data

    async def readinto_exactly(self, view: memoryview) -> None:
        """Fills `view` (a frame's payload area) completely: what is buffered first, the rest read by
        the thread straight into it, one hand-over for the whole of it. IncompleteReadError at the
        end of the stream."""
        self._check()
        await self._idle()
        view = view.cast("B")
        have = min(len(self._buf), len(view))
        view[:have] = memoryview(self._buf)[:have]
        del self._buf[:have]
        pos = have
        while pos < len(view):
            if self._eof:
                raise asyncio.IncompleteReadError(b"", len(view) - pos)
            if len(self._scratch) < READ_AHEAD:
                self._scratch = bytearray(READ_AHEAD)
            ahead = memoryview(self._scratch)[:READ_AHEAD]
            pos += await self._request(view[pos:], len(view) - pos, own=False, ahead=ahead)
            self._check()

    def at_eof(self) -> bool:
        return self._eof and not self._buf

    def buffered(self) -> int:
        """Bytes received and not yet consumed."""
        return len(self._buf)


class DirectConnection:
    """One authenticated TLS connection as an asyncio (reader, writer) pair."""

    def __init__(self, sock: ssl.SSLSocket, peer_id: str, loop: asyncio.AbstractEventLoop):
        self.sock = sock
        self.peer_id = peer_id
        self.loop = loop
        self._done = 0
        self._lock = threading.Lock()
        self.writer = _Writer(sock, loop, self._writer_done)
        self.reader = _Reader(sock, loop, self._half_closed)

    def _writer_done(self) -> None:
        self._half_closed()
        reader = getattr(self, "reader", None)
        if reader is not None:
            reader.stop()

    def _half_closed(self) -> None:
        with self._lock:
            self._done += 1
            last = self._done == 2
        if last or self.writer.is_closing():
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        if last:
            with contextlib.suppress(OSError):
                self.sock.close()
