"""`fusionnode bench verify --sections seeded`: many seeded runs per kind of lie, each stopped at its
first catch; counts the runs caught within CATCH_WITHIN steps, the steps it took, and whether the
peer caught was the liar (split from bench/verify.py, which parses the options and runs the sections).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

from fusionnode.bench.verify import CATCH_WITHIN, FRESH, _params, _spec, _train, lie_config
from fusionnode.bench.verify_links import link_params, reason_kind
from fusionnode.bench.verify_peer import verifier_params, workers


def _seeded_run(
    args: argparse.Namespace,
    swarm: Any,
    tiny: argparse.Namespace,
    kind: str,
    r: int,
    attempt: int,
    driver: str,
    others: list[int],
) -> tuple[list[dict], list[str], list[int] | None] | None:
    """One seeded job: (its first `caught` event or none, the peers that carried the lie in its
    first plan, and when it was not caught the steps at which its revealed secret drew a gradient
    check of a liar's stage: a check that recomputes all of the stage's work, so any such step
    where it lied should have caught it); None when it failed before its liar was caught."""
    from fusionnode import control
    from fusionnode.errors import FusionNodeError

    seed = 1000 + r
    job_id = f"verify-seeded-{kind}-{r}-{attempt}-{os.getpid()}"
    spec = _spec(tiny, job_id, CATCH_WITHIN, seed=seed)
    for i in others:
        (swarm.state_dir(i) / "debug_lie").write_text(json.dumps(lie_config(kind, args, seed)))
    caught: list[dict] = []
    liars: list[str] = []
    liar_stages: list[int] = []
    fell_back: list[dict] = []

    async def on_event(ev: dict) -> None:
        if ev["type"] == "plan" and not liars:
            liars.extend(s["peer"] for s in ev["stages"] if s["peer"] != driver)
            liar_stages.extend(s["stage"] for s in ev["stages"] if s["peer"] != driver)
        if ev["type"] == "event" and ev.get("what") == "verifier_down":
            fell_back.append(ev)  # --verifier-peer: its checks ran in the driver's check process for a while
        if ev["type"] == "event" and ev.get("kind") == "caught" and not caught:
            caught.append(ev)
            await control.call(swarm.control(0), "cancel", {"job": job_id}, timeout=120)

    params = {
        **_params(spec, "sample", args.rate, args.grad_rate, args.sync_cfg),
        **FRESH,
        **link_params(args, swarm),
        **verifier_params(swarm),
    }
    if args.liar_stage == "first":  # a liar's peer holds stage 0: it lies on the activations it sends
        ids = [swarm.ready[i]["peer_id"] for i in others]
        params["peers"] = [ids[0], driver, *ids[1:]]
    try:
        result, _events = asyncio.run(_train(swarm, params, on_event))
    except (FusionNodeError, OSError) as exc:
        if not caught:  # a cancelled job ends its stream with an error: expected then
            print(f"  seeded run {job_id} failed: {exc}", file=sys.stderr, flush=True)
            return None
    finally:
        for i in others:
            (swarm.state_dir(i) / "debug_lie").unlink(missing_ok=True)
    drawn = None
    if not caught:
        from fusionnode.verify.selector import CheckSelector

        sel = CheckSelector(bytes.fromhex(result["verify"]["secret"]))
        drawn = [
            st for st in range(CATCH_WITHIN) if any(sel.draw(st, g, -1) < args.grad_rate for g in liar_stages)
        ]
    args.verifier_down = getattr(args, "verifier_down", 0) + len(fell_back)
    return caught, liars, drawn


def run_seeded(args: argparse.Namespace, swarm: Any) -> Any:
    """`--seeded-runs` real jobs per kind of lie at `--rate`, each of at most CATCH_WITHIN steps
    and stopped (cancelled) as soon as the liar is caught; a tiny batch (4 sequences of 32 tokens,
    `--micro-batches` micro-batches). Both workers other than the driver's peer carry the lie
    before the job starts, so whichever the plan picks lies from step 0 (the spare runs nothing);
    steps are counted from step 0. The driver forgets its bans at each job (a debug option). A job
    that fails before its liar is caught (a stream reset at its start, say) is run again, at most
    twice, then counted as failed. Yields one row per kind."""

    driver = swarm.ready[0]["peer_id"]
    others = [i for i in workers(swarm) if swarm.ready[i]["peer_id"] != driver]  # not the verifier
    tiny = argparse.Namespace(**{**vars(args), "batch_size": 4, "seq_len": 32})
    for kind in args.kinds:
        steps_needed: list[int | None] = []
        wrong_peer, failed, retried, t0 = 0, 0, 0, time.monotonic()
        uncaught_draws: list[list[int]] = []
        reasons: dict[str, int] = {}
        args.verifier_down = 0
        for r in range(args.seeded_runs):
            for attempt in range(3):
                got = _seeded_run(args, swarm, tiny, kind, r, attempt, driver, others)
                if got is not None:
                    caught, liars, drawn = got
                    steps_needed.append(caught[0]["step"] + 1 if caught else None)
                    if drawn is not None:
                        uncaught_draws.append(drawn)
                    wrong_peer += bool(caught) and caught[0]["peer"] not in liars
                    if caught:
                        why = reason_kind(caught[0].get("reason", ""))
                        reasons[why] = reasons.get(why, 0) + 1
                    break
                retried += 1
            else:
                failed += 1
        done = [x for x in steps_needed if x is not None]
        yield (
            {
                "scenario": f"seeded:{kind}",
                "compress": args.compress,
                "liar_stage": args.liar_stage,
                "runs": len(steps_needed),
                "runs_failed_to_run": failed,
                "attempts_retried": retried,
                f"caught_within_{CATCH_WITHIN}_steps": sum(1 for x in done if x <= CATCH_WITHIN),
                "median_steps_until_caught": statistics.median(done) if done else None,
                "max_steps_until_caught": max(done) if done else None,
                "caught_peer_not_the_liar": wrong_peer,
                "steps_until_caught": steps_needed,
                # per uncaught run, the steps its revealed secret drew a gradient check of the liar's
                # stage ([]: bad luck, (1 - rate)^20 per run; a step listed: a lie that got through)
                "uncaught_runs_gradient_checks_drawn": uncaught_draws,
                "caught_by": reasons,  # what the first check that caught each run found (numbers as #)
                # --verifier-peer: notices that its checks fell back to the driver's check process (0:
                # every check of every run was judged by the verifier peer)
                "verifier_down_notices": args.verifier_down if verifier_params(swarm) else None,
                "wall_s": round(time.monotonic() - t0, 1),
            }
        )
