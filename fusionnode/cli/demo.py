"""The `demo` command: a local swarm of real daemons on loopback training gpt2-tiny.

Starts N `fusionnode join` processes (real libp2p through p2pd, real DHT; fusionnode.localswarm),
waits until they see each other, asks the first one to drive a training job over all of them,
shows live progress, prints a summary with a text sample and what compression saved, and stops
every process it started (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fusionnode.cli.args import command, int_at_least
from fusionnode.cli.jobs import add_train_job_args, follow_job, print_train_summary, spec_from_args
from fusionnode.config import parse_rate
from fusionnode.errors import DaemonError
from fusionnode.localswarm import LocalSwarm
from fusionnode.term import Progress

DEFAULT_PEERS = 3
DEFAULT_DEMO_STEPS = 300
NOTHING_SAVED = 0.01  # compression that saves less than this fraction of the bytes is reported as none


def add_command(sub: Any) -> None:
    """demo: its own options and the job options it shares with `train`."""
    p = command(
        sub,
        "demo",
        "start a local swarm, train gpt2-tiny on it, and show the result",
        "Start a local swarm of real daemons on loopback, train gpt2-tiny over all of them with live "
        "progress, print a summary with a text sample, and stop every process it started.",
    )
    add_demo_arguments(p)
    add_train_job_args(p)
    p.set_defaults(steps=DEFAULT_DEMO_STEPS, compress="adatopk", save_every=0)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peers", type=int_at_least(1), default=DEFAULT_PEERS, help="daemons to start (default %(default)s)"
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
    spec = spec_from_args(args)
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
