"""A small Chrome DevTools Protocol driver for tests: the Debian chromium, headless, over a websocket.

No browser download and no driver binary: chromium is started with
``--remote-debugging-port=0``, the port is read back from the profile's
DevToolsActivePort file, and the page target is driven with JSON messages on
aiohttp's websocket client (Page.navigate, Runtime.evaluate, Input.dispatchMouseEvent,
Page.captureScreenshot).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
START_TIMEOUT_S = 30.0  # seconds for chromium to open its DevTools port
CALL_TIMEOUT_S = 30.0  # seconds one DevTools call may take


class CDPError(RuntimeError):
    pass


class Browser:
    """One headless chromium with one page; ``await Browser.create(profile)``, then ``await close()``."""

    def __init__(self, proc: subprocess.Popen, session: aiohttp.ClientSession, ws: Any):
        self.proc = proc
        self.session = session
        self.ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.ensure_future(self._read())
        self.console: list[str] = []  # console messages and uncaught exceptions of the page

    @classmethod
    async def create(cls, profile: Path, *, width: int = 1280, height: int = 1000) -> Browser:
        if CHROMIUM is None:
            raise CDPError("chromium is not installed (apt-get install -y chromium)")
        profile.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [
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
                "--hide-scrollbars",
                f"--window-size={width},{height}",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise CDPError(f"chromium did not open its DevTools port (exit {proc.poll()})")
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        session = aiohttp.ClientSession()
        try:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
                targets = await r.json()
            page = next(t for t in targets if t.get("type") == "page")
            ws = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 << 20)
        except BaseException:
            await session.close()
            proc.kill()
            raise
        self = cls(proc, session, ws)
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            fut = self._waiting.pop(data.get("id", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(data["params"]["exceptionDetails"])[:500])
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(CDPError("the DevTools connection closed"))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[msg_id] = fut
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        data = await asyncio.wait_for(fut, CALL_TIMEOUT_S)
        if "error" in data:
            raise CDPError(f"{method}: {data['error']}")
        return data.get("result", {})

    async def evaluate(self, expression: str) -> Any:
        res = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in res:
            raise CDPError(f"{expression!r} threw: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def wait_for(self, expression: str, timeout: float = 30.0, interval: float = 0.1) -> Any:
        """The first truthy value of `expression`, polled until `timeout` seconds have passed."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(CDPError):
                value = await self.evaluate(expression)
                if value:
                    return value
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{expression!r} stayed falsy for {timeout} s; console: {self.console[-5:]}"
                )
            await asyncio.sleep(interval)

    async def click(self, selector: str, hold_s: float = 0.0) -> None:
        """A real mouse click (pressed, held `hold_s`, released) at the centre of the element `selector`
        names."""
        box = await self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2, r.width * r.height]; })()"
        )
        if not box or not box[2]:
            raise CDPError(f"no visible element {selector!r}")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            if kind == "mouseReleased" and hold_s:
                await asyncio.sleep(hold_s)
            await self.send(
                "Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1
            )

    async def screenshot(self, path: Path) -> int:
        res = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        data = base64.b64decode(res["data"])
        path.write_bytes(data)
        return len(data)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.send("Browser.close"), 5)
        self._reader.cancel()
        with contextlib.suppress(Exception):
            await self.ws.close()
        await self.session.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
