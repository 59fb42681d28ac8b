"""The local control API: the CLI talks to its running daemon over a Unix socket.

Reachable only from this host (a Unix socket in the node's state directory,
mode 0600). One JSON object a line. A request is ``{"method": str, "params":
{...}}``; the daemon answers with zero or more ``{"event": {...}}`` lines (progress
of long calls such as ``train``) and then exactly one ``{"result": {...}}`` or
``{"error": {"type": str, "message": str}}`` line. Closing the connection
cancels the call (Ctrl-C in ``fusionnode train`` stops the job).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fusionnode.errors import DaemonError, FusionNodeError

logger = logging.getLogger(__name__)

MAX_LINE = 16 << 20  # bytes: longest request or reply line
Emit = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[[dict[str, Any], Emit], Awaitable[dict[str, Any]]]


class ControlServer:
    def __init__(self, path: Path, handlers: dict[str, Handler]):
        self.path = path
        self.handlers = handlers
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a stale socket: the state-dir lock guarantees no live daemon owns it
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_LINE)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def send(obj: dict[str, Any]) -> None:
            writer.write(json.dumps(obj, default=_jsonable).encode() + b"\n")
            await writer.drain()

        try:
            line = await reader.readline()
            if not line:
                return
            try:
                request = json.loads(line)
                method = request["method"]
                params = request.get("params") or {}
                if not isinstance(params, dict):
                    raise TypeError("params must be an object")
            except (ValueError, KeyError, TypeError) as exc:
                await send({"error": {"type": "BadRequest", "message": f"malformed control request: {exc}"}})
                return
            handler = self.handlers.get(method)
            if handler is None:
                await send({"error": {"type": "BadRequest", "message": f"unknown method {method!r}"}})
                return

            async def emit(event: dict[str, Any]) -> None:
                await send({"event": event})

            call = asyncio.ensure_future(handler(params, emit))
            # the client hanging up cancels the call
            hangup = asyncio.ensure_future(reader.read(1))
            done, _ = await asyncio.wait({call, hangup}, return_when=asyncio.FIRST_COMPLETED)
            if call not in done:
                if not hangup.cancelled() and hangup.exception() is not None:
                    logger.debug("control client of %s went away: %r", method, hangup.exception())
                call.cancel()
                with contextlib.suppress(BaseException):
                    await call
                return
            hangup.cancel()
            try:
                result = call.result()
            except FusionNodeError as exc:
                await send({"error": {"type": type(exc).__name__, "message": str(exc)}})
            except Exception as exc:
                logger.exception("control call %s failed", method)
                await send({"error": {"type": type(exc).__name__, "message": str(exc)}})
            else:
                await send({"result": result})
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return str(obj)


async def call_stream(
    path: Path, method: str, params: dict[str, Any] | None = None, timeout: float | None = 30.0
) -> AsyncIterator[dict[str, Any]]:
    """Yields {"event": ...} objects, then the final {"result": ...}; raises DaemonError on errors."""
    if not path.exists():
        raise DaemonError(
            f"no daemon is running for this state directory (no control socket at {path}); "
            "start one with `fusionnode join`"
        )
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path), limit=MAX_LINE), 5)
    except (TimeoutError, OSError) as exc:
        raise DaemonError(f"the daemon at {path} does not answer ({exc}); is it running?") from exc
    try:
        writer.write(json.dumps({"method": method, "params": params or {}}).encode() + b"\n")
        await writer.drain()
        while True:
            line = await asyncio.wait_for(reader.readline(), timeout)
            if not line:
                raise DaemonError(f"the daemon closed the connection during {method!r}")
            obj = json.loads(line)
            if "error" in obj:
                err = obj["error"]
                raise DaemonError(f"{err.get('type')}: {err.get('message')}")
            yield obj
            if "result" in obj:
                return
    except TimeoutError as exc:
        raise DaemonError(f"the daemon did not answer {method!r} within {timeout} s") from exc
    finally:
        writer.close()


async def call(
    path: Path, method: str, params: dict[str, Any] | None = None, timeout: float | None = 30.0
) -> dict[str, Any]:
    async for obj in call_stream(path, method, params, timeout):
        if "result" in obj:
            return obj["result"]
    raise DaemonError(f"no result for {method!r}")


def socket_is_live(path: Path) -> bool:
    if not path.exists():
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()
