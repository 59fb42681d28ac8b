"""`fusionnode bench verify`: spot-checks against lying workers on a real local swarm.

Method (real `fusionnode join --debug` daemons on loopback; 3 peers: the driver's peer, which is
also the optimizer host and a worker, and two more workers, one of them a spare; 2 stages, offload
on; the liar reads its lie from `<state dir>/debug_lie`, see fusionnode/verify/liar.py):

- overhead: the same honest job with checks off and at the default rates (`--rate`, `--grad-rate`),
  interleaved off/on, on/off, ... for `--overhead-repeats` pairs (after one short checked job that
  starts the driver's check process); per run the median step time over the steps after its first
  3 and the swarm's CPU seconds per step (daemons, p2pd, the check process); reported: each pair's
  on/off ratio as median and range, the ratio of the medians, the CPU ratio and the load average
  along the way. Time it under the shared lock (`flock`): other load moves it.
  The swarm is unpaced (no `debug_pace`: the paced testbed sleeps, which would hide the cost);
  every peer shares this machine's cores.
- lies: for each kind (`--kinds`), `--runs` jobs at the default rate in which the worker of the
  first stage that is not the driver's own peer lies from its first step (`scale` by 1.01 = a 1%
  activation scaling; `noise` of 1% RMS; `stale` tensors of the previous step; `other`: another
  micro-batch's tensors; `fraction`: a 1% scaling on only `--fraction` of its micro-batches;
  `gradient`: a random parameter gradient of the right norm pushed to the optimizer hosts, found by
  the gradient check, which recomputes all of a stage's micro-batches with probability `--rate`).
  Reported: the step at which it was caught (steps until caught, counted from its first lie), the
  validation loss at the end and the last step's loss, each with its difference to the
  single-process reference of the same job (the validation loss is the steadier figure: the last
  batch's loss of a 24-step run moves by tenths when only the plan, hence the summation order,
  changes), and one
  `--unchecked` run per kind with checks off (the loss a liar leaves behind when nobody checks).
- seeded (`--sections seeded`): `--seeded-runs` (100) real jobs per kind on the same swarm, each of
  at most 20 steps on a tiny batch and cancelled as soon as its liar is caught (see `run_seeded`);
  reported: caught within 20 steps out of the runs, median / max steps until caught, whether the
  caught peer was the liar. About 1-2 s per job here.
- sim (bench/verify_sim.py): the same statistics simulated with the real check selector (a fresh secret per seeded run) and the real liar's own
  random choices, using that a checked micro-batch that was lied on is always caught (what the
  real runs and tests/test_verify.py show: every kind of lie mismatches on every lied micro-batch)
  and the closed form 1 - (1 - rate x fraction)^(m x 20) next to it.
- contrib (`--sections contrib`, its own 4-daemon swarm): a replica sending random pseudo-gradients
  in 2 x 2 `--sync diloco|sparseloco` jobs under `--contrib-policy` off, clip and score
  (bench/verify_contrib.py).
- clean: one honest job of `--clean-steps` steps under `--clean-policy` (default: every micro-batch
  checked); reported: micro-batches checked, peers caught (false positives), disputes, rollbacks.

`--compress adatopk` (or `topk:R`, `fp16`): every job over that link codec, told its links are slow
so AdaTopK compresses on loopback too (bench/verify_links.py); the checks judge it within the codec's
bounds (verify/lossy.py).

`--verifier-peer`: every checked job names one more daemon, started with `--serve-checks`, as its
verifier (`train --verifier`), which judges the audits instead of the driver's check process;
`--verifier-core` (overhead) also pins the swarm to CPU 0 and the verifier to CPU 1 (bench/verify_peer.py).

With offload the driver checks a step while the next one runs, its recomputes in a low-priority
process of its daemon (or on the verifier peer); a lie found that way rolls the lied step back on the optimizer hosts (the
`rollback` event) and the job replays from it (train/checks.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fusionnode.bench.verify_contrib import add_args as add_contrib_args
from fusionnode.bench.verify_contrib import run_contrib
from fusionnode.bench.verify_links import (
    add_link_args,
    check_link_args,
    link_params,
    link_summary,
)
from fusionnode.bench.verify_peer import add_verifier_args, start_verifier, verifier_params

DEBUG_ENV = "FUSIONNODE_DEBUG"
KIND_CONFIGS: dict[str, dict[str, Any]] = {
    "scale": {"kind": "scale", "factor": 1.01},
    "noise": {"kind": "noise", "sigma": 0.01},
    "stale": {"kind": "stale"},
    "other": {"kind": "other"},
    "fraction": {"kind": "scale", "factor": 1.01},  # + "fraction": --fraction
    "gradient": {"kind": "random_pseudo_gradient"},  # a random parameter gradient of the right norm
    "update": {"kind": "update", "factor": 1.01},  # --sync diloco|sparseloco: a 1% longer inner step
}
ROUND_KINDS = ("scale", "noise", "stale", "other", "fraction", "update")  # the default under --sync rounds
CATCH_WITHIN = 20  # steps: the target
SECTIONS = ("sim", "overhead", "lies", "seeded", "clean", "contrib")
FRESH = {"debug_forget_bans": True}  # the driver forgets the bans of earlier jobs (daemons run --debug)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from fusionnode.verify.policy import DEFAULT_PUBLIC_GRAD_RATE, DEFAULT_PUBLIC_RATE

    p = argparse.ArgumentParser(
        prog="fusionnode bench verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--kinds",
        default=None,
        help="comma-separated kinds of lie to run (default: all but update under --sync step, "
        f"{','.join(ROUND_KINDS)} under a round mode)",
    )
    p.add_argument(
        "--sync",
        choices=["step", "diloco", "sparseloco"],
        default="step",
        help="the jobs' --sync (lies, seeded, clean, overhead sections): a round mode checks the "
        "workers' inner steps (verify/inner.py); its jobs run one replica (default %(default)s)",
    )
    p.add_argument(
        "--inner-steps", type=int, default=5, help="H of a round mode's jobs (default %(default)s)"
    )
    p.add_argument("--runs", type=int, default=2, help="real runs per kind of lie (default %(default)s)")
    p.add_argument(
        "--sim-runs", type=int, default=100, help="simulated seeded runs per kind (default %(default)s)"
    )
    p.add_argument("--steps", type=int, default=24, help="steps of each liar job (default %(default)s)")
    p.add_argument(
        "--rate",
        type=float,
        default=DEFAULT_PUBLIC_RATE,
        help="spot-check rate per micro-batch, besides the gradient checks (default: a public swarm's, "
        "%(default)s)",
    )
    p.add_argument(
        "--grad-rate",
        type=float,
        default=DEFAULT_PUBLIC_GRAD_RATE,
        help="gradient check rate per stage and step: all its micro-batches and its parameter gradients "
        "(default: a public swarm's, %(default)s)",
    )
    p.add_argument(
        "--fraction",
        type=float,
        default=0.25,
        help="share of micro-batches the fraction liar lies on (default %(default)s)",
    )
    p.add_argument(
        "--overhead-steps", type=int, default=30, help="steps of each overhead job (default %(default)s)"
    )
    p.add_argument(
        "--overhead-repeats", type=int, default=4, help="interleaved off/on pairs (default %(default)s)"
    )
    p.add_argument(
        "--liar-stage",
        choices=["plan", "first"],
        default="plan",
        help="seeded: where the liar sits: as the plan puts it (the last stage: it lies on the gradients "
        "it sends back), or on the first stage (it lies on its activations) (default %(default)s)",
    )
    p.add_argument(
        "--pin-checks",
        action="store_true",
        help="overhead: the swarm on CPU 0, the driver's check process on CPU 1 (both modes)",
    )
    p.add_argument(
        "--clean-steps", type=int, default=500, help="steps of the clean run, 0 = skip (default %(default)s)"
    )
    p.add_argument(
        "--clean-policy",
        choices=["all", "sample"],
        default="all",
        help="checks of the clean run: every micro-batch, or the --rate sample (default %(default)s)",
    )
    p.add_argument(
        "--unchecked",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also one liar run per kind with checks off, for its loss (default: on)",
    )
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default %(default)s)")
    p.add_argument(
        "--micro-batches", type=int, default=4, help="micro-batches per step (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=11, help="seed of the jobs (default %(default)s)")
    p.add_argument(
        "--workdir", default=None, help="peers' state and logs (default: a new temporary directory)"
    )
    p.add_argument(
        "--sections",
        default="sim,overhead,lies,clean",
        help="what to run, comma-separated among sim, overhead, lies, seeded, clean, contrib "
        "(default %(default)s)",
    )
    add_contrib_args(p)
    p.add_argument(
        "--seeded-runs",
        type=int,
        default=100,
        help="real seeded runs per kind of lie in the 'seeded' section (default %(default)s)",
    )
    add_link_args(p)
    add_verifier_args(p)
    p.add_argument("--json", action="store_true", help="print the figures as JSON (default: text)")
    args = p.parse_args(argv)
    check_link_args(p, args)
    rounds = args.sync != "step"
    if args.kinds is None:
        args.kinds = ",".join(ROUND_KINDS if rounds else [k for k in KIND_CONFIGS if k != "update"])
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KIND_CONFIGS for k in kinds):
        p.error(f"--kinds: choose among {', '.join(KIND_CONFIGS)}")
    if "update" in kinds and not rounds:
        p.error("--kinds update lies in a round mode's inner steps: use it with --sync diloco|sparseloco")
    if args.inner_steps < 1:
        p.error("--inner-steps must be at least 1")
    from fusionnode.sync import SyncConfig

    args.sync_cfg = SyncConfig(args.sync, inner_steps=args.inner_steps).to_dict() if rounds else None
    args.kinds = kinds
    sections = [x for x in args.sections.split(",") if x]
    if not sections or any(x not in SECTIONS for x in sections):
        p.error(f"--sections: choose among {', '.join(SECTIONS)}")
    args.sections = sections
    if any(m not in ("diloco", "sparseloco") for m in args.contrib_sync.split(",") if m):
        p.error("--contrib-sync: choose among diloco, sparseloco")
    if not 0 <= args.rate <= 1 or not 0 < args.fraction <= 1 or not 0 <= args.grad_rate <= 1:
        p.error("--fraction must be in (0, 1], --rate and --grad-rate in [0, 1]")
    if args.rate == 0 == args.grad_rate:
        p.error("--rate and --grad-rate cannot both be 0 (no checks)")
    for name in (
        "runs",
        "sim_runs",
        "seeded_runs",
        "steps",
        "overhead_steps",
        "overhead_repeats",
        "micro_batches",
        "contrib_steps",
        "contrib_inner_steps",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.clean_steps < 0:
        p.error("--clean-steps must be >= 0")
    if (args.pin_checks or args.verifier_core) and not {0, 1} <= os.sched_getaffinity(0):
        p.error("--pin-checks and --verifier-core need CPUs 0 and 1")
    if args.pin_checks and (args.verifier_core or args.verifier_peer):
        p.error(
            "--pin-checks pins the driver's check process: not with a verifier peer (--verifier-core pins it)"
        )
    return args


def lie_config(kind: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    cfg = {**KIND_CONFIGS[kind], "seed": seed}
    if kind == "fraction":
        cfg["fraction"] = args.fraction
    return cfg


def _spec(
    args: argparse.Namespace, job_id: str, steps: int, metrics: Path | None = None, seed: int | None = None
) -> Any:
    from fusionnode.train.spec import JobSpec

    return JobSpec(
        model="gpt2-tiny",
        steps=steps,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        seq_len=args.seq_len,
        seed=args.seed if seed is None else seed,
        grad_clip=1.0,
        lr=3e-3,
        warmup_steps=2,
        metrics_out=str(metrics) if metrics else None,
        job_id=job_id,
        compress=getattr(args, "compress", "none"),
    )


async def _train(swarm: Any, params: dict[str, Any], on_event: Any = None) -> tuple[dict, list[dict]]:
    from fusionnode import control

    events: list[dict] = []
    async for obj in control.call_stream(swarm.control(0), "train", params, timeout=None):
        if "event" not in obj:
            return obj["result"], events
        events.append(obj["event"])
        if on_event is not None:
            await on_event(obj["event"])
    raise RuntimeError("the driver closed the job without a result")


def _params(
    spec: Any, policy: str, rate: float | None, grad_rate: float | None = None, sync: Any = None
) -> dict[str, Any]:
    """A bench job's train params; `sync` (`args.sync_cfg`): --sync's SyncConfig map, None for step."""
    return {
        **({"sync": sync} if sync else {}),
        "verify_grad_rate": grad_rate,
        "spec": spec.to_dict(),
        "stages": 2,
        "offload": "on",
        "rebalance_every": 0,
        "verify_policy": policy,
        "verify_rate": rate,
    }


def _steps(events: list[dict]) -> list[dict]:
    """The step records that stand: a `rollback` event voids those from its step on (replayed)."""
    steps: list[dict] = []
    for e in events:
        if e["type"] == "step":
            steps.append(e)
        elif e["type"] == "event" and e.get("kind") == "rollback":
            steps = [x for x in steps if x["step"] < e["step"]]
    return steps


def _events(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == "event" and e.get("kind") == kind]


def run_lies(args: argparse.Namespace, swarm: Any, workdir: Path) -> Any:
    """One row per kind of lie (see the module docstring); each job starts with no bans."""
    from fusionnode.train.local import train_local

    driver = swarm.ready[0]["peer_id"]
    refs: dict[int, list[float]] = {}
    honest: dict[tuple[int, str], tuple[float, float, bool]] = {}
    swarm_index = {rec["peer_id"]: i for i, rec in enumerate(swarm.ready)}
    for kind in args.kinds:
        rows = []
        modes = ["checked"] * args.runs + (["unchecked"] if args.unchecked else [])
        for r, mode in enumerate(modes):
            seed = args.seed + r
            spec = _spec(args, f"verify-{kind}-{mode}-{r}", args.steps, workdir / f"{kind}-{r}.jsonl", seed)
            if seed not in refs:
                refs[seed] = train_local(spec.replace(metrics_out=None, job_id=""))
            victim: list[int] = []

            async def on_event(
                ev: dict, kind: str = kind, seed: int = seed, victim: list[int] = victim
            ) -> None:
                if ev["type"] == "plan" and not victim:
                    peer = next(s["peer"] for s in ev["stages"] if s["peer"] != driver)
                    i = next(i for i, rec in enumerate(swarm.ready) if rec["peer_id"] == peer)
                    (swarm.state_dir(i) / "debug_lie").write_text(json.dumps(lie_config(kind, args, seed)))
                    victim.append(i)

            t0 = time.monotonic()
            try:
                result, events = asyncio.run(
                    _train(
                        swarm,
                        {
                            **_params(
                                spec,
                                "sample" if mode == "checked" else "off",
                                args.rate,
                                args.grad_rate,
                                args.sync_cfg,
                            ),
                            **FRESH,
                            **link_params(args, swarm),
                            **verifier_params(swarm),
                        },
                        on_event,
                    )
                )
            finally:
                for i in victim:
                    (swarm.state_dir(i) / "debug_lie").unlink(missing_ok=True)
            caught = _events(events, "caught")
            steps = _steps(events)
            ref, ref_val = refs[seed].losses, refs[seed].val_loss
            final = steps[-1]["loss"]
            plan = [p for p in events if p["type"] == "plan"][-1]["stages"]  # the plan the run ended on
            key = (seed, json.dumps([(x["peer"], x["lo"], x["hi"]) for x in plan]))
            if key not in honest:  # the same job, honest, on the final plan's peers and layout
                hspec = _spec(
                    args, f"verify-honest-{kind}-{r}", args.steps, workdir / f"honest-{kind}-{r}.jsonl", seed
                )
                hparams = {
                    **_params(hspec, "off", None, None, args.sync_cfg),
                    "peers": [x["peer"] for x in plan],
                    **FRESH,
                    **link_params(args, swarm),
                }
                hres, hev = asyncio.run(_train(swarm, hparams))
                hplan = [p for p in hev if p["type"] == "plan"][-1]["stages"]
                same = [(x["peer"], x["lo"], x["hi"]) for x in hplan] == [
                    (x["peer"], x["lo"], x["hi"]) for x in plan
                ]
                honest[key] = (hres["val_loss"], _steps(hev)[-1]["loss"], same)
            h_val, h_final, h_same = honest[key]
            rows.append(
                {
                    "mode": mode,
                    "caught_at_step": caught[0]["step"] if caught else None,
                    "rolled_back_to": [e["step"] for e in _events(events, "rollback")],
                    "steps_until_caught": caught[0]["step"] + 1 if caught else None,
                    "caught_peer_is_liar": bool(caught)
                    and caught[0]["peer"] == swarm.ready[victim[0]]["peer_id"]
                    and len(caught) == 1,
                    "val_loss": result["val_loss"],
                    "reference_val_loss": ref_val,
                    "val_loss_rel_diff": abs(result["val_loss"] - ref_val) / ref_val,
                    # the fair baseline: an honest run of the job on the plan this one ended on (same
                    # peers, same layers per stage: the liar out, as after its ban)
                    "honest_same_plan_val_loss": h_val,
                    "val_loss_rel_diff_vs_honest_same_plan": abs(result["val_loss"] - h_val) / h_val,
                    "final_loss_rel_diff_vs_honest_same_plan": abs(final - h_final) / h_final,
                    "honest_run_had_the_same_layout": h_same,
                    "plan_peers": [swarm_index[x["peer"]] for x in plan],
                    "layout": [(x["lo"], x["hi"]) for x in plan],
                    "final_loss": final,
                    "reference_final_loss": ref[-1],
                    "final_loss_rel_diff": abs(final - ref[-1]) / ref[-1],
                    "max_abs_loss_diff_vs_reference": max(abs(s["loss"] - ref[s["step"]]) for s in steps),
                    "wall_s": round(time.monotonic() - t0, 1),
                }
            )
        yield {"scenario": f"lie:{kind}", "config": lie_config(kind, args, 0), "runs": rows}


def run_clean(args: argparse.Namespace, swarm: Any) -> dict[str, Any]:
    spec = _spec(args, "verify-clean", args.clean_steps)
    t0 = time.monotonic()
    params = {
        **_params(spec, args.clean_policy, args.rate, args.grad_rate, args.sync_cfg),
        **link_params(args, swarm),
        **verifier_params(swarm),
    }
    result, events = asyncio.run(_train(swarm, params))
    v = result.get("verify", {})
    return {
        "scenario": "clean",
        "policy": args.clean_policy,
        "compress": args.compress,
        "steps": len(_steps(events)),
        "micro_batches_checked": v.get("checked"),
        "false_positives_caught": len(_events(events, "caught")),
        "disputes": len(_events(events, "dispute")),
        "rollbacks": len(_events(events, "rollback")),
        "failures": len(_events(events, "failure")),
        "steps_checked": v.get("steps"),
        "links": link_summary(_steps(events)),
        "transitions_checked": v.get("transitions"),  # round modes: inner steps recomputed (verify/inner.py)
        "transitions_caught": v.get("transitions_caught"),
        "check_seconds_total": round(v.get("seconds", 0.0), 1),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    from fusionnode.localswarm import LocalSwarm

    args = parse_args(argv)
    torch.set_num_threads(1)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fusionnode-verify-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if "sim" in args.sections:
        from fusionnode.bench.verify_sim import simulate

        for res in simulate(args):
            _print(res, args.json)
    if "contrib" in args.sections:
        os.environ[DEBUG_ENV] = "1"  # the daemons inherit it: their debug hooks (the liar) are on
        for res in run_contrib(args, workdir, _train, _spec):
            _print(res, args.json)
    if not set(args.sections) - {"sim", "contrib"}:
        return 0
    os.environ[DEBUG_ENV] = "1"  # the daemons inherit it: their debug hooks (the liar) are on
    swarm = LocalSwarm(workdir / "swarm", 3, log=sys.stderr)
    (workdir / "swarm").mkdir(parents=True, exist_ok=True)
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        start_verifier(args, swarm)
        if "overhead" in args.sections:
            from fusionnode.bench.verify_overhead import run_overhead

            _print(run_overhead(args, swarm), args.json)
        if "lies" in args.sections:
            for res in run_lies(args, swarm, workdir):
                _print(res, args.json)
        if "seeded" in args.sections:
            from fusionnode.bench.verify_seeded import run_seeded

            for res in run_seeded(args, swarm):
                _print(res, args.json)
        if "clean" in args.sections and args.clean_steps:
            _print(run_clean(args, swarm), args.json)
    finally:
        swarm.stop()
    return 0


def _print(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(res), flush=True)
        return
    print(f"[{res['scenario']}]")
    for k, v in res.items():
        if k == "scenario":
            continue
        if k == "runs" and isinstance(v, list):
            for row in v:
                print(
                    "  "
                    + ", ".join(f"{a}={round(b, 5) if isinstance(b, float) else b}" for a, b in row.items())
                )
        else:
            print(f"  {k:40s} {round(v, 5) if isinstance(v, float) else v}")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
