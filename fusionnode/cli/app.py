"""The `fusionnode` command: its top-level parser, `main`, and the dispatch to each command.

Each command's options are defined by its module (node, jobs, plan, demo, models); `main` layers
defaults from flags, environment and config file (settings.py); the dispatch runs the command's
handler with uniform error handling and exit codes (2 for misuse, 130 on Ctrl-C)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from fusionnode import __version__
from fusionnode.cli import demo, jobs, models, node
from fusionnode.cli import plan as plan_cmd
from fusionnode.cli.args import command, json_arg
from fusionnode.errors import FusionNodeError

logger = logging.getLogger("fusionnode")

BENCHMARKS = {
    "wire": "fusionnode.bench.wire",
    "codec": "fusionnode.bench.codec",
    "adatopk": "fusionnode.bench.adatopk",
    "plan": "fusionnode.bench.plan",
    "optim": "fusionnode.bench.optim",
    "pipeline": "fusionnode.bench.pipeline",
    "testbed": "fusionnode.bench.testbed",
    "memory": "fusionnode.bench.memory",
    "faults": "fusionnode.bench.faults",
    "verify": "fusionnode.bench.verify",
    "sync": "fusionnode.bench.sync",  # issue 19
    "defaults": "fusionnode.bench.defaults",  # issue 18: train's defaults vs simple on one machine
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusionnode",
        description="Contribute a GPU (or CPU) to a decentralized training swarm, and train models on it.",
    )
    parser.add_argument("--version", action="version", version=f"fusionnode {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("FUSIONNODE_LOG_LEVEL", "WARNING"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="how much to log on stderr (default %(default)s; env FUSIONNODE_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    node.add_daemon_commands(sub)
    jobs.add_cancel_command(sub)
    jobs.add_train_command(sub)
    plan_cmd.add_commands(sub)
    _add_bench_command(sub)
    demo.add_command(sub)
    node.add_keygen_command(sub)
    _add_config_command(sub)
    models.add_model_commands(sub)
    return parser


def _add_bench_command(sub: argparse._SubParsersAction) -> None:
    p = command(
        sub,
        "bench",
        "run a benchmark and print its figures",
        "Run one of the benchmarks the README quotes and print its figures; "
        "`fusionnode bench NAME --help` lists its options.",
    )
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark: %(choices)s")
    p.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)"
    )


def _add_config_command(sub: argparse._SubParsersAction) -> None:
    p = command(
        sub,
        "config",
        "show the effective configuration and where each value comes from",
        "`fusionnode config show COMMAND [FLAGS...]` prints the options COMMAND would run with and "
        "where each value came from: a flag, a FUSIONNODE_* environment variable, the config file, "
        "or the built-in default.",
    )
    p.add_argument("action", choices=["show"], help="what to do: show")
    json_arg(p)
    p.add_argument(
        "target", nargs=argparse.REMAINDER, help="COMMAND [FLAGS...] to show it for (default: join)"
    )


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    mod = importlib.import_module(BENCHMARKS[args.name])
    return int(mod.main(args.bench_args) or 0)


def cmd_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fusionnode import settings

    if args.target and args.target[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if args.target and args.target[0] not in settings.subparsers(build_parser()):
        parser.error(
            f"config show: {args.target[0]!r} is not a command; name one, e.g. "
            "`fusionnode config show join --max-memory 8GB`"
        )
    print(settings.show_config(build_parser, args.target or ["join"], as_json=args.json))
    return 0


Handler = Callable[[argparse.Namespace, argparse.ArgumentParser], int]

# each command's handler; it gets the parsed arguments and the command's own parser (for its errors)
COMMANDS: dict[str, Handler] = {
    "join": node.cmd_join,
    "peers": lambda args, _parser: node.cmd_peers(args),
    "status": lambda args, _parser: node.cmd_status(args),
    "pause": lambda args, _parser: node.cmd_pause_resume(args),
    "resume": lambda args, _parser: node.cmd_pause_resume(args),
    "leave": lambda args, _parser: node.cmd_leave(args),
    "cancel": lambda args, _parser: jobs.cmd_cancel(args),
    "train": jobs.cmd_train,
    "plan": lambda args, _parser: plan_cmd.run_plan(args),
    "simulate": lambda args, _parser: plan_cmd.run_simulate(args),
    "bench": lambda args, _parser: cmd_bench(args),
    "demo": lambda args, _parser: demo.run_demo(args),
    "keygen": lambda args, _parser: node.cmd_keygen(args),
    "config": cmd_config,
    "generate": lambda args, _parser: models.cmd_generate(args),
    "export": lambda args, _parser: models.cmd_export(args),
    "tokenizer": lambda args, _parser: models.cmd_tokenizer(args),
}


def main(argv: list[str] | None = None) -> int:
    from fusionnode import settings

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    subs = settings.subparsers(parser)
    cmd = next((a for a in argv if a in subs), None)
    if cmd and cmd != "config":
        try:
            settings.layered_defaults(parser, argv, cmd)
        except FusionNodeError as exc:
            subs[cmd].error(str(exc))
    args = parser.parse_args(argv)
    try:
        rc = _dispatch(args, subs[args.command])
        sys.stdout.flush()  # here, where a closed pipe can still be handled
        return rc
    except BrokenPipeError:  # `fusionnode status | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # what a shell reports for a process killed by SIGPIPE


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs the parsed command; `parser` is the command's own parser, so its errors show its usage."""
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # hivemind sets its logger's level from $HIVEMIND_LOGLEVEL (default INFO) when first imported,
    # which happens later (and in the processes it forks): set the variable, not only the level
    hivemind_level = "DEBUG" if args.log_level == "DEBUG" else "ERROR"
    os.environ.setdefault("HIVEMIND_LOGLEVEL", hivemind_level)
    logging.getLogger("hivemind").setLevel(hivemind_level)
    handler = COMMANDS.get(args.command)
    if handler is None:
        parser.error(f"unknown command {args.command}")
    try:
        return int(handler(args, parser) or 0)
    except FusionNodeError as exc:
        print(f"fusionnode {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fusionnode {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
