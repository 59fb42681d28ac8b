"""`fusionnode bench verify --sections contrib`: a replica that sends random pseudo-gradients in a
`--sync diloco|sparseloco` job, weighed by `--contrib-policy` (issue 20, verify/contrib.py).

Method: 4 real `fusionnode join --debug` daemons on loopback (every one a worker and an optimizer
host); jobs of 2 replicas x 2 stages, offload on, 2 optimizer hosts, gpt2-tiny, `--contrib-steps`
steps in rounds of `--contrib-inner-steps`. In a liar run both workers of replica 1 read
`{"kind": "random_pseudo_gradient"}` from their `debug_lie` (written when the plan is known, before
the first round closes): at each round's end each sends a random pseudo-gradient of the norm of its
honest one (`norm` x it in the `scaled` runs). Runs per sync mode:

- honest under `off` and under `score` (no false positive: no replica dropped, the same losses);
- the liar under `off` (the damage when nobody weighs), `clip` (the hosts' norm floor alone) and
  `score` (the driver's scoring on a held-out batch, over the floor);
- a liar scaled x`--contrib-scale` under `off` and `clip` (what the floor is for).

Reported per run: under `score`, each round's weights of the honest and the lying replica (the
plan's token weight x the floor's scale x the verdict, as host 0 closed the round), the floor's
scale, the loss gains on the held-out batch and the rounds each replica was dropped from (a `clip`
run's weights stay on the hosts: its figure is the loss); for every run the validation loss and its
difference to the honest `off` run, to the single-process reference (`train --local --replicas 2
--sync ...`) and to the honest replica alone on its half of the batch (`--replicas 1`, half the batch:
what a job whose liar is dropped from every round can reach, the liar's share of the data being
lost), the last step's loss and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

N_PEERS = 4
RUNS = (  # (name, policy, lie)
    ("honest", "off", None),
    ("honest", "score", None),
    ("liar", "off", 1.0),
    ("liar", "clip", 1.0),
    ("liar", "score", 1.0),
    ("scaled liar", "off", "scale"),
    ("scaled liar", "clip", "scale"),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--contrib-steps", type=int, default=24, help="steps of each contrib job (default %(default)s)"
    )
    p.add_argument(
        "--contrib-inner-steps", type=int, default=4, help="inner steps per round, H (default %(default)s)"
    )
    p.add_argument(
        "--contrib-sync",
        default="diloco,sparseloco",
        help="sync modes of the contrib section, comma-separated (default %(default)s)",
    )
    p.add_argument(
        "--contrib-scale",
        type=float,
        default=100.0,
        help="norm multiple of the scaled liar's random pseudo-gradient (default %(default)s)",
    )


def _sync(mode: str, h: int) -> Any:
    from fusionnode.sync import SyncConfig

    if mode == "sparseloco":
        return SyncConfig("sparseloco", inner_steps=h, topk_density=1 / 16, chunk=256)
    return SyncConfig(mode, inner_steps=h)


def run_contrib(args: argparse.Namespace, workdir: Path, train: Any, spec_of: Any) -> list[dict[str, Any]]:
    """`train(swarm, params, on_event)` and `spec_of(args, job_id, steps)` are bench/verify.py's."""
    from fusionnode.localswarm import LocalSwarm
    from fusionnode.train.replicas import train_local_replicas

    modes = [m for m in args.contrib_sync.split(",") if m]
    swarm = LocalSwarm(workdir / "contrib-swarm", N_PEERS, log=sys.stderr)
    (workdir / "contrib-swarm").mkdir(parents=True, exist_ok=True)
    out = []
    try:
        swarm.start()
        asyncio.run(swarm.wait_connected())
        for mode in modes:
            sync = _sync(mode, args.contrib_inner_steps)
            base = spec_of(args, "", args.contrib_steps).replace(micro_batches=2, job_id="")
            ref = train_local_replicas(base, sync, replicas=2)
            # the honest replica alone on its half of the batch: what a run whose liar is dropped
            # from every round can reach (the liar's share of the data is lost)
            alone = train_local_replicas(base.replace(batch_size=base.batch_size // 2), sync, replicas=1)
            alone_val = _val_loss(base, alone.params)  # on the same validation batches as the jobs'
            rows: list[dict[str, Any]] = []
            honest_val = None
            for i, (name, policy, lie) in enumerate(RUNS):
                row = _run(swarm, args, train, base.replace(job_id=f"contrib-{mode}-{i}"), sync, policy, lie)
                honest_val = row["val_loss"] if i == 0 else honest_val
                row = {"run": name, "policy": policy, **row}
                row["val_loss_diff_vs_honest"] = round(row["val_loss"] - honest_val, 5)
                row["val_loss_rel_diff_vs_reference"] = round(
                    abs(row["val_loss"] - ref.val_loss) / ref.val_loss, 5
                )
                row["val_loss_rel_diff_vs_honest_replica_alone"] = round(
                    abs(row["val_loss"] - alone_val) / alone_val, 5
                )
                rows.append(row)
            out.append(
                {
                    "scenario": f"contrib:{mode}",
                    "sync": sync.to_dict(),
                    "reference_val_loss": ref.val_loss,
                    "honest_replica_alone_val_loss": alone_val,
                    "scale": args.contrib_scale,
                    "runs": rows,
                }
            )
    finally:
        swarm.stop()
    return out


def _val_loss(spec: Any, params: dict[str, Any]) -> float:
    """The validation loss of `params` on `spec`'s validation batches (what a job's result reports)."""
    import torch

    from fusionnode.train.data import BatchSource
    from fusionnode.train.local import build_job_model, evaluate
    from fusionnode.train.spec import resolve_seq_len

    model = build_job_model(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in params:
                p.copy_(params[name])
    return evaluate(model, BatchSource.from_spec(spec, resolve_seq_len(spec)))


def _run(
    swarm: Any, args: argparse.Namespace, train: Any, spec: Any, sync: Any, policy: str, lie: Any
) -> dict[str, Any]:
    liars: list[int] = []
    config = {"kind": "random_pseudo_gradient", "seed": 5}
    if lie == "scale":
        config["norm"] = args.contrib_scale

    async def on_event(ev: dict) -> None:
        if lie is None or ev["type"] != "plan" or liars:
            return
        for st in ev["stages"]:
            if st["replica"] == 1:
                i = next(i for i, rec in enumerate(swarm.ready) if rec["peer_id"] == st["peer"])
                (swarm.state_dir(i) / "debug_lie").write_text(json.dumps(config))
                liars.append(i)

    params = {
        "spec": spec.to_dict(),
        "stages": 2,
        "replicas": 2,
        "offload": "on",
        "optimizer_hosts": 2,
        "sync": sync.to_dict(),
        "rebalance_every": 0,
        "verify_policy": "off",
        "contrib_policy": policy,
    }
    t0 = time.monotonic()
    try:
        result, events = asyncio.run(train(swarm, params, on_event))
    finally:
        for i in liars:
            (swarm.state_dir(i) / "debug_lie").unlink(missing_ok=True)
    scored = [e for e in events if e["type"] == "event" and e.get("kind") == "scored"]
    steps = [e for e in events if e["type"] == "step"]
    return {
        "liar_weight_per_round": [e["weights"][0][1] for e in scored] if scored else None,
        "honest_weight_per_round": [e["weights"][0][0] for e in scored] if scored else None,
        "liar_floor_scale_per_round": [round(e["scales"][0][1], 5) for e in scored] if scored else None,
        "dropped": (result.get("contrib") or {}).get("dropped"),
        "gains": [e["scores"] for e in scored] if scored else None,
        "judge_s_per_round": [e.get("judge_s") for e in scored] if scored else None,
        "val_loss": result["val_loss"],
        "final_loss": steps[-1]["loss"],
        "wall_s": round(time.monotonic() - t0, 1),
    }


__all__ = ["add_args", "run_contrib"]
