"""Anchors, and the planner's model-robust final choice.

Anchors: the layouts the planner always considers and must beat.

* every even grid that fits (plan/grid.py), as is, and the fastest GRIDS_RESPLIT re-split by the
  planner's split DP;
* DT-FM's layout (plan/dtfm.py), found with a budget a planning call can afford
  (dtfm.PLANNER_POPULATION x dtfm.PLANNER_TRIALS, on clusters of at most DTFM_MAX_WORKERS workers)
  for the shape of the best even grid under the planner's closed form AND for the shape of the
  best even grid under DT-FM's cost model (plan/dtfm_cost.py), each as is and re-split;
* given the graph (clusters above SMALL_CLUSTER), each DT-FM layout with its worst-linked
  data-parallel groups left out, re-chained and split by parameter bytes (plan/prune.py): DT-FM must
  use every device and split layers evenly, the planner need not.

The robust choice (`robust_choice`, clusters above SMALL_CLUSTER workers; below, the closed form
is what the exhaustive reference checks): two cost models disagree most about overlap. The
planner's simulator overlaps activation transfers with compute and so likes deep pipelines of thin
stages; DT-FM's cost model charges every pipeline boundary its whole batch share with no overlap,
and all-reduce between replicas, and so likes short pipelines. A plan chosen under one of them
alone can lose 2-7x under the other. So the planner scores a shortlist under both: the simulator
and DT-FM's model, each step time divided by the best any candidate reaches under that model, and
takes the candidate whose worse ratio is smallest (ties: the faster simulated). The shortlist:

* the planner's own best configuration per pipeline count (closed form);
* the SIMULATED fastest anchors by the closed form;
* the GRID_SHORTLIST fastest even grids by the closed form and the GRID_SHORTLIST fastest by
  DT-FM's model (so the best grid under either model is always a candidate: `fusionnode bench
  plan` compares with the best of exactly these);
* every DT-FM layout found;
* the BALANCED candidates with the smallest worse ratio of closed form and DT-FM's model.

Every candidate is scored under DT-FM's model (cheap); only the shortlist is simulated. With the
planner's dp_sync "auto" every candidate also comes priced with a ring all-reduce among the replicas
of each stage (evaluate.ring_variant; "ring": only so), so the choice also picks how the pipelines
synchronise: DT-FM's model prices DP as a ring whatever a plan records, and with the ring priced the
two models agree on DT-FM's settings. Last, the pick's batch shares are moved between its pipelines
(`_tune_shares`) while neither model gets slower and the worse ratio improves: the closed form
balances shares by its own pipeline times, which on unlike devices neither model shares.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from fusionnode.errors import PlanError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan import dtfm, grid
from fusionnode.plan.dtfm_cost import dtfm_step_time
from fusionnode.plan.evaluate import (
    Context,
    Evaluated,
    build_plan,
    evaluate_config,
    ring_variant,
    with_shares,
)
from fusionnode.plan.prune import pruned_layouts
from fusionnode.plan.simulator import simulate

log = logging.getLogger(__name__)

DTFM_MAX_WORKERS = 256  # DT-FM's search runs inside the planner only up to this many workers
GRIDS_RESPLIT = 3  # the fastest even grids also re-split by the DP
SIMULATED = 3  # anchors (by the closed form) the planner simulates against its own choice
GRID_SHORTLIST = 6  # even grids simulated per ranking (closed form, DT-FM's model)
BALANCED = 6  # and candidates with the best worse ratio of closed form and DT-FM's model
PRUNED = 4  # and the pruned layouts (plan/prune.py) with the best such ratio
BALANCED_SHAPES = 2  # DT-FM also runs for the shapes of the grids with the best such ratio
DTFM_POPULATION = 20  # DT-FM's budget for the shape DT-FM's model rates best (on DT-FM's settings
DTFM_TRIALS = 200  # it finds the same layouts as the published 100 x 4,900: bench plan)
SHARE_STEP = 4  # micro-batches moved between two pipelines at a time by the robust choice's share tuning
SHARE_TRIES = 12  # and the most share moves it scores (each: one simulation, one DT-FM model run)


def _key(ev: Evaluated) -> tuple:
    return (
        ev.pipelines,
        ev.shares,
        tuple(o.cost.split for o in ev.choices),
        tuple(o.u for o in ev.choices),
        ev.hosts,
        ev.dp_sync,
    )


def dtfm_of(graph: OpGraph, ctx: Context, ev: Evaluated) -> float:
    """ev's step seconds under DT-FM's cost model."""
    return dtfm_step_time(graph, ctx.est.cluster, build_plan(graph, ctx, ev, None, "fusion"), ctx.est).step_s


def sim_of(graph: OpGraph, ctx: Context, ev: Evaluated) -> float:
    """ev's step seconds under the planner's event simulator."""
    return simulate(graph, ctx.est.cluster, build_plan(graph, ctx, ev, None, "fusion"), ctx.est).step_time_s


def grids_by_dtfm(graph: OpGraph, ctx: Context, grids: list[Evaluated]) -> list[tuple[float, Evaluated]]:
    """(DT-FM model seconds, grid), fastest first."""
    scored = [(dtfm_of(graph, ctx, ev), ev) for ev in grids]
    scored.sort(key=lambda x: x[0])
    return scored


def anchors(
    ctx: Context, with_dtfm: bool = True, graph: OpGraph | None = None, ring: bool = False
) -> list[Evaluated]:
    """Even grids (as is, and the best GRIDS_RESPLIT re-split) and DT-FM's layouts, fastest first
    by the closed form. DT-FM runs for the best grid's shape under the closed form, given the
    graph, for the best grid's shape under DT-FM's cost model and, with `ring`, for the shape of the
    grid that is fastest with a ring all-reduce (evaluate.ring_variant)."""
    grids = grid.even_grids(ctx)
    out = list(grids)
    for ev in list(out[:GRIDS_RESPLIT]):
        re = evaluate_config(ctx, ev.pipelines)
        if re is not None:
            out.append(re)
    if with_dtfm and grids and len(ctx.workers) <= DTFM_MAX_WORKERS:
        budget = (dtfm.PLANNER_POPULATION, dtfm.PLANNER_TRIALS)
        shapes = {grid.grid_shape(grids[0]): budget}
        prune_shape = None
        if graph is not None:
            by_dtfm = grids_by_dtfm(graph, ctx, grids)
            prune_shape = grid.grid_shape(by_dtfm[0][1])
            shapes.setdefault(prune_shape, (DTFM_POPULATION, DTFM_TRIALS))
            c0, d0 = grids[0].step_s, by_dtfm[0][0]
            balanced = sorted(by_dtfm, key=lambda x: max(x[1].step_s / c0, x[0] / d0))
            for _, ev in balanced[:BALANCED_SHAPES]:
                shapes.setdefault(grid.grid_shape(ev), budget)
        if ring:
            rings = [r for r in (ring_variant(ctx, g) for g in grids) if r is not None]
            if rings:
                shapes.setdefault(grid.grid_shape(min(rings, key=lambda e: e.step_s)), budget)
        for (replicas, stages), (population, trials) in shapes.items():
            if stages == 1 and replicas == 1:
                continue
            _, ev = dtfm.dtfm_search(ctx, replicas, stages, population=population, trials=trials)
            if ev is not None:
                ev = dataclasses.replace(ev, origin="dtfm")
                out.append(ev)
                re = evaluate_config(ctx, ev.pipelines)
                if re is not None:
                    out.append(re)
                if (replicas, stages) == prune_shape:  # worst-linked groups left out, re-split
                    out.extend(pruned_layouts(ctx, ev))
    out.sort(key=lambda e: e.step_s)
    return out


def best_anchor(ctx: Context, with_dtfm: bool = True) -> Evaluated | None:
    found = anchors(ctx, with_dtfm)
    return found[0] if found else None


def by_simulation(graph: OpGraph, ctx: Context, candidates: list[Evaluated]) -> Evaluated:
    """The candidate whose plan the event simulator finds fastest (the first on ties): the final
    choice on clusters above DTFM_MAX_WORKERS, where DT-FM's model is too slow to score them all."""
    best, best_t = candidates[0], math.inf
    seen: set = set()
    for ev in candidates:
        if _key(ev) in seen:
            continue
        seen.add(_key(ev))
        t = sim_of(graph, ctx, ev)
        if t < best_t * (1 - 1e-9):
            best, best_t = ev, t
    return best


@dataclasses.dataclass
class Scored:
    ev: Evaluated
    dtfm_s: float
    sim_s: float = math.nan


def robust_choice(
    graph: OpGraph, ctx: Context, own: list[Evaluated], found: list[Evaluated], dp_sync: str = "hosts"
) -> tuple[Evaluated, dict]:
    """The candidate with the smallest worse ratio to the best under the simulator and under
    DT-FM's model (module docstring). `own`: the planner's configurations (its choice first);
    `found`: the anchors. `dp_sync` (planner.plan's): "hosts" scores the candidates as priced;
    "ring" their ring all-reduce variants (evaluate.ring_variant) instead; "auto" both, so the
    choice also picks how the pipelines synchronise. Returns (choice, figures for the log)."""
    pool: dict[tuple, Scored] = {}

    def variants(ev: Evaluated) -> list[Evaluated]:
        if dp_sync == "hosts" or ev.dp_sync == "ring" or len(ev.pipelines) < 2:
            return [ev]
        r = ring_variant(ctx, ev)
        if dp_sync == "ring":
            return [r] if r is not None else []
        return [ev] if r is None else [ev, r]

    def add(ev: Evaluated) -> list[Scored]:
        out = []
        for v in variants(ev):
            k = _key(v)
            if k not in pool:
                pool[k] = Scored(v, dtfm_of(graph, ctx, v))
            out.append(pool[k])
        return out

    grids = grid.even_grids(ctx)
    shortlist: dict[tuple, Scored] = {}
    for ev in [*own, *found[:SIMULATED]]:
        for s in add(ev):
            shortlist[_key(s.ev)] = s
    for ev in found:
        add(ev)
    grid_scored = [s for ev in grids for s in add(ev)]
    by_closed = sorted(grid_scored, key=lambda s: s.ev.step_s)
    by_dtfm = sorted(grid_scored, key=lambda s: s.dtfm_s)
    for s in by_closed[:GRID_SHORTLIST] + by_dtfm[:GRID_SHORTLIST]:
        shortlist[_key(s.ev)] = s
    for ev in found:  # DT-FM's layouts are not grids of the cluster's order: all of them
        if ev.origin != "pruned" and not any(ev.pipelines == g.pipelines for g in grids):
            for s in add(ev):
                shortlist[_key(s.ev)] = s
    if not pool:
        raise PlanError(f"no candidate fits with dp_sync {dp_sync!r}")
    closed_best = min(s.ev.step_s for s in pool.values())
    dtfm_best = min(s.dtfm_s for s in pool.values())

    def closed_ratio(s: Scored) -> float:
        return max(s.ev.step_s / closed_best, s.dtfm_s / dtfm_best)

    balanced = sorted(pool.values(), key=closed_ratio)
    pruned = [s for s in balanced if s.ev.origin == "pruned"]
    for s in balanced[:BALANCED] + pruned[:PRUNED]:
        shortlist[_key(s.ev)] = s
    for s in shortlist.values():
        s.sim_s = sim_of(graph, ctx, s.ev)
    sim_best = min(s.sim_s for s in shortlist.values())

    def worst(s: Scored) -> tuple[float, float]:
        return (max(s.sim_s / sim_best, s.dtfm_s / dtfm_best), s.sim_s)

    # the baselines (even grids, DT-FM's layouts): a pick no slower than the best of them under
    # either model, where the shortlist has one
    baseline = {_key(s.ev) for s in grid_scored} | {
        _key(s.ev) for s in pool.values() if s.ev.origin == "dtfm"
    }
    ref_sim = min((s.sim_s for k, s in shortlist.items() if k in baseline), default=math.inf)
    ref_dtfm = min((s.dtfm_s for k, s in pool.items() if k in baseline), default=math.inf)
    eligible = [
        s for s in shortlist.values() if s.sim_s <= ref_sim * (1 + 1e-9) and s.dtfm_s <= ref_dtfm * (1 + 1e-9)
    ]
    pick = min(eligible or shortlist.values(), key=worst)
    pick, tuned = _tune_shares(
        graph, ctx, pick, lambda s: (max(s.sim_s / sim_best, s.dtfm_s / dtfm_best), s.sim_s)
    )
    if log.isEnabledFor(logging.DEBUG):
        for s in sorted(shortlist.values(), key=worst):
            log.debug(
                "candidate %s shares %s: closed %.3g sim %.3g dtfm %.3g worst %.3f",
                [len(p) for p in s.ev.pipelines][:6],
                s.ev.shares[:6],
                s.ev.step_s,
                s.sim_s,
                s.dtfm_s,
                worst(s)[0],
            )
    figures = {
        "pool": len(pool),
        "simulated": len(shortlist),
        "sim_best": sim_best,
        "dtfm_best": dtfm_best,
        "sim_s": pick.sim_s,
        "dtfm_s": pick.dtfm_s,
        "sim_ratio": pick.sim_s / sim_best,
        "dtfm_ratio": pick.dtfm_s / dtfm_best,
        "share_moves": tuned,
    }
    return pick.ev, figures


def _tune_shares(graph: OpGraph, ctx: Context, pick: Scored, key) -> tuple[Scored, int]:
    """Move batch shares between the pick's pipelines, SHARE_STEP micro-batches at a time, while
    `key` (the robust choice's: worse ratio, then simulated seconds) improves and neither model's
    seconds grow (so the pick never gets slower under either); at most SHARE_TRIES
    candidates scored. The closed form balances shares by its own pipeline times; the simulator and
    DT-FM's model (which charges a pipeline's boundaries its whole share) can disagree with it, most
    on pipelines of unlike devices. Returns (the best found, how many moves were taken)."""
    n = len(pick.ev.pipelines)
    if n < 2:
        return pick, 0
    best, moves, tries = pick, 0, 0
    improved = True
    while improved and tries < SHARE_TRIES:
        improved = False
        for i in range(n):
            for j in range(n):
                if i == j or tries >= SHARE_TRIES:
                    continue
                step = SHARE_STEP * max(best.ev.choices[i].u, best.ev.choices[j].u)
                shares = list(best.ev.shares)
                shares[i] += step
                shares[j] -= step
                ev = with_shares(ctx, best.ev, shares)
                if ev is None:
                    continue
                tries += 1
                cand = Scored(ev, dtfm_of(graph, ctx, ev), sim_of(graph, ctx, ev))
                no_worse = cand.sim_s <= best.sim_s * (1 + 1e-9) and cand.dtfm_s <= best.dtfm_s * (1 + 1e-9)
                if no_worse and key(cand) < key(best):
                    best, moves, improved = cand, moves + 1, True
    return best, moves
