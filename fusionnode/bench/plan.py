"""Planner benchmark: planning time, plan vs baselines, optimality gap on small instances.

Method: each bundled cluster is planned for GPT-2 (traced by fusionnode.graph.trace when that module
is present, otherwise the synthetic GPT-2-shaped OP-DAG below with the same per-op FLOPs, params and
activation sizes); planning wall time is one run on this machine (one thread). Plan, even-split and
memory-proportional baselines are priced by the estimator's closed form and by the event simulator.
The optimality gap is planner / exhaustive optimum on N random instances (2-4 devices, 5-10 ops),
under the same cost model.

Run: python -m fusionnode.bench.plan [--model gpt2-xl] [--batch-size 512] [--instances 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Sequence

from fusionnode.errors import PlanError
from fusionnode.graph.dag import OpEdge, OpGraph, OpNode

log = logging.getLogger(__name__)

GPT2_SHAPES = {  # name: (layers, hidden, heads)
    "gpt2-tiny": (2, 128, 2),
    "gpt2-small": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}
GPT2_VOCAB = 50257
GPT2_SEQ = 1024


def gpt2_like_graph(
    layers: int, hidden: int, seq_len: int, vocab: int = GPT2_VOCAB, name: str = "gpt2-like"
) -> OpGraph:
    """A GPT-2-shaped OP-DAG (pre-LN blocks with residual edges, tied LM head) with analytic costs."""
    t, h, f4 = seq_len, hidden, 4
    nodes: list[OpNode] = []
    edges: list[OpEdge] = []

    def add(
        name: str, flops: float, params: int, pnames: tuple[str, ...], out: int, srcs: Sequence[int]
    ) -> int:
        i = len(nodes)
        nodes.append(OpNode(i, name, "call_module", name, float(flops), params, pnames, out))
        for s in srcs:
            edges.append(OpEdge(s, i, nodes[s].out_bytes))
        return i

    ids = add("input_ids", 0, 0, (), t * 8, [])
    tok = add("wte", 0, vocab * h * f4, ("transformer.wte.weight",), t * h * f4, [ids])
    pos = add("wpe", 0, GPT2_SEQ * h * f4, ("transformer.wpe.weight",), t * h * f4, [])
    x = add("embed_add", t * h, 0, (), t * h * f4, [tok, pos])
    for layer in range(layers):
        p = f"transformer.h.{layer}"
        ln1 = add(f"{p}.ln_1", 5 * t * h, 2 * h * f4, (f"{p}.ln_1.weight", f"{p}.ln_1.bias"), t * h * f4, [x])
        qkv = add(
            f"{p}.attn.c_attn", 2 * t * h * 3 * h, (3 * h * h + 3 * h) * f4,
            (f"{p}.attn.c_attn.weight", f"{p}.attn.c_attn.bias"), t * 3 * h * f4, [ln1],
        )  # fmt: skip
        att = add(f"{p}.attn.sdpa", 4 * t * t * h, 0, (), t * h * f4, [qkv])
        proj = add(
            f"{p}.attn.c_proj", 2 * t * h * h, (h * h + h) * f4,
            (f"{p}.attn.c_proj.weight", f"{p}.attn.c_proj.bias"), t * h * f4, [att],
        )  # fmt: skip
        x1 = add(f"{p}.add_1", t * h, 0, (), t * h * f4, [x, proj])
        ln2 = add(
            f"{p}.ln_2", 5 * t * h, 2 * h * f4, (f"{p}.ln_2.weight", f"{p}.ln_2.bias"), t * h * f4, [x1]
        )
        fc = add(
            f"{p}.mlp.c_fc", 2 * t * h * 4 * h, (4 * h * h + 4 * h) * f4,
            (f"{p}.mlp.c_fc.weight", f"{p}.mlp.c_fc.bias"), t * 4 * h * f4, [ln2],
        )  # fmt: skip
        act = add(f"{p}.mlp.gelu", 8 * t * 4 * h, 0, (), t * 4 * h * f4, [fc])
        fc2 = add(
            f"{p}.mlp.c_proj", 2 * t * 4 * h * h, (4 * h * h + h) * f4,
            (f"{p}.mlp.c_proj.weight", f"{p}.mlp.c_proj.bias"), t * h * f4, [act],
        )  # fmt: skip
        x = add(f"{p}.add_2", t * h, 0, (), t * h * f4, [x1, fc2])
    lnf = add(
        "transformer.ln_f",
        5 * t * h,
        2 * h * f4,
        ("transformer.ln_f.weight", "transformer.ln_f.bias"),
        t * h * f4,
        [x],
    )
    head = add(
        "lm_head", 2 * t * h * vocab, vocab * h * f4, ("transformer.wte.weight",), t * vocab * f4, [lnf]
    )
    add("loss", 3 * t * vocab, 0, (), 4, [head, ids])
    return OpGraph(model_name=name, nodes=tuple(nodes), edges=tuple(edges), seq_len=seq_len)


def random_graph(rng: random.Random, n: int, name: str = "random") -> OpGraph:
    """A random OP-DAG of n nodes: a chain plus random skip edges, random costs."""
    nodes, edges = [], []
    for i in range(n):
        out = rng.choice([1, 2, 4, 8, 16]) * 1024 * rng.randint(1, 8)
        params = rng.choice([0, 0, 1, 4, 16]) * 1_000_000
        nodes.append(
            OpNode(
                i,
                f"op{i}",
                "call_function",
                "op",
                rng.uniform(1e8, 5e10),
                params,
                (f"p{i}",) if params else (),
                out,
            )
        )
        if i > 0:
            edges.append(OpEdge(i - 1, i, nodes[i - 1].out_bytes))
        if i > 1 and rng.random() < 0.3:
            src = rng.randrange(0, i - 1)
            edges.append(OpEdge(src, i, nodes[src].out_bytes))
    return OpGraph(model_name=name, nodes=tuple(nodes), edges=tuple(edges), seq_len=0)


def model_graph(spec: str, seq_len: int | None = None) -> tuple[OpGraph, str]:
    """(graph, source): the traced model when fusionnode.graph.trace exists, else the synthetic one."""
    try:
        from fusionnode.graph.trace import graph_for
    except ImportError:
        graph_for = None
    if graph_for is not None:
        return graph_for(spec, seq_len), "traced"
    if spec not in GPT2_SHAPES:
        raise ValueError(f"unknown model {spec!r}")
    layers, hidden, _ = GPT2_SHAPES[spec]
    return gpt2_like_graph(layers, hidden, seq_len or GPT2_SEQ, name=spec), "synthetic"


def random_cluster_dict(rng: random.Random, devices: int) -> dict:
    """A small random cluster document: random speeds, memories and per-pair bandwidths."""
    devs = [
        {
            "id": f"d{i}",
            "tflops": rng.choice([5.0, 10.0, 20.0, 40.0, 80.0]),
            "memory_gb": rng.choice([0.1, 0.2, 0.5, 1.0]),
        }
        for i in range(devices)
    ]
    pairs = [
        {
            "a": f"d{i}",
            "b": f"d{j}",
            "bandwidth_gbps": rng.choice([0.008, 0.1, 1.0, 10.0]),
            "latency_ms": rng.choice([0.1, 5, 30]),
        }
        for i in range(devices)
        for j in range(i + 1, devices)
    ]
    return {"name": "random", "devices": devs, "links": {"pairs": pairs}}


def optimality_gaps(instances: int, seed: int = 0) -> list[float]:
    """planner step / exhaustive step on random small instances (1.0 = optimal)."""
    from fusionnode.plan.cluster import load_cluster_dict
    from fusionnode.plan.exhaustive import exhaustive_plan
    from fusionnode.plan.planner import plan

    rng = random.Random(seed)
    gaps = []
    while len(gaps) < instances:
        g = random_graph(rng, rng.randint(5, 10))
        c = load_cluster_dict(random_cluster_dict(rng, rng.randint(2, 4)))
        batch = rng.choice([4, 8])
        try:
            ref = exhaustive_plan(g, c, batch)
        except PlanError:
            continue
        got = plan(g, c, batch)
        assert ref.prediction is not None and got.prediction is not None
        gaps.append(got.prediction.step_time_s / ref.prediction.step_time_s)
    return gaps


def compare(graph: OpGraph, cluster_name: str, batch: int) -> dict:
    """Plan one bundled cluster; price plan and baselines with the closed form and the simulator."""
    from fusionnode.plan.baselines import even_plan, memory_plan
    from fusionnode.plan.cluster import load_cluster
    from fusionnode.plan.planner import plan
    from fusionnode.plan.simulator import simulate

    cluster = load_cluster(cluster_name)
    t0 = time.perf_counter()
    try:
        p = plan(graph, cluster, batch)
    except PlanError as exc:
        return {"cluster": cluster_name, "devices": cluster.size, "fits": False, "why": str(exc)}
    dt = time.perf_counter() - t0
    row: dict = {"cluster": cluster_name, "devices": cluster.size, "fits": True, "plan_s": round(dt, 3)}
    row["pipelines"] = len(p.pipelines)
    row["stages"] = [len(pl.stages) for pl in p.pipelines][:8]
    for label, fn in (("plan", None), ("even", even_plan), ("memory", memory_plan)):
        try:
            q = p if fn is None else fn(graph, cluster, batch)
        except PlanError as exc:
            row[label] = {"fits": False, "why": str(exc)[:80]}
            continue
        assert q.prediction is not None
        sim = simulate(graph, cluster, q).step_time_s
        row[label] = {"closed_s": round(q.prediction.step_time_s, 4), "sim_s": round(sim, 4)}
    for label in ("even", "memory"):
        if "closed_s" in row[label]:
            row[f"speedup_vs_{label}"] = {
                "closed": round(row[label]["closed_s"] / row["plan"]["closed_s"], 2),
                "sim": round(row[label]["sim_s"] / row["plan"]["sim_s"], 2),
            }
    return row


def _versus(args: argparse.Namespace, graph: OpGraph) -> list[dict]:
    """Planner vs best even grid vs DT-FM on the clusters --versus names."""
    from fusionnode.bench.versus import compare as versus
    from fusionnode.plan import dtfm
    from fusionnode.plan.cluster import bundled_clusters, load_cluster, load_cluster_dict
    from fusionnode.plan.dtfm_scenarios import SCENARIOS, scenario, with_activation_bytes

    if args.versus == "none":
        return []
    names = {"all": [*SCENARIOS, *bundled_clusters()], "dtfm": list(SCENARIOS)}.get(
        args.versus, [x for x in args.versus.split(",") if x]
    )
    half = with_activation_bytes(graph, 0.5)  # DT-FM trains with fp16 activations
    kw = {
        "population": args.dtfm_population or dtfm.POPULATION,
        "trials": dtfm.TRIALS if args.dtfm_trials is None else args.dtfm_trials,
        "dp_sync": args.dp_sync,
    }
    rows = []
    for name in names:
        if name in SCENARIOS:
            rows.append(versus(half, load_cluster_dict(scenario(name)), args.batch_size, **kw))
        else:
            rows.append(versus(graph, load_cluster(name), args.batch_size, **kw))
        log.info("versus %s: %s", name, rows[-1])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fusionnode bench plan", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-xl", help="model to plan (default %(default)s)")
    ap.add_argument("--batch-size", type=int, default=512, help="samples per step (default %(default)s)")
    ap.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sample (default: the model's context)"
    )
    ap.add_argument(
        "--instances",
        type=int,
        default=20,
        help="random small instances for the optimality gap (default %(default)s)",
    )
    ap.add_argument("--clusters", default="", help="comma-separated bundled cluster names (default: all)")
    ap.add_argument(
        "--versus",
        default="all",
        help="clusters for planner vs best even grid vs DT-FM (fusionnode/bench/versus.py): 'all' "
        "(DT-FM's five settings and every bundled cluster, the default), 'dtfm' (the five only), "
        "'none', or comma-separated names",
    )
    ap.add_argument(
        "--dtfm-trials", type=int, default=None, help="DT-FM's search trials (default: its published 4,900)"
    )
    ap.add_argument(
        "--dtfm-population", type=int, default=None, help="DT-FM's population (default: its published 100)"
    )
    ap.add_argument(
        "--dp-sync",
        choices=("auto", "hosts"),
        default="auto",
        help="data-parallel sync of the versus placements: 'auto' (optimizer hosts or a ring all-reduce "
        "among the replicas, the faster per plan; the default) or 'hosts' only",
    )
    ap.add_argument("--json", action="store_true", help="print the figures as JSON (default: text)")
    args = ap.parse_args(argv)
    if args.dtfm_trials is not None and args.dtfm_trials < 0:
        ap.error("--dtfm-trials must be >= 0")
    if args.dtfm_population is not None and args.dtfm_population < 2:
        ap.error("--dtfm-population must be >= 2")
    import torch

    from fusionnode.plan.cluster import bundled_clusters

    torch.set_num_threads(1)
    graph, source = model_graph(args.model, args.seq_len)
    names = [x for x in args.clusters.split(",") if x] or bundled_clusters()
    rows = [compare(graph, name, args.batch_size) for name in names]
    versus = _versus(args, graph)
    gaps = optimality_gaps(args.instances) if args.instances > 0 else []
    summary = {
        "model": args.model,
        "graph": source,
        "nodes": graph.num_nodes,
        "batch_size": args.batch_size,
        "clusters": rows,
        "versus": versus,
        "optimality": {
            "instances": len(gaps),
            "mean_ratio": round(sum(gaps) / len(gaps), 4) if gaps else None,
            "max_ratio": round(max(gaps), 4) if gaps else None,
            "within_5pct": sum(g <= 1.05 for g in gaps),
        },
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from fusionnode.term import table

    cells = []
    for r in rows:
        if not r["fits"]:
            cells.append((r["cluster"], r["devices"], "", "", "does not fit: " + r["why"][:90], "", ""))
            continue

        def ratio(label: str, r: dict = r) -> str:
            v = r.get(f"speedup_vs_{label}")
            return "OOM" if v is None else f"{v['closed']}/{v['sim']}"

        step = f"{r['plan']['closed_s']:.3g}/{r['plan']['sim_s']:.3g}"
        cells.append(
            (
                r["cluster"],
                r["devices"],
                f"{r['plan_s']:.2f}",
                r["pipelines"],
                step,
                ratio("even"),
                ratio("memory"),
            )
        )
    table(
        ("cluster", "dev", "plan s", "pipes", "plan step s", "even x", "memory x"),
        cells,
        title=f"model {args.model} ({source}, {graph.num_nodes} nodes), batch {args.batch_size}; "
        "step times and speed-ups as closed form/simulator",
        right=(1, 2, 3, 4, 5, 6),
    )
    if versus:
        from fusionnode.bench.versus import format_rows

        print("\nplanner vs best even grid vs DT-FM (dense, step seconds; x = min(grid, dtfm) / plan)")
        print("\n".join(format_rows(versus)))
    o = summary["optimality"]
    print(
        f"optimality: {o['instances']} instances, mean {o['mean_ratio']}, max {o['max_ratio']}, within 5%: {o['within_5pct']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
