"""`fusionnode plan` and `fusionnode simulate`: argument definitions and entry functions for cli.py."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from fusionnode.errors import ConfigError, PlanError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan.baselines import even_plan, memory_plan
from fusionnode.plan.cluster import Cluster, load_cluster
from fusionnode.plan.plan import Plan
from fusionnode.plan.planner import plan as make_plan
from fusionnode.plan.simulator import simulate

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 512  # samples per step
DEFAULT_MODEL = "gpt2-xl"
DEFAULT_STEPS = 100


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster",
        default=None,
        help="cluster JSON file, or a bundled cluster's name: "
        + ", ".join(sorted(f.stem for f in (Path(__file__).parent / "clusters").glob("*.json")))
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
        choices=("on", "off"),
        default="on",
        help="optimizer state on optimizer hosts (on) or on the workers (off) (default %(default)s)",
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
    from fusionnode.train.driver import cluster_from_records

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
    lines = [f"plan for {p.model} on {p.cluster}: batch {p.batch_size}, seq {p.seq_len}, offload {p.offload}"]
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
        graph, cluster = _inputs(args)
        p = make_plan(
            graph,
            cluster,
            args.batch_size,
            micro_batches=args.micro_batches,
            seq_len=args.seq_len,
            offload=args.offload == "on",
        )
        sim = simulate(graph, cluster, p).step_time_s
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
    return 0


def compare_plans(graph: OpGraph, cluster: Cluster, args: argparse.Namespace) -> dict:
    """Plan and both baselines, each priced by the closed form and the simulator."""
    kw = {"micro_batches": args.micro_batches, "seq_len": args.seq_len, "offload": args.offload == "on"}
    out: dict = {
        "model": graph.model_name,
        "cluster": cluster.name,
        "batch_size": args.batch_size,
        "steps": args.steps,
    }
    tokens = args.batch_size * (args.seq_len or graph.seq_len or 1)
    for label, fn in (("plan", make_plan), ("even", even_plan), ("memory", memory_plan)):
        try:
            p = fn(graph, cluster, args.batch_size, **kw)
        except PlanError as exc:
            out[label] = {"fits": False, "error": str(exc)}
            continue
        assert p.prediction is not None
        sim = simulate(graph, cluster, p).step_time_s
        closed = p.prediction.step_time_s
        out[label] = {
            "fits": True,
            "closed_step_s": closed,
            "sim_step_s": sim,
            "closed_tokens_per_s": tokens / closed,
            "sim_tokens_per_s": tokens / sim,
            "closed_total_s": closed * args.steps,
            "sim_total_s": sim * args.steps,
        }
    if out["plan"].get("fits"):
        for label in ("even", "memory"):
            if out[label].get("fits"):
                out[f"plan_vs_{label}"] = {
                    "closed": out[label]["closed_step_s"] / out["plan"]["closed_step_s"],
                    "sim": out[label]["sim_step_s"] / out["plan"]["sim_step_s"],
                }
    return out


def run_simulate(args: argparse.Namespace) -> int:
    try:
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
        graph, cluster = _inputs(args)
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
    return 0
