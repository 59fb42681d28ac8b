"""Dashboard: HTTP routes, Prometheus text, limits, and the page as rendered by a real headless Chromium."""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client", reason="prometheus-client is a dependency of fusionnode.web")
from cdp import CHROMIUM, Browser
from prometheus_client.parser import text_string_to_metric_families

from fusionnode.errors import ConfigError
from fusionnode.web import Dashboard
from fusionnode.web import server as web_server

PEERS = [
    "12D3KooWAbcdefGHijkLmnopQRstuvWXyz0123456789abcdefA1",
    "12D3KooWBbcdefGHijkLmnopQRstuvWXyz0123456789abcdefB2",
    "12D3KooWCbcdefGHijkLmnopQRstuvWXyz0123456789abcdefC3",
    "12D3KooWDbcdefGHijkLmnopQRstuvWXyz0123456789abcdefD4",
]
BANDWIDTH = {(0, 1): 940e6, (1, 2): 8e6, (2, 3): 940e6, (0, 3): 95e6, (0, 2): 8e6, (1, 3): 95e6}  # bit/s
# the browser tests' screenshots: a temporary folder, so a test run leaves the tree as it was;
# FUSIONNODE_SCREENSHOTS=docs python3 -m pytest tests/test_web.py tests/test_pipeline_e2e.py renews docs/'s
DOCS = Path(os.environ.get("FUSIONNODE_SCREENSHOTS") or tempfile.gettempdir()).resolve()


def link_counters(step: int, stage: int, ratio: float) -> dict[str, Any]:
    """A stage link's compressor counters after `step` steps (cumulative, as LinkCompressor reports)."""
    dense = 400_000 * (step + 1)
    wire = int(dense * (2.5 * ratio if ratio < 1 else 1.0))
    return {"dense_bytes": dense, "wire_bytes": wire, "ratio": ratio, "bandwidth_bps": BANDWIDTH[(1, 2)]}


def realistic_status(n_steps: int = 120) -> dict[str, Any]:
    """A status dict shaped like node.py's `status` control call, with the driver's step history."""
    peers = []
    for i, pid in enumerate(PEERS):
        links = {}
        for (a, b), bps in BANDWIDTH.items():
            if i in (a, b):
                other = b if i == a else a
                links[PEERS[other]] = {
                    "bandwidth_bps": bps * (1.0 if i < other else 0.97),
                    "rtt_s": 0.002 + 0.01 * (bps < 1e8),
                }
        peers.append(
            {
                "peer_id": pid,
                "maddrs": [f"/ip4/127.0.0.1/tcp/{40000 + i}/p2p/{pid}"]
                if i < 3
                else [f"/ip4/10.0.0.9/tcp/4001/p2p/{PEERS[0]}/p2p-circuit/p2p/{pid}"],
                "software_version": "0.1.0",
                "protocol_version": 1,
                "device": {
                    "kind": "cuda" if i == 0 else "cpu",
                    "name": "NVIDIA H100" if i == 0 else "AMD EPYC 7B13",
                    "memory_total_bytes": (80 if i == 0 else 16) * 2**30,
                    "memory_free_bytes": 8 * 2**30,
                    "tflops_fp32": 51.0 if i == 0 else 0.4,
                    "tflops_bf16": None,
                    "tflops_fp16": None,
                    "torch_version": "2.13.0",
                    "cpu_count": 8,
                    "measured_at": 1.7e9,
                },
                "roles": ["worker", "optimizer"] if i < 3 else ["optimizer"],
                "capacity_bytes": 8 * 2**30,
                "links": links,
                "availability": "available",
                "updated_at": time.time() - i,
            }
        )
    history = []
    for step in range(n_steps):
        st = 0.8 + 0.1 * math.sin(step / 7)
        history.append(
            {
                "step": step,
                "loss": 10.8 * math.exp(-step / 60) + 2.0,
                "tokens": 256,
                "step_time_s": st,
                "tokens_per_s": 256 / st,
                "wire_bytes": 3_000_000 + 1000 * step,
                "plan_version": 1 + (step >= 60),
                "stages": [
                    {
                        "stage": k,
                        "compute_s": st * (0.7 - 0.2 * k),
                        "wait_s": st * 0.1 * (k + 1),
                        "sent_bytes": 1_000_000,
                        "peer": PEERS[k],
                        "links": {
                            "fwd": link_counters(step, k, 0.1 if k == 1 else 1.0),
                            "bwd": link_counters(step, k, 1.0),
                        },
                    }
                    for k in range(3)
                ],
            }
        )
    return {
        "peer_id": PEERS[0],
        "maddrs": peers[0]["maddrs"],
        "uptime_s": 321.5,
        "roles": ["worker", "optimizer"],
        "device": peers[0]["device"],
        "peers": peers,
        "availability": {"availability": "available", "reason": None},
        "serving": [{"job": "job-7f3a", "stage": 0, "num_stages": 3, "last_step": n_steps - 1}],
        "jobs": [
            {
                "job": "job-7f3a",
                "model": "gpt2-tiny",
                "state": "running",
                "step": n_steps,
                "steps": 200,
                "loss": history[-1]["loss"],
                "tokens_per_s": 301.2,
                "plan_version": 2,
                "stages": [
                    {
                        "stage": k,
                        "replica": 0,
                        "pos": k,
                        "peer": PEERS[k],
                        "lo": 10 * k,
                        "hi": 10 * k + 10,
                        "n_params": 1000 * (k + 1),
                    }
                    for k in range(3)
                ],
                "history": history,
                "events": [
                    {"event": "replan", "step": 0, "reason": "initial plan", "ts": 1.7e9},
                    {"event": "join", "step": 40, "peer": PEERS[3], "ts": 1.7e9 + 40},
                    {
                        "event": "failure",
                        "step": 59,
                        "peer": PEERS[2],
                        "reason": "timed out",
                        "ts": 1.7e9 + 59,
                    },
                    {
                        "event": "replan",
                        "step": 60,
                        "reason": "peer failed",
                        "plan_version": 2,
                        "ts": 1.7e9 + 60,
                    },
                ],
                "validation": [
                    {"step": min(60, n_steps - 1), "loss": history[min(60, n_steps - 1)]["loss"] + 0.3}
                ],
            }
        ],
    }


async def _provider() -> dict[str, Any]:
    return realistic_status()


async def http(
    url: str, method: str = "GET", path: str = "/", raw: bytes | None = None
) -> tuple[int, dict, bytes]:
    host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        raw if raw is not None else f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    )
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.fixture
def run():
    loop = asyncio.new_event_loop()
    yield lambda coro: loop.run_until_complete(asyncio.wait_for(coro, 90))
    loop.close()


def test_routes_status_and_page(run):
    async def go():
        dash = Dashboard(_provider)
        url = await dash.start()
        try:
            assert url.startswith("http://127.0.0.1:") and dash.port > 0
            code, headers, body = await http(url, path="/")
            assert code == 200 and headers["content-type"].startswith("text/html")
            assert b"app.js" in body and int(headers["content-length"]) == len(body)
            code, headers, body = await http(url, path="/app.js")
            assert code == 200 and b"api/events" in body
            code, headers, body = await http(url, path="/api/status?x=1")
            assert code == 200 and headers["content-type"] == "application/json"
            st = json.loads(body)
            assert (
                st["peer_id"] == PEERS[0] and len(st["peers"]) == 4 and len(st["jobs"][0]["history"]) == 120
            )
            code, headers, body = await http(url, "HEAD", "/api/status")
            assert code == 200 and body == b"" and int(headers["content-length"]) > 0
        finally:
            await dash.close()

    run(go())


def test_metrics_parse(run):
    async def go():
        dash = Dashboard(_provider)
        url = await dash.start()
        try:
            code, headers, body = await http(url, path="/metrics")
        finally:
            await dash.close()
        assert code == 200 and headers["content-type"].startswith("text/plain")
        fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
        val = {n: [(s.labels, s.value) for s in f.samples] for n, f in fams.items()}
        assert val["fusionnode_peers"] == [({}, 4.0)]
        assert val["fusionnode_uptime_seconds"] == [({}, 321.5)]
        assert ({"job": "job-7f3a"}, 120.0) in val["fusionnode_job_step"]
        assert ({"job": "job-7f3a"}, 301.2) in val["fusionnode_job_tokens_per_second"]
        last = realistic_status()["jobs"][0]["history"][-1]
        loss = dict((s["job"], v) for s, v in val["fusionnode_job_loss"])
        assert loss["job-7f3a"] == pytest.approx(last["loss"])
        assert val["fusionnode_job_wire_bytes"] == [({"job": "job-7f3a"}, float(last["wire_bytes"]))]
        util = {s["stage"]: (s["peer"], v) for s, v in val["fusionnode_stage_utilization_ratio"]}
        assert set(util) == {"0", "1", "2"} and util["1"][0] == PEERS[1]
        assert util["0"][1] == pytest.approx(last["stages"][0]["compute_s"] / last["step_time_s"])
        links = {(s["src"], s["dst"]): v for s, v in val["fusionnode_link_bandwidth_bits_per_second"]}
        assert len(links) == 2 * len(BANDWIDTH) and links[(PEERS[1], PEERS[2])] == pytest.approx(8e6)
        bubble = {s["stage"]: v for s, v in val["fusionnode_stage_bubble_ratio"]}
        assert bubble["2"] == pytest.approx(last["stages"][2]["wait_s"] / last["step_time_s"])
        assert val["fusionnode_job_step_time_seconds"] == [({"job": "job-7f3a"}, last["step_time_s"])]
        # per link (stage k's forward link goes to stage k+1's peer, its backward link to stage k-1's)
        dense = {
            (s["stage"], s["direction"]): (s["src"], s["dst"], v)
            for s, v in val["fusionnode_link_dense_bytes"]
        }
        wire = {(s["stage"], s["direction"]): v for s, v in val["fusionnode_link_wire_bytes"]}
        assert set(dense) == {("0", "fwd"), ("1", "fwd"), ("1", "bwd"), ("2", "bwd")}
        assert dense[("1", "fwd")] == (PEERS[1], PEERS[2], 400_000.0 * 120)
        assert (
            wire[("1", "fwd")] == pytest.approx(0.25 * 400_000 * 120) and wire[("0", "fwd")] == 400_000 * 120
        )
        keep = {(s["stage"], s["direction"]): v for s, v in val["fusionnode_link_keep_ratio"]}
        assert keep[("1", "fwd")] == 0.1 and keep[("2", "bwd")] == 1.0

    run(go())


def test_errors_and_limits(run, monkeypatch):
    monkeypatch.setattr(web_server, "REQUEST_TIMEOUT_S", 0.5)

    async def go():
        dash = Dashboard(_provider)
        url = await dash.start()
        try:
            code, headers, _ = await http(url, path="/nope")
            assert code == 404 and headers["content-security-policy"].startswith("default-src 'self'")
            assert (await http(url, path="/../../etc/passwd"))[0] == 404
            code, headers, _ = await http(url, "POST", "/api/status")
            assert code == 405 and set(headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
            assert (await http(url, "DELETE", "/"))[0] == 405
            assert (await http(url, "PUT", "/x"))[0] == 404
            assert (await http(url, "POST", "/api/action/pause"))[0] == 404  # read-only: no action routes
            assert (await http(url, path="/api/session"))[0] == 404
            # an oversized header field or too many of them: refused, the connection dropped
            big = (
                b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: "
                + b"a" * (2 * web_server.MAX_REQUEST_BYTES)
                + b"\r\n\r\n"
            )
            code, _, body = await http(url, raw=big)
            assert code == 400 and b"Got more than" in body
            many = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(
                b"X-H%d: 1\r\n" % i for i in range(web_server.MAX_HEADERS + 1)
            )
            assert (await http(url, raw=many + b"\r\n"))[0] == 400
            assert (await http(url, raw=b"garbage\r\n\r\n"))[0] == 400
            # a client that sends part of its request and stalls gets 408 when REQUEST_TIMEOUT_S runs out
            t0 = time.monotonic()
            code, _, body = await http(url, raw=b"GET /api/status HTTP/1.1\r\nHost: 127.0")
            assert code == 408 and 0.4 < time.monotonic() - t0 < 5
            assert (await http(url, raw=b""))[0] == 408  # one that sends nothing at all, too
            # DNS rebinding: a foreign Host name is refused on a loopback-bound dashboard
            code, headers, _ = await http(
                url, raw=b"GET /api/status HTTP/1.1\r\nHost: evil.example:80\r\n\r\n"
            )
            assert code == 421 and headers["x-frame-options"] == "DENY"
            assert (await http(url, raw=b"GET /api/status HTTP/1.1\r\nHost: localhost:1\r\n\r\n"))[0] == 200
            assert (await http(url, raw=b"GET /metrics HTTP/1.0\r\n\r\n"))[0] == 200  # HTTP/1.0: no Host
        finally:
            await dash.close()

    run(go())


async def sse_events(url: str, n: int, headers: str = "") -> list[dict]:
    """The first `n` data events of /api/events."""
    host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /api/events HTTP/1.1\r\nHost: {host}:{port}\r\n{headers}\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert b"200 OK" in head and b"text/event-stream" in head
    out, buf = [], b""
    while len(out) < n:
        buf += await reader.read(65536)
        while b"\n\n" in buf:
            chunk, buf = buf.split(b"\n\n", 1)
            for line in chunk.split(b"\n"):
                if line.startswith(b"data: "):
                    out.append(json.loads(line[6:]))
    writer.close()
    return out[:n]


def test_event_stream_sends_new_history_only(run, monkeypatch):
    monkeypatch.setattr(web_server, "PUSH_INTERVAL_S", 0.05)
    monkeypatch.setattr(web_server, "STATUS_CACHE_S", 0.0)
    n = {"steps": 5}

    async def provider():
        n["steps"] += 1
        return realistic_status(n["steps"])

    async def go():
        dash = Dashboard(provider)
        url = await dash.start()
        try:
            first, second, third = await sse_events(url, 3)
        finally:
            await dash.close()
        h1, h2 = first["jobs"][0]["history"], second["jobs"][0]["history"]
        assert not first["jobs"][0]["history_append"] and len(h1) >= 6 and h1[0]["step"] == 0
        assert second["jobs"][0]["history_append"] and [r["step"] for r in h2] == [h1[-1]["step"] + 1]
        assert third["jobs"][0]["history"][0]["step"] == h2[-1]["step"] + 1
        assert len(first["peers"]) == 4

    run(go())


def test_actions_need_the_token(run):
    calls = []

    async def pause(body):
        calls.append(("pause", body))
        return {"availability": "paused"}

    async def cancel(body):
        calls.append(("cancel", body))
        if body.get("job") != "job-7f3a":
            raise ConfigError(f"no job {body.get('job')} runs on this driver")
        return {"cancelled": body["job"]}

    async def go():
        dash = Dashboard(_provider, actions={"pause": pause, "cancel": cancel})
        url = await dash.start()
        host = url.split("//")[1].rstrip("/")
        try:
            assert dash.token and dash.actions_url == f"{url}#token={dash.token}"

            def post(name, token, body=b"{}", extra=""):
                auth = f"Authorization: Bearer {token}\r\n" if token else ""
                return http(
                    url,
                    raw=(
                        f"POST /api/action/{name} HTTP/1.1\r\nHost: {host}\r\n{auth}{extra}"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                    ).encode()
                    + body,
                )

            assert (await post("pause", None))[0] == 403
            assert (await post("pause", "wrong"))[0] == 403
            assert (await http(url, path="/api/session"))[0] == 403
            assert calls == []
            code, _, body = await post("pause", dash.token)
            assert code == 200 and json.loads(body) == {"availability": "paused"}
            code, _, body = await post("cancel", dash.token, b'{"job": "job-7f3a"}')
            assert code == 200 and json.loads(body) == {"cancelled": "job-7f3a"}
            code, _, body = await post("cancel", dash.token, b'{"job": "other"}')
            assert code == 409 and "no job other" in json.loads(body)["error"]
            assert (await post("resume", dash.token))[0] == 404  # not offered by this node
            assert (await post("pause", dash.token, b"[1]"))[0] == 400
            assert (await post("pause", dash.token, b"x" * 5000))[0] in (400, 413)
            assert (await post("pause", dash.token, extra="Origin: http://evil.example\r\n"))[0] == 403
            code, _, body = await http(
                url,
                raw=f"GET /api/session HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {dash.token}\r\n\r\n".encode(),
            )
            assert code == 200 and json.loads(body) == {"actions": ["cancel", "pause"]}
            assert [c[0] for c in calls] == ["pause", "cancel", "cancel"]
        finally:
            await dash.close()

    run(go())


def test_status_is_cached_and_failures_are_503(run, monkeypatch):
    calls = []
    fail = {"on": False}

    async def provider():
        calls.append(1)
        await asyncio.sleep(0.01)
        if fail["on"]:
            raise RuntimeError("DHT down")
        st = realistic_status(3)
        st["jobs"][0]["loss"] = float("nan")  # JSON must still parse in a browser
        return st

    async def go():
        dash = Dashboard(provider)
        url = await dash.start()
        try:
            monkeypatch.setattr(web_server, "STATUS_CACHE_S", 60.0)
            res = await asyncio.gather(*(http(url, path=p) for p in ["/api/status", "/metrics"] * 4))
            assert all(r[0] == 200 for r in res) and len(calls) == 1
            assert json.loads(res[0][2])["jobs"][0]["loss"] is None
            monkeypatch.setattr(web_server, "STATUS_CACHE_S", 0.0)
            fail["on"] = True
            code, _, body = await http(url, path="/api/status")
            assert code == 503 and "DHT down" in json.loads(body)["error"]
            assert (await http(url, path="/metrics"))[0] == 503
            assert (await http(url, path="/"))[0] == 200  # the page itself does not need the status
        finally:
            await dash.close()

    run(go())


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_page_in_headless_chromium_is_live_and_actions_need_the_token(run, tmp_path, monkeypatch):
    """The page in a real Chromium driven over the DevTools protocol: it draws the swarm map, the plan,
    the links and the events; its loss curve gains points as the status grows, with no reload; the
    action buttons appear only with the token, and clicking one runs the action."""
    monkeypatch.setattr(web_server, "PUSH_INTERVAL_S", 0.2)
    monkeypatch.setattr(web_server, "STATUS_CACHE_S", 0.0)
    steps = {"n": 100}
    calls = []

    async def provider():
        return realistic_status(steps["n"])

    async def pause(body):
        calls.append("pause")
        return {"availability": "paused"}

    async def go():
        dash = Dashboard(provider, actions={"pause": pause})
        url = await dash.start()
        browser = await Browser.create(tmp_path / "profile")
        try:
            await browser.navigate(url)
            await browser.wait_for("document.body.dataset.state === 'ok'")
            page = await browser.evaluate(
                """(() => {
                  const q = (s) => document.querySelector(s), all = (s) => document.querySelectorAll(s);
                  return {
                    peers: [...all('#swarm g.peer')].map((g) => [g.dataset.peerId, g.dataset.stages, g.dataset.path]),
                    links: q('#swarm').dataset.links, pipes: q('#swarm').dataset.pipes,
                    compressed: q('#swarm').dataset.compressed,
                    labels: [...all('#swarm .edge-label')].map((t) => t.textContent),
                    loss: q('#loss polyline').dataset.points, val: all('#loss circle.val').length,
                    plan: [q('svg.plan').dataset.devices, q('svg.plan').dataset.columns, all('svg.plan rect.cell').length],
                    util: [...all('.bar-row')].map((r) => [r.dataset.stage, r.dataset.util, r.dataset.bubble]),
                    linkRows: [...all('#links tbody tr')].map((r) => [r.dataset.stage, r.dataset.dir, r.cells[4].textContent]),
                    events: q('#timeline').dataset.events,
                    actionsShown: q('#btn-pause').checkVisibility(), cancel: all('button.cancel').length,
                  };
                })()"""
            )
            assert [p[0] for p in page["peers"]] == PEERS
            assert [p[1] for p in page["peers"]] == ["0", "1", "2", ""]
            assert [p[2] for p in page["peers"]] == ["direct", "direct", "direct", "relayed"]
            assert page["links"] == str(len(BANDWIDTH)) and "7.9 Mb/s" in page["labels"]
            assert page["pipes"] == "2" and page["compressed"] == "1"  # stage 1 -> 2 sends top-k
            assert page["loss"] == "100" and page["val"] == 1
            assert page["plan"] == ["3", "3", 3]
            assert page["util"][0] == ["0", "0.700", "0.100"]
            assert ["1", "fwd", "4.0×"] in page["linkRows"] and len(page["linkRows"]) == 4
            assert page["events"] == "4"
            assert not page["actionsShown"] and page["cancel"] == 0  # no token: read-only
            # live: the status grows, the curve follows over the event stream, the page is not reloaded
            await browser.evaluate("window.__same_page = 1")
            updates = int(await browser.evaluate("document.body.dataset.updates"))
            steps["n"] = 110
            await browser.wait_for("document.querySelector('#loss polyline').dataset.points === '110'")
            assert await browser.evaluate("window.__same_page") == 1
            assert int(await browser.evaluate("document.body.dataset.updates")) > updates
            DOCS.mkdir(exist_ok=True)
            assert await browser.screenshot(DOCS / "dashboard.png") > 50_000
            # with a wrong token the buttons stay hidden; with the printed one they appear and work
            await browser.navigate(url + "#token=not-the-token")
            await browser.wait_for("document.body.dataset.state === 'ok'")
            await browser.wait_for("document.querySelector('#toast').dataset.result === 'error'")
            assert not await browser.evaluate("document.querySelector('#btn-pause').checkVisibility()")
            await browser.evaluate("sessionStorage.clear()")
            await browser.navigate("about:blank")
            await browser.navigate(dash.actions_url)
            await browser.wait_for("document.body.dataset.actions === 'on'")
            assert await browser.evaluate("location.hash") == ""  # the token left the address bar
            assert await browser.evaluate("document.querySelector('#btn-pause').checkVisibility()")
            assert not await browser.evaluate("document.querySelector('#btn-resume').checkVisibility()")
            assert calls == []
            await browser.click("#btn-pause")
            await browser.wait_for("document.body.dataset.lastAction === 'pause'")
            assert calls == ["pause"] and "paused" in await browser.evaluate(
                "document.querySelector('#toast').textContent"
            )
            assert not [c for c in browser.console if c.startswith("exception")], browser.console
        finally:
            await browser.close()
            await dash.close()

    run(go())
