"""`train`'s defaults against the simple layout on one machine: is the planner with AdaTopK ever slower?

One local swarm of real daemons (loopback), one gpt2-tiny job per configuration, the configurations
run in alternating order round after round (A B, B A, ...) so that a change in the machine's load
falls on both. Each configuration is `planner:compress`: `fusion:adatopk` is what `fusionnode train`
does by default in a private or local swarm, `simple:none` the layout it used before. Per run: the
median tokens/s after the first 3 steps and the plan taken; at the end, per configuration the
median and range, and per round the ratio of the second configuration to the first.

Timings on a shared machine are noisy: run it when nothing else does, and quote the range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PLANNERS = ("simple", "fusion", "grid", "even", "memory")
CODECS = ("none", "adatopk")
WARM_STEPS = 3  # steps left out of the median (compile, first allocations, the first link probes)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from fusionnode.bench.faults import add_job_options

    p = argparse.ArgumentParser(
        prog="fusionnode bench defaults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--configs",
        default="simple:none,fusion:adatopk",
        help="comma-separated planner:compress pairs; ratios are of each to the first (default %(default)s)",
    )
    p.add_argument("--peers", type=int, default=3, help="daemons in the local swarm (default %(default)s)")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of every configuration (default %(default)s)"
    )
    p.add_argument("--steps", type=int, default=16, help="steps of each job (default %(default)s)")
    add_job_options(p)
    args = p.parse_args(argv)
    configs = []
    for item in (x for x in args.configs.split(",") if x):
        planner, _, codec = item.partition(":")
        if planner not in PLANNERS or codec not in CODECS:
            p.error(
                f"--configs: {item!r} is not planner:compress with planner in {', '.join(PLANNERS)} "
                f"and compress in {', '.join(CODECS)}"
            )
        configs.append((planner, codec))
    if len(configs) < 2:
        p.error("--configs: give at least two planner:compress pairs to compare")
    args.configs = configs
    for name in ("peers", "rounds", "steps", "seq_len", "batch_size", "micro_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.steps <= WARM_STEPS:
        p.error(f"--steps must be more than {WARM_STEPS} (the first {WARM_STEPS} are left out)")
    if args.peers < 2:
        p.error("--peers must be at least 2")
    return args


def run_once(swarm: Any, args: argparse.Namespace, workdir: Path, planner: str, codec: str, r: int) -> dict:
    """One job of one configuration: median tokens/s after the warm steps, the plan, the final loss."""
    from fusionnode.bench.faults import _spec, _train

    name = f"{planner}-{codec}-{r}"
    spec = _spec(args, workdir / f"{name}.jsonl").replace(job_id=name, compress=codec)
    t0 = time.monotonic()
    _result, events = asyncio.run(_train(swarm, {"spec": spec.to_dict(), "planner": planner}))
    steps = [e for e in events if e["type"] == "step"][WARM_STEPS:]
    plan = next(e for e in events if e["type"] == "plan")
    return {
        "config": f"{planner}:{codec}",
        "round": r,
        "tokens_per_s": statistics.median(e["tokens_per_s"] for e in steps),
        "step_s": statistics.median(e["step_time_s"] for e in steps),
        "pipelines": len({s["replica"] for s in plan["stages"]}),
        "stages": len(plan["stages"]),
        "optimizer_hosts": len(plan.get("optimizer_hosts") or []),
        "loss": steps[-1]["loss"],
        "wall_s": time.monotonic() - t0,
    }


def summarise(runs: list[dict], configs: list[str]) -> dict[str, Any]:
    """Per configuration the median and range of tokens/s; per round each one's ratio to the first."""
    by = {c: [x["tokens_per_s"] for x in runs if x["config"] == c] for c in configs}
    base = configs[0]
    ratios: dict[str, list[float]] = {}
    for c in configs[1:]:
        pairs = zip(by[base], by[c], strict=True)
        ratios[c] = [round(b / a, 3) for a, b in pairs if a > 0]
    return {
        "tokens_per_s": {
            c: {"median": statistics.median(v), "min": min(v), "max": max(v)} for c, v in by.items() if v
        },
        "ratio_to_first_per_round": ratios,
        "never_slower": {c: bool(v) and min(v) >= 1.0 for c, v in ratios.items()},
    }


def main(argv: list[str] | None = None) -> int:
    import os

    import torch

    from fusionnode.bench.faults import _swarm

    args = parse_args(argv)
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the swarm's cleanup on SIGTERM too
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fusionnode-defaults-")).resolve()
    swarm = _swarm(workdir / "swarm", args.peers)
    names = [f"{p}:{c}" for p, c in args.configs]
    runs: list[dict] = []
    try:
        for r in range(args.rounds):
            order = args.configs if r % 2 == 0 else args.configs[::-1]
            for planner, codec in order:
                run = run_once(swarm, args, workdir, planner, codec, r)
                run["load_avg"] = os.getloadavg()[0]
                runs.append(run)
                if not args.json:
                    print(
                        f"round {r} {run['config']:16s} {run['tokens_per_s']:9.0f} tokens/s "
                        f"step {run['step_s']:.3f} s, {run['pipelines']} pipeline(s), "
                        f"{run['stages']} stage(s) in all, {run['optimizer_hosts']} host(s), "
                        f"loss {run['loss']:.4f}, load {run['load_avg']:.1f}",
                        flush=True,
                    )
    finally:
        swarm.stop()
    summary = summarise(runs, names)
    if args.json:
        print(json.dumps({"runs": runs, **summary}))
    else:
        for c, s in summary["tokens_per_s"].items():
            print(f"{c:16s} median {s['median']:.0f} tokens/s (range {s['min']:.0f}-{s['max']:.0f})")
        for c, v in summary["ratio_to_first_per_round"].items():
            print(f"{c} / {names[0]} per round: {', '.join(f'{x:.2f}x' for x in v)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
