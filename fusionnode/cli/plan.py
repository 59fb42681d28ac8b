"""The `plan` and `simulate` commands, and the live swarm as a cluster for `plan --swarm`.

Their options, the swarm as the local daemon sees it (through its control socket) turned into a
cluster, and a plan compared with the baselines under the closed form and the simulator. The
planning itself is fusionnode.plan's, which knows nothing of the daemon, the swarm or training."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from fusionnode.errors import ConfigError, PlanError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan.baselines import even_plan, memory_plan
from fusionnode.plan.cluster import Cluster, bundled_clusters, load_cluster
from fusionnode.plan.estimator import PLAN_KEEP_FLOOR
from fusionnode.plan.plan import Plan
from fusionnode.plan.planner import plan as make_plan
from fusionnode.plan.simulator import simulate

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 512  # samples per step
DEFAULT_MODEL = "gpt2-xl"
DEFAULT_STEPS = 100


def add_commands(sub: Any) -> None:
    """plan, simulate (in `fusionnode --help`'s order)."""
    from fusionnode.cli.args import command

    p = command(
        sub,
        "plan",
        "plan a job over a cluster file (offline) and print it",
        "Plan a job over a cluster file (or the live swarm with --swarm) and print the pipelines, "
        "their stages and the predicted step time; nothing is trained. Its defaults describe "
        "capacity planning (gpt2-xl, batch 512), not `train`'s (gpt2-tiny, batch 16).",
    )
    add_plan_arguments(p)
    p = command(
        sub,
        "simulate",
        "simulate a plan's throughput against the baselines",
        "Plan a job over a cluster file, then simulate its throughput against the even-split and "
        "memory-split baselines; nothing is trained.",
    )
    add_simulate_arguments(p)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster",
        default=None,
        help="cluster JSON file, or a bundled cluster's name: "
        + ", ".join(sorted(bundled_clusters()))
        + " (required unless --swarm)",
    )
    parser.add_argument(
        "--swarm",
        action="store_true",
        help="plan over the live swarm instead: the peers the local daemon sees, with their measured "
        "devices and links (see --state-dir)",
    )
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="the local daemon's state dir (with --swarm)"
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="gpt2-tiny|small|medium|large|xl (default %(default)s)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help="samples per step (default %(default)s, a capacity-planning batch; `train` defaults to 16)",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="fix the micro-batch count per pipeline (default: the planner chooses)",
    )
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the model's)")
    parser.add_argument(
        "--offload",
        choices=("on", "off", "auto"),
        default="on",
        help="optimizer state on optimizer hosts (on), or on the workers with the pipelines' gradients "
        "averaged by ring all-reduce among the replicas of each stage (off), or whichever is faster for "
        "the plan (auto: hosts only where they pay) (default %(default)s)",
    )
    parser.add_argument(
        "--compress",
        choices=("none", "adatopk"),
        default="adatopk",
        help="adatopk (default): the plan may count on AdaTopK on slow links, never below a keep ratio of "
        f"{PLAN_KEEP_FLOOR} (the floor, see plan/estimator.py); none: dense links only",
    )
    from fusionnode.sync import add_sync_args

    add_sync_args(parser)  # the replicas' sync, priced per round of H steps by the planner


def _sync(args: argparse.Namespace) -> Any:
    """`--sync`'s settings (fusionnode.sync.SyncConfig; a round mode without --inner-steps carries the
    budget the planner chooses H for); ConfigError naming a bad option."""
    from fusionnode.sync import sync_from_args

    return sync_from_args(args, plans=True)


def planned(graph: OpGraph, cluster: Cluster, args: argparse.Namespace, sync: Any) -> tuple[Plan, Any, Any]:
    """The plan under `sync` and its SyncPrice, with H chosen for --sync-budget when the user gave no
    --inner-steps (plan/choose_h.py): (plan, price, choice or None)."""
    from fusionnode.plan.choose_h import plan_for_sync

    def plan_with(price: Any) -> Plan:
        return make_plan(
            graph,
            cluster,
            args.batch_size,
            micro_batches=args.micro_batches,
            seq_len=args.seq_len,
            offload=args.offload != "off",
            compress=args.compress == "adatopk",
            keep_floor=PLAN_KEEP_FLOOR,
            sync=price,
            dp_sync="auto" if args.offload == "auto" else None,
        )

    p, price, _fixed, choice = plan_for_sync(
        sync, plan_with, lambda pl, pr: simulate(graph, cluster, pl, sync=pr)
    )
    return p, price, choice


def sync_line(price: Any, sim: Any) -> str:
    """What a round mode's sync costs in the simulation: per step, and the round of H steps."""
    pipes = max(sim.pipeline_finish_s)
    per_step = max(0.0, max(sim.sync_finish_s) - pipes)
    return (
        f"sync {price.mode}: a round of H = {price.inner_steps} steps takes {price.inner_steps * sim.step_time_s:.3f} s "
        f"(simulated); its exchange ({price.wire_ratio:.4g} x the float32 bytes each way) costs "
        f"{per_step:.4f} s per step, amortised over H"
    )


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument(
        "--json", action="store_true", help="print the plan as JSON (protocol/plan.schema.json)"
    )


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="steps to project time for (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument(
        "--plan",
        type=Path,
        default=None,
        dest="plan_file",
        help="also score this plan (JSON, protocol/plan.schema.json) under the same models; refused "
        "(exit 2) if it uses a device twice, leaves nodes uncovered or exceeds a device's memory",
    )


def _inputs(args: argparse.Namespace) -> tuple[OpGraph, Cluster]:
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.micro_batches is not None and args.micro_batches < 1:
        raise ConfigError(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len must be >= 1, got {args.seq_len}")
    if bool(args.cluster) == bool(args.swarm):
        raise ConfigError("give exactly one of --cluster FILE|NAME or --swarm")
    cluster = swarm_cluster(args.state_dir) if args.swarm else load_cluster(args.cluster)
    try:
        from fusionnode.graph.trace import graph_for
    except ImportError as exc:
        raise ConfigError("model tracing (fusionnode.graph.trace) is not available in this install") from exc
    graph = graph_for(args.model, args.seq_len)
    return graph, cluster


def swarm_cluster(state_dir: Path | None) -> Cluster:
    """The live swarm as the local daemon sees it: its peers' signed records (measured TFLOPS, offered
    memory, probed links) as a cluster, the way a job's driver builds it."""
    import asyncio

    from fusionnode import control
    from fusionnode.config import default_state_dir
    from fusionnode.plan.cluster import load_cluster_dict
    from fusionnode.swarm.records import PeerRecord
    from fusionnode.train.swarm_cluster import cluster_from_records

    path = (state_dir or default_state_dir()).expanduser().resolve() / "control.sock"
    res = asyncio.run(control.call(path, "peers"))
    records = [PeerRecord.from_wire(p) for p in res["peers"]]
    live = [r for r in records if r.availability == "available"]
    workers = [r.peer_id for r in live if "worker" in r.roles]
    hosts = [r.peer_id for r in live if "optimizer" in r.roles]
    if not workers:
        raise ConfigError("the swarm has no available worker peers to plan over")
    return load_cluster_dict(cluster_from_records(records, workers, hosts), "swarm")


def format_plan(p: Plan) -> str:
    """A human-readable table of a plan."""
    lines = [
        f"plan for {p.model} on {p.cluster}: batch {p.batch_size}, seq {p.seq_len}, offload {p.offload}"
        + (
            ", replicas synchronise by ring all-reduce"
            if p.dp_sync == "ring" and len(p.pipelines) > 1
            else ""
        )
    ]
    if p.prediction is not None:
        lines.append(
            f"predicted step {p.prediction.step_time_s:.3f} s, {p.prediction.tokens_per_s:,.0f} tokens/s"
            + (
                f" (simulated step {p.prediction.simulated_step_time_s:.3f} s)"
                if p.prediction.simulated_step_time_s is not None
                else ""
            )
        )
    for i, pl in enumerate(p.pipelines):
        lines.append(
            f"pipeline {i}: {len(pl.stages)} stages, share {pl.batch_share} = {pl.micro_batches} x "
            f"{pl.micro_batch_size}, time {pl.time_s:.3f} s"
        )
        lines.append(
            f"  {'stage':>5} {'devices':<24}{'nodes':>12}{'compute s':>11}{'comm s':>9}{'keep':>7}{'mem GB':>8}"
        )
        for k, st in enumerate(pl.stages):
            lines.append(
                f"  {k:>5} {','.join(st.devices):<24}{f'[{st.lo},{st.hi})':>12}{st.compute_s:>11.4f}"
                f"{st.comm_s:>9.4f}{st.keep_ratio:>7.3f}{st.memory_bytes / 1e9:>8.2f}"
            )
    if p.optimizer_hosts:
        hosts = ", ".join(f"{h.device} ({h.share:.0%})" for h in p.optimizer_hosts)
        lines.append(f"optimizer hosts: {hosts}")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    try:
        sync = _sync(args)
        graph, cluster = _inputs(args)
        p, price, choice = planned(graph, cluster, args, sync)
        result = simulate(graph, cluster, p, sync=price)
        sim = result.step_time_s
    except (ConfigError, PlanError) as exc:
        print(f"fusionnode plan: error: {exc}", file=sys.stderr)
        return 2
    assert p.prediction is not None
    import dataclasses

    p = dataclasses.replace(p, prediction=dataclasses.replace(p.prediction, simulated_step_time_s=sim))
    if args.json:
        print(p.to_json())
    else:
        from fusionnode.term import print_plan

        print_plan(p)
        if price.rounds:
            print(sync_line(price, result))
        if choice is not None:
            print(choice.line())
    return 0


def load_given_plan(path: Path, graph: OpGraph, cluster: Cluster) -> Plan:
    """A user's plan file, checked against the graph and cluster; ConfigError/PlanError with the reason."""
    from fusionnode.plan.estimator import Chain, Estimator

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--plan {path}: {exc.strerror or exc}") from exc
    p = Plan.from_json(text)
    p.validate(graph)  # every node once per pipeline, shares, a device used twice
    for d in p.devices:
        if d not in {dev.id for dev in cluster.devices}:
            raise PlanError(f"--plan {path}: device {d!r} is not in cluster {cluster.name!r}")
    est = Estimator(cluster, offload=p.offload)
    bounds = sorted({0, graph.num_nodes} | {s.lo for pl in p.pipelines for s in pl.stages})
    chain = Chain.from_graph(graph, bounds)
    pos = {b: i for i, b in enumerate(bounds)}
    for i, pl in enumerate(p.pipelines):
        devs = [cluster.index(st.devices[0]) for st in pl.stages]
        split = [pos[st.lo] for st in pl.stages] + [chain.blocks]
        cost = est.evaluate(
            chain, devs, split, pl.micro_batch_size, ratios=[st.keep_ratio for st in pl.stages]
        )
        for st, mem, d in zip(pl.stages, cost.memory_bytes, devs, strict=True):
            if mem > est.capacity(d):
                raise PlanError(
                    f"--plan {path}: pipeline {i} stage [{st.lo}, {st.hi}) needs {mem / 1e9:.2f} GB on "
                    f"{st.devices[0]!r}, which has {est.capacity(d) / 1e9:.2f} GB usable"
                )
    return p


def compare_plans(graph: OpGraph, cluster: Cluster, args: argparse.Namespace) -> dict:
    """The plan, the baselines, the best even grid and DT-FM's layout (a re-implementation, at the
    planner's trial budget), and a given plan, each priced by the closed form, the simulator and
    DT-FM's cost model."""
    from fusionnode.plan import dtfm, fence, grid
    from fusionnode.plan.dtfm_cost import dtfm_step_time
    from fusionnode.plan.evaluate import build_plan, evaluate_plan, make_context

    compress = args.compress == "adatopk"
    kw = {"micro_batches": args.micro_batches, "seq_len": args.seq_len, "offload": args.offload != "off"}
    sync = _sync(args)
    try:  # the plan first: with --sync-budget it fixes H, and every layout is priced under that sync
        chosen, price, choice = planned(graph, cluster, args, sync)
    except PlanError as exc:
        from fusionnode.plan.syncprice import SyncPrice

        chosen, price, choice = exc, SyncPrice.from_dict(sync.price()), None
    out: dict = {
        "model": graph.model_name,
        "cluster": cluster.name,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "compress": args.compress,
    }
    tokens = args.batch_size * (args.seq_len or graph.seq_len or 1)

    def anchor_context():
        """The planner's context for the anchors (even grid, DT-FM): no latency, fixed keep floor."""
        return make_context(
            graph, cluster, args.batch_size, args.micro_batches, kw["offload"], None, None,
            fence.MAX_BLOCKS, compress, PLAN_KEEP_FLOOR, price,
        )  # fmt: skip

    def make_grid(*_a, **_k) -> Plan:
        ctx = anchor_context()
        ev = grid.best_even_grid(ctx)
        if ev is None:
            raise PlanError("no even grid fits")
        return build_plan(graph, ctx, ev, args.seq_len, "grid")

    def make_dtfm(*_a, **_k) -> Plan:
        ctx = anchor_context()
        ev = grid.best_even_grid(ctx)
        if ev is None:
            raise PlanError("no even grid fits, so DT-FM has no shape")
        _, found = dtfm.dtfm_search(
            ctx, *grid.grid_shape(ev), population=dtfm.PLANNER_POPULATION, trials=dtfm.PLANNER_TRIALS
        )
        if found is None:
            raise PlanError("DT-FM's layout does not fit")
        return build_plan(graph, ctx, found, args.seq_len, "dtfm")

    def make_given(*_a, **_k) -> Plan:
        return args.given_plan

    def make_chosen(*_a, **_k) -> Plan:
        if isinstance(chosen, PlanError):
            raise chosen
        return chosen

    makers = [
        ("plan", make_chosen),
        ("grid", make_grid),
        ("dtfm", make_dtfm),
        ("even", lambda *a, **k: even_plan(*a, **k, compress=compress)),
        ("memory", lambda *a, **k: memory_plan(*a, **k, compress=compress)),
    ]
    if getattr(args, "given_plan", None) is not None:
        makers.append(("given", make_given))
    for label, fn in makers:
        try:
            p = fn(graph, cluster, args.batch_size, **kw)
        except PlanError as exc:
            out[label] = {"fits": False, "error": str(exc)}
            continue
        closed = (
            p.prediction.step_time_s
            if p.prediction is not None and (label in ("plan", "grid", "dtfm") or not price.rounds)
            else evaluate_plan(graph, cluster, p, sync=price)
        )
        result = simulate(graph, cluster, p, sync=price)
        sim = result.step_time_s
        if label == "plan" and price.rounds:
            out["sync"] = {
                **price.to_dict(),
                "round_s": price.inner_steps * sim,
                "line": sync_line(price, result),
            }
            if choice is not None:
                out["sync"]["chosen"] = choice.to_dict()
                out["sync"]["line"] += "\n" + choice.line()
        out[label] = {
            "fits": True,
            "closed_step_s": closed,
            "sim_step_s": sim,
            "dtfm_model_step_s": dtfm_step_time(graph, cluster, p).step_s,
            "closed_tokens_per_s": tokens / closed,
            "sim_tokens_per_s": tokens / sim,
            "closed_total_s": closed * args.steps,
            "sim_total_s": sim * args.steps,
        }
    if out["plan"].get("fits"):
        for label, _ in makers[1:]:
            if out[label].get("fits"):
                out[f"plan_vs_{label}"] = {
                    m: out[label][f"{m}_step_s"] / out["plan"][f"{m}_step_s"]
                    for m in ("closed", "sim", "dtfm_model")
                }
    return out


def run_simulate(args: argparse.Namespace) -> int:
    try:
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
        graph, cluster = _inputs(args)
        args.given_plan = None if args.plan_file is None else load_given_plan(args.plan_file, graph, cluster)
        out = compare_plans(graph, cluster, args)
        if not out["plan"].get("fits"):
            raise PlanError(out["plan"]["error"])
    except (ConfigError, PlanError) as exc:
        print(f"fusionnode simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from fusionnode.term import print_simulation

    print_simulation(out, args.steps)
    if "sync" in out:
        print(out["sync"]["line"])
    return 0
