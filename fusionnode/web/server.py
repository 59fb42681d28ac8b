"""The dashboard: a small read-only HTTP/1.1 server on the node's event loop.

Written on ``asyncio.start_server`` (no web framework): it answers GET and HEAD
for a fixed set of paths and nothing else, one request per connection.

    /             the page (static/index.html, with app.js and style.css)
    /api/status   the node's status as JSON (what ``fusionnode status --json`` prints)
    /metrics      the same status in the Prometheus text format

The status comes from an async ``status_provider``; one call serves every
request that arrives within ``STATUS_CACHE_S`` of it, so a page left open in
several tabs and a Prometheus scraper cost one DHT lookup per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"  # loopback only unless the user asks for more
DEFAULT_PORT = 0  # 0 = a free port picked by the OS; read the URL back from start()
MAX_REQUEST_BYTES = 8192  # request line + headers; larger requests get 431 and are dropped
REQUEST_TIMEOUT_S = 10.0  # seconds a client has to send its whole request
STATUS_CACHE_S = 0.5  # seconds one status_provider() result serves later requests
STATUS_TIMEOUT_S = 10.0  # seconds status_provider() may take before the request gets 503
STATIC_FILES = {  # path -> (file in fusionnode/web/static, content type); nothing else is served
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    421: "Misdirected Request",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'",
}

StatusProvider = Callable[[], Awaitable[dict[str, Any]]]


def _num(x: Any) -> float | None:
    """A finite float, or None for missing / non-numeric / NaN values (Prometheus gets no sample)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def job_history(status: dict[str, Any], job: dict[str, Any]) -> list[dict[str, Any]]:
    """The step records of a job: ``job["history"]``, else ``status["history"][job_id]``, else []."""
    hist = job.get("history")
    if hist is None:
        hist = (
            (status.get("history") or {}).get(job.get("job"))
            if isinstance(status.get("history"), dict)
            else None
        )
    return list(hist or [])


class StatusCollector(Collector):
    """Prometheus collector over the latest status dict (set by the server before each scrape)."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.status
        peers = [p for p in s.get("peers") or [] if isinstance(p, dict)]
        jobs = [j for j in s.get("jobs") or [] if isinstance(j, dict)]

        up = GaugeMetricFamily("fusionnode_uptime_seconds", "Seconds since this daemon started")
        if _num(s.get("uptime_s")) is not None:
            up.add_metric([], _num(s.get("uptime_s")))
        yield up
        yield GaugeMetricFamily(
            "fusionnode_peers", "Peers this daemon sees in the swarm (itself included)", value=len(peers)
        )

        info = GaugeMetricFamily(
            "fusionnode_peer_info",
            "One sample per known peer (value 1)",
            labels=["peer", "kind", "device", "roles", "availability"],
        )
        tflops = GaugeMetricFamily(
            "fusionnode_peer_tflops_fp32", "Measured fp32 TFLOP/s of each peer", labels=["peer"]
        )
        bw = GaugeMetricFamily(
            "fusionnode_link_bandwidth_bits_per_second",
            "Measured bandwidth from one peer to another",
            labels=["src", "dst"],
        )
        rtt = GaugeMetricFamily(
            "fusionnode_link_rtt_seconds", "Measured round-trip time between peers", labels=["src", "dst"]
        )
        for p in peers:
            pid = str(p.get("peer_id", ""))
            dev = p.get("device") or {}
            info.add_metric(
                [
                    pid,
                    str(dev.get("kind", "")),
                    str(dev.get("name", "")),
                    ",".join(map(str, p.get("roles") or [])),
                    str(p.get("availability", "")),
                ],
                1,
            )
            if _num(dev.get("tflops_fp32")) is not None:
                tflops.add_metric([pid], _num(dev.get("tflops_fp32")))
            for dst, link in (p.get("links") or {}).items():
                if not isinstance(link, dict):
                    continue
                if _num(link.get("bandwidth_bps")) is not None:
                    bw.add_metric([pid, str(dst)], _num(link.get("bandwidth_bps")))
                if _num(link.get("rtt_s")) is not None:
                    rtt.add_metric([pid, str(dst)], _num(link.get("rtt_s")))
        yield from (info, tflops, bw, rtt)

        serving = GaugeMetricFamily(
            "fusionnode_serving_last_step",
            "Last step this peer ran for a stage it serves",
            labels=["job", "stage"],
        )
        for sv in s.get("serving") or []:
            if isinstance(sv, dict) and _num(sv.get("last_step")) is not None:
                serving.add_metric(
                    [str(sv.get("job", "")), str(sv.get("stage", ""))], _num(sv.get("last_step"))
                )
        yield serving

        fams = {
            "step": GaugeMetricFamily(
                "fusionnode_job_step", "Steps done by a job this peer drives", labels=["job"]
            ),
            "steps": GaugeMetricFamily(
                "fusionnode_job_steps_target", "Steps a job is asked to run", labels=["job"]
            ),
            "loss": GaugeMetricFamily(
                "fusionnode_job_loss", "Training loss of the last step", labels=["job"]
            ),
            "tokens_per_s": GaugeMetricFamily(
                "fusionnode_job_tokens_per_second", "Mean training throughput of a job", labels=["job"]
            ),
            "plan_version": GaugeMetricFamily(
                "fusionnode_job_plan_version", "Plan version in force", labels=["job"]
            ),
        }
        state = GaugeMetricFamily(
            "fusionnode_job_info", "One sample per driven job (value 1)", labels=["job", "model", "state"]
        )
        stages = GaugeMetricFamily("fusionnode_job_stages", "Pipeline stages of a job's plan", labels=["job"])
        wire = GaugeMetricFamily(
            "fusionnode_job_wire_bytes", "Bytes on the wire (all peers) in the last step", labels=["job"]
        )
        step_time = GaugeMetricFamily(
            "fusionnode_job_step_time_seconds", "Wall time of the last step", labels=["job"]
        )
        compute = GaugeMetricFamily(
            "fusionnode_stage_compute_seconds",
            "Compute time of a stage in the last step",
            labels=["job", "stage", "peer"],
        )
        wait = GaugeMetricFamily(
            "fusionnode_stage_wait_seconds",
            "Time a stage waited in the last step",
            labels=["job", "stage", "peer"],
        )
        util = GaugeMetricFamily(
            "fusionnode_stage_utilization_ratio",
            "compute_s / step_time_s of a stage in the last step",
            labels=["job", "stage", "peer"],
        )
        for j in jobs:
            jid = str(j.get("job", ""))
            for key, fam in fams.items():
                if _num(j.get(key)) is not None:
                    fam.add_metric([jid], _num(j.get(key)))
            state.add_metric([jid, str(j.get("model", "")), str(j.get("state", ""))], 1)
            plan = [st for st in j.get("stages") or [] if isinstance(st, dict)]
            stages.add_metric([jid], len(plan))
            peer_of = {str(st.get("stage")): str(st.get("peer", "")) for st in plan}
            hist = job_history(s, j)
            if not hist or not isinstance(hist[-1], dict):
                continue
            last = hist[-1]
            if _num(last.get("wire_bytes")) is not None:
                wire.add_metric([jid], _num(last.get("wire_bytes")))
            st_time = _num(last.get("step_time_s"))
            if st_time is not None:
                step_time.add_metric([jid], st_time)
            for rec in last.get("stages") or []:
                if not isinstance(rec, dict):
                    continue
                labels = [jid, str(rec.get("stage", "")), peer_of.get(str(rec.get("stage")), "")]
                c, w = _num(rec.get("compute_s")), _num(rec.get("wait_s"))
                if c is not None:
                    compute.add_metric(labels, c)
                    if st_time:
                        util.add_metric(labels, c / st_time)
                if w is not None:
                    wait.add_metric(labels, w)
        yield from (*fams.values(), state, stages, wire, step_time, compute, wait, util)


class _HttpError(Exception):
    def __init__(self, code: int, message: str = ""):
        super().__init__(message or _REASONS.get(code, ""))
        self.code = code


class Dashboard:
    """The read-only dashboard and /metrics endpoint; ``await start()`` returns its URL."""

    def __init__(
        self, status_provider: StatusProvider, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT
    ):
        self.status_provider = status_provider
        self.host = host
        self.port = port
        self.url = ""
        self._server: asyncio.Server | None = None
        self._collector = StatusCollector()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._collector)
        self._static: dict[str, bytes] = {}
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._pending: asyncio.Future[dict[str, Any]] | None = None
        self._conns: set[asyncio.Task[Any]] = set()

    async def start(self) -> str:
        root = resources.files("fusionnode.web") / "static"
        self._static = {name: (root / name).read_bytes() for name, _ in set(STATIC_FILES.values())}
        self._server = await asyncio.start_server(
            self._on_conn, self.host, self.port, limit=MAX_REQUEST_BYTES
        )
        sock_host, sock_port = self._server.sockets[0].getsockname()[:2]
        self.port = int(sock_port)
        shown = f"[{sock_host}]" if ":" in sock_host else sock_host
        self.url = f"http://{shown}:{self.port}/"
        logger.info("dashboard at %s", self.url)
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conns):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

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

    # ---- HTTP ----------------------------------------------------------------------------------
    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        try:
            try:
                method, path, headers = await asyncio.wait_for(self._read_request(reader), REQUEST_TIMEOUT_S)
                code, ctype, body = await self._route(method, path, headers)
            except _HttpError as exc:
                method, code, ctype = "GET", exc.code, "text/plain; charset=utf-8"
                body = f"{exc.code} {exc}\n".encode()
            except TimeoutError:
                method, code, ctype, body = "GET", 408, "text/plain; charset=utf-8", b"408 Request Timeout\n"
            extra = {"Allow": "GET, HEAD"} if code == 405 else {}
            self._write(writer, code, ctype, body, head_only=method == "HEAD", extra=extra)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:
            logger.exception("dashboard request failed")
        finally:
            if task is not None:
                self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_request(self, reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _HttpError(431) from None
        except asyncio.IncompleteReadError as exc:
            if len(exc.partial) >= MAX_REQUEST_BYTES:
                raise _HttpError(431) from None
            raise
        if len(head) > MAX_REQUEST_BYTES:
            raise _HttpError(431)
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ")
        except ValueError:
            raise _HttpError(400, "malformed request line") from None
        if not version.startswith("HTTP/1."):
            raise _HttpError(400, "only HTTP/1.x")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise _HttpError(400, "malformed header")
            headers[name.strip().lower()] = value.strip()
        return method, target, headers

    async def _route(self, method: str, target: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
        path = target.split("?", 1)[0].split("#", 1)[0]
        known = path in STATIC_FILES or path in ("/api/status", "/metrics")
        if method not in ("GET", "HEAD"):
            raise _HttpError(405 if known else 404)
        if not known:
            raise _HttpError(404)
        if self.host in LOOPBACK_HOSTS and not self._host_ok(headers.get("host", "")):
            # a page from another site that re-points its DNS name at 127.0.0.1 must not read the status
            raise _HttpError(421, "this dashboard answers only to loopback host names")
        if path in STATIC_FILES:
            name, ctype = STATIC_FILES[path]
            return 200, ctype, self._static[name]
        try:
            st = await self.status()
        except Exception as exc:
            logger.warning("dashboard: status unavailable: %s", exc)
            if path == "/api/status":
                return 503, "application/json", json.dumps({"error": f"status unavailable: {exc}"}).encode()
            raise _HttpError(503, "status unavailable") from None
        if path == "/api/status":
            return 200, "application/json", json.dumps(json_safe(st), default=str, allow_nan=False).encode()
        self._collector.status = st
        return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)

    @staticmethod
    def _host_ok(host: str) -> bool:
        if not host:
            return True  # HTTP/1.0 clients and curl --http1.0 send none
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name.lower() in LOOPBACK_HOSTS

    @staticmethod
    def _write(
        writer: asyncio.StreamWriter,
        code: int,
        ctype: str,
        body: bytes,
        *,
        head_only: bool,
        extra: dict[str, str],
    ) -> None:
        headers = {
            "Content-Type": ctype,
            "Content-Length": str(len(body)),
            "Connection": "close",
            **_SECURITY_HEADERS,
            **extra,
        }
        head = (
            f"HTTP/1.1 {code} {_REASONS.get(code, 'Error')}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + "\r\n"
        )
        writer.write(head.encode("latin-1") + (b"" if head_only else body))


def json_safe(obj: Any) -> Any:
    """A copy with NaN and infinities replaced by None: browsers' JSON.parse rejects them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj
