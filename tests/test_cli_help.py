"""Every command and option of `fusionnode` explains itself: a description per command, help text
per option, and the default wherever an option has one; the bench commands name themselves."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from fusionnode import cli, settings

_NO_DEFAULT = (None, False, [], argparse.SUPPRESS)


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def undocumented(p: argparse.ArgumentParser) -> list[str]:
    """The parser's options without help, or with a default their help does not state."""
    bad = []
    for a in p._actions:
        if isinstance(a, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
            continue
        if a.help == argparse.SUPPRESS:
            continue
        name = "/".join(a.option_strings) or a.dest
        if not (a.help or "").strip():
            bad.append(f"{p.prog} {name}: no help text")
        elif a.default not in _NO_DEFAULT and a.option_strings and "default" not in a.help.lower():
            bad.append(f"{p.prog} {name}: default {a.default!r} not stated in its help")
    return bad


def bench_parser(name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The benchmark's own parser, captured when its main() parses (before any work starts)."""

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    mod = importlib.import_module(cli.BENCHMARKS[name])
    with pytest.raises(_Captured) as info:
        mod.main([])
    monkeypatch.undo()
    return info.value.parser


def test_every_command_has_a_description_and_every_option_help_with_its_default():
    parser = cli.build_parser()
    problems = undocumented(parser)
    for name, sub in settings.subparsers(parser).items():
        if not (sub.description or "").strip():
            problems.append(f"fusionnode {name}: no description")
        problems += undocumented(sub)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_every_benchmark_option_is_documented(name, monkeypatch):
    p = bench_parser(name, monkeypatch)
    assert p.prog == f"fusionnode bench {name}"
    assert (p.description or "").strip(), f"{p.prog}: no description"
    assert not undocumented(p), "\n".join(undocumented(p))


def test_the_walker_catches_an_undocumented_option():
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--a", type=int, default=3, help="a count")
    p.add_argument("--b")
    assert undocumented(p) == ["x --a: default 3 not stated in its help", "x --b: no help text"]


def test_help_of_demo_config_show_and_bench_plan(capsys):
    out = subprocess.run(
        [sys.executable, "-m", "fusionnode", "config", "show", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.startswith("usage: fusionnode config"), out.stderr
    for argv, usage in (
        (["demo", "--help"], "fusionnode demo"),
        (["bench", "plan", "--help"], "fusionnode bench plan"),
    ):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: {usage}")
        assert "default None" not in text
        if argv[0] == "demo":
            assert "optimizer steps (default 300)" in " ".join(text.split())


def test_what_a_new_user_read_wrong_in_the_help_and_config_show():
    subs = settings.subparsers(cli.build_parser())
    join_help = subs["join"].format_help()
    assert "12D3" not in join_help and "/p2p/Qm..." in join_help  # peer ids here start "Qm"
    assert "another port" in " ".join(join_help.split())  # --listen says what a second daemon needs
    helps = {a.dest: a.help % vars(a) for a in subs["plan"]._actions if a.help}
    assert "geo-48" in helps["cluster"] and "two-universities" in helps["cluster"]  # the bundled clusters
    assert "(default 512, a capacity-planning batch; `train` defaults to 16)" in helps["batch_size"]
    shown = settings.show_config(cli.build_parser, ["join"], env={})
    assert "# max-memory = (what is free)" in shown and "# listen = (/ip4/0.0.0.0/tcp/31337)" in shown
    assert "(unset)" not in shown.replace("# config file", "")
