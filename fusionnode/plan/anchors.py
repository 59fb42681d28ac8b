"""Anchors: the layouts the planner always considers and must beat under its own cost model.

* every even grid that fits (plan/grid.py), as is, and re-split by the planner's split DP;
* DT-FM's layout (plan/dtfm.py) for the best even grid's shape, found with a budget a planning
  call can afford (PLANNER_POPULATION x PLANNER_TRIALS, on clusters of at most DTFM_MAX_WORKERS
  workers), as is and re-split.

The planner takes the fastest of them under its closed form when it beats its own search; on
clusters of more than SMALL_CLUSTER workers (below, the closed form is what the exhaustive
reference checks) it then simulates its choice and the SIMULATED fastest anchors (plan/simulator.py) and keeps the one the
simulator finds fastest (`by_simulation`), together with the SHALLOW even grids that DT-FM's
cost model (plan/dtfm_cost.py) rates fastest, a cheap second opinion on which shapes to simulate: the closed form is within a few percent of the
simulator on most pipelines, but not on all, and the plan should not lose to an anchor where the
finer model can tell.
"""

from __future__ import annotations

import logging
import math

from fusionnode.graph.dag import OpGraph
from fusionnode.plan import dtfm, grid
from fusionnode.plan.dtfm_cost import dtfm_step_time
from fusionnode.plan.evaluate import Context, Evaluated, build_plan, evaluate_config, ring_variant
from fusionnode.plan.simulator import simulate

log = logging.getLogger(__name__)

DTFM_MAX_WORKERS = 256  # DT-FM's search runs inside the planner only up to this many workers
GRIDS_RESPLIT = 3  # the fastest even grids also re-split by the DP
SIMULATED = 3  # anchors the planner simulates against its own choice
SHALLOW = 2  # and even grids the fastest under DT-FM's cost model (which favours short pipelines)


def anchors(ctx: Context, with_dtfm: bool = True, ring: bool = False) -> list[Evaluated]:
    """Even grids (as is, and the best GRIDS_RESPLIT re-split) and DT-FM's layout, fastest first.
    With `ring`, DT-FM's layout also for the shape of the grid that is fastest with a ring all-reduce."""
    grids = grid.even_grids(ctx)
    out = list(grids)
    for ev in list(out[:GRIDS_RESPLIT]):
        re = evaluate_config(ctx, ev.pipelines)
        if re is not None:
            out.append(re)
    shapes = [grid.grid_shape(out[0])] if out else []
    if ring and out:
        rings = [r for r in (ring_variant(ctx, g) for g in grids) if r is not None]
        if rings:
            shape = grid.grid_shape(min(rings, key=lambda e: e.step_s))
            shapes += [shape] if shape not in shapes else []
    for replicas, stages in shapes if with_dtfm and len(ctx.workers) <= DTFM_MAX_WORKERS else []:
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


def by_simulation(graph: OpGraph, ctx: Context, candidates: list[Evaluated]) -> Evaluated:
    """The candidate whose plan the event simulator finds fastest (the first on ties)."""
    best, best_t = candidates[0], math.inf
    seen: set = set()
    for ev in candidates:
        key = (
            ev.pipelines,
            ev.shares,
            tuple(o.cost.split for o in ev.choices),
            tuple(o.u for o in ev.choices),
            ev.dp_sync,
        )
        if key in seen:
            continue
        seen.add(key)
        t = simulate(graph, ctx.est.cluster, build_plan(graph, ctx, ev, None, "fusion"), ctx.est).step_time_s
        if t < best_t * (1 - 1e-9):
            best, best_t = ev, t
    return best


def shallow_grids(graph: OpGraph, ctx: Context) -> list[Evaluated]:
    """The SHALLOW even grids DT-FM's cost model rates fastest."""
    scored = []
    for ev in grid.even_grids(ctx):
        p = build_plan(graph, ctx, ev, None, "grid")
        scored.append((dtfm_step_time(graph, ctx.est.cluster, p, ctx.est).step_s, ev))
    scored.sort(key=lambda x: x[0])
    return [ev for _, ev in scored[:SHALLOW]]
