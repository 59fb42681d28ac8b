"""`fusionnode bench faults`: straggler rebalancing and worker kills on a real local swarm.

Method (real `fusionnode join` daemons on loopback, started with FUSIONNODE_DEBUG=1 so a
worker reads a slow-down factor from `<state dir>/debug_slow`):

- straggler: 4 workers. First the reference: the same job on the 3 workers that will stay
  healthy (3 stages) — the best plan without the slowed peer's capacity, measured on the same
  machine (all peers share its cores, so this comparison is the meaningful one). Then the job on
  all 4 (4 stages, offload, a rebalance check every `--check-every` steps); after `--slow-at`
  steps one worker (not the driver's) is slowed `--factor` times. Reported: median tokens/s of the
  healthy steps, of the slowed steps before the re-plan, of the steps after it (leaving out the
  first step of each plan), the reference's, and the steps from the slow-down to the re-plan.
  With `--pipelines 2`: the job is the planner's layout of the 4 workers (`train`'s default: no
  --stages/--replicas; on 4 local peers it lays gpt2-tiny out as 2 pipelines, which the result's
  `initial_plan_stages_per_pipeline` shows), or with `--pinned` 2 pipelines x 2 stages (the user's
  shape: rebalancing moves shares and re-splits, never changes it), or with `--reshape` 2 x 2 as
  the first plan, which the planner may re-plan into another shape. References on the 3 healthy
  ones: the same command (the job's own layout options; issue 18's bar: "the same job run without
  that peer"), 2 pipelines of one stage (3 // 2 stages each), one of 3 stages, and the planner's
  layout. `--stages 2 --replicas 2` needs 4 workers: the driver refuses it on 3, and the same
  command without `--stages` (the driver's default, one stage per worker of each of the 2
  pipelines: 2 x 1) is the bar. Reported against the bar and each reference: the tokens/s after
  the last re-plan, and over the steps from `window_steps` (10) after the slow-down on (each plan's
  first step left out); `met_80_percent_within_window`: at least 0.8 of the bar there, with the last
  re-plan within the window. (`reference_without_slowed_peer_tokens_per_s`: the fastest reference.)
- clean: the job of `--pipelines` on 4 healthy workers with rebalancing at its default (on, every
  2 steps: the optimizer state is offloaded); reported: the re-plans it made (there should be none:
  the trigger acts only on a gain that clears the measured noise at consecutive checks).
- kill: 2 + `--kills` peers (the driver, also the optimizer host, and one worker form 2 stages;
  the rest are spares); `--kills` times, at least 3 steps apart, a random non-driver worker of
  the plan in force is SIGKILLed at a random moment of a step. Reported: steps completed,
  failures and recoveries in the metrics, time to recover (failure detected -> new plan
  running), and the largest loss difference to
  the same job trained in one process (with offload a replayed step is exact).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEBUG_ENV = "FUSIONNODE_DEBUG"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="fusionnode bench faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--scenario",
        choices=["straggler", "kill", "clean", "all"],
        default="all",
        help="which fault to inject: a straggler, SIGKILLed workers, or both; clean: none, to count "
        "the re-plans rebalancing makes on a healthy job (default %(default)s)",
    )
    p.add_argument(
        "--pipelines",
        type=int,
        choices=[1, 2],
        default=1,
        help="straggler and clean: one pipeline of 4 stages, or 2 pipelines: the planner's layout "
        "(train's default; it lays gpt2-tiny out as 2 pipelines on 4 local peers), or with --pinned "
        "2 x 2 stages (default %(default)s)",
    )
    p.add_argument(
        "--pinned",
        action="store_true",
        help="with --pipelines 2: lay the job out as 2 x 2 stages (--stages 2 --replicas 2: the user's "
        "shape, which rebalancing keeps) instead of the planner's layout",
    )
    p.add_argument(
        "--reshape",
        action="store_true",
        help="with --pipelines 2: 2 x 2 stages as the first plan, which rebalancing may re-plan with the "
        "planner (`train --stages 2 --replicas 2 --reshape`: the shape may change) instead of keeping it",
    )
    p.add_argument("--steps", type=int, default=30, help="steps of each job (default %(default)s)")
    p.add_argument("--factor", type=float, default=4.0, help="straggler slow-down (default %(default)s)")
    p.add_argument(
        "--slow-at",
        type=int,
        default=8,
        help="step after which the straggler slows down; 0: from the first step, a peer of the first "
        "plan (which the share move's trigger never sees: it needs a drop) (default %(default)s)",
    )
    p.add_argument(
        "--check-every",
        type=int,
        default=None,
        help="steps between rebalance checks (default: the job's default, 2 with offload)",
    )
    p.add_argument(
        "--kills", type=int, default=5, help="workers SIGKILLed in the kill scenario (default %(default)s)"
    )
    p.add_argument(
        "--offload",
        choices=["on", "off"],
        default="on",
        help="where the optimizer state lives: optimizer hosts, or the workers (off: the kill scenario "
        "runs 2 pipelines synced by ring all-reduce, recovered from the surviving replicas) "
        "(default %(default)s)",
    )
    add_job_options(p)
    return p.parse_args(argv)


def add_job_options(p: argparse.ArgumentParser) -> None:
    """The gpt2-tiny job's options that `_spec` reads, the workdir and --json (shared with
    bench/defaults.py, which runs its jobs the same way)."""
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default %(default)s)")
    p.add_argument(
        "--micro-batches", type=int, default=4, help="micro-batches per step (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=11, help="seed of the job (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default %(default)s)")
    p.add_argument(
        "--workdir",
        default=None,
        help="where the peers keep state and logs (default: a new temporary directory)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON (default: text)")


def _spec(args: argparse.Namespace, metrics: Path) -> Any:
    from fusionnode.train.spec import JobSpec

    return JobSpec(
        model="gpt2-tiny",
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        seq_len=args.seq_len,
        seed=args.seed,
        grad_clip=1.0,
        lr=args.lr,
        warmup_steps=2,
        metrics_out=str(metrics),
    )


async def _train(swarm: Any, params: dict[str, Any], on_event: Any = None) -> tuple[dict, list[dict]]:
    from fusionnode import control

    events: list[dict] = []
    async for obj in control.call_stream(swarm.control(0), "train", params, timeout=None):
        if "event" not in obj:
            return obj["result"], events
        events.append(obj["event"])
        if on_event is not None:
            await on_event(obj["event"], events)
    raise RuntimeError("the driver closed the job without a result")


def _swarm(workdir: Path, n: int) -> Any:
    from fusionnode.localswarm import LocalSwarm

    os.environ[DEBUG_ENV] = "1"  # the daemons inherit it: their debug slow-down hook is on
    workdir.mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(workdir, n, log=sys.stderr)
    swarm.start()
    asyncio.run(swarm.wait_connected())
    return swarm


async def _seen_by_driver(swarm: Any, peer_id: str, timeout: float = 60.0) -> None:
    """Waits until the driver's peer sees `peer_id` in the swarm."""
    from fusionnode import control

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = await control.call(swarm.control(0), "peers")
        if peer_id in {p["peer_id"] for p in res["peers"]}:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"peer {peer_id[:12]} did not join within {timeout:.0f} s")


def _shape(args: argparse.Namespace) -> dict[str, Any]:
    """The straggler and clean job's layout options: 1 x 4 stages; 2 pipelines the planner's way
    (none: `train`'s default planner lays the job out), or 2 x 2 with --pinned (kept) or --reshape
    (the first plan only)."""
    if args.pipelines == 1:
        return {"stages": 4}
    if args.reshape:
        return {"stages": 2, "replicas": 2, "reshape": True}
    return {"stages": 2, "replicas": 2} if args.pinned else {"planner": "fusion"}


def _layout_name(args: argparse.Namespace) -> str:
    shape = _shape(args)
    return "reshape" if shape.get("reshape") else "planner" if "planner" in shape else "pinned"


def _shape_of(events: list[dict]) -> list[int]:
    """Stages per pipeline of a job's first plan."""
    plan = next(e for e in events if e["type"] == "plan")
    per: dict[int, int] = {}
    for st in plan["stages"]:
        per[st["replica"]] = per.get(st["replica"], 0) + 1
    return [per[r] for r in sorted(per)]


def _median_tps(steps: list[dict]) -> float | None:
    return statistics.median(e["tokens_per_s"] for e in steps) if steps else None


def run_straggler(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The straggler scenario; returns its figures."""
    swarm = _swarm(workdir / "straggler", 4)
    try:
        ids = [r["peer_id"] for r in swarm.ready]
        order = [ids[0], *sorted(ids[1:])]  # the driver's layout order: itself first, then by id
        spec = _spec(args, workdir / "straggler.jsonl")
        slowed: list[str] = []

        async def on_event(ev: dict, events: list[dict]) -> None:
            due = (
                ev["type"] == "plan"
                if args.slow_at == 0
                else ev["type"] == "step" and ev["step"] == args.slow_at - 1
            )
            if due and not slowed:
                plan = [e for e in events if e["type"] == "plan"][-1]
                peers = [st["peer"] for st in plan["stages"] if st["peer"] != ids[0]]
                victim = peers[len(peers) // 2]  # a middle stage of the plan in force, not the driver
                (swarm.state_dir(ids.index(victim)) / "debug_slow").write_text(str(args.factor))
                slowed.append(victim)

        params = {"spec": spec.to_dict(), **_shape(args), "peers": order, "offload": args.offload}
        if args.check_every is not None:
            params["rebalance_every"] = args.check_every
        _res, events = asyncio.run(_train(swarm, params, on_event))
        victim = slowed[0]
        (swarm.state_dir(ids.index(victim)) / "debug_slow").unlink(missing_ok=True)
        healthy = [p for p in order if p != victim]
        refs, ref_plans, same = _references(args, swarm, healthy, workdir)
        steps = [e for e in events if e["type"] == "step"]
        replans = [e for e in events if e.get("kind") == "replan" and e["step"] >= args.slow_at]
        replan_step = replans[0]["step"] if replans else None
        before = [e for e in steps if 1 <= e["step"] < args.slow_at]
        during = [
            e for e in steps if e["step"] >= args.slow_at and (replan_step is None or e["step"] < replan_step)
        ]
        after = [e for e in steps if replan_step is not None and e["step"] > replan_step]
        # a share move and a re-plan may follow each other: the steps after the last re-plan after
        # the slow-down (each plan's first step left out) are what the job recovered to
        last_step = replans[-1]["step"] if replans else None
        settled = [e for e in steps if last_step is not None and e["step"] > last_step]
        ref_tps = max((v for v in refs.values() if v), default=None)
        after_tps = _median_tps(after)
        return {
            "scenario": "straggler",
            "pipelines": args.pipelines,
            "factor": args.factor,
            **_against_same_command(args, same, refs, steps, replans),
            "reference_without_slowed_peer_tokens_per_s": ref_tps,  # the fastest of them
            "references_tokens_per_s": refs,
            "before_slowdown_tokens_per_s": _median_tps(before),
            "slowed_before_replan_tokens_per_s": _median_tps(during),
            "after_rebalance_tokens_per_s": after_tps,
            "recovered_fraction_of_reference": (after_tps / ref_tps) if after_tps and ref_tps else None,
            "after_last_replan_tokens_per_s": _median_tps(settled),
            "recovered_fraction_of_each_reference": {
                k: round(_median_tps(settled) / v, 3) for k, v in refs.items() if v and settled
            },
            "steps_from_slowdown_to_last_replan": (last_step - args.slow_at)
            if last_step is not None
            else None,
            "initial_plan_stages_per_pipeline": _shape_of(events),
            "reference_plans_stages_per_pipeline": ref_plans,
            "job_layout": _layout_name(args),
            "steps_from_slowdown_to_replan": (replan_step - args.slow_at)
            if replan_step is not None
            else None,
            "replans_in_run": sum(e.get("kind") == "replan" for e in events),
            "replan_reason": replans[0]["reason"] if replans else None,
            "replan_reasons": [e["reason"] for e in replans],
            "replan_steps": [e["step"] for e in replans],
            "replan_moved": (replans[0].get("moved") or "stages") if replans else None,
            "replan_move_s": replans[0].get("move_s") if replans else None,
            "replan_shares": replans[0].get("shares") if replans else None,
            "new_plan": [[p[:12], *b] for p, b in zip(replans[0]["peers"], replans[0]["bounds"], strict=True)]
            if replans
            else None,
            "slowed_peer": victim[:12],
        }
    finally:
        swarm.stop()


WINDOW_STEPS = 10  # issue 18: throughput recovers within this many steps of the slow-down


def _references(
    args: argparse.Namespace, swarm: Any, healthy: list[str], workdir: Path
) -> tuple[dict[str, float | None], dict[str, list[int]], dict[str, Any]]:
    """The jobs without the slowed peer, on the `healthy` ones (rebalancing off): the same command
    (the job's own layout options), and for comparison 3 stages; for 2 pipelines also 2 pipelines of
    one stage (3 // 2 stages each) and the planner's layout (what `train` runs by default). Returns
    (tokens/s by name, stages per pipeline by name, the same command's record: its options, and
    where the driver refused it why, with the shape it runs without --stages, which asks for more
    workers than are left: the driver's default, one stage per worker of each pipeline)."""
    from fusionnode.control import DaemonError

    own = _shape(args)
    shapes: dict[str, dict[str, Any]] = {"1x3": {"stages": 3}}
    if args.pipelines == 2:
        shapes = {"2x1": {"replicas": 2}, **shapes, "planner": {"planner": "fusion"}}
    plain = {k: v for k, v in own.items() if k != "reshape"}  # rebalancing is off in a reference
    name = next((k for k, v in shapes.items() if v == plain), None)
    same: dict[str, Any] = {"options": own, "name": name or "same", "refused": None}
    if name is None:
        shapes = {"same": own, **shapes}
    refs: dict[str, float | None] = {}
    plans: dict[str, list[int]] = {}

    def run(key: str, ref_shape: dict[str, Any]) -> None:
        ref_spec = _spec(args, workdir / f"straggler-reference-{key}.jsonl").replace(
            job_id=f"straggler-reference-{key}"
        )
        params = {"spec": ref_spec.to_dict(), **ref_shape, "peers": healthy, "offload": args.offload}
        _res, ref_events = asyncio.run(_train(swarm, {**params, "rebalance_every": 0}))
        refs[key] = _median_tps([e for e in ref_events if e["type"] == "step"][2:])
        plans[key] = _shape_of(ref_events)

    for key, ref_shape in shapes.items():
        try:
            run(key, ref_shape)
        except DaemonError as exc:
            if key != "same":
                raise
            same["refused"] = str(exc)
            fewer = {k: v for k, v in plain.items() if k != "stages"}
            same["runs_without_stages"] = fewer
            same["name"] = next((k for k, v in shapes.items() if v == fewer), "same")
            if same["name"] == "same":
                run("same", fewer)
    return refs, plans, same


def _against_same_command(
    args: argparse.Namespace,
    same: dict[str, Any],
    refs: dict[str, float | None],
    steps: list[dict],
    replans: list[dict],
) -> dict[str, Any]:
    """The straggler job against the same command run without the slowed peer (issue 18's bar: at
    least 0.8 of it within WINDOW_STEPS steps of the slow-down): its tokens/s after the last re-plan,
    and over the steps from the window's end on (each plan's first step left out), as fractions of
    the same command's, and of every other reference (labelled)."""
    bar = refs.get(same["name"])
    moved = {e["step"] for e in replans}
    last = max(moved) if moved else None
    after_last = _median_tps([e for e in steps if last is not None and e["step"] > last])
    late = _median_tps(
        [e for e in steps if e["step"] >= args.slow_at + WINDOW_STEPS and e["step"] not in moved]
    )
    frac = round(late / bar, 3) if late and bar else None
    return {
        "same_command": same,
        "same_command_tokens_per_s": bar,
        "window_steps": WINDOW_STEPS,
        "tokens_per_s_from_window_end": late,
        "fraction_of_same_command_from_window_end": frac,
        "fraction_of_same_command_after_last_replan": round(after_last / bar, 3)
        if after_last and bar
        else None,
        "fraction_of_each_reference_from_window_end": {
            k: round(late / v, 3) for k, v in refs.items() if v and late
        },
        "met_80_percent_within_window": bool(
            frac is not None and frac >= 0.8 and last is not None and last - args.slow_at <= WINDOW_STEPS
        ),
    }


def run_clean(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """A healthy job with rebalancing at its default (on: offloaded optimizer state): the re-plans it
    makes (the trigger should see only timing noise, so none) and the noise it measured."""
    swarm = _swarm(workdir / "clean", 4)
    try:
        spec = _spec(args, workdir / "clean.jsonl").replace(job_id="clean")
        t0 = time.monotonic()
        _res, events = asyncio.run(
            _train(swarm, {"spec": spec.to_dict(), **_shape(args), "offload": args.offload})
        )
        steps = [e for e in events if e["type"] == "step"]
        replans = [e for e in events if e.get("kind") == "replan" and e.get("reason") != "initial plan"]
        return {
            "scenario": "clean",
            "pipelines": args.pipelines,
            "steps": len(steps),
            "replans": len(replans),
            "job_layout": _layout_name(args),
            "initial_plan_stages_per_pipeline": _shape_of(events),
            "replan_reasons": [e.get("reason") for e in replans],
            "median_tokens_per_s": _median_tps(steps[2:]),
            "wall_s": round(time.monotonic() - t0, 1),
        }
    finally:
        swarm.stop()


def run_kills(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The kill scenario; returns its figures."""
    from fusionnode.train.local import train_local
    from fusionnode.train.metrics import read_metrics

    ring = args.offload == "off"  # 2 pipelines x 2 stages: each stage's state survives on its replica
    # the driver, the other workers of the first plan, a spare for every kill
    swarm = _swarm(workdir / "kill", (4 if ring else 2) + args.kills)
    rng = random.Random(args.seed)
    metrics = workdir / "kill.jsonl"
    spec = _spec(args, metrics)
    killed: list[str] = []
    killed_at: list[float] = []  # wall clock of each kill
    spawning: list[asyncio.Task] = []
    every = 3  # steps at least between kills
    try:
        driver = swarm.ready[0]["peer_id"]

        state = {"next_step": every, "busy": False}

        async def kill_soon(ev: dict, events: list[dict]) -> None:
            plan = [e for e in events if e["type"] == "plan"][-1]
            victims = [s["peer"] for s in plan["stages"] if s["peer"] != driver]
            if victims:
                victim = rng.choice(victims)
                await asyncio.sleep(rng.uniform(0.0, ev["step_time_s"]))  # a random moment of the next step
                i = next(k for k, r in enumerate(swarm.ready) if r["peer_id"] == victim)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(swarm.procs[i].pid, signal.SIGKILL)
                killed.append(victim)
                killed_at.append(time.time())
            state["next_step"] = ev["step"] + every
            state["busy"] = False

        async def on_event(ev: dict, events: list[dict]) -> None:
            if ev["type"] != "step" or len(killed) >= args.kills or state["busy"]:
                return
            if ev["step"] >= state["next_step"]:
                state["busy"] = True
                spawning.append(asyncio.create_task(kill_soon(ev, list(events))))

        t0 = time.monotonic()
        shape = {"stages": 2, "replicas": 2} if ring else {"stages": 2}
        params = {"spec": spec.to_dict(), **shape, "offload": args.offload, "rebalance_every": 0}
        result, _events = asyncio.run(_train(swarm, params, on_event))
        wall = time.monotonic() - t0
        steps, evs = read_metrics(metrics)
        ref = train_local(spec.replace(metrics_out=None)).losses
        losses = [s["loss"] for s in steps]
        rec = [e for e in evs if e["event"] == "recovered"]
        return {
            "scenario": "kill",
            "kills": len(killed),
            "steps_completed": len(steps),
            "steps_planned": spec.steps,
            "step_ids_in_order": [s["step"] for s in steps] == list(range(spec.steps)),
            "failures": sum(e["event"] == "failure" for e in evs),
            "recoveries": len(rec),
            "time_to_recover_s": [e["time_to_recover_s"] for e in rec],
            # from the SIGKILL to the next step recorded (the rest of the step it hit, the failure's
            # detection, the re-plan and the replayed step)
            "kill_to_next_step_s": [
                round(min((s["ts"] for s in steps if s["ts"] > k), default=float("nan")) - k, 3)
                for k in killed_at
            ],
            "median_step_s": statistics.median(s["step_time_s"] for s in steps),
            "offload": args.offload,
            "max_abs_loss_diff_vs_single_process": max(abs(a - b) for a, b in zip(losses, ref, strict=True)),
            "final_loss": losses[-1],
            "wall_s": round(wall, 1),
            "result_steps": result["steps"],
        }
    finally:
        swarm.stop()


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the swarms' cleanup on SIGTERM too
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fusionnode-faults-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    out = []
    if args.scenario in ("straggler", "all"):
        out.append(run_straggler(args, workdir))
    if args.scenario in ("kill", "all"):
        out.append(run_kills(args, workdir))
    if args.scenario == "clean":
        out.append(run_clean(args, workdir))
    for res in out:
        if args.json:
            print(json.dumps(res))
        else:
            print(f"[{res['scenario']}]")
            for k, v in res.items():
                if k != "scenario":
                    print(f"  {k:40s} {round(v, 3) if isinstance(v, float) else v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
