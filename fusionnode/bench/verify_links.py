"""`fusionnode bench verify --compress`: its jobs over a lossy link codec (verify/lossy.py judges them).

On loopback AdaTopK would send dense (the links keep up), so the jobs are told their links carry
`--link-mbps` (a cluster document, as `fusionnode demo --link-limit` does): AdaTopK then sends q8 both
ways during its warm-up (30% of a job's steps), then centered top-k activations at its floor and q8
gradients. `reason_kind` sums up what caught each seeded run.
"""

from __future__ import annotations

import argparse
import re
from typing import Any


def add_link_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compress",
        default="none",
        help="link codec of every job: none, adatopk, topk:R or fp16 (default %(default)s)",
    )
    p.add_argument(
        "--link-mbps",
        type=float,
        default=1.0,
        help="with a lossy --compress, the link bandwidth the jobs are told (default %(default)s Mbit/s)",
    )
    p.add_argument(
        "--link-warmup",
        type=int,
        default=None,
        help="with --compress adatopk, its warm-up steps (q8 both ways; default: the driver's, 30%% of "
        "a job's steps; 0 = top-k activations from the start)",
    )


def check_link_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from fusionnode.compress.policy import parse_compress
    from fusionnode.errors import ConfigError

    try:
        parse_compress(args.compress)
    except ConfigError as exc:
        p.error(f"--compress: {exc}")
    if not args.link_mbps > 0:
        p.error("--link-mbps must be > 0")
    if args.link_warmup is not None and args.link_warmup < 0:
        p.error("--link-warmup must be >= 0")


def link_params(args: argparse.Namespace, swarm: Any) -> dict[str, Any]:
    """With a lossy `--compress`: the jobs' links declared at `--link-mbps` (so AdaTopK compresses)."""
    if getattr(args, "compress", "none") == "none":
        return {}
    ids = [r["peer_id"] for r in swarm.ready]
    warmup = getattr(args, "link_warmup", None)
    return {
        **({"link_options": {"warmup_steps": warmup}} if warmup is not None else {}),
        "cluster": {
            "version": 1,
            "name": "bench-verify",
            "devices": [{"id": pid, "tflops": 0.05, "memory_gb": 4} for pid in ids],
            "links": {"inter_site": {"bandwidth_gbps": args.link_mbps / 1e3, "latency_ms": 0.1}},
        },
    }


def link_summary(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The activation links of a job's last step: keep ratio in force, wire / dense bytes so far."""
    if not steps:
        return None
    fwd = [s["links"]["fwd"] for s in steps[-1].get("stages", []) if (s.get("links") or {}).get("fwd")]
    fwd = [f for f in fwd if f.get("dense_bytes")]
    if not fwd:
        return None
    return {
        "act_keep_ratio_last_step": [f["ratio"] for f in fwd],
        "act_wire_over_dense_bytes": [round(f["wire_bytes"] / f["dense_bytes"], 4) for f in fwd],
    }


def reason_kind(reason: str) -> str:
    """A caught event's reason without its peer, step, micro-batch and figures (to count kinds)."""
    tail = reason.split("…)", 1)[-1]
    tail = re.sub(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", "#", tail)
    return re.sub(r"'[^']*'", "'_'", tail).strip()[:140]


__all__ = ["add_link_args", "check_link_args", "link_params", "link_summary", "reason_kind"]
