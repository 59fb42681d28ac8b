"""`fusionnode bench testbed`: FusionNode against its baselines on an emulated geo-distributed network.

Method. One real peer (`fusionnode join`) per device of a cluster file, on an
emulated network with that file's per-link bandwidths:
- `--network netns` (root with iproute2): deploy/testbed.sh builds one network
  namespace per device, a veth pair per device pair and a `tc tbf` qdisc per
  direction; the peers talk over those links.
- `--network userspace` (anywhere): the peers run on loopback and every tensor
  stream passes a token bucket set to the link's bandwidth (the same code path
  otherwise). Chosen automatically where netns is unavailable, and labelled so.
Latency is not emulated (no netem in this kernel), so the planner is told the links have none;
bandwidth is, and so are the devices' speeds. All peers share this machine's CPU, so a peer's raw
compute speed would depend on what the others do at the time (a pipeline's idle stages lend it
cores, data parallelism takes them back) and on the CPU cost of its own network traffic. Instead
every peer is paced to the speed of the device it emulates (the `fusionnode join --debug` hook
`debug_pace`): its forward and backward really run, then it sleeps out the rest of the time that
device would take for the stage's FLOPs. The fastest device is set to this machine's measured
per-core speed on the model x cores / peers / `--headroom`, the others in the cluster file's
proportions; the headroom leaves the real compute and the traffic room to finish inside the pace.

Calibration. Two short runs of the baseline's even split (local optimizer, then optimizer hosts)
measure what the planner cannot know from the cluster file: each peer's achieved compute speed, and
the runtime's fixed cost per step in each mode (RPC rounds through p2pd, the hosts' optimizer). The
cluster document every configuration is planned with carries them (`step_overhead_ms`).

Paths. Each configuration's row lists the path every link's tensor bytes took during its run
(`paths`: direct, libp2p or relayed, from the daemons' per-path byte counters) next to the path the
runtime's rule picks for that link: direct for links of DIRECT_MIN_BPS (200 Mbit/s) and more, libp2p
for slower ones (the testbed has no relays). The daemons know the links' bandwidth from the
user-space limits, or, with netns, from `set_link_limits`' `declared` (tc shapes the links and the
testbed runs without probes).

Then the same job (gpt2-tiny, same seed and data, a fixed number of steps) runs
under five configurations, one after the other on the same peers:
  1. baseline:  even split of the layers over the devices, no compression, local optimizer
  2. planner:   OP-Fence / asymmetric DP x PP plan, no compression (optimizer hosts as planned)
  3. adatopk:   the baseline split with AdaTopK on every stage link
  4. fusionnode: planner + AdaTopK + optimizer hosts
  5. even-grid: the best even grid (k equal pipelines, layers split evenly, devices in id order)
     under the planner's cost model, no compression, optimizer hosts: what `planner` must not lose to
Throughput is the median tokens/s of the steps after `--warmup`; the table shows
each configuration's speedup over the baseline, final loss (mean of the last 3
steps), bytes on the wire, and the planner's two predictions of the plan's step time next to
the measured one: the event simulation of the plan ("sim", plan/simulator.py) and the closed form
its search minimises ("closed", plan/estimator.py).

Against hivemind (netns only). After FusionNode's configurations, the same namespaces, links and
device pacing run hivemind's collaborative training as its users run it (bench/hivemind_peer.py):
  hivemind-avg:   hivemind.Optimizer's default mode, gradients averaged every target batch
  hivemind-local: hivemind.Optimizer(use_local_updates=True), parameters averaged every target batch
with the job's model, corpus, seed and tokens per step (target_batch_size = --batch-size), and
settings fixed from hivemind's docstring guidance before any run (hivemind_peer.hivemind_settings,
printed under the table). A second table (bench/compare.py) puts every system side by side: time
to a target loss the baseline reaches, tokens/s, bytes sent on the emulated links (each namespace's
/proc/net/dev, the same way for every system), final and validation loss, each device's share of
the time computing; testbed-loss.png (and curves.csv) plot loss against wall-clock time. With
user-space links hivemind is skipped: the token buckets shape FusionNode's streams, not hivemind's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fusionnode.bench import compare
from fusionnode.bench.compare import plot, print_table
from fusionnode.bench.systems import (
    HIVEMIND_SYSTEMS,
    HIVEMIND_USERSPACE,
    all_configs,
    default_system_names,
    fusionnode_row,
    resolve_options,
    run_hivemind,
    system_names,
)
from fusionnode.bench.testbed_net import Testbed, link_paths, netns_available, paths_line
from fusionnode.plan.estimator import DEFAULT_EFFICIENCY

DEFAULT_CLUSTERS = ("testbed-4-mixed", "testbed-6-two-sites", "testbed-4-slow-compute", "home-volunteers-4")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="fusionnode bench testbed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--cluster",
        action="append",
        default=None,
        help=f"cluster file or bundled name; repeatable (default: {', '.join(DEFAULT_CLUSTERS)})",
    )
    p.add_argument(
        "--network",
        choices=["auto", "netns", "userspace"],
        default="auto",
        help="how links are emulated (auto: netns when root and iproute2 are there) (default %(default)s)",
    )
    p.add_argument("--steps", type=int, default=12, help="training steps per configuration (default 12)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians (default 3)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per step (default 16)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument(
        "--calibration-steps",
        type=int,
        default=5,
        help="steps of each calibration run (the first --warmup of them are not used); 0 skips calibration (default %(default)s)",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=2.0,
        help="how much slower than this machine's fair share of a core the fastest emulated device is (>= 1; the real compute and the peers' traffic must fit in the pace) (default %(default)s)",
    )
    p.add_argument(
        "--configs",
        default=",".join(default_system_names()),
        help="which configurations and systems to run; hivemind's only on netns links (default %(default)s)",
    )
    p.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="the loss whose time to reach the comparison reports (default: the baseline's final "
        "3-step mean loss, a loss the baseline reaches)",
    )
    p.add_argument(
        "--hivemind-timeout",
        type=float,
        default=1200.0,
        help="seconds a hivemind run may take before its peers are stopped (default %(default)s)",
    )
    p.add_argument(
        "--contrib-policy",
        choices=["auto", "off", "clip", "score"],
        default="off",
        help="FusionNode's weighing of round contributions (train --contrib-policy). Off by default: "
        "the testbed compares training systems as a group of volunteers who know each other runs "
        "them (hivemind checks no work either); auto would score every round, the testbed's swarm "
        "having no swarm key (default %(default)s)",
    )
    p.add_argument(
        "--verify-policy",
        choices=["auto", "off", "sample", "all"],
        default="off",
        help="FusionNode's spot-checks of stage work (train --verify-policy); off by default, as "
        "--contrib-policy; auto would check, the swarm having no swarm key (default %(default)s)",
    )
    p.add_argument(
        "--out",
        default="testbed-results",
        help="directory for results.json (the table), runs.json (every step) and testbed.png (default %(default)s)",
    )
    return p.parse_args(argv)


def peer_cluster(cluster_path: Path, peer_ids: list[str], tflops: list[float]) -> dict[str, Any]:
    """The cluster document the planner gets: the file's link bandwidths, keyed by peer id, and each
    peer's TFLOP/s (tflops[i]). The links' latency is 0: the testbed does not emulate it (no netem
    here), so the planner is not told it."""
    from fusionnode.plan.cluster import load_cluster

    c = load_cluster(str(cluster_path))
    devices = []
    for i, d in enumerate(c.devices):
        devices.append(
            {
                "id": peer_ids[i],
                "tflops": tflops[i],
                "memory_gb": 8.0,
                "roles": list(d.roles),
            }
        )
    matrix = [
        [float(c.bandwidth_bps[i, j]) / 1e9 if i != j else 1.0 for j in range(len(devices))]
        for i in range(len(devices))
    ]
    latency = [[0.0] * len(devices) for _ in devices]
    return {
        "version": 1,
        "name": c.name,
        "devices": devices,
        "links": {"matrix": {"bandwidth_gbps": matrix, "latency_ms": latency}},
    }


def step_overhead(run: dict[str, Any], warmup: int) -> float:
    """The runtime's fixed cost per step in `run`: the median of the step time less its slowest
    stage's time inside `job.step` (inputs, RPC rounds, the optimizer, commits)."""
    steps = run["steps"][warmup:] or run["steps"]
    return statistics.median(
        s["step_time_s"] - max(st["compute_s"] + st["wait_s"] + st["link_s"] for st in s["stages"])
        for s in steps
    )


def calibrate(doc: dict[str, Any], run: dict[str, Any], seq_len: int, warmup: int) -> dict[str, Any]:
    """The cluster document with each peer's TFLOPS replaced by what it achieved in `run`: the stage's
    forward FLOPs x 3 (forward + backward) x samples per step over its median compute seconds, divided by
    the estimator's efficiency factor (it multiplies the advertised figure by that factor)."""
    from fusionnode.graph.trace import graph_for

    graph = graph_for("gpt2-tiny", seq_len)
    prefix = graph.prefix_flops()
    steps = run["steps"][warmup:] or run["steps"]
    achieved: dict[str, float] = {}
    for st in run["plan"]["stages"]:
        compute = statistics.median(s["stages"][st["stage"]]["compute_s"] for s in steps)
        flops = (
            3
            * (prefix[st["hi"]] - prefix[st["lo"]])
            * run["batch_size"]
            / len({x["replica"] for x in run["plan"]["stages"]})
        )
        achieved[st["peer"]] = flops / max(compute, 1e-6) / DEFAULT_EFFICIENCY / 1e12
    out = json.loads(json.dumps(doc))
    for d in out["devices"]:
        if d["id"] in achieved:
            d["tflops"] = achieved[d["id"]]
    return out


def run_config(control_path: Path, spec: Any, params: dict[str, Any]) -> dict[str, Any]:
    from fusionnode import control

    async def go() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        events: list[dict[str, Any]] = []
        async for obj in control.call_stream(
            # the configuration as given: no straggler re-plan mid-measurement (on by default)
            control_path,
            "train",
            {"spec": spec.to_dict(), "rebalance_every": 0, **params},
            timeout=1800,
        ):
            if "event" in obj:
                events.append(obj["event"])
            else:
                return obj["result"], events
        raise RuntimeError("no result")

    t0 = time.time()
    result, events = asyncio.run(go())
    steps = [e for e in events if e["type"] == "step"]
    plan = next(e for e in events if e["type"] == "plan")
    return {
        "result": result,
        "steps": steps,
        "plan": plan,
        "wall_s": time.time() - t0,
        "batch_size": spec.batch_size,
    }


def summarize(name: str, run: dict[str, Any], warmup: int) -> dict[str, Any]:
    steps = run["steps"]
    measured = steps[warmup:] or steps
    pred = (run["plan"].get("prediction") or {}).get("step_time_s")
    sim = (run["plan"].get("prediction") or {}).get("simulated_step_time_s")
    step_time = statistics.median(s["step_time_s"] for s in measured)
    last_links = [link for st in steps[-1]["stages"] for link in (st.get("links") or {}).values()]
    dense = sum(link["dense_bytes"] for link in last_links)
    wire = sum(link["wire_bytes"] for link in last_links)
    return {
        "config": name,
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in measured),
        "step_time_s": step_time,
        "predicted_step_time_s": pred,
        "prediction_error": (step_time - pred) / pred if pred else None,
        "simulated_step_time_s": sim,
        "simulation_error": (step_time - sim) / sim if sim else None,
        "wire_bytes": sum(s["wire_bytes"] for s in steps),
        "link_dense_bytes": dense,
        "link_wire_bytes": wire,
        "final_loss": statistics.mean(s["loss"] for s in steps[-3:]),
        "stages": len(run["plan"]["stages"]),
        "pipelines": len({st["replica"] for st in run["plan"]["stages"]}),
        "curve": [
            {
                "t": sum(x["step_time_s"] for x in steps[: i + 1]),
                "loss": s["loss"],
                "tokens_per_s": s["tokens_per_s"],
            }
            for i, s in enumerate(steps)
        ],
    }


def measured_speed(seq_len: int, batch: int = 4, repeats: int = 7) -> float:
    """This machine's forward-FLOP rate (TFLOP/s) on gpt2-tiny, forward + backward on one thread:
    3 x the forward FLOPs of `batch` samples over the fastest of `repeats` steps (the fastest, so
    that other work on the machine at the time does not lower it)."""
    import torch

    from fusionnode.graph.trace import graph_for
    from fusionnode.models import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("gpt2-tiny", seq_len=seq_len)
        x = torch.randint(0, 256, (batch, seq_len))
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            out = model(x)
            (out if torch.is_tensor(out) else out[0]).float().mean().backward()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    flops = graph_for("gpt2-tiny", seq_len).total_flops() * batch
    return 3.0 * flops / min(times[1:]) / 1e12


def resolve_cluster_path(cluster: str) -> str:
    """A cluster file path, or the bundled file of that name (testbed.sh needs a file)."""
    from importlib import resources

    if Path(cluster).is_file():
        return cluster
    res = resources.files("fusionnode.plan") / "clusters" / f"{cluster}.json"
    if not res.is_file():
        from fusionnode.plan.cluster import load_cluster

        load_cluster(cluster)  # raises the clear ConfigError naming the bundled clusters
    return str(res)


def bench_cluster(
    cluster: str, args: argparse.Namespace, network: str, raw: list[dict[str, Any]]
) -> dict[str, Any]:
    """One testbed's table rows; every run's plan and per-step stage records are appended to `raw`."""
    from fusionnode.plan.cluster import load_cluster
    from fusionnode.train.spec import JobSpec

    path = Path(resolve_cluster_path(cluster))
    c = load_cluster(str(path))
    n = len(c.devices)
    workdir = Path(tempfile.mkdtemp(prefix="fusionnode-testbed-"))
    bed = Testbed(path, network, workdir, n)
    print(f"[{c.name}] starting {n} peers ({network} network) in {workdir}", file=sys.stderr, flush=True)
    try:
        bed.start()
        if network == "userspace":
            bed.limit_links(c.bandwidth_bps)
        else:
            bed.declare_links(c.bandwidth_bps)
        # emulated device speeds: the fastest at this machine's fair share of a core / headroom
        fastest = max(d.tflops for d in c.devices)
        top = args.machine_tflops * min(1.0, (os.cpu_count() or 1) / n) / args.headroom
        paced = [top * d.tflops / fastest for d in c.devices]
        bed.pace(paced)
        # the planner is told those speeds (the estimator takes a device's advertised TFLOP/s at
        # DEFAULT_EFFICIENCY; the calibration runs below then replace them with what was achieved)
        doc = peer_cluster(path, bed.peer_ids, [v / DEFAULT_EFFICIENCY for v in paced])

        def record(config: str, run: dict[str, Any]) -> None:
            raw.append({"cluster": c.name, "config": config, "plan": run["plan"], "steps": run["steps"]})

        def job(steps: int, compress: str, fields: dict[str, Any] | None = None) -> Any:
            return JobSpec(
                model="gpt2-tiny",
                steps=steps,
                batch_size=args.batch_size,
                micro_batches=args.micro_batches,
                seq_len=args.seq_len,
                seed=0,
                compress=compress,
                warmup_steps=min(20, args.steps),
                **(fields or {}),
            )

        overhead = {False: 0.0, True: 0.0}
        if args.calibration_steps > 0:
            # what the cluster file cannot say: each peer's achieved speed (the even split over all
            # peers), and the runtime's fixed cost per step in each mode (peer 0 alone, its own
            # optimizer host: RPC rounds and optimizer work, no emulated link in the way)
            alone = {
                **doc,
                "devices": doc["devices"][:1],
                "links": {"matrix": {"bandwidth_gbps": [[1.0]], "latency_ms": [[0.0]]}},
            }
            calibrations = [
                ("speeds", {"planner": "even", "offload": "off", "cluster": doc, "peers": bed.peer_ids}),
                (
                    "overhead-local",
                    {"planner": "even", "offload": "off", "cluster": alone, "peers": bed.peer_ids[:1]},
                ),
                (
                    "overhead-offload",
                    {
                        "planner": "even",
                        "offload": "on",
                        "cluster": alone,
                        "peers": bed.peer_ids[:1],
                        "optimizer_peers": bed.peer_ids[:1],
                    },
                ),
            ]
            calib = {}
            for what, params in calibrations:
                print(f"[{c.name}] calibrating: {what} ...", file=sys.stderr, flush=True)
                calib[what] = run_config(bed.controls[0], job(args.calibration_steps, "none"), params)
                record(f"calibration-{what}", calib[what])
            overhead = {
                False: step_overhead(calib["overhead-local"], args.warmup),
                True: step_overhead(calib["overhead-offload"], args.warmup),
            }
            doc = calibrate(doc, calib["speeds"], args.seq_len, args.warmup)
            print(
                f"[{c.name}] calibrated: step overhead {overhead[False] * 1e3:.0f} ms (local optimizer), "
                f"{overhead[True] * 1e3:.0f} ms (optimizer hosts)",
                file=sys.stderr,
                flush=True,
            )
        wanted = [x.strip() for x in args.configs.split(",") if x.strip()]
        rows = []
        comparison = []
        # the work checks (issue 20), off unless asked: the settings line of each row says which
        checks = {
            "contrib_policy": args.contrib_policy,
            "verify_policy": None if args.verify_policy == "auto" else args.verify_policy,
        }
        for name, params, compress, fields in all_configs():
            if name not in wanted:
                continue
            print(f"[{c.name}] {name} ...", file=sys.stderr, flush=True)
            planned = {**doc, "step_overhead_ms": overhead[params["offload"] == "on"] * 1e3}
            params = resolve_options(params, args.batch_size, paced)
            tx0 = bed.tx_bytes()
            paths0 = bed.path_bytes()
            run = run_config(
                bed.controls[0],
                job(args.steps, compress, fields),
                {**params, "cluster": planned, "peers": bed.peer_ids, **checks},
            )
            tx1 = bed.tx_bytes()
            rows.append(summarize(name, run, args.warmup))
            rows[-1]["paths"] = link_paths(
                paths0, bed.path_bytes(), c.bandwidth_bps, [d.id for d in c.devices]
            )
            print(f"[{c.name}] {name}: links {paths_line(rows[-1]['paths'])}", file=sys.stderr, flush=True)
            record(name, run)
            comparison.append(
                fusionnode_row(name, run, bed.peer_ids, args, tx0, tx1, {**params, **fields, **checks})
            )
            print(f"[{c.name}] {name}: {rows[-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
        for system in HIVEMIND_SYSTEMS:
            if system not in wanted:
                continue
            if network != "netns":
                print(f"[{c.name}] {system}: skipped: {HIVEMIND_USERSPACE}", file=sys.stderr, flush=True)
                continue
            print(f"[{c.name}] {system} ...", file=sys.stderr, flush=True)
            comparison.append(run_hivemind(bed, system, args, paced, c, workdir))
            print(
                f"[{c.name}] {system}: {comparison[-1]['tokens_per_s']:.0f} tokens/s",
                file=sys.stderr,
                flush=True,
            )
        base = next((r for r in rows if r["config"] == "baseline"), None)
        for r in rows:
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
            r["loss_vs_baseline"] = (
                (r["final_loss"] - base["final_loss"]) / base["final_loss"] if base else None
            )
        return {
            "cluster": c.name,
            "devices": n,
            "network": network,
            "emulated_tflops": paced,
            "step_overhead_s": {"local": overhead[False], "offload": overhead[True]},
            "rows": rows,
            "comparison": compare.finish(comparison, args.target_loss),
            "workdir": str(workdir),
        }
    finally:
        bed.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = [x.strip() for x in args.configs.split(",") if x.strip()]
    unknown = [x for x in wanted if x not in system_names()]
    if unknown:
        print(
            f"fusionnode bench testbed: unknown configuration(s) {unknown}; choose from "
            f"{', '.join(system_names())}",
            file=sys.stderr,
        )
        return 2
    if args.hivemind_timeout <= 0:
        print("fusionnode bench testbed: --hivemind-timeout must be > 0", file=sys.stderr)
        return 2
    explicit_hivemind = args.configs != ",".join(system_names()) and any(
        x in HIVEMIND_SYSTEMS for x in wanted
    )
    if args.steps < 1 or args.warmup < 0 or args.calibration_steps < 0:
        print(
            "fusionnode bench testbed: --steps must be >= 1, --warmup and --calibration-steps >= 0",
            file=sys.stderr,
        )
        return 2
    if not args.headroom >= 1.0:
        print(f"fusionnode bench testbed: --headroom must be >= 1, got {args.headroom}", file=sys.stderr)
        return 2
    network = args.network
    if network in ("auto", "netns"):
        ok, why = netns_available()
        if not ok and network == "netns":
            print(f"fusionnode bench testbed: --network netns unavailable: {why}", file=sys.stderr)
            return 2
        if not ok:
            print(
                f"network namespaces unavailable ({why}): emulating links with user-space token buckets "
                "on loopback",
                file=sys.stderr,
            )
        network = "netns" if ok else "userspace"
    if network == "userspace" and explicit_hivemind:
        print(
            f"fusionnode bench testbed: {', '.join(x for x in wanted if x in HIVEMIND_SYSTEMS)}: "
            f"{HIVEMIND_USERSPACE}",
            file=sys.stderr,
        )
        return 2
    args.machine_tflops = measured_speed(args.seq_len)  # once: every testbed paces from the same figure
    raw: list[dict[str, Any]] = []
    results = [bench_cluster(c, args, network, raw) for c in (args.cluster or DEFAULT_CLUSTERS)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for res in results:
        if res["rows"]:
            print_table(res)
            for row in res["rows"]:
                print(f"  paths, {row['config']}: {paths_line(row.get('paths') or [])}")
        if res["comparison"]["rows"]:
            compare.print_comparison(res["cluster"], res["network"], res["comparison"])
    (out / "results.json").write_text(
        json.dumps({"machine": f"{os.cpu_count()} cores", "results": results}, indent=2)
    )
    (out / "runs.json").write_text(json.dumps(raw))
    compare.write_curves_csv(results, out / "curves.csv")
    wrote = [out / "results.json", out / "runs.json", out / "curves.csv"]
    if any(res["rows"] for res in results) and plot(
        [res for res in results if res["rows"]], out / "testbed.png"
    ):
        wrote.append(out / "testbed.png")
    if compare.plot_loss_vs_time(results, out / "testbed-loss.png"):
        wrote.append(out / "testbed-loss.png")
    print(f"\nwrote {', '.join(str(p) for p in wrote)} (runs.json: every step's stage records)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
