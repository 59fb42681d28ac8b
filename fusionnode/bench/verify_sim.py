"""`fusionnode bench verify --sections sim`: the seeded runs' statistics simulated, with the real
check selector (a fresh secret per run) and the real liar's own random choices, next to the closed
form (split from bench/verify.py, whose docstring holds the method).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
from typing import Any

from fusionnode.bench.verify import CATCH_WITHIN, lie_config


def simulate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """100 seeded runs per kind with the real selector and the real liar's random choices."""
    import torch

    from fusionnode.train.inner_checks import transition_rate
    from fusionnode.verify.liar import Liar
    from fusionnode.verify.selector import CheckSelector, catch_probability, miss_probability

    m, stage = args.micro_batches, 1000
    out = []
    for kind in args.kinds:
        cfg = lie_config(kind, args, 0)
        caught_within, steps_needed = 0, []
        for seed in range(args.sim_runs):
            sel = CheckSelector(hashlib.sha256(f"bench-verify-{seed}".encode()).digest())
            liar = Liar.from_dict({**cfg, "seed": seed})
            found = None
            for step in range(CATCH_WITHIN * 5):
                if cfg["kind"] == "random_pseudo_gradient":  # every step; caught when a gradient check
                    if sel.draw(step, stage, -1) < args.grad_rate:
                        found = step
                        break
                    continue
                if cfg["kind"] == "update":  # every inner step; a transition check at the next step,
                    # drawn at the gradient-check rate, except a round's last step (verify/inner.py)
                    closes = (step + 1) % args.inner_steps == 0
                    if not closes and sel.draw(step, stage, -2) < transition_rate(args.grad_rate):
                        found = step + 1
                        break
                    continue
                for mb in range(m):
                    x = {"h": torch.full((1,), float(step * m + mb + 1))}
                    lied = liar.tamper("act", stage, step, mb, False, x)["h"] is not x["h"]
                    checked = (
                        sel.draw(step, stage, mb) < args.rate or sel.draw(step, stage, -1) < args.grad_rate
                    )
                    if lied and checked:  # a spot-check of it, or the stage's gradient check
                        found = step
                        break
                if found is not None:
                    break
            steps_needed.append(found + 1 if found is not None else None)
            caught_within += found is not None and found + 1 <= CATCH_WITHIN
        lied_per_step = m * cfg.get("fraction", 1.0)
        if kind == "gradient":  # one gradient check draw per stage and step
            lied_total = CATCH_WITHIN
        elif kind == "update":  # one transition draw per inner step not closing a round, checked next step
            lied_total = sum(1 for t in range(CATCH_WITHIN - 1) if (t + 1) % args.inner_steps)
        elif kind == "stale":  # nothing to replay on the first step
            lied_total = lied_per_step * (CATCH_WITHIN - 1)
        elif kind == "other":  # micro-batch 0 has no earlier one to copy
            lied_total = (m - 1) * CATCH_WITHIN
        else:
            lied_total = lied_per_step * CATCH_WITHIN
        done = [s for s in steps_needed if s is not None]
        out.append(
            {
                "scenario": f"sim:{kind}",
                "runs": args.sim_runs,
                f"caught_within_{CATCH_WITHIN}_steps": caught_within,
                "median_steps_until_caught": statistics.median(done) if done else None,
                "max_steps_until_caught": max(done) if done else None,
                # the closed form: gradient checks alone for the gradient liar and the transition rate
                # for an update liar; else spot-checks and gradient checks together, the liar's
                # micro-batches drawn independently, at the share of them it lies on (an
                # approximation for stale and other, which lie on all but the first step's or
                # micro-batch's)
                "closed_form_p_within_20": round(
                    catch_probability(
                        {"update": transition_rate(args.grad_rate), "gradient": args.grad_rate}[kind],
                        lied_total,
                    )
                    if kind in ("update", "gradient")
                    else 1
                    - miss_probability(
                        args.rate, args.grad_rate, m, lied_total / (m * CATCH_WITHIN), CATCH_WITHIN
                    ),
                    5,
                ),
            }
        )
    return out
