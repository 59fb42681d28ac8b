"""The commands about this machine's daemon: join, peers, status, pause, resume, leave, keygen.

`join` runs the daemon; the others ask it over its control socket, except `keygen`, which writes
a private swarm's key."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from fusionnode.availability.caps import parse_percent
from fusionnode.cli.args import command, control_path, json_arg, run, state_dir_arg
from fusionnode.config import (
    DEFAULT_HEARTBEAT,
    DEFAULT_LISTEN,
    DEFAULT_PROBE_INTERVAL,
    DEFAULT_RECORD_TTL,
    DEFAULT_STARTUP_TIMEOUT,
    NodeConfig,
    add_network_arguments,
    default_state_dir,
    network_options,
    parse_rate,
    parse_roles,
    parse_size,
)
from fusionnode.errors import FusionNodeError
from fusionnode.messages import describe_availability
from fusionnode.term import print_peers, print_status


def add_daemon_commands(sub: Any) -> None:
    """join, peers, status, pause, resume, leave (in `fusionnode --help`'s order)."""
    p = sub.add_parser(
        "join",
        help="run a daemon that joins (or starts) a swarm",
        description="Run a FusionNode daemon. The first peer starts a swarm and prints the "
        "address others dial; later peers pass it to --initial-peers.",
    )
    state_dir_arg(p)
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddrs of peers already in the swarm, as their READY line or `fusionnode status` "
        "prints them (/ip4/1.2.3.4/tcp/31337/p2p/Qm...; default: none, this peer starts a swarm)",
    )
    p.add_argument(
        "--listen",
        action="append",
        default=None,
        metavar="MADDR",
        help=f"where to accept peers (default {DEFAULT_LISTEN}; a second daemon on the same host needs "
        "another port: /ip4/0.0.0.0/tcp/0 picks a free one, /ip4/127.0.0.1/tcp/0 a loopback one)",
    )
    p.add_argument(
        "--announce",
        action="append",
        default=[],
        metavar="MADDR",
        help="addresses to advertise instead of the listening ones (default: the listening ones)",
    )
    add_network_arguments(p)
    p.add_argument(
        "--role", default="worker,optimizer", help="roles offered: worker, optimizer (default: both)"
    )
    p.add_argument(
        "--serve-checks",
        action="store_true",
        help="judge spot-checks for the drivers named by --serve-checks-for, which name this peer "
        "(`train --verifier PEER_ID`): their recomputes run in this daemon's check process (default: "
        "refuse them). Requires --serve-checks-for (exit 2 without): other peers are refused",
    )
    p.add_argument(
        "--serve-checks-for",
        default=None,
        metavar="PEER[,PEER]",
        help="with --serve-checks: the peer ids of the drivers whose checks are judged; any other "
        "caller is answered forbidden and its messages dropped (default: nobody)",
    )
    p.add_argument(
        "--max-memory", default=None, help="memory offered to the swarm, e.g. 12GB (default: what is free)"
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="do not measure links (for metered connections; default: measure them)",
    )
    p.add_argument(
        "--probe-interval",
        type=float,
        default=DEFAULT_PROBE_INTERVAL,
        help="seconds between link probes (default %(default)s)",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=DEFAULT_HEARTBEAT,
        help="seconds between advertisements (default %(default)s)",
    )
    p.add_argument(
        "--record-ttl",
        type=float,
        default=DEFAULT_RECORD_TTL,
        help="seconds an advertisement lives (default %(default)s)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT,
        help="seconds to wait for the libp2p daemon and the DHT (default %(default)s)",
    )
    p.add_argument(
        "--egress-limit",
        default=None,
        metavar="RATE",
        help="cap this peer's outgoing tensor traffic, e.g. 8Mbit, 100Mbit, 1Gbit (user-space token "
        "bucket; for tests and for sharing a metered uplink; default: no cap)",
    )
    p.add_argument(
        "--when",
        choices=["always", "idle"],
        default="always",
        help="idle: contribute only while the machine's owner is not using it (yield within seconds, "
        "come back after --idle-grace); always: whenever the daemon runs (default)",
    )
    p.add_argument(
        "--schedule",
        default=None,
        metavar="HH:MM-HH:MM[,...]",
        help="contribute only inside these local-time windows, e.g. 22:00-07:00 (default: at any time)",
    )
    p.add_argument(
        "--max-util",
        default=None,
        metavar="PERCENT",
        help="cap this peer's compute, e.g. 80%% (default: no cap)",
    )
    p.add_argument(
        "--idle-grace",
        type=float,
        default=60.0,
        help="seconds the owner must stay idle before contributing again (default %(default)s)",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="enable debug hooks (a compute slow-down read from <state-dir>/debug_slow, a lie told "
        "as a worker from <state-dir>/debug_lie, for tests and benchmarks; "
        "default: off)",
    )
    p.add_argument(
        "--swarm-key",
        default=None,
        metavar="FILE",
        help="join a private swarm: speak only to peers holding this secret (or $FUSIONNODE_SWARM_KEY_FILE; "
        "create one with `fusionnode keygen`; default: none, a public swarm)",
    )
    p.add_argument(
        "--dashboard",
        default=None,
        metavar="HOST:PORT",
        help="serve the read-only dashboard and /metrics here, e.g. 127.0.0.1:8080 (port 0 = random; "
        "default: no dashboard)",
    )
    p.add_argument(
        "--dashboard-actions",
        action="store_true",
        help="let the dashboard pause/resume this node and cancel its jobs, for whoever holds the token "
        "printed at start (default: off, read-only)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads for this peer's compute (default %(default)s)"
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="measure the device again instead of using the cache (default: use the cache)",
    )

    p = command(
        sub,
        "peers",
        "list the swarm's peers as the local daemon sees them",
        "List the peers the local daemon sees: device, memory, speed, measured links, roles, "
        "availability and how fresh each record is.",
    )
    state_dir_arg(p)
    json_arg(p)

    p = command(
        sub,
        "status",
        "the local daemon, the swarm and running jobs",
        "Show the local daemon (peer id, addresses, device, availability, whether the swarm is "
        "private), the peers it sees, the stages it serves and the jobs it drives.",
    )
    state_dir_arg(p)
    json_arg(p)

    for name, text, desc in (
        (
            "pause",
            "stop contributing for now (in-flight work finishes, stages are released)",
            "Stop contributing until `fusionnode resume`: steps in flight finish, this peer's stages "
            "are released (their jobs re-plan without it) and it advertises itself as paused.",
        ),
        (
            "resume",
            "contribute again after a pause",
            "Lift a `fusionnode pause`. If --schedule or --when idle still keep the peer paused, "
            "says so and until when, and exits with status 1.",
        ),
    ):
        p = command(sub, name, text, desc)
        state_dir_arg(p)

    p = command(
        sub,
        "leave",
        "ask the local daemon to leave the swarm gracefully",
        "Ask the local daemon to leave: it finishes steps in flight, withdraws its record from the "
        "DHT and exits.",
    )
    state_dir_arg(p)


def add_keygen_command(sub: Any) -> None:
    p = command(
        sub,
        "keygen",
        "create a private swarm key file (mode 0600) to share with your peers",
        "Create a private swarm key: peers started with --swarm-key FILE speak only to peers holding "
        "the same key. Refuses to overwrite an existing file unless --force.",
    )
    p.add_argument("--out", required=True, help="where to write the key (required)")
    p.add_argument(
        "--force", action="store_true", help="overwrite an existing file or directory (default: refuse)"
    )


def _node_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> NodeConfig:
    try:
        return NodeConfig(
            state_dir=(args.state_dir or default_state_dir()).expanduser().resolve(),
            listen=tuple(args.listen or [DEFAULT_LISTEN]),
            initial_peers=tuple(args.initial_peers),
            announce=tuple(args.announce),
            roles=parse_roles(args.role),
            max_memory_bytes=parse_size(args.max_memory) if args.max_memory else None,
            startup_timeout_s=args.startup_timeout,
            heartbeat_s=args.heartbeat,
            record_ttl_s=args.record_ttl,
            probe=not args.no_probe,
            probe_interval_s=args.probe_interval,
            torch_threads=args.threads,
            dashboard=args.dashboard,
            dashboard_actions=args.dashboard_actions,
            swarm_key_file=args.swarm_key,
            when=args.when,
            schedule=args.schedule,
            max_util_percent=parse_percent(args.max_util) if args.max_util else None,
            idle_grace_s=args.idle_grace,
            egress_limit_bps=parse_rate(args.egress_limit) if args.egress_limit else None,
            reprofile=args.reprofile,
            serve_checks=getattr(args, "serve_checks", False),
            serve_checks_for=tuple(
                p.strip() for p in (getattr(args, "serve_checks_for", None) or "").split(",") if p.strip()
            ),
            network=network_options(args),
        )
    except FusionNodeError as exc:
        parser.error(str(exc))
        raise  # unreachable


def cmd_join(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from fusionnode.node import run_node

    config = _node_config(args, parser)
    if args.debug:
        os.environ["FUSIONNODE_DEBUG"] = "1"
    torch.set_num_threads(max(1, config.torch_threads))
    return run(run_node(config))


def cmd_peers(args: argparse.Namespace) -> int:
    from fusionnode import control

    res = run(control.call(control_path(args), "peers"))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print_peers(res["peers"], res.get("self"))
    if res.get("reachability"):
        from fusionnode.term import reach_text

        print(f"this peer: {reach_text(res['reachability'])}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from fusionnode import control

    res = run(control.call(control_path(args), "status"))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print_status(res)
    return 0


def cmd_leave(args: argparse.Namespace) -> int:
    from fusionnode import control

    res = run(control.call(control_path(args), "leave"))
    print(f"peer {res['peer_id']} is leaving the swarm")
    return 0


def cmd_pause_resume(args: argparse.Namespace) -> int:
    from fusionnode import control

    res = run(control.call(control_path(args), args.command, timeout=None))
    print(describe_availability(args.command, res))
    return 0 if args.command == "pause" or res.get("availability") != "paused" else 1


def cmd_keygen(args: argparse.Namespace) -> int:
    from fusionnode.security import write_swarm_key

    key = write_swarm_key(Path(args.out), overwrite=args.force)
    print(
        f"wrote swarm key {args.out} (fingerprint {key.fingerprint}); give it to your peers over a "
        "trusted channel and start each with --swarm-key"
    )
    return 0
