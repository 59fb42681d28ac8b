"""Terminal output: rich bars and tables on a terminal, plain lines (no escape codes) in pipes and logs."""

from __future__ import annotations

import argparse
import io
import math

from fusionnode import term
from fusionnode.bench.plan import gpt2_like_graph
from fusionnode.cli.plan import compare_plans
from fusionnode.plan.cluster import load_cluster
from fusionnode.plan.planner import plan
from fusionnode.sync import add_sync_args


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def step(i: int) -> dict:
    return {
        "step": i,
        "loss": 5.0 - i,
        "tokens_per_s": 1234.0,
        "wire_bytes": 3 * 2**20,
        "step_time_s": 0.5,
        "stages": [{"compute_s": 0.25}, {"compute_s": 0.4}],
    }


def test_progress_is_plain_lines_off_a_terminal(monkeypatch):
    out = io.StringIO()
    p = term.Progress(3, out)
    for i in range(3):
        p.update(step(i))
    lines = out.getvalue().splitlines()
    # the first and the last step always, the others every PLAIN_EVERY_S seconds
    assert lines[0] == "step 1/3 loss 5.0000 1234 tok/s wire 3.0 MiB stages busy 50%/80%"
    assert lines[-1].startswith("step 3/3 loss 3.0000") and "\x1b" not in out.getvalue()
    assert len(lines) == 2


def test_progress_on_a_terminal_draws_a_bar_with_eta():
    out = Tty()
    p = term.Progress(4, out)
    p.print("  stage 0: on peer 12D3…")
    p.update(step(0))
    p.update(step(1))
    p.close()
    text = out.getvalue()
    assert "\x1b[" in text and "ETA" in text and "2/4" in text and "loss 4.0000" in text
    assert "stage 0: on peer" in text


def test_tables_plain_and_rich():
    rows = [("a", 1, "x"), ("bbbb", 22, None)]
    assert term.format_table(("name", "n", "z"), rows, right=(1,)).splitlines() == [
        "name   n  z",
        "a      1  x",
        "bbbb  22",
    ]
    plain = io.StringIO()
    term.table(("name", "n", "z"), rows, title="t", right=(1,), stream=plain)
    assert plain.getvalue() == "t\nname   n  z\na      1  x\nbbbb  22\n"
    rich = Tty()
    term.table(("name", "n", "z"), rows, title="t", right=(1,), stream=rich)
    assert "\x1b[" in rich.getvalue() and "bbbb" in rich.getvalue()


def test_status_view_lists_the_peer_its_peers_and_jobs():
    peer = {
        "peer_id": "12D3KooWAbcdefGHijkLmnop",
        "device": {"kind": "cpu", "name": "EPYC", "memory_total_bytes": 2**34, "tflops_fp32": 0.4},
        "links": {"12D3KooWOther1": {"bandwidth_bps": 8e6}, "12D3KooWGone99": {"bandwidth_bps": 1e6}},
        "roles": ["worker"],
        "availability": "available",
    }
    res = {
        "peer_id": peer["peer_id"],
        "maddrs": ["/ip4/127.0.0.1/tcp/1"],
        "uptime_s": 12.0,
        "roles": ["worker"],
        "device": peer["device"],
        "availability": {"availability": "paused", "reason": "manual"},
        "peers": [peer, {**peer, "peer_id": "12D3KooWOther1", "links": {}}],
        "serving": [{"job": "j1", "stage": 1, "num_stages": 3, "last_step": 7}],
        "jobs": [
            {"job": "j1", "model": "gpt2-tiny", "state": "running", "step": 8, "steps": 10, "loss": math.pi}
            | {"tokens_per_s": 99.4, "plan_version": 2, "stages": [{}, {}, {}]}
        ],
    }
    out = io.StringIO()
    term.print_status(res, out)
    text = out.getvalue()
    assert "state    paused (manual)" in text and "*…ijkLmnop" in text and "…oWOther1:8Mb/s" in text
    assert "Gone99" not in text  # links to departed peers are not listed
    assert "2 peer(s), public (no --swarm-key)" in text
    assert (
        "j1   v1    1/3" in text
        and "j1   gpt2-tiny  running  8/10  3.1416" in text
        and "v2, 3 stages" in text
    )


def test_plan_and_simulate_tables():
    graph = gpt2_like_graph(6, 128, 64, name="gpt2-mini")
    cluster = load_cluster("testbed-4-mixed")
    out = io.StringIO()
    term.print_plan(plan(graph, cluster, 16), out)
    text = out.getvalue()
    assert "pipeline 0:" in text and "stage  devices" in text and "optimizer hosts:" in text
    parser = argparse.ArgumentParser()
    add_sync_args(parser)  # the simulate command's --sync options, at their defaults
    args = parser.parse_args([])
    args.__dict__.update(
        micro_batches=None,
        seq_len=None,
        offload="auto",
        batch_size=16,
        steps=10,
        compress="none",
        plan_file=None,
    )
    out = io.StringIO()
    term.print_simulation(compare_plans(graph, cluster, args), 10, out)
    lines = out.getvalue().splitlines()
    assert lines[1].split() == [
        "placement",
        "tokens/s",
        "(closed)",
        "tokens/s",
        "(sim)",
        "DT-FM",
        "model",
        "s",
        "10",
        "steps",
        "(sim)",
        "plan",
        "x",
    ]
    assert [ln.split()[0] for ln in lines[2:7]] == ["plan", "grid", "dtfm", "even", "memory"]
    assert "\x1b" not in out.getvalue()
