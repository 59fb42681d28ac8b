"""The testbed's emulated network (`fusionnode bench testbed`): real peers in network namespaces
linked by tc-shaped veth pairs (deploy/testbed.sh), or on loopback behind user-space token buckets;
and which path (direct, libp2p, relayed) each link's tensors took during a run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

TESTBED_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "testbed.sh"


def netns_available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "not root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return False, "iproute2 (ip, tc) missing"
    name = f"fnprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        return True, ""
    return False, "`ip netns add` failed (no CAP_SYS_ADMIN?)"


class Testbed:
    """Peers on an emulated network; `controls[i]` is device i's control socket."""

    def __init__(self, cluster_path: Path, network: str, workdir: Path, n: int):
        self.cluster_path = cluster_path
        self.network = network
        self.workdir = workdir
        self.n = n
        self.peer_ids: list[str] = []
        self.controls: list[Path] = []
        self.netns: list[str] = []  # netns: device i's namespace
        self.links: list[dict[str, Any]] = []  # netns: {"a", "b", "addr_a", "addr_b", ...} per link
        self._proc: subprocess.Popen | None = None
        self._swarm: Any = None

    def start(self) -> None:
        from fusionnode.config import LOCAL_JOIN_FLAGS

        # no port mapping, AutoNAT or relay service: the peers reach only the testbed's own addresses
        join_flags = ["--heartbeat", "2", "--record-ttl", "8", "--no-probe", "--debug", *LOCAL_JOIN_FLAGS]
        if self.network == "netns":
            self._proc = subprocess.Popen(
                [
                    "bash",
                    str(TESTBED_SCRIPT),
                    str(self.cluster_path),
                    "--workdir",
                    str(self.workdir),
                    "--",
                    *join_flags,
                ],
                stdout=subprocess.PIPE,
                stderr=open(self.workdir / "testbed.log", "ab"),  # noqa: SIM115
                start_new_session=True,
            )
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                line = self._proc.stdout.readline().decode()
                if line.startswith("TESTBED READY "):
                    info = json.loads(line[len("TESTBED READY ") :])
                    self.peer_ids = [p["peer_id"] for p in info["peers"]]
                    self.netns = [d["netns"] for d in info["devices"]]
                    self.links = info["links"]
                    self.controls = [Path(self.workdir) / f"peer{i}" / "control.sock" for i in range(self.n)]
                    return
                if not line and self._proc.poll() is not None:
                    break
            raise RuntimeError(f"the netns testbed did not come up; see {self.workdir / 'testbed.log'}")
        from fusionnode.localswarm import LocalSwarm

        self._swarm = LocalSwarm(self.workdir, self.n, log=None)
        self._swarm.extra_args = join_flags
        self._swarm.start()
        asyncio.run(self._swarm.wait_connected())
        self.peer_ids = [r["peer_id"] for r in self._swarm.ready]
        self.controls = [self._swarm.control(i) for i in range(self.n)]

    def pace(self, tflops: list[float]) -> None:
        """Emulated device speeds: peer i computes at tflops[i] (forward-FLOP rate) through the
        worker's `--debug` pacing hook, read from <state dir>/debug_pace before each step."""
        for i, speed in enumerate(tflops):
            (Path(self.workdir) / f"peer{i}" / "debug_pace").write_text(f"{speed:.6g}\n")

    def limit_links(self, bandwidth_bps: Any) -> None:
        """userspace: every peer caps its tensor streams to each other peer at the link's bandwidth."""
        from fusionnode import control

        async def go() -> None:
            for i in range(self.n):
                limits = {self.peer_ids[j]: float(bandwidth_bps[i, j]) for j in range(self.n) if j != i}
                await control.call(self.controls[i], "set_link_limits", {"limits": limits})

        asyncio.run(go())

    def declare_links(self, bandwidth_bps: Any) -> None:
        """netns: tells every peer its links' bandwidth (tc shapes them, the daemons do not know it and
        the testbed runs without probes): the runtime's rule keeps links slower than DIRECT_MIN_BPS on
        libp2p and moves the others to the direct path."""
        from fusionnode import control

        async def go() -> None:
            for i in range(self.n):
                declared = {self.peer_ids[j]: float(bandwidth_bps[i, j]) for j in range(self.n) if j != i}
                await control.call(self.controls[i], "set_link_limits", {"declared": declared})

        asyncio.run(go())

    def path_bytes(self) -> dict[tuple[int, int], dict[str, int]]:
        """(i, j) -> {path: bytes} device i has written to device j's data streams so far, per path
        (direct, libp2p, relayed), from each daemon's status."""
        from fusionnode import control

        index = {pid: j for j, pid in enumerate(self.peer_ids)}

        async def go() -> dict[tuple[int, int], dict[str, int]]:
            out: dict[tuple[int, int], dict[str, int]] = {}
            for i in range(self.n):
                status = await control.call(self.controls[i], "status", {})
                for peer, by_path in (status.get("security", {}).get("path_bytes") or {}).items():
                    if peer in index:
                        out[i, index[peer]] = {k: int(v) for k, v in by_path.items()}
            return out

        return asyncio.run(go())

    def tx_bytes(self) -> list[int] | None:
        """netns: bytes each device has sent on its emulated links so far (None on loopback)."""
        if self.network != "netns":
            return None
        from fusionnode.bench.compare import netdev_tx

        return [netdev_tx(ns) for ns in self.netns]

    def address(self, i: int, j: int) -> str:
        """netns: device i's address on its link to device j."""
        for link in self.links:
            if (link["a"], link["b"]) == (i, j):
                return link["addr_a"]
            if (link["a"], link["b"]) == (j, i):
                return link["addr_b"]
        raise KeyError(f"no link between devices {i} and {j}")

    def stop(self) -> None:
        if self._swarm is not None:
            self._swarm.stop()
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(180)  # testbed.sh stops every daemon, then deletes the namespaces


def link_paths(
    before: dict[tuple[int, int], dict[str, int]],
    after: dict[tuple[int, int], dict[str, int]],
    bandwidth_bps: Any,
    names: list[str],
) -> list[dict[str, Any]]:
    """The path each link's tensor bytes took during one run (the difference of two `path_bytes`
    snapshots), with the path the runtime's rule should pick for that link's bandwidth: direct at
    DIRECT_MIN_BPS and above, libp2p below (the testbed has no relayed links)."""
    from fusionnode.runtime.transport import DIRECT_MIN_BPS

    rows = []
    for (i, j), now in sorted(after.items()):
        was = before.get((i, j), {})
        moved = {p: n - was.get(p, 0) for p, n in now.items() if n - was.get(p, 0) > 0}
        if not moved:
            continue
        bps = float(bandwidth_bps[i, j])
        rows.append(
            {
                "from": names[i],
                "to": names[j],
                "bandwidth_bps": bps,
                "path": "+".join(sorted(moved)),
                "bytes": moved,
                "expected": "direct" if bps >= DIRECT_MIN_BPS else "libp2p",
            }
        )
    return rows


def paths_line(paths: list[dict[str, Any]]) -> str:
    """'direct 4 (1 Gbit/s), libp2p 2 (8-10 Mbit/s)' and the links off the rule, if any."""
    groups: dict[str, list[float]] = {}
    for p in paths:
        groups.setdefault(p["path"], []).append(p["bandwidth_bps"])
    parts = []
    for path, bws in sorted(groups.items()):
        lo, hi = min(bws) / 1e6, max(bws) / 1e6
        span = f"{lo:.0f} Mbit/s" if lo == hi else f"{lo:.0f}-{hi:.0f} Mbit/s"
        parts.append(f"{path} {len(bws)} ({span})")
    off = [
        f"{p['from']}->{p['to']} {p['path']} (expected {p['expected']})"
        for p in paths
        if p["path"] != p["expected"]
    ]
    return (
        ", ".join(parts) + (f"; OFF THE RULE: {', '.join(off)}" if off else "")
        if parts
        else "no link carried tensors"
    )
