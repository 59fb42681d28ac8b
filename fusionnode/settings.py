"""Layered configuration: command-line flags win over environment variables, which win over a
TOML file, which wins over the built-in defaults.

The file (``--config FILE``; else ``$FUSIONNODE_CONFIG``; else ``<state dir>/config.toml`` when it
exists) holds option names as keys, spelled like the long flag or its destination
(``max-memory`` or ``max_memory``). Top-level keys apply to every command that has the option;
a table named after a command applies to that command only and wins over the top level::

    initial-peers = ["/ip4/10.0.0.1/tcp/31337/p2p/Qm..."]
    max-memory = "12GB"
    [join]
    role = "worker"
    no-probe = true
    [train]
    steps = 500

Environment variables are ``FUSIONNODE_<NAME>`` with the name upper-cased and dashes as
underscores: ``FUSIONNODE_MAX_MEMORY=12GB``, ``FUSIONNODE_INITIAL_PEERS="maddr1 maddr2"`` (lists are
split on whitespace), ``FUSIONNODE_NO_PROBE=1``.

``layered_defaults`` turns file and environment into argparse defaults of the command's parser,
so anything given on the command line still wins; values are converted and checked the way
argparse would (type, choices, lists, booleans) and a bad or unknown key raises ``ConfigError``
naming the key and where it came from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusionnode.config import ENV_STATE_DIR, default_state_dir
from fusionnode.errors import ConfigError

ENV_PREFIX = "FUSIONNODE_"
ENV_CONFIG = "FUSIONNODE_CONFIG"  # path of the config file, when --config is not given
CONFIG_FILE_NAME = "config.toml"  # looked for in the state directory
MAX_CONFIG_BYTES = 1 << 20  # 1 MiB: a config file larger than this is refused before parsing
SOURCES_ATTR = "config_sources"  # namespace attribute: dest -> (source, value) of the layered defaults
FILE_ATTR = "config_file"  # namespace attribute: the config file used, or None
_SKIP_DESTS = {"help", "version", "config", SOURCES_ATTR, FILE_ATTR}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def add_config_argument(p: argparse.ArgumentParser) -> None:
    """The ``--config FILE`` flag; add it to every subcommand whose options may come from the file."""
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help=f"TOML file of option values (default: ${ENV_CONFIG}, else <state dir>/{CONFIG_FILE_NAME} "
        "if present); flags win over FUSIONNODE_* environment variables, which win over the file",
    )


def read_toml(path: Path) -> dict[str, Any]:
    import tomllib

    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes")
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def find_config_file(argv: list[str], env: dict[str, str] | None = None) -> Path | None:
    """--config from argv, else $FUSIONNODE_CONFIG, else <state dir>/config.toml when it exists."""
    env = os.environ if env is None else env
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--state-dir", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        return Path(known.config).expanduser()
    if env.get(ENV_CONFIG):
        return Path(env[ENV_CONFIG]).expanduser()
    if known.state_dir:
        state_dir = Path(known.state_dir).expanduser()
    elif env.get(ENV_STATE_DIR):
        state_dir = Path(env[ENV_STATE_DIR]).expanduser()
    else:
        state_dir = default_state_dir()
    candidate = state_dir / CONFIG_FILE_NAME
    return candidate if candidate.is_file() else None


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every name a key may use (dest and long flags, dashes as underscores) -> the optional action."""
    out: dict[str, argparse.Action] = {}
    for a in p._actions:
        if not a.option_strings or a.dest in _SKIP_DESTS or a.help == argparse.SUPPRESS:
            continue
        if isinstance(a, argparse._SubParsersAction | argparse._HelpAction | argparse._VersionAction):
            continue
        out[a.dest] = a
        for opt in a.option_strings:
            if opt.startswith("--"):
                out[opt[2:].replace("-", "_")] = a
    return out


def _convert(action: argparse.Action, raw: Any, where: str, *, from_env: bool) -> Any:
    """The value argparse would have produced for `raw` (a TOML value, or an env string)."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if from_env:
            text = str(raw).strip().lower()
            if text not in _TRUE | _FALSE:
                raise ConfigError(f"{where}: expected a boolean (1/0, true/false, yes/no), got {raw!r}")
            flag = text in _TRUE
        elif isinstance(raw, bool):
            flag = raw
        else:
            raise ConfigError(f"{where}: expected true or false, got {raw!r}")
        return flag if isinstance(action, argparse._StoreTrueAction) else not flag
    if not isinstance(action, argparse._StoreAction | argparse._AppendAction):
        raise ConfigError(f"{where}: this option cannot be set from a file or the environment")
    is_list = (
        isinstance(action, argparse._AppendAction)
        or action.nargs in ("*", "+")
        or isinstance(action.nargs, int)
    )
    if is_list:
        if from_env or isinstance(raw, str):
            items: list[Any] = str(raw).split()
        elif isinstance(raw, list):
            items = raw
        else:
            raise ConfigError(f"{where}: expected a list, got {raw!r}")
        if action.nargs == "+" and not items:
            raise ConfigError(f"{where}: expected at least one value")
        if isinstance(action.nargs, int) and len(items) != action.nargs:
            raise ConfigError(f"{where}: expected {action.nargs} values, got {len(items)}")
        return [_scalar(action, v, f"{where}[{i}]", from_env=from_env) for i, v in enumerate(items)]
    return _scalar(action, raw, where, from_env=from_env)


def _scalar(action: argparse.Action, raw: Any, where: str, *, from_env: bool) -> Any:
    if isinstance(raw, dict | list):
        raise ConfigError(f"{where}: expected a single value, got {type(raw).__name__}")
    if isinstance(raw, bool) and not from_env:
        raise ConfigError(f"{where}: expected {_type_name(action)}, got a boolean")
    typ = action.type
    try:
        if typ is None:
            if not isinstance(raw, str | int | float):
                raise ConfigError(f"{where}: expected a string, got {raw!r}")
            value: Any = str(raw)
        elif typ is int and isinstance(raw, float) and not from_env:
            raise ConfigError(f"{where}: expected an integer, got {raw!r}")
        else:
            value = typ(raw)
    except ConfigError:
        raise
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{where}: expected {_type_name(action)}, got {raw!r} ({exc})") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def _type_name(action: argparse.Action) -> str:
    return {int: "an integer", float: "a number", None: "a string"}.get(
        action.type, "a " + getattr(action.type, "__name__", "value")
    )


def _layer(
    parser: argparse.ArgumentParser, file_values: dict[str, Any], file_where: str, env: dict[str, str]
) -> dict[str, tuple[str, Any]]:
    """dest -> (source, converted value) for one parser; checks nothing about other parsers."""
    opts = _options(parser)
    chosen: dict[str, tuple[str, Any]] = {}
    for key, raw in file_values.items():
        action = opts[key.replace("-", "_")]
        chosen[action.dest] = ("file", _convert(action, raw, f"{file_where}: {key}", from_env=False))
    for name, action in opts.items():
        var = ENV_PREFIX + name.upper()
        if var in env:
            chosen[action.dest] = ("env", _convert(action, env[var], f"environment {var}", from_env=True))
    return chosen


def layered_defaults(
    parser: argparse.ArgumentParser, argv: list[str] | None, command: str, env: dict[str, str] | None = None
) -> None:
    """Sets the defaults of `parser` (the top-level parser) and of its `command` subparser from the
    config file and FUSIONNODE_* variables; flags parsed afterwards still win. Records the source of
    every value for `effective_config`. Raises ConfigError on an unknown key or a bad value."""
    env = dict(os.environ if env is None else env)
    argv = list(argv if argv is not None else [])
    subs = subparsers(parser)
    if command not in subs:
        raise ConfigError(f"unknown command {command!r}")
    sub = subs[command]
    path = find_config_file(argv, env)
    data = read_toml(path) if path is not None else {}
    where = str(path)
    known_anywhere = {name for p in [parser, *subs.values()] for name in _options(p)}
    top: dict[str, Any] = {}
    section: dict[str, Any] = {}
    for key, value in data.items():
        if key in subs:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: [{key}] must be a table of options")
            if key == command:
                unknown = sorted(k for k in value if k.replace("-", "_") not in _options(sub))
                if unknown:
                    raise ConfigError(
                        f"{where}: [{key}] has unknown option(s) {unknown}; "
                        f"known: {sorted(_public_names(sub))}"
                    )
                section = value
            continue
        if key.replace("-", "_") not in known_anywhere:
            raise ConfigError(
                f"{where}: unknown key {key!r} (not an option of any command; tables must be "
                f"named after a command: {', '.join(sorted(subs))})"
            )
        top[key] = value
    top_opts, sub_opts = _options(parser), _options(sub)
    for_top = {k: v for k, v in top.items() if k.replace("-", "_") in top_opts}
    for_sub = {k: v for k, v in top.items() if k.replace("-", "_") in sub_opts}
    for k, v in section.items():  # a command's table wins over the top level for the same option
        dest = sub_opts[k.replace("-", "_")].dest
        for_sub = {kk: vv for kk, vv in for_sub.items() if sub_opts[kk.replace("-", "_")].dest != dest}
        for_sub[k] = v
    top_layer = _layer(parser, for_top, where, env) if parser is not sub else {}
    sub_layer = _layer(sub, for_sub, where, env)
    parser.set_defaults(**{dest: v for dest, (_, v) in top_layer.items()})
    sub.set_defaults(**{dest: v for dest, (_, v) in sub_layer.items()})
    sources: dict[str, tuple[str, Any]] = {}
    for p, layer in ((parser, top_layer), (sub, sub_layer)):
        for a in p._actions:
            if (
                a.option_strings
                and a.dest not in _SKIP_DESTS
                and a.help != argparse.SUPPRESS
                and a.dest != "command"
            ):
                if isinstance(a, argparse._HelpAction | argparse._VersionAction):
                    continue
                sources[a.dest] = layer.get(a.dest, ("default", p.get_default(a.dest)))
    sub.set_defaults(**{SOURCES_ATTR: sources, FILE_ATTR: str(path) if path is not None else None})


def _public_names(p: argparse.ArgumentParser) -> set[str]:
    return {opt[2:] for a in _options(p).values() for opt in a.option_strings if opt.startswith("--")}


def effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """{"file": path or None, "options": {dest: {"value", "source"}}} with source one of
    flag / env / file / default, for a namespace parsed after `layered_defaults`."""
    sources: dict[str, tuple[str, Any]] = getattr(args, SOURCES_ATTR, None) or {}
    options: dict[str, dict[str, Any]] = {}
    for dest, (source, layered) in sorted(sources.items()):
        value = getattr(args, dest, layered)
        if not _same(value, layered):
            source = "flag"
        options[dest] = {"value": _plain(value), "source": source}
    return {"file": getattr(args, FILE_ATTR, None), "options": options}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and not isinstance(b, str) and b is not None:
        return False
    return a == b or (isinstance(a, str | Path) and isinstance(b, str | Path) and str(a) == str(b))


def _plain(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v


_DEFAULT_IN_HELP = re.compile(r"[(;]\s*default:?\s*([^;)]*)")


def described_defaults(p: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> what the option's help says its default is, for options whose parsed default is None
    (it is derived at run time: "what is free", "the model's context", ...)."""
    out = {}
    for a in p._actions:
        if a.default is None and a.help and a.help != argparse.SUPPRESS:
            m = _DEFAULT_IN_HELP.search(a.help)
            if m and m.group(1).strip():
                out[a.dest] = m.group(1).strip()
    return out


def format_config(
    cfg: dict[str, Any], *, as_json: bool = False, described: dict[str, str] | None = None
) -> str:
    """TOML (with the source of each value as a comment) or JSON; options whose value is None are
    listed as comments in TOML, which has no null, with what `described` (see `described_defaults`)
    says the default is."""
    described = described or {}
    if as_json:
        return json.dumps(cfg, indent=2)
    lines = [
        f"# config file: {cfg['file'] or 'none'}",
        "# precedence: flag > env (FUSIONNODE_*) > file > default",
    ]
    for dest, item in cfg["options"].items():
        key = dest.replace("_", "-")
        if item["value"] is None:
            what = described.get(dest, "unset")
            lines.append(f"# {key} = ({what})  # {item['source']}")
        else:
            lines.append(f"{key} = {_toml_value(item['value'])}  # {item['source']}")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def show_config(
    build_parser: Callable[[], argparse.ArgumentParser],
    argv: list[str],
    *,
    as_json: bool = False,
    env: dict[str, str] | None = None,
) -> str:
    """`fusionnode config show COMMAND [FLAGS...]`: what COMMAND would run with, and where each value
    came from. `argv` starts with the command name."""
    if not argv:
        raise ConfigError("name a command, e.g. `fusionnode config show join`")
    parser = build_parser()
    layered_defaults(parser, argv, argv[0], env=env)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        raise ConfigError(f"cannot parse {' '.join(argv)!r} (see the message above)") from exc
    sub = subparsers(parser)[argv[0]]
    described = {**described_defaults(parser), **described_defaults(sub)}
    return format_config(effective_config(args), as_json=as_json, described=described)
