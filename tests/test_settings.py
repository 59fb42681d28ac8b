"""Layered configuration: flag > FUSIONNODE_* env > TOML file > default, and clear errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fusionnode.errors import ConfigError
from fusionnode.settings import (
    add_config_argument,
    effective_config,
    find_config_file,
    format_config,
    layered_defaults,
    show_config,
)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING"])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("join")
    add_config_argument(p)
    p.add_argument("--state-dir", type=Path, default=None)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--listen", action="append", default=None)
    p.add_argument("--role", default="worker,optimizer")
    p.add_argument("--max-memory", default=None)
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--heartbeat", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1)
    p = sub.add_parser("train")
    add_config_argument(p)
    p.add_argument("--state-dir", type=Path, default=None)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--save", dest="save_dir", default=None)
    return parser


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    parser = make_parser()
    layered_defaults(parser, argv, argv[0], env=env or {})
    return parser.parse_args(argv)


def write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "c.toml"
    f.write_text(text)
    return f


def test_precedence_flag_env_file_default(tmp_path):
    f = write(
        tmp_path,
        'max-memory = "8GB"\nheartbeat = 2\nthreads = 3\nrole = "worker"\nsteps = 7\n'
        'log-level = "INFO"\n[join]\nthreads = 4\nno_probe = true\n',
    )
    env = {"FUSIONNODE_HEARTBEAT": "1.5", "FUSIONNODE_THREADS": "6", "FUSIONNODE_UNRELATED": "x"}
    args = parse(["join", "--config", str(f), "--threads", "9"], env)
    assert args.max_memory == "8GB"  # file
    assert args.heartbeat == 1.5  # env over file
    assert args.threads == 9  # flag over env over [join] over top level
    assert args.role == "worker" and args.no_probe is True and args.log_level == "INFO"
    assert args.initial_peers == [] and args.listen is None  # defaults
    src = {k: v["source"] for k, v in effective_config(args)["options"].items()}
    assert src == {
        "state_dir": "default",
        "initial_peers": "default",
        "listen": "default",
        "role": "file",
        "max_memory": "file",
        "no_probe": "file",
        "heartbeat": "env",
        "threads": "flag",
        "log_level": "file",
    }
    # `steps` is a train option: allowed at the top level, ignored by join, used by train
    assert parse(["train", "--config", str(f)], env).steps == 7
    # a command's table wins over the top level
    assert parse(["join", "--config", str(f)]).threads == 4


def test_env_lists_booleans_and_types(tmp_path):
    env = {
        "FUSIONNODE_INITIAL_PEERS": "/ip4/10.0.0.1/tcp/1/p2p/A  /ip4/10.0.0.2/tcp/1/p2p/B",
        "FUSIONNODE_LISTEN": "/ip4/0.0.0.0/tcp/5",
        "FUSIONNODE_NO_PROBE": "yes",
        "FUSIONNODE_MAX_MEMORY": "12GB",
        "FUSIONNODE_STATE_DIR": str(tmp_path / "s"),
    }
    args = parse(["join"], env)
    assert args.initial_peers == ["/ip4/10.0.0.1/tcp/1/p2p/A", "/ip4/10.0.0.2/tcp/1/p2p/B"]
    assert args.listen == ["/ip4/0.0.0.0/tcp/5"] and args.no_probe is True and args.max_memory == "12GB"
    assert args.state_dir == tmp_path / "s"
    # the flag form of a list still replaces the env list
    assert parse(["join", "--initial-peers", "X"], env).initial_peers == ["X"]
    assert parse(["join"], {"FUSIONNODE_NO_PROBE": "0"}).no_probe is False
    # dest spelling works too (--save has dest save_dir)
    assert parse(["train"], {"FUSIONNODE_SAVE_DIR": "/ck"}).save_dir == "/ck"
    assert parse(["train"], {"FUSIONNODE_SAVE": "/ck2"}).save_dir == "/ck2"


@pytest.mark.parametrize(
    ("toml", "env", "match"),
    [
        ("bogus = 1\n", {}, "unknown key 'bogus'"),
        ("[join]\nsteps = 3\n", {}, r"\[join\] has unknown option\(s\) \['steps'\]"),
        ("[nosuchcommand]\nx = 1\n", {}, "unknown key 'nosuchcommand'"),
        ("join = 3\n", {}, r"\[join\] must be a table"),
        ("threads = 'many'\n", {}, "threads: expected an integer"),
        ("threads = 2.5\n", {}, "expected an integer"),
        ("threads = true\n", {}, "got a boolean"),
        ("no-probe = 'yes'\n", {}, "expected true or false"),
        ("initial-peers = 5\n", {}, "expected a list"),
        ("max-memory = [1, 2]\n", {}, "expected a single value"),
        ("log-level = 'LOUD'\n", {}, "not one of DEBUG, INFO, WARNING"),
        ("threads = \n", {}, "not valid TOML"),
        ("", {"FUSIONNODE_NO_PROBE": "maybe"}, "FUSIONNODE_NO_PROBE: expected a boolean"),
        ("", {"FUSIONNODE_HEARTBEAT": "fast"}, "FUSIONNODE_HEARTBEAT: expected a number"),
    ],
)
def test_errors_name_the_key_and_source(tmp_path, toml, env, match):
    f = write(tmp_path, toml)
    with pytest.raises(ConfigError, match=match):
        parse(["join", "--config", str(f)], env)


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse(["join", "--config", str(tmp_path / "nope.toml")])


def test_config_file_lookup(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    assert find_config_file(["join", "--state-dir", str(state)], {}) is None
    (state / "config.toml").write_text("threads = 2\n")
    assert find_config_file(["join", "--state-dir", str(state)], {}) == state / "config.toml"
    assert find_config_file(["join"], {"FUSIONNODE_STATE_DIR": str(state)}) == state / "config.toml"
    other = write(tmp_path, "threads = 5\n")
    assert (
        find_config_file(["join"], {"FUSIONNODE_CONFIG": str(other), "FUSIONNODE_STATE_DIR": str(state)})
        == other
    )
    assert find_config_file([f"--config={other}", "join", "--state-dir", str(state)], {}) == other
    args = parse(["join", "--state-dir", str(state)])
    assert args.threads == 2 and effective_config(args)["file"] == str(state / "config.toml")


def test_format_toml_round_trips(tmp_path):
    import tomllib

    f = write(tmp_path, 'initial-peers = ["a", "b"]\nheartbeat = 2.5\nno-probe = true\n')
    cfg = effective_config(parse(["join", "--config", str(f), "--role", "worker"]))
    text = format_config(cfg)
    back = tomllib.loads(text)
    assert back["initial-peers"] == ["a", "b"] and back["heartbeat"] == 2.5 and back["no-probe"] is True
    assert back["role"] == "worker" and 'role = "worker"  # flag' in text
    assert "# max-memory = (unset)  # default" in text
    assert json.loads(format_config(cfg, as_json=True))["options"]["heartbeat"] == {
        "value": 2.5,
        "source": "file",
    }


def test_real_cli_parser(tmp_path):
    """The project's own parser: every join/train option can come from a file or the environment."""
    from fusionnode.cli import build_parser

    f = write(
        tmp_path, 'max-memory = "4GB"\n[join]\nrole = "optimizer"\nheartbeat = 3.0\n[train]\nsteps = 11\n'
    )
    env = {"FUSIONNODE_CONFIG": str(f), "FUSIONNODE_INITIAL_PEERS": "/ip4/10.77.0.1/tcp/31337/p2p/Q"}
    parser = build_parser()
    layered_defaults(parser, ["join"], "join", env=env)
    args = parser.parse_args(["join", "--heartbeat", "4"])
    assert (args.role, args.heartbeat, args.max_memory) == ("optimizer", 4.0, "4GB")
    assert args.initial_peers == ["/ip4/10.77.0.1/tcp/31337/p2p/Q"]
    text = show_config(build_parser, ["train", "--lr", "0.01"], env=env, as_json=True)
    opts = json.loads(text)["options"]
    assert opts["steps"] == {"value": 11, "source": "file"} and opts["lr"]["source"] == "flag"
    with pytest.raises(ConfigError, match="unknown option"):
        layered_defaults(
            build_parser(),
            ["train"],
            "train",
            env={"FUSIONNODE_CONFIG": str(write(tmp_path, "[train]\nrole = 'x'\n"))},
        )
