"""Dashboard: HTTP routes, Prometheus text, limits, and the page as rendered by a real headless Chromium."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client", reason="prometheus-client is a dependency of fusionnode.web")
from prometheus_client.parser import text_string_to_metric_families

from fusionnode.web import Dashboard
from fusionnode.web import server as web_server

PEERS = [
    "12D3KooWAbcdefGHijkLmnopQRstuvWXyz0123456789abcdefA1",
    "12D3KooWBbcdefGHijkLmnopQRstuvWXyz0123456789abcdefB2",
    "12D3KooWCbcdefGHijkLmnopQRstuvWXyz0123456789abcdefC3",
    "12D3KooWDbcdefGHijkLmnopQRstuvWXyz0123456789abcdefD4",
]
BANDWIDTH = {(0, 1): 940e6, (1, 2): 8e6, (2, 3): 940e6, (0, 3): 95e6, (0, 2): 8e6, (1, 3): 95e6}  # bit/s
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


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
                "maddrs": [f"/ip4/127.0.0.1/tcp/{40000 + i}/p2p/{pid}"],
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
                        "peer": PEERS[k],
                        "lo": 10 * k,
                        "hi": 10 * k + 10,
                        "n_params": 1000 * (k + 1),
                    }
                    for k in range(3)
                ],
                "history": history,
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
    yield lambda coro: loop.run_until_complete(asyncio.wait_for(coro, 20))
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
            assert code == 200 and b"api/status" in body
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

    run(go())


def test_errors_and_limits(run, monkeypatch):
    async def go():
        dash = Dashboard(_provider)
        url = await dash.start()
        try:
            assert (await http(url, path="/nope"))[0] == 404
            assert (await http(url, path="/../../etc/passwd"))[0] == 404
            code, headers, _ = await http(url, "POST", "/api/status")
            assert code == 405 and headers["allow"] == "GET, HEAD"
            assert (await http(url, "DELETE", "/"))[0] == 405
            assert (await http(url, "PUT", "/x"))[0] == 404
            big = (
                b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: "
                + b"a" * (2 * web_server.MAX_REQUEST_BYTES)
                + b"\r\n\r\n"
            )
            assert (await http(url, raw=big))[0] == 431
            assert (await http(url, raw=b"garbage\r\n\r\n"))[0] == 400
            # DNS rebinding: a foreign Host name is refused on a loopback-bound dashboard
            assert (await http(url, raw=b"GET /api/status HTTP/1.1\r\nHost: evil.example:80\r\n\r\n"))[
                0
            ] == 421
            assert (await http(url, raw=b"GET /api/status HTTP/1.1\r\nHost: localhost:1\r\n\r\n"))[0] == 200
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


def _serve_in_thread(provider):
    """A Dashboard on its own loop in a thread (Chromium runs as a blocking subprocess meanwhile)."""
    import threading

    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, Any] = {}

    def target():
        asyncio.set_event_loop(loop)
        box["dash"] = Dashboard(provider)
        box["url"] = loop.run_until_complete(box["dash"].start())
        started.set()
        loop.run_forever()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    assert started.wait(10)

    def stop():
        asyncio.run_coroutine_threadsafe(box["dash"].close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()

    return box["url"], stop


def chromium_cmd(profile: str, *extra: str) -> list[str]:
    return [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        *extra,
    ]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_page_renders_in_headless_chromium(tmp_path):
    url, stop = _serve_in_thread(_provider)
    try:
        t0 = time.monotonic()
        out = subprocess.run(
            chromium_cmd(str(tmp_path / "profile"), "--dump-dom", url),
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - t0
    finally:
        stop()
    dom = out.stdout
    assert out.returncode == 0, out.stderr[-2000:]
    assert 'data-state="ok"' in dom, dom[:2000]
    # the JS drew every peer on the swarm map, with its stage, and the measured links
    for i, pid in enumerate(PEERS):
        assert f'<g class="peer" data-peer-id="{pid}" data-stages="{i if i < 3 else ""}"' in dom
    assert f'data-links="{len(BANDWIDTH)}"' in dom and "8.0 Mb/s" in dom and "940 Mb/s" in dom
    assert 'data-job="job-7f3a" data-points="120"' in dom  # loss and throughput curves from the history
    assert dom.count('class="bar-row" data-stage=') == 3
    assert 'class="compute" title="compute" style="width: 70%;"' in dom  # stage 0: compute_s / step_time_s
    print(f"headless chromium dump-dom: {elapsed:.2f} s")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_page_screenshot(tmp_path):
    url, stop = _serve_in_thread(_provider)
    shot = Path(tempfile.gettempdir()) / "fusionnode-dashboard.png"
    try:
        out = subprocess.run(
            chromium_cmd(
                str(tmp_path / "profile"),
                f"--screenshot={shot}",
                "--window-size=1280,1000",
                "--hide-scrollbars",
                url,
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stop()
    assert out.returncode == 0, out.stderr[-2000:]
    assert shot.stat().st_size > 20_000  # a drawn page, not a blank one (a blank 1280x1000 PNG is ~5 kB)
