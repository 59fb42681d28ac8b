"""The systems `fusionnode bench testbed` compares: FusionNode's configurations (the train options
and job-spec fields each passes), the plug point for issue 19's `--sync` modes, and hivemind's
two modes run on the testbed's namespaces (bench/hivemind_peer.py), with each system's row of the
comparison table (bench/compare.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from fusionnode.bench import compare

# FusionNode's configurations: (name, `train` options, compression, JobSpec fields beyond the job's)
CONFIGS: list[tuple[str, dict[str, Any], str, dict[str, Any]]] = [
    ("baseline", {"planner": "even", "offload": "off"}, "none", {}),
    ("planner", {"planner": "fusion", "offload": "on"}, "none", {}),  # the driver's choice for a planned job
    ("adatopk", {"planner": "even", "offload": "off"}, "adatopk", {}),
    ("fusionnode", {"planner": "fusion", "offload": "on"}, "adatopk", {}),
]
# Issue 19's low-communication sync modes (`fusionnode train --sync diloco|sparseloco --inner-steps
# H`): one H and one set of options, fixed before any run. They join CONFIGS where this build's
# JobSpec has the fields they set (`sync_available`); until then they are listed and skipped.
SYNC_INNER_STEPS = 10
SYNC_CONFIGS: list[tuple[str, dict[str, Any], str, dict[str, Any]]] = [
    (
        "fusionnode-diloco",
        {"planner": "fusion", "offload": "on"},
        "none",
        {"sync": "diloco", "inner_steps": SYNC_INNER_STEPS},
    ),
    (
        "fusionnode-sparseloco",
        {"planner": "fusion", "offload": "on"},
        "none",
        {"sync": "sparseloco", "inner_steps": SYNC_INNER_STEPS},
    ),
]
HIVEMIND_SYSTEMS = ("hivemind-avg", "hivemind-local")  # bench/hivemind_peer.py, --mode avg / local
HIVEMIND_PORT = 31400  # hivemind's libp2p port inside each namespace (FusionNode's daemons use 31337)


def sync_available(spec_fields: dict[str, Any]) -> bool:
    """Whether this build's JobSpec has every field a sync configuration sets."""
    import dataclasses

    from fusionnode.train.spec import JobSpec

    names = {f.name for f in dataclasses.fields(JobSpec)}
    return set(spec_fields) <= names


def all_configs() -> list[tuple[str, dict[str, Any], str, dict[str, Any]]]:
    return [*CONFIGS, *SYNC_CONFIGS]


def system_names() -> list[str]:
    return [c[0] for c in all_configs()] + list(HIVEMIND_SYSTEMS)


HIVEMIND_USERSPACE = (
    "user-space token buckets shape FusionNode's streams, not hivemind's; hivemind runs on "
    "--network netns only (root and iproute2)"
)


def fusionnode_row(
    name: str,
    run: dict[str, Any],
    peer_ids: list[str],
    args: argparse.Namespace,
    tx0: list[int] | None,
    tx1: list[int] | None,
    options: dict[str, Any],
) -> dict[str, Any]:
    """A FusionNode configuration's row of the comparison table (bench/compare.py)."""
    steps = run["steps"]
    if tx0 is not None and tx1 is not None:
        sent, note = sum(tx1) - sum(tx0), "bytes include the job's setup and its final parameter fetch"
    else:
        sent, note = sum(s["wire_bytes"] for s in steps), "bytes: tensor bytes of the step records (no netns)"
    return compare.row(
        name,
        kind="fusionnode",
        curve=compare.fusionnode_curve(steps),
        wall_s=sum(s["step_time_s"] for s in steps),
        tokens=len(steps) * args.batch_size * args.seq_len,
        bytes_sent=sent,
        val_loss=(run.get("result") or {}).get("val_loss"),
        utilisation=compare.fusionnode_utilisation(steps, peer_ids),
        settings={k: v for k, v in options.items() if k not in ("cluster", "peers")},
        note=note,
    )


def run_hivemind(
    bed: Any, system: str, args: argparse.Namespace, paced: list[float], cluster: Any, workdir: Path
) -> dict[str, Any]:
    """One hivemind system on the testbed's namespaces (`bed`: a netns `testbed.Testbed`): a peer per device (bench/hivemind_peer.py)
    listening on its namespace's link addresses, paced to the device's emulated speed; its row of
    the comparison table. Bytes are the links' transmit counters between the start signal and the
    moment the last peer reached the final epoch."""
    from fusionnode.bench import hivemind_peer as hp
    from fusionnode.models import build_model

    n = bed.n
    mode = system.split("-", 1)[1]
    param_bytes = 4 * sum(p.numel() for p in build_model("gpt2-tiny", seq_len=args.seq_len).parameters())
    slowest = min(float(cluster.bandwidth_bps[i, j]) for i in range(n) for j in range(n) if i != j)
    settings = hp.hivemind_settings(n, param_bytes, slowest)
    out = workdir / system
    port = HIVEMIND_PORT + HIVEMIND_SYSTEMS.index(system)
    commands = []
    for i in range(n):
        kwargs = {
            "mode": mode,
            "index": i,
            "peers": n,
            "listen": f"/ip4/0.0.0.0/tcp/{port}",
            "announce": [f"/ip4/{bed.address(i, j)}/tcp/{port}" for j in range(n) if j != i],
            "out": out,
            "go_file": out / "go",
            "steps": args.steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "seed": 0,
            "settings": settings,
            "run_id": f"fn-testbed-{os.getpid()}-{system}",
            "pace_tflops": paced[i],
            "max_seconds": args.hivemind_timeout,
        }
        boot = (lambda b, i=i: f"/ip4/{bed.address(0, i)}/tcp/{port}/p2p/{b['peer_id']}") if i else None
        commands.append(hp.PeerCommand(kwargs, boot))
    swarm = hp.launch_swarm(
        commands,
        out,
        prefix=[["ip", "netns", "exec", ns] for ns in bed.netns],
        timeout_s=args.hivemind_timeout + 60,
        at_start=bed.tx_bytes,
        at_end=bed.tx_bytes,
    )
    curve = compare.hivemind_curve(swarm, args.steps)
    notes = [
        f"peer {p['index']} stopped at epoch {p['done']['epoch'] if p['done'] else '?'} of {args.steps}"
        for p in swarm["peers"]
        if not (p["done"] and p["done"]["complete"])
    ]
    epochs = max(1, len(curve))
    samples = sum(r["samples"] for p in swarm["peers"] for r in p["steps"])
    rounds = [p["rounds"] for p in swarm["peers"] if p["rounds"]]
    notes.append(
        f"{samples / epochs:.1f} samples per target batch of {args.batch_size} (peers go on computing "
        "while a round assembles)"
    )
    if rounds:
        notes.append(
            "averaging rounds per peer: "
            + ", ".join(f"{r['averaged']} done (mean group {r['mean_group']:.1f})" for r in rounds)
            + f"; went alone {sum(r['alone'] for r in rounds)}x, failed {sum(r['failed'] for r in rounds)}x in all"
        )
    val = None
    if swarm["peers"][0]["params"]:
        val = compare.evaluate_params(
            swarm["peers"][0]["params"], batch_size=args.batch_size, seq_len=args.seq_len, seed=0
        )
    tokens = samples * args.seq_len
    sent = sum(swarm["at_end"]) - sum(swarm["at_start"]) if swarm.get("at_start") else None
    return compare.row(
        system,
        kind="hivemind",
        curve=curve,
        wall_s=compare.hivemind_wall(swarm),
        tokens=tokens,
        bytes_sent=sent,
        val_loss=val,
        utilisation=compare.hivemind_utilisation(swarm),
        settings={
            "target_batch_size": args.batch_size,
            "batch_size_per_step": hp.local_batch(args.batch_size, n),
            **settings,
        },
        note="; ".join([*notes, f"peer logs in {out}"]),
    )
