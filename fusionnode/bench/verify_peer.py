"""`fusionnode bench verify --verifier-peer` / `--verifier-core`: the checks judged by a verifier peer
(train/verifier_peer.py) instead of the driver's own check process.

`--verifier-peer` starts one more daemon, `join --serve-checks --role worker`, that every checked job
names (`verifier`); the jobs name their workers (`peers`: the three peers of the bench, in the order
the driver would pick them), so the verifier never holds a stage. `--verifier-core` (overhead) also
pins: every process of the swarm (daemons with their p2pd and DHT children: driver, optimizer host,
workers, the driver's check process if it were spawned) on CPU 0, the verifier's daemon and its
children (its p2pd, its check process) on CPU 1, for the checks-off and the checks-on runs alike. That
is the deployment the verifier peer is for: the recompute on a core (or machine) the swarm does not
use; the baseline is the same swarm on CPU 0 with checks off.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any


def add_verifier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verifier-peer",
        action="store_true",
        help="the checks judged by one more daemon started with --serve-checks (train --verifier), "
        "not the driver's check process (overhead, seeded, lies, clean)",
    )
    p.add_argument(
        "--verifier-core",
        action="store_true",
        help="overhead: --verifier-peer, with the swarm on CPU 0 and the verifier peer on CPU 1 (both modes)",
    )


def start_verifier(args: argparse.Namespace, swarm: Any) -> None:
    """With --verifier-peer (or --verifier-core): one more daemon serving checks, in `swarm.verifier`
    (its index; None without)."""
    swarm.verifier = None
    if not (args.verifier_peer or args.verifier_core):
        return
    before = list(swarm.extra_args)
    drivers = ",".join(r["peer_id"] for r in swarm.ready)  # the daemons started so far: the drivers
    swarm.extra_args = [*before, "--serve-checks", "--serve-checks-for", drivers, "--role", "worker"]
    try:
        swarm.verifier = swarm.add_peer()
    finally:
        swarm.extra_args = before
    asyncio.run(swarm.wait_connected())


def workers(swarm: Any) -> list[int]:
    """The indices of the bench's own peers (not the verifier)."""
    return [i for i in range(len(swarm.ready)) if i != getattr(swarm, "verifier", None)]


def verifier_params(swarm: Any) -> dict[str, Any]:
    """What a job's params add for the verifier peer: its id, and the workers named (the verifier is
    a worker by role, never one by plan); {} without a verifier peer."""
    v = getattr(swarm, "verifier", None)
    if v is None:
        return {}
    driver = swarm.ready[0]["peer_id"]
    others = sorted(swarm.ready[i]["peer_id"] for i in workers(swarm) if i != 0)
    return {"verifier": swarm.ready[v]["peer_id"], "peers": [driver, *others]}


def pin_apart(swarm: Any) -> None:
    """The swarm (every process but the verifier's) on CPU 0, the verifier's daemon and children on CPU 1."""
    from fusionnode.bench.verify_overhead import _members, _pin

    for i, q in _members(swarm):
        _pin(q, {1} if i == swarm.verifier else {0})


__all__ = ["add_verifier_args", "pin_apart", "start_verifier", "verifier_params", "workers"]
