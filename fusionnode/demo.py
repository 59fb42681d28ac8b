"""`fusionnode demo`: a local swarm of real daemons on loopback training gpt2-tiny.

Starts N `fusionnode join` processes (real libp2p through p2pd, real DHT), waits
until they see each other, asks the first one to drive a training job over all
of them, shows live progress, prints a summary with a text sample, and stops
every process it started (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fusionnode.config import LOCAL_JOIN_FLAGS, parse_rate
from fusionnode.errors import DaemonError

DEFAULT_PEERS = 3
DEFAULT_DEMO_STEPS = 300
READY_TIMEOUT = 120.0  # seconds for a daemon to print its ready line
SWARM_TIMEOUT = 60.0  # seconds for every peer to see every other
NOTHING_SAVED = 0.01  # compression that saves less than this fraction of the bytes is reported as none


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    from fusionnode.cli import _int_at_least

    p.add_argument(
        "--peers", type=_int_at_least(1), default=DEFAULT_PEERS, help="daemons to start (default %(default)s)"
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="where peers keep their state, metrics and checkpoint "
        "(default: a new directory under the system temp dir)",
    )
    p.add_argument(
        "--link-limit",
        default=None,
        metavar="RATE",
        help="emulate a slow network: cap every link between the peers at RATE, e.g. 20Mbit "
        "(user-space token buckets; AdaTopK then compresses; default: no cap)",
    )


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

    async def wait_connected(self, timeout: float = SWARM_TIMEOUT) -> list[dict[str, Any]]:
        from fusionnode import control

        deadline = time.monotonic() + timeout
        want = {r["peer_id"] for r in self.ready}
        seen: set[str] = set()
        while time.monotonic() < deadline:
            res = await control.call(self.control(0), "peers")
            seen = {p["peer_id"] for p in res["peers"]}
            if want <= seen:
                return res["peers"]
            await asyncio.sleep(0.5)
        raise DaemonError(f"only {len(seen)} of {self.n} peers found each other within {timeout:.0f} s")

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


def print_wire_summary(metrics_path: Path, steps: int) -> None:
    """Bytes between peers, and what compression saved on the stage links (from the metrics file)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    step_records = [r for r in records if r.get("type") == "step"]
    total_wire = sum(r.get("wire_bytes", 0) for r in step_records)
    dense = wire = 0
    if step_records:  # link counters are cumulative: the last record holds the run's totals
        for st in step_records[-1].get("stages", []):
            for link in (st.get("links") or {}).values():
                dense += link.get("dense_bytes", 0)
                wire += link.get("wire_bytes", 0)
    print(f"wire:       {total_wire / 2**20:.1f} MiB between peers in {steps} steps")
    if dense:
        print(compression_line(dense, wire))


def compression_line(dense: int, wire: int) -> str:
    """What compression did on the stage links: `dense` bytes of activations and gradients, `wire`
    bytes sent for them."""
    if wire >= dense * (1 - NOTHING_SAVED):
        return (
            f"compressed: nothing needed: the links kept up with the compute, so the stage links "
            f"carried the {dense / 2**20:.1f} MiB of activations and gradients dense (AdaTopK "
            "compresses only a link that is the bottleneck; try --link-limit 20Mbit)"
        )
    return (
        f"compressed: stage links carried {wire / 2**20:.1f} MiB for {dense / 2**20:.1f} MiB of activations "
        f"and gradients ({(dense - wire) / 2**20:.1f} MiB saved, {dense / max(wire, 1):.1f}x fewer bytes)"
    )


def run_demo(args: argparse.Namespace) -> int:
    from fusionnode import control
    from fusionnode.cli import Progress, _spec_from_args, follow_job, print_train_summary

    if args.peers < 1:
        raise DaemonError("--peers must be at least 1")
    if args.steps is None:
        args.steps = DEFAULT_DEMO_STEPS
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fusionnode-demo-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if args.metrics_out is None:
        args.metrics_out = str(workdir / "metrics.jsonl")
    if args.save_dir is None:
        args.save_dir = str(workdir / "checkpoint")
    spec = _spec_from_args(args)
    print(
        f"FusionNode demo: {args.peers} peers on loopback, {spec.model}, {spec.steps} steps "
        f"(workdir {workdir})",
        file=sys.stderr,
        flush=True,
    )
    link_bps = parse_rate(args.link_limit) if args.link_limit else None
    swarm = LocalSwarm(workdir, args.peers)
    swarm.first_peer_args = ["--dashboard", "127.0.0.1:0"]
    t0 = time.monotonic()
    try:
        swarm.start()
        if swarm.ready[0].get("dashboard"):
            print(f"  dashboard: {swarm.ready[0]['dashboard']}", file=sys.stderr)

        async def go() -> dict[str, Any]:
            peers = await swarm.wait_connected()
            print(f"  swarm of {len(peers)} peers formed in {time.monotonic() - t0:.1f} s", file=sys.stderr)
            if link_bps:
                ids = [r["peer_id"] for r in swarm.ready]
                for i in range(len(ids)):
                    limits = {pid: link_bps for pid in ids if pid != ids[i]}
                    await control.call(swarm.control(i), "set_link_limits", {"limits": limits})
                print(f"  every link between peers capped at {link_bps / 1e6:g} Mbit/s", file=sys.stderr)
            progress = Progress(spec.steps)
            params = {"spec": spec.to_dict(), "stages": args.peers}
            if link_bps:  # what the links are, for AdaTopK's first choice (it then follows measured sends)
                ids = [r["peer_id"] for r in swarm.ready]
                params["cluster"] = {
                    "version": 1,
                    "name": "demo",
                    "devices": [{"id": pid, "tflops": 0.05, "memory_gb": 4} for pid in ids],
                    "links": {"inter_site": {"bandwidth_gbps": link_bps / 1e9, "latency_ms": 0.1}},
                }
            return await follow_job(swarm.control(0), params, progress)

        import uvloop

        result = uvloop.run(go())
        print()
        print_train_summary(result)
        print_wire_summary(Path(args.metrics_out), result["steps"])
        print(f"demo took {time.monotonic() - t0:.0f} s; peer logs in {workdir}")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every peer", file=sys.stderr)
        return 130
    finally:
        swarm.stop()
