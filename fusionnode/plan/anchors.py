"""Anchors: the layouts the planner always considers and must beat under its own cost model.

* every even grid that fits (plan/grid.py), as is, and re-split by the planner's split DP;
* DT-FM's layout (plan/dtfm.py) for the best even grid's shape, found with a budget a planning
  call can afford (PLANNER_POPULATION x PLANNER_TRIALS, on clusters of at most DTFM_MAX_WORKERS
  workers), as is and re-split.

`best_anchor` returns the fastest of them under the estimator in the planner's context, so the
planner's answer is never slower than an even grid, nor than DT-FM's layout at that budget.
"""

from __future__ import annotations

import logging

from fusionnode.plan import dtfm, grid
from fusionnode.plan.planner import Context, Evaluated, evaluate_config

log = logging.getLogger(__name__)

DTFM_MAX_WORKERS = 256  # DT-FM's search runs inside the planner only up to this many workers
GRIDS_RESPLIT = 3  # the fastest even grids also re-split by the DP


def anchors(ctx: Context, with_dtfm: bool = True) -> list[Evaluated]:
    """Even grids (as is, and the best GRIDS_RESPLIT re-split) and DT-FM's layout, fastest first."""
    out = grid.even_grids(ctx)
    for ev in list(out[:GRIDS_RESPLIT]):
        re = evaluate_config(ctx, ev.pipelines)
        if re is not None:
            out.append(re)
    if with_dtfm and out and len(ctx.workers) <= DTFM_MAX_WORKERS:
        replicas, stages = grid.grid_shape(out[0])
        if stages > 1 or replicas > 1:
            _, ev = dtfm.dtfm_search(
                ctx, replicas, stages, population=dtfm.PLANNER_POPULATION, trials=dtfm.PLANNER_TRIALS
            )
            if ev is not None:
                out.append(ev)
                re = evaluate_config(ctx, ev.pipelines)
                if re is not None:
                    out.append(re)
    out.sort(key=lambda e: e.step_s)
    return out


def best_anchor(ctx: Context, with_dtfm: bool = True) -> Evaluated | None:
    found = anchors(ctx, with_dtfm)
    return found[0] if found else None
