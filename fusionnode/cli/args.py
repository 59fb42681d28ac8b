"""What the command modules share: argparse value types and the daemon's state-dir option.

The value types check a value where it is parsed, with the wording config errors reuse; a command
reaches the local daemon through its control socket (`control_path`) on an event loop (`run`)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from fusionnode.config import default_state_dir
from fusionnode.errors import FusionNodeError


def command(sub: Any, name: str, text: str, description: str) -> argparse.ArgumentParser:
    """A subcommand with its one-line help (in `fusionnode --help`) and its description."""
    return sub.add_parser(name, help=text, description=description)


def json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text (default: text)")


def state_dir_arg(p: argparse.ArgumentParser) -> None:
    from fusionnode.settings import add_config_argument

    add_config_argument(p)
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"the node's identity, cache and control socket (default: {default_state_dir()}; "
        "env FUSIONNODE_STATE_DIR)",
    )


def int_at_least(lo: int) -> Any:
    """An argparse type: an integer >= lo."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value

    parse.__name__ = f"whole number >= {lo}"  # how config errors name it: "expected a whole number >= 1"
    return parse


def _float_bound(lo: float, strict: bool) -> Any:
    op = ">" if strict else ">="

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            value = float("nan")
        if not (value > lo if strict else value >= lo) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a number {op} {lo:g}, got {text!r}")
        return value

    parse.__name__ = f"number {op} {lo:g}"
    return parse


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def float_above(lo: float) -> Any:
    """An argparse type: a finite number > lo."""
    return _float_bound(lo, strict=True)


def float_at_least(lo: float) -> Any:
    """An argparse type: a finite number >= lo."""
    return _float_bound(lo, strict=False)


def compress_arg(text: str) -> str:
    """An argparse type for --compress: checked here, so a bad value never reaches the workers."""
    from fusionnode.compress.policy import parse_compress

    if text == "auto":  # train's default: the driver chooses (train/jobdefaults.py)
        return text
    try:
        parse_compress(text)
    except FusionNodeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


compress_arg.__name__ = "compression setting"  # "expected a compression setting" in config errors


def control_path(args: argparse.Namespace) -> Path:
    return (args.state_dir or default_state_dir()).expanduser().resolve() / "control.sock"


def run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)
