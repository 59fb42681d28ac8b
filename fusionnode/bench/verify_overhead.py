"""`fusionnode bench verify`'s overhead section (see fusionnode/bench/verify.py's help): the same
honest job with checks off and on, interleaved, timed on an unpaced local swarm."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any

from fusionnode.bench.verify import _params, _spec, _steps, _train


def _swarm_cpu_s(swarm: Any) -> float:
    """CPU seconds used so far by the swarm's daemons and their children (p2pd, the check process)."""
    import psutil

    total = 0.0
    for proc in swarm.procs:
        try:
            top = psutil.Process(proc.pid)
            family = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for q in family:
            try:
                t = q.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
    return total


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def run_overhead(args: argparse.Namespace, swarm: Any) -> dict[str, Any]:
    """The same honest job with checks off (A) and on at `--rate` (B), interleaved A B B A A B ...
    (`--overhead-repeats` pairs: the machine's other load drifts); per run the median step time
    after its first 3 steps, and the swarm's CPU seconds per step; the overhead is each pair's
    on/off ratio (median and range over the pairs), and the ratio of the runs' medians."""
    per_run: dict[str, list[float]] = {"off": [], "on": []}  # each run's median step time
    cpu: dict[str, list[float]] = {"off": [], "on": []}  # each run's swarm CPU seconds per step
    verify_s: list[float] = []
    losses: dict[str, float] = {}
    parts: dict[str, float] = {}
    deferred = None
    load = [round(os.getloadavg()[0], 2)]
    # a short checked job first: the driver's daemon spawns its check process at its first checked job
    asyncio.run(
        _train(
            swarm,
            _params(
                _spec(args, "verify-overhead-warmup", 4), "sample", args.rate, args.grad_rate, args.sync_cfg
            ),
        )
    )
    for r in range(args.overhead_repeats):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):  # interleaved: the load drifts
            spec = _spec(args, f"verify-overhead-{mode}-{r}", args.overhead_steps)
            c0 = _swarm_cpu_s(swarm)
            result, events = asyncio.run(
                _train(
                    swarm,
                    _params(
                        spec, "sample" if mode == "on" else "off", args.rate, args.grad_rate, args.sync_cfg
                    ),
                )
            )
            steps = _steps(events)
            cpu[mode].append((_swarm_cpu_s(swarm) - c0) / len(steps))
            per_run[mode].append(statistics.median(s["step_time_s"] for s in steps[3:]))
            if mode == "on":
                verify_s += [s.get("phases", {}).get("verify_s", 0.0) for s in steps[3:]]
                for k in ("params_s", "pushed_s", "audit_s", "recompute_s", "seconds", "steps", "wait_s"):
                    parts[k] = parts.get(k, 0.0) + result["verify"][k]
                deferred = result["verify"].get("deferred")
            losses[mode] = steps[-1]["loss"]
            load.append(round(os.getloadavg()[0], 2))
    off, on = statistics.median(per_run["off"]), statistics.median(per_run["on"])
    pairs = [b / a - 1 for a, b in zip(per_run["off"], per_run["on"], strict=True)]
    cpu_pairs = [b / a - 1 for a, b in zip(cpu["off"], cpu["on"], strict=True)]
    return {
        "scenario": "overhead",
        "rate": args.rate,
        "grad_rate": args.grad_rate,
        "pairs": args.overhead_repeats,
        "overhead": _spread(pairs),  # each pair's median step time on / off - 1
        "overhead_of_medians": round(on / off - 1, 4),
        "step_s_off": _spread(per_run["off"]),
        "step_s_on": _spread(per_run["on"]),
        "cpu_overhead": _spread(cpu_pairs),  # each pair's swarm CPU per step on / off - 1
        "cpu_s_per_step_off": _spread(cpu["off"]),
        "cpu_s_per_step_on": _spread(cpu["on"]),
        "load_avg_1min": load,
        "checks_off_critical_path": deferred,
        "median_verify_phase_s": round(statistics.median(verify_s), 4),
        "final_loss_off": losses["off"],
        "final_loss_on": losses["on"],
        "mean_per_step_s": {
            k: round(parts[k] / parts["steps"], 4)
            for k in ("seconds", "params_s", "pushed_s", "audit_s", "recompute_s", "wait_s")
        },
    }


__all__ = ["run_overhead"]
