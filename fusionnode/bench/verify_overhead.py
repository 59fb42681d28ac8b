"""`fusionnode bench verify`'s overhead section (see fusionnode/bench/verify.py's help): the same
honest job with checks off and on, interleaved, timed on an unpaced local swarm.

With `--pin-checks` the check process gets a core of its own: every process of the swarm (daemons,
their p2pd and DHT children: workers, driver, optimizer hosts) runs on CPU 0 only and the driver's
check process on CPU 1 only (each thread's affinity, `os.sched_setaffinity`), for the checks-off and
the checks-on runs alike, so the baseline is like for like. It shows the checks' cost where a spare
core exists (the idle-priority check process's design); the per-core busy share is reported too."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any

from fusionnode.bench.verify import _params, _spec, _steps, _train
from fusionnode.bench.verify_peer import pin_apart, verifier_params


def _members(swarm: Any) -> list[tuple[int, Any]]:
    """Every live process of the swarm with its daemon's index: the daemons and their children."""
    import psutil

    out = []
    for i, proc in enumerate(swarm.procs):
        try:
            top = psutil.Process(proc.pid)
            out += [(i, q) for q in (top, *top.children(recursive=True))]
        except psutil.NoSuchProcess:
            continue
    return out


def _family(swarm: Any) -> list[Any]:
    """Every live process of the swarm: its daemons and their children."""
    return [q for _, q in _members(swarm)]


def _swarm_cpu_s(swarm: Any) -> float:
    """CPU seconds used so far by the swarm's daemons and their children (p2pd, the check process)."""
    import psutil

    total = 0.0
    for _, q in _members(swarm):
        try:
            t = q.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _cpu_by_role(swarm: Any) -> dict[str, float]:
    """CPU seconds used so far, by role: the driver's daemon (driver, optimizer host and a worker),
    its check process, the other daemons (workers, the spare), and every daemon's p2pd."""
    import psutil

    out = {"driver_daemon": 0.0, "check_process": 0.0, "other_daemons": 0.0, "p2pd": 0.0}
    verifier = getattr(swarm, "verifier", None)
    if verifier is not None:
        out["verifier_peer"] = 0.0  # its daemon, p2pd and check process (--verifier-peer)
    for i, q in _members(swarm):
        try:
            cmd = " ".join(q.cmdline())
            t = q.cpu_times()
        except psutil.NoSuchProcess:
            continue
        if i == verifier:
            out["verifier_peer"] += t.user + t.system
            continue
        role = "p2pd" if "p2pd" in cmd else "check_process" if "spawn_main" in cmd else None
        role = role or ("driver_daemon" if i == 0 else "other_daemons")
        out[role] += t.user + t.system
    return out


def _pin(proc: Any, cpus: set[int]) -> None:
    """Every thread of `proc` on `cpus` (a process's affinity call covers one thread only)."""
    import psutil

    try:
        for t in proc.threads():
            try:
                os.sched_setaffinity(t.id, cpus)
            except (ProcessLookupError, PermissionError):
                continue
    except psutil.NoSuchProcess:
        return


def pin_swarm(swarm: Any, before: set[int]) -> int | None:
    """The swarm on CPU 0 and its check process (a `spawn_main` child of the driver's daemon that was
    not there in `before`) on CPU 1; the check process's pid (None when none was found)."""
    import psutil

    driver = psutil.Process(swarm.procs[0].pid)
    checker = None
    for q in driver.children(recursive=True):
        try:
            if q.pid not in before and any("spawn_main" in part for part in q.cmdline()):
                checker = q
        except psutil.NoSuchProcess:
            continue
    for q in _family(swarm):
        if checker is None or q.pid != checker.pid:
            _pin(q, {0})
    if checker is not None:
        _pin(checker, {1})
    return None if checker is None else checker.pid


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def run_overhead(args: argparse.Namespace, swarm: Any) -> dict[str, Any]:
    """The same honest job with checks off (A) and on at `--rate` (B), interleaved A B B A A B ...
    (`--overhead-repeats` pairs: the machine's other load drifts); per run the median step time
    after its first 3 steps, and the swarm's CPU seconds per step; the overhead is each pair's
    on/off ratio (median and range over the pairs), and the ratio of the runs' medians."""
    per_run: dict[str, list[float]] = {"off": [], "on": []}  # each run's median step time
    cpu: dict[str, list[float]] = {"off": [], "on": []}  # each run's swarm CPU seconds per step
    roles: dict[str, list[dict[str, float]]] = {"off": [], "on": []}  # the same, by role
    verify_s: list[float] = []
    losses: dict[str, float] = {}
    parts: dict[str, float] = {}
    deferred = None
    judged: dict[str, float] = {}  # with a verifier peer: checks it judged, checks that fell back
    import psutil

    load = [round(os.getloadavg()[0], 2)]
    pin = getattr(args, "pin_checks", False)
    vcore = getattr(args, "verifier_core", False)  # the verifier peer on CPU 1, the rest on CPU 0
    named = verifier_params(swarm)  # with a verifier peer: it, and the workers named
    before = {q.pid for q in _family(swarm)}
    if pin:
        pin_swarm(swarm, before)  # the check process, spawned below, inherits CPU 0: moved after
    if vcore:
        pin_apart(swarm)
    # a short checked job first: the driver's daemon (or the verifier's) spawns its check process at
    # its first checked job
    warm = _params(
        _spec(args, "verify-overhead-warmup", 4), "sample", args.rate, args.grad_rate, args.sync_cfg
    )
    asyncio.run(_train(swarm, {**warm, **named}))
    check_pid = pin_swarm(swarm, before) if pin else None
    if vcore:
        pin_apart(swarm)  # its check process inherited CPU 1; the swarm's new threads CPU 0
    if pin and check_pid is None:
        raise RuntimeError("--pin-checks: the driver's check process was not found")
    psutil.cpu_percent(percpu=True)  # starts the per-core busy count
    for r in range(args.overhead_repeats):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):  # interleaved: the load drifts
            spec = _spec(args, f"verify-overhead-{mode}-{r}", args.overhead_steps)
            c0, r0 = _swarm_cpu_s(swarm), _cpu_by_role(swarm)
            params = _params(
                spec, "sample" if mode == "on" else "off", args.rate, args.grad_rate, args.sync_cfg
            )
            result, events = asyncio.run(_train(swarm, {**params, **named}))
            steps = _steps(events)
            cpu[mode].append((_swarm_cpu_s(swarm) - c0) / len(steps))
            roles[mode].append({k: (v - r0[k]) / len(steps) for k, v in _cpu_by_role(swarm).items()})
            per_run[mode].append(statistics.median(s["step_time_s"] for s in steps[3:]))
            if mode == "on":
                verify_s += [s.get("phases", {}).get("verify_s", 0.0) for s in steps[3:]]
                for k in ("params_s", "pushed_s", "audit_s", "recompute_s", "seconds", "steps", "wait_s"):
                    parts[k] = parts.get(k, 0.0) + result["verify"][k]
                deferred = result["verify"].get("deferred")
                for k, v in (result["verify"].get("verifier") or {}).items():
                    if k != "peer":
                        judged[k] = judged.get(k, 0) + v
            losses[mode] = steps[-1]["loss"]
            load.append(round(os.getloadavg()[0], 2))
    busy = psutil.cpu_percent(percpu=True)
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
        # where the CPU goes (medians over the runs): what the checks add is on - off per role
        "cpu_s_per_step_by_role": {
            mode: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]}
            for mode, rs in roles.items()
        },
        "load_avg_1min": load,
        "pinned": {"swarm_cpus": [0], "check_cpus": [1], "check_pid": check_pid} if pin else None,
        "verifier_core": {"swarm_cpus": [0], "verifier_cpus": [1]} if vcore else None,
        "verifier_peer": named.get("verifier"),
        "verifier_checks": {k: round(v, 3) for k, v in judged.items()} or None,
        "busy_percent_per_core": busy,  # over the timed runs, whatever ran on each core (others' too)
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
