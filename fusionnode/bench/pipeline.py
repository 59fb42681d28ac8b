"""`fusionnode bench pipeline`: a real local swarm vs single-process training of the same job.

Method: start N `fusionnode join` daemons on loopback (real libp2p), run a job of
`--steps` steps split into N pipeline stages, and take the median tokens/s of the
steps after `--warmup`. Then train the identical job (same seed, data, micro-batches)
in this process with one torch thread, the same as each peer, and take its median.
The bubble of a stage is the fraction of the step it spends not computing
(1 - compute_s / step_time_s), averaged over the measured steps. On a machine with
fewer cores than peers the peers share cores, which the ratio includes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="fusionnode bench pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--peers", type=int, default=3, help="daemons (one stage each) (default %(default)s)")
    p.add_argument("--model", default="gpt2-tiny", help="bundled model (default %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default %(default)s)")
    p.add_argument(
        "--warmup", type=int, default=3, help="steps left out of the medians (default %(default)s)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default %(default)s)")
    p.add_argument(
        "--micro-batches", type=int, default=4, help="micro-batches per step (default %(default)s)"
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default %(default)s)")
    p.add_argument(
        "--offload",
        choices=["on", "off"],
        default="off",
        help="optimizer state on an optimizer host (on) or on the workers (off) (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON (default: text)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fusionnode import control
    from fusionnode.localswarm import LocalSwarm
    from fusionnode.train.local import train_local
    from fusionnode.train.spec import JobSpec

    spec = JobSpec(
        model=args.model,
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        seq_len=args.seq_len,
        seed=0,
    )
    swarm = LocalSwarm(Path(tempfile.mkdtemp(prefix="fusionnode-bench-")), args.peers, log=None)
    try:
        swarm.start()

        async def go() -> list[dict[str, Any]]:
            await swarm.wait_connected()
            steps = []
            params = {
                "spec": spec.to_dict(),
                "stages": args.peers,
                "offload": args.offload,
                "rebalance_every": 0,
            }
            async for obj in control.call_stream(swarm.control(0), "train", params, timeout=None):
                ev = obj.get("event")
                if ev is None:
                    return steps
                if ev.get("type") == "step":
                    steps.append(ev)
            return steps

        steps = asyncio.run(go())
    finally:
        swarm.stop()
    measured = steps[args.warmup :]
    dist_tps = statistics.median(s["tokens_per_s"] for s in measured)
    n_stages = len(measured[0]["stages"])
    bubble = [
        statistics.mean(1 - s["stages"][i]["compute_s"] / s["step_time_s"] for s in measured)
        for i in range(n_stages)
    ]
    wire = statistics.median(s["wire_bytes"] for s in measured)

    torch.set_num_threads(1)
    times: list[float] = []
    last = [time.perf_counter()]

    def tick(_rec: dict[str, Any]) -> None:
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    train_local(spec, progress=tick)
    tokens = spec.batch_size * (spec.seq_len or 0)
    local_tps = statistics.median(tokens / t for t in times[args.warmup :])
    return {
        "model": args.model,
        "peers": args.peers,
        "stages": n_stages,
        "batch_size": spec.batch_size,
        "micro_batches": spec.micro_batches,
        "seq_len": spec.seq_len,
        "offload": args.offload,
        "distributed_tokens_per_s": dist_tps,
        "single_process_tokens_per_s": local_tps,
        "ratio": dist_tps / local_tps,
        "bubble_per_stage": bubble,
        "wire_bytes_per_step": wire,
        "measured_steps": len(measured),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(
        f"pipeline benchmark: {res['model']}, {res['peers']} peers on loopback, batch {res['batch_size']} x "
        f"{res['seq_len']} tokens, {res['micro_batches']} micro-batches, offload {res['offload']}"
    )
    print(f"  distributed pipeline   {res['distributed_tokens_per_s']:9.0f} tokens/s")
    print(f"  single process (1 thr) {res['single_process_tokens_per_s']:9.0f} tokens/s")
    print(f"  ratio                  {res['ratio']:9.2f}x")
    print(f"  wire per step          {res['wire_bytes_per_step'] / 2**20:9.2f} MiB")
    for i, b in enumerate(res["bubble_per_stage"]):
        print(f"  stage {i} bubble (idle)  {b:9.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
