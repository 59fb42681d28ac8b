"""`fusionnode bench memory`: peak RSS of pipeline workers with the optimizer local vs offloaded.

Method: start a local swarm of real daemons; peers 0 and 1 run the two pipeline
stages of the job, peer 2 offers only the optimizer role. Train the same job
twice, `--offload off` (AdamW state on the workers) and `--offload on` (state on
peer 2); while each runs, sample the resident set size of the worker daemons'
process trees every 0.2 s and keep the peak. Reported per worker and summed, with
the offloaded/local ratio. The model defaults to gpt2-small (85M parameters with
the byte-level vocabulary), the largest that trains in reasonable time here.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil


def tree_rss(pid: int) -> int:
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            if p.name() != "p2pd":  # the libp2p daemon's memory does not depend on the optimizer
                total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class PeakSampler(threading.Thread):
    def __init__(self, pids: list[int], interval_s: float = 0.2):
        super().__init__(daemon=True)
        self.pids = pids
        self.interval_s = interval_s
        self.peak = [0] * len(pids)
        self.baseline = [tree_rss(p) for p in pids]
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            for i, pid in enumerate(self.pids):
                self.peak[i] = max(self.peak[i], tree_rss(pid))

    def stop(self) -> None:
        self._done.set()
        self.join()


def run_mode(spec: Any, mode: str) -> dict[str, Any]:
    """Peak RSS of the two worker daemons while `spec` trains with the optimizer `mode` (off/on)."""
    from fusionnode import control
    from fusionnode.localswarm import LocalSwarm

    swarm = LocalSwarm(Path(tempfile.mkdtemp(prefix="fusionnode-mem-")), 3, log=None)
    try:
        swarm._wait_ready(0, swarm._spawn(0, []))
        swarm._wait_ready(1, swarm._spawn(1, swarm.ready[0]["maddrs"]))
        swarm.extra_args = ["--role", "optimizer"]
        swarm._wait_ready(2, swarm._spawn(2, swarm.ready[0]["maddrs"]))
        asyncio.run(swarm.wait_connected())
        workers = [r["peer_id"] for r in swarm.ready[:2]]
        sampler = PeakSampler([swarm.procs[0].pid, swarm.procs[1].pid])
        sampler.start()
        params = {
            "spec": spec.to_dict(),
            "stages": 2,
            "peers": workers,
            "offload": mode,
            "optimizer_peers": [swarm.ready[2]["peer_id"]],
            "rebalance_every": 0,  # the layout as given while memory is sampled
        }

        async def go() -> None:
            async for obj in control.call_stream(swarm.control(0), "train", params, timeout=None):
                if "result" in obj:
                    return

        asyncio.run(go())
        sampler.stop()
        return {"peak": sampler.peak, "baseline": sampler.baseline}
    finally:
        swarm.stop()


def main(argv: list[str] | None = None) -> int:
    from fusionnode.train.spec import JobSpec

    p = argparse.ArgumentParser(
        prog="fusionnode bench memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="gpt2-small", help="bundled model (default %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="training steps per run (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default %(default)s)")
    args = p.parse_args(argv)

    spec = JobSpec(
        model=args.model,
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batches=2,
        seq_len=args.seq_len,
        seed=0,
        warmup_steps=1,
    )
    results = {
        mode: run_mode(spec, mode) for mode in ("off", "on")
    }  # a fresh swarm each: allocators keep memory
    off, on = results["off"], results["on"]
    print(
        f"worker peak RSS, {args.model} in 2 stages on 2 workers ({args.steps} steps, batch {args.batch_size} x "
        f"{args.seq_len}); optimizer host apart (MiB)"
    )
    print(f"{'':18} {'worker 0':>10} {'worker 1':>10} {'total':>10}")
    for name, r in (("optimizer local", off), ("offloaded", on)):
        print(
            f"{name:18} {r['peak'][0] / 2**20:10.0f} {r['peak'][1] / 2**20:10.0f} {sum(r['peak']) / 2**20:10.0f}"
        )
    grown_off = sum(p - b for p, b in zip(off["peak"], off["baseline"], strict=True))
    grown_on = sum(p - b for p, b in zip(on["peak"], on["baseline"], strict=True))
    print(
        f"peak RSS ratio offloaded/local: {sum(on['peak']) / sum(off['peak']):.2f}; "
        f"growth during the job: {grown_on / 2**20:.0f} MiB vs {grown_off / 2**20:.0f} MiB "
        f"({grown_on / max(grown_off, 1):.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
