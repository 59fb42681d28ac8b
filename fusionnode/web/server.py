"""The dashboard's web server: aiohttp routes, their guards and the live status stream.

    GET  /                  the page (static/index.html, app.js, style.css; nothing else is served)
    GET  /api/status        the node's status as JSON (what ``fusionnode status --json`` prints)
    GET  /api/events        the same status as server-sent events, pushed when it changes
    GET  /metrics           the status in the Prometheus text format
    GET  /api/session       200 with the allowed actions when the request carries the token, else 403
    POST /api/action/NAME   pause, resume or cancel (only when actions are on, and with the token)

Read-only by default. Actions exist only when the node passes them, each request
carrying the token printed at start (``Authorization: Bearer TOKEN``). On a
loopback address every request must name a loopback Host (a page elsewhere that
re-points its DNS name at 127.0.0.1 reads nothing). One request per connection;
a client that has not sent its request head within ``REQUEST_TIMEOUT_S`` gets 408.

The status comes from an async ``status_provider``; one call serves every
request (and every event stream) within ``STATUS_CACHE_S`` of it, so several
open tabs and a Prometheus scraper cost one DHT lookup per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry

from fusionnode.errors import FusionNodeError
from fusionnode.web.metrics import StatusCollector, job_history, json_safe

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"  # loopback only unless the user asks for more
DEFAULT_PORT = 0  # 0 = a free port picked by the OS; read the URL back from start()
MAX_REQUEST_BYTES = 8192  # longest request line or header field; longer ones get 400 and are dropped
MAX_HEADERS = 64  # header fields per request
MAX_BODY_BYTES = 4096  # an action's JSON body
REQUEST_TIMEOUT_S = 10.0  # seconds a client has to send its request head
STATUS_CACHE_S = 0.5  # seconds one status_provider() result serves later requests
STATUS_TIMEOUT_S = 10.0  # seconds status_provider() may take before the request gets 503
PUSH_INTERVAL_S = 1.0  # seconds between looks at the status for an event stream
KEEPALIVE_S = 15.0  # seconds of an unchanged status after which a stream sends a comment line
STATIC_FILES = {  # path -> (file in fusionnode/web/static, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
ACTIONS = ("pause", "resume", "cancel")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'",
}
# a fixed answer to a client too slow to send its request (there is no request to answer through aiohttp)
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 20\r\nConnection: close\r\n\r\n408 Request Timeout\n"
)

StatusProvider = Callable[[], Awaitable[dict[str, Any]]]
Action = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def host_ok(host: str) -> bool:
    """A Host header that names this machine's loopback (or none: HTTP/1.0 clients send none)."""
    if not host:
        return True
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name.lower() in LOOPBACK_HOSTS


class Dashboard:
    """The dashboard and /metrics endpoint; ``await start()`` returns its URL.

    `actions` maps names in ACTIONS to coroutines taking the request's JSON body;
    None (the default) serves a read-only dashboard with no action routes at all."""

    def __init__(
        self,
        status_provider: StatusProvider,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        actions: dict[str, Action] | None = None,
    ):
        unknown = set(actions or {}) - set(ACTIONS)
        if unknown:
            raise ValueError(f"unknown dashboard actions {sorted(unknown)}; known: {ACTIONS}")
        self.status_provider = status_provider
        self.host = host
        self.port = port
        self.actions = dict(actions or {})
        self.token = secrets.token_urlsafe(24) if self.actions else None
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._collector = StatusCollector()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._collector)
        self._static: dict[str, bytes] = {}
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._pending: asyncio.Future[dict[str, Any]] | None = None
        self._waiting: set[Any] = set()  # connections whose request head has not arrived yet
        self._closing = asyncio.Event()

    @property
    def actions_url(self) -> str | None:
        """The page's URL with the token in its fragment (never sent to the server, nor in a Referer)."""
        return f"{self.url}#token={self.token}" if self.token else None

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> str:
        root = resources.files("fusionnode.web") / "static"
        self._static = {name: (root / name).read_bytes() for name, _ in set(STATIC_FILES.values())}
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY_BYTES)
        app.on_response_prepare.append(self._headers)
        for path in STATIC_FILES:
            app.router.add_get(path, self._page)
        app.router.add_get("/api/status", self._api_status)
        app.router.add_get("/api/events", self._api_events)
        app.router.add_get("/metrics", self._metrics)
        if self.actions:
            app.router.add_get("/api/session", self._session)
            app.router.add_post("/api/action/{name}", self._action)
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=1.0,
            max_line_size=MAX_REQUEST_BYTES,
            max_field_size=MAX_REQUEST_BYTES,
            max_headers=MAX_HEADERS,
            keepalive_timeout=REQUEST_TIMEOUT_S,
        )
        await self._runner.setup()
        self._server = await asyncio.get_running_loop().create_server(self._protocol, self.host, self.port)
        sock_host, sock_port = self._server.sockets[0].getsockname()[:2]
        self.port = int(sock_port)
        shown = f"[{sock_host}]" if ":" in sock_host else sock_host
        self.url = f"http://{shown}:{self.port}/"
        logger.info("dashboard at %s", self.url)
        if self.actions and self.host not in LOOPBACK_HOSTS:
            logger.warning(
                "dashboard actions are on at %s, off loopback: anyone who reaches it with the token can act",
                self.url,
            )
        return self.url

    async def close(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await self._runner.cleanup()
            self._runner = None
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    def _protocol(self) -> Any:
        """aiohttp's protocol for one connection, with a deadline on its request head."""
        assert self._runner is not None and self._runner.server is not None
        proto = self._runner.server()
        self._waiting.add(proto)
        asyncio.get_running_loop().call_later(REQUEST_TIMEOUT_S, self._head_deadline, proto)
        return proto

    def _head_deadline(self, proto: Any) -> None:
        if proto not in self._waiting:
            return
        self._waiting.discard(proto)
        transport = getattr(proto, "transport", None)
        if transport is None or transport.is_closing():
            return
        transport.write(_TIMEOUT_RESPONSE)
        transport.close()

    # ---- status --------------------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        """The provider's status, shared between requests within STATUS_CACHE_S and while one is pending."""
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < STATUS_CACHE_S:
            return self._cached[1]
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._fetch_status())
        return await asyncio.shield(self._pending)

    async def _fetch_status(self) -> dict[str, Any]:
        try:
            st = await asyncio.wait_for(self.status_provider(), STATUS_TIMEOUT_S)
            if not isinstance(st, dict):
                raise TypeError(f"status provider returned {type(st).__name__}, not dict")
            self._cached = (time.monotonic(), st)
            return st
        finally:
            self._pending = None

    # ---- guards --------------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self._waiting.discard(request.protocol)
        if self.host in LOOPBACK_HOSTS and not host_ok(request.headers.get("Host", "")):
            # DNS rebinding: a page from another site that re-points its name at 127.0.0.1 reads nothing
            return _text(421, "this dashboard answers only to loopback host names")
        return await handler(request)

    @staticmethod
    async def _headers(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(SECURITY_HEADERS)
        response.force_close()  # one request per connection: the head deadline covers every request

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "")
        return bool(self.token) and hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    # ---- routes --------------------------------------------------------------------------------
    async def _page(self, request: web.Request) -> web.Response:
        name, ctype = STATIC_FILES[request.path]
        return web.Response(body=self._static[name], headers={"Content-Type": ctype})

    async def _status_or_503(self) -> dict[str, Any] | web.Response:
        try:
            return await self.status()
        except Exception as exc:
            logger.warning("dashboard: status unavailable: %s", exc)
            return web.json_response({"error": f"status unavailable: {exc}"}, status=503)

    async def _api_status(self, request: web.Request) -> web.Response:
        st = await self._status_or_503()
        if isinstance(st, web.Response):
            return st
        return web.Response(body=_dumps(st), content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        st = await self._status_or_503()
        if isinstance(st, web.Response):
            return _text(503, "status unavailable")
        self._collector.status = st
        return web.Response(
            body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _api_events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: an event with the status whenever it changes; each job's step history is
        sent whole in the first event and as the new records after that ("history_append": true)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        sent: dict[str, int] = {}  # job -> last step sent
        last_body, last_write = b"", time.monotonic()
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while not self._closing.is_set():
                try:
                    st = await self.status()
                except Exception as exc:
                    body = b"event: error\ndata: " + _dumps({"error": f"status unavailable: {exc}"}) + b"\n\n"
                else:
                    body = b"data: " + _dumps(stream_delta(st, sent)) + b"\n\n"
                if body != last_body or time.monotonic() - last_write > KEEPALIVE_S:
                    await resp.write(body if body != last_body else b": keep-alive\n\n")
                    last_body, last_write = body, time.monotonic()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), PUSH_INTERVAL_S)
        return resp

    async def _session(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _text(403, "a valid token is needed (the one printed when the daemon started)")
        return web.json_response({"actions": sorted(self.actions)})

    async def _action(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.actions:
            return _text(404, f"no action {name!r}")
        if not self._authorized(request):
            return _text(403, "a valid token is needed (the one printed when the daemon started)")
        origin = request.headers.get("Origin")
        if origin is not None and origin.rstrip("/").split("//")[-1] != request.headers.get("Host", ""):
            return _text(403, "cross-origin action refused")
        try:
            body = await request.json() if request.can_read_body else {}
        except (ValueError, web.HTTPRequestEntityTooLarge):
            return _text(400, "the body must be a JSON object of at most 4 KiB")
        if not isinstance(body, dict):
            return _text(400, "the body must be a JSON object")
        try:
            result = await self.actions[name](body)
        except FusionNodeError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        logger.info("dashboard action %s %s -> %s", name, body, result)
        self._cached = None  # the next status shows the action's effect
        return web.Response(body=_dumps(result), content_type="application/json")


def stream_delta(status: dict[str, Any], sent: dict[str, int]) -> dict[str, Any]:
    """`status` with each job's history cut to the records after the step last sent (updates `sent`);
    the whole history again when it no longer reaches that step (a replay after a recovery)."""
    jobs = []
    for job in status.get("jobs") or []:
        if not isinstance(job, dict):
            continue
        hist = [r for r in job_history(status, job) if isinstance(r, dict) and isinstance(r.get("step"), int)]
        jid = str(job.get("job"))
        last = sent.get(jid)
        append = last is not None and bool(hist) and hist[-1]["step"] >= last
        new = [r for r in hist if r["step"] > last] if append and last is not None else hist
        if hist:
            sent[jid] = hist[-1]["step"]
        jobs.append({**job, "history": new, "history_append": append})
    return {**{k: v for k, v in status.items() if k != "history"}, "jobs": jobs}


def _dumps(obj: Any) -> bytes:
    return json.dumps(json_safe(obj), default=str, allow_nan=False).encode()


def _text(code: int, message: str) -> web.Response:
    return web.Response(status=code, text=f"{code} {message}\n", content_type="text/plain")
