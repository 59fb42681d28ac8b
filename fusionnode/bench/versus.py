"""Planner vs the best even grid vs DT-FM's scheduler, under two cost models (`fusionnode bench plan`).

Method: for each cluster (DT-FM's five settings, plan/dtfm_scenarios.py, with fp16 activations;
and every bundled cluster with the traced model's own activation sizes), every placement is dense
(no AdaTopK: `compress=False`, so compression cannot explain a win) and uses the job's default
optimizer offload. Placements:

* plan: `fusionnode.plan.planner.plan`, its wall time on this machine;
* grid: every even grid that fits (plan/grid.py); under each cost model the best of them counts
  (under the simulator, the best simulated of the GRID_SIMULATED fastest by the closed form and
  the GRID_SIMULATED fastest by DT-FM's model);
* dtfm: DT-FM's scheduler (plan/dtfm.py, a re-implementation) with its published settings
  (population 100, 4,900 trials unless --dtfm-trials says otherwise) for the shape of the best
  even grid under DT-FM's own model, layers and batch split evenly, best micro-batch size.

Data-parallel sync (`dp_sync`, default "auto"): the planner prices optimizer hosts and a ring
all-reduce among the replicas of each stage and takes the faster per plan (plan/dpsync.py); under the
simulator the grid and DT-FM placements also count the faster of the two (hosts or ring); DT-FM's
model charges every placement a ring all-reduce whatever it records.

Cost models: the planner's event simulator (plan/simulator.py) and DT-FM's cost model
(plan/dtfm_cost.py). Reported per model: each placement's step seconds and
``min(grid, dtfm) / plan`` (> 1: the plan is faster).
"""

from __future__ import annotations

import logging
import time

from fusionnode.errors import PlanError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan import dtfm, fence, grid
from fusionnode.plan.cluster import Cluster
from fusionnode.plan.dtfm_cost import dtfm_step_time
from fusionnode.plan.evaluate import Evaluated, build_plan, make_context, ring_variant
from fusionnode.plan.planner import plan
from fusionnode.plan.simulator import simulate

log = logging.getLogger(__name__)

GRID_SIMULATED = 6  # even grids simulated per cost-model ranking


def compare(
    graph: OpGraph,
    cluster: Cluster,
    batch: int,
    *,
    population: int = dtfm.POPULATION,
    trials: int = dtfm.TRIALS,
    offload: bool = True,
    dp_sync: str = "auto",
) -> dict:
    row: dict = {"cluster": cluster.name, "devices": cluster.size}
    t0 = time.perf_counter()
    try:
        p = plan(graph, cluster, batch, offload=offload, compress=False, dp_sync=dp_sync if offload else None)
    except PlanError as exc:
        return {**row, "fits": False, "why": str(exc)[:120]}
    row["plan_s"] = round(time.perf_counter() - t0, 2)
    row["fits"] = True
    row["plan"] = {
        "shape": [len(pl.stages) for pl in p.pipelines][:8],
        "dp_sync": p.dp_sync,
        "sim_s": simulate(graph, cluster, p).step_time_s,
        "dtfm_s": dtfm_step_time(graph, cluster, p).step_s,
    }
    ctx = make_context(graph, cluster, batch, None, offload, None, None, fence.MAX_BLOCKS, False)
    both = dp_sync != "hosts"  # the baselines' sync priced both ways too, the faster simulated counts

    def simulated(ev: Evaluated, strategy: str) -> tuple[float, str]:
        out = [(simulate(graph, cluster, build_plan(graph, ctx, ev, None, strategy)).step_time_s, ev.dp_sync)]
        ring = ring_variant(ctx, ev) if both and ev.dp_sync != "ring" else None
        if ring is not None:
            out.append(
                (simulate(graph, cluster, build_plan(graph, ctx, ring, None, strategy)).step_time_s, "ring")
            )
        t, how = min(out)
        return t, how or ("hosts" if offload else "ring")

    grids = grid.even_grids(ctx)
    if grids:
        scored = []
        for ev in grids:
            q = build_plan(graph, ctx, ev, None, "grid")
            scored.append((ev, q, dtfm_step_time(graph, cluster, q).step_s))
        by_dtfm = sorted(scored, key=lambda x: x[2])
        shortlist = {id(x[0]): x for x in scored[:GRID_SIMULATED] + by_dtfm[:GRID_SIMULATED]}
        sims = [(*simulated(ev, "grid"), ev) for ev, _q, _ in shortlist.values()]
        best_sim = min(sims, key=lambda x: x[0])
        best_sim = (best_sim[0], best_sim[2], best_sim[1])
        row["grid"] = {
            "sim_s": best_sim[0],
            "sim_dp_sync": best_sim[2],
            "sim_shape": list(grid.grid_shape(best_sim[1])),
            "dtfm_s": by_dtfm[0][2],
            "dtfm_shape": list(grid.grid_shape(by_dtfm[0][0])),
        }
        replicas, stages = grid.grid_shape(by_dtfm[0][0])
        res, ev = dtfm.dtfm_search(ctx, replicas, stages, population=population, trials=trials)
        if ev is not None:
            q = build_plan(graph, ctx, ev, None, "dtfm")
            sim_s, how = simulated(ev, "dtfm")
            row["dtfm"] = {
                "shape": [replicas, stages],
                "search_s": round(res.seconds, 1),
                "trials": res.trials,
                "sim_s": sim_s,
                "sim_dp_sync": how,
                "dtfm_s": dtfm_step_time(graph, cluster, q).step_s,
            }
    for model in ("sim_s", "dtfm_s"):
        refs = [row[k][model] for k in ("grid", "dtfm") if k in row]
        if refs:
            row[f"ratio_{model[:-2]}"] = round(min(refs) / row["plan"][model], 3)
    return row


def format_rows(rows: list[dict]) -> list[str]:
    out = [
        f"{'cluster':<20}{'dev':>5}{'plan s':>8}  {'simulator: plan / grid / dtfm (x)':<38}"
        f"{'DT-FM model: plan / grid / dtfm (x)':<40}"
    ]

    def cell(r: dict, model: str) -> str:
        vals = [r["plan"][model]] + [r[k][model] if k in r else float("nan") for k in ("grid", "dtfm")]
        ratio = r.get(f"ratio_{model[:-2]}")
        text = " / ".join(f"{v:.3g}" for v in vals) + (f" ({ratio:.2f}x)" if ratio else "")
        return text + (" ring" if model == "sim_s" and r["plan"].get("dp_sync") == "ring" else "")

    for r in rows:
        if not r["fits"]:
            out.append(f"{r['cluster']:<20}{r['devices']:>5}  does not fit: {r['why'][:90]}")
            continue
        out.append(
            f"{r['cluster']:<20}{r['devices']:>5}{r['plan_s']:>8.2f}  {cell(r, 'sim_s'):<38}{cell(r, 'dtfm_s'):<40}"
        )
    return out
