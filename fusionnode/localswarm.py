"""A local swarm: N real `fusionnode join` daemons on loopback, started as processes.

What `fusionnode demo`, the benchmarks and the end-to-end tests start. Each peer has its own state
dir and log under a work dir; `stop` ends every process it started (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fusionnode.config import LOCAL_JOIN_FLAGS
from fusionnode.errors import DaemonError

READY_TIMEOUT = 120.0  # seconds for a daemon to print its ready line
SWARM_TIMEOUT = 60.0  # seconds for every peer to see every other


def fusionnode_command() -> list[str]:
    """The argv prefix that runs this very fusionnode (the package this process imported) in a new
    Python process, whatever that process's working directory: `python -m fusionnode` would put the
    working directory first on sys.path, where a folder named `fusionnode` (a clone, say) shadows
    the installed package."""
    import fusionnode

    root = str(Path(fusionnode.__file__).resolve().parent.parent)
    boot = f"import sys; sys.path[0] = {root!r}; from fusionnode.cli import main; sys.exit(main())"
    return [sys.executable, "-c", boot]


class LocalSwarm:
    """N daemons started as real processes; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, workdir: Path, n: int, *, log: Any = sys.stderr):
        """`log`: where progress lines go (None: nowhere)."""
        self.workdir = workdir
        self.n = n
        self.procs: list[subprocess.Popen] = []
        self.ready: list[dict[str, Any]] = []
        self.log = log
        self.extra_args: list[str] = []  # more `fusionnode join` flags for peers started from now on
        self.first_peer_args: list[str] = []  # flags for peer 0 only

    def state_dir(self, i: int) -> Path:
        return self.workdir / f"peer{i}"

    def start(self) -> None:
        """Peer 0 first (its address is the others' bootstrap), then every other peer at once."""
        self._wait_ready(0, self._spawn(0, []))
        self._say(f"  peer 0: {self.ready[0]['peer_id']} up")
        procs = [(i, self._spawn(i, self.ready[0]["maddrs"])) for i in range(1, self.n)]
        for i, proc in procs:
            self._wait_ready(i, proc)
            self._say(f"  peer {i}: {self.ready[-1]['peer_id']} up")

    def _say(self, text: str) -> None:
        if self.log is not None:
            print(text, file=self.log, flush=True)

    def add_peer(self) -> int:
        """Starts one more peer that joins through peer 0; returns its index."""
        i = len(self.procs)
        self._wait_ready(i, self._spawn(i, self.ready[0]["maddrs"]))
        return i

    def _spawn(self, i: int, initial: list[str]) -> subprocess.Popen:
        cmd = [
            *fusionnode_command(),
            "join",
            "--state-dir",
            str(self.state_dir(i)),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--heartbeat",
            "2",
            "--record-ttl",
            "8",
            "--probe-interval",
            "10",
            *LOCAL_JOIN_FLAGS,  # loopback: no port mapping, AutoNAT or relay service, said explicitly
        ]
        cmd += self.extra_args
        if i == 0:
            cmd += self.first_peer_args
        if initial:
            cmd += ["--initial-peers", *initial]
        logf = open(self.workdir / f"peer{i}.log", "ab")  # noqa: SIM115 - lives as long as the process
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _wait_ready(self, i: int, proc: subprocess.Popen) -> None:
        from fusionnode.node import READY_PREFIX

        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode(errors="replace")
            if not line:
                if proc.poll() is not None:
                    raise DaemonError(
                        f"peer {i} exited with code {proc.returncode} before it was ready; "
                        f"see {self.workdir / f'peer{i}.log'}"
                    )
                continue
            if line.startswith(READY_PREFIX):
                self.ready.append(json.loads(line[len(READY_PREFIX) :]))
                return
        raise DaemonError(
            f"peer {i} did not come up within {READY_TIMEOUT:.0f} s; see {self.workdir / f'peer{i}.log'}"
        )

    def control(self, i: int) -> Path:
        return self.state_dir(i) / "control.sock"

    async def wait_connected(
        self, timeout: float = SWARM_TIMEOUT, peers: list[str] | None = None
    ) -> list[dict[str, Any]]:
        """Waits until peer 0 sees `peers` (default: every peer started) in the swarm."""
        from fusionnode import control

        deadline = time.monotonic() + timeout
        want = set(peers) if peers is not None else {r["peer_id"] for r in self.ready}
        seen: set[str] = set()
        while time.monotonic() < deadline:
            res = await control.call(self.control(0), "peers")
            seen = {p["peer_id"] for p in res["peers"]}
            if want <= seen:
                return res["peers"]
            await asyncio.sleep(0.5)
        raise DaemonError(
            f"only {len(seen & want)} of {len(want)} peers found each other within {timeout:.0f} s"
        )

    def stop(self) -> None:
        """SIGTERM to each daemon (it withdraws and stops its DHT), SIGKILL to the group after a grace period."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # the DHT's child process and p2pd, if still there
            p.wait()
