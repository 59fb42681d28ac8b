"""The planner's price of a round sync mode (plan/syncprice.py): the replicas' sync amortised over
H steps, in the closed form, the simulator, the search, and the `plan`/`simulate` commands."""

from __future__ import annotations

import json

import pytest

from fusionnode import cli
from fusionnode.errors import ConfigError
from fusionnode.graph.trace import graph_for
from fusionnode.plan.cluster import load_cluster
from fusionnode.plan.estimator import Estimator
from fusionnode.plan.evaluate import evaluate_plan
from fusionnode.plan.planner import plan
from fusionnode.plan.simulator import simulate
from fusionnode.plan.syncprice import EVERY_STEP, SyncPrice, amortised_sync_s
from fusionnode.sync import SyncConfig

GRAPH = graph_for("gpt2-tiny", 128)
HOME = load_cluster("home-volunteers-4")


def test_price_checks_and_amortises() -> None:
    price = SyncPrice("diloco", inner_steps=10, wire_ratio=0.25)
    assert price.round_bytes(4e6) == 1e6
    assert price.per_step(2.0) == pytest.approx(0.2)
    assert amortised_sync_s(2.0, price) == pytest.approx(0.2)
    assert amortised_sync_s(2.0, None) == amortised_sync_s(2.0, EVERY_STEP) == 2.0
    assert SyncPrice.from_dict(price.to_dict()) == price
    for bad in (
        {"mode": "lazy"},
        {"mode": "diloco", "inner_steps": 0},
        {"mode": "diloco", "wire_ratio": 0.0},
        {"mode": "step", "inner_steps": 4},
    ):
        with pytest.raises(ConfigError):
            SyncPrice(**bad)


def test_wire_ratio_of_the_codecs() -> None:
    assert SyncConfig("diloco", inner_steps=5, codec="raw").wire_ratio == 1.0
    assert SyncConfig("diloco", inner_steps=5, codec="q8").wire_ratio == 0.25
    # 16 of each 256: 8 bytes of scales, 16 u8 positions, 16 2-bit values -> 28 bytes of 1024
    sparse = SyncConfig("sparseloco", inner_steps=10, topk_density=1 / 16, chunk=256)
    assert sparse.wire_ratio == pytest.approx(28 / 1024)
    assert sparse.price() == {"mode": "sparseloco", "inner_steps": 10, "wire_ratio": pytest.approx(28 / 1024)}
    assert SyncConfig().price() == EVERY_STEP.to_dict()


def test_a_round_costs_its_exchange_over_h_in_the_estimator_and_the_simulator() -> None:
    p = plan(GRAPH, HOME, 16, seq_len=128, compress=False)
    hosts = [(HOME.index(h.device), h.share) for h in p.optimizer_hosts]
    every = Estimator(HOME)
    rounds = Estimator(HOME, sync=SyncPrice("diloco", inner_steps=10, wire_ratio=0.25))
    device = next(i for i in range(HOME.size) if all(i != h for h, _ in hosts))
    t_step = every.stage_sync_time(device, 4e6, hosts, True)
    assert t_step > 0
    links = [every.link(device, h) for h, share in hosts if share > 0]
    assert t_step == pytest.approx(
        sum(2 * (lat + 4e6 * s * 8 / bw) for (bw, lat), (_, s) in zip(links, hosts, strict=True))
    )
    # a round: a quarter of the bytes (latency unchanged), once per 10 steps
    expected = sum(2 * (lat + 1e6 * s * 8 / bw) for (bw, lat), (_, s) in zip(links, hosts, strict=True)) / 10
    assert rounds.stage_sync_time(device, 4e6, hosts, True) == pytest.approx(expected)
    assert rounds.host_bound(4e6, hosts, 2) == pytest.approx(every.host_bound(4e6, hosts, 2) * 0.25 / 10)
    # the same plan: the sync's share of the step shrinks, the compute does not move
    sim_every = simulate(GRAPH, HOME, p)
    sim_rounds = simulate(GRAPH, HOME, p, sync=SyncPrice("diloco", inner_steps=10, wire_ratio=0.25))
    assert sim_rounds.pipeline_finish_s == sim_every.pipeline_finish_s
    assert sim_rounds.step_time_s <= sim_every.step_time_s
    assert evaluate_plan(GRAPH, HOME, p, sync=SyncPrice("diloco", 10, 0.25)) <= evaluate_plan(GRAPH, HOME, p)


def test_the_planner_puts_replicas_across_slow_links_when_the_sync_is_amortised() -> None:
    every = plan(GRAPH, HOME, 16, seq_len=128, compress=False)
    sparse = SyncPrice("sparseloco", inner_steps=10, wire_ratio=28 / 1024)
    rounds = plan(GRAPH, HOME, 16, seq_len=128, compress=False, sync=sparse)
    # every step: the parameters cross a 10-30 Mbit/s link each step, so the planner avoids replicas
    assert len(rounds.pipelines) > len(every.pipelines)
    assert rounds.prediction.step_time_s < every.prediction.step_time_s
    # its prediction covers the sync: the simulator, given the same sync, agrees with it
    sim = simulate(GRAPH, HOME, rounds, sync=sparse).step_time_s
    assert sim == pytest.approx(rounds.prediction.step_time_s, rel=0.2)


def test_plan_and_simulate_commands_take_the_sync_mode(capsys) -> None:
    base = [
        "--cluster",
        "home-volunteers-4",
        "--model",
        "gpt2-tiny",
        "--batch-size",
        "16",
        "--seq-len",
        "128",
    ]
    sync = ["--sync", "sparseloco", "--inner-steps", "10", "--topk-density", "0.0625", "--topk-chunk", "256"]
    assert cli.main(["plan", *base, "--compress", "none", *sync]) == 0
    out = capsys.readouterr().out
    assert "sync sparseloco: a round of H = 10 steps takes" in out
    assert cli.main(["simulate", *base, "--compress", "none", "--json", *sync]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sync"]["mode"] == "sparseloco" and doc["sync"]["inner_steps"] == 10
    assert doc["sync"]["round_s"] == pytest.approx(10 * doc["plan"]["sim_step_s"])
    # bad input: exit 2 naming the option
    assert cli.main(["plan", *base, "--sync", "diloco", "--inner-steps", "0"]) == 2
    assert "--inner-steps 0" in capsys.readouterr().err
    assert cli.main(["plan", *base, "--sync", "diloco", "--offload", "off"]) == 2
    assert "--offload" in capsys.readouterr().err


def test_a_round_mode_plan_is_chosen_by_the_simulator_not_dtfm_s_every_step_all_reduce() -> None:
    """Above SMALL_CLUSTER workers the planner's final choice weighs DT-FM's cost model, which
    all-reduces float32 gradients every step. Under --sync sparseloco that model would hold the plan
    back from the data-parallel layouts the round mode makes cheap (here it chose 2 pipelines of 4,
    1.6x slower under the sync-aware simulator than one replica per device): the simulator alone
    chooses, so the plan is at least as fast as every even grid under the round's price."""
    from fusionnode.bench.plan import gpt2_like_graph
    from fusionnode.plan import fence, grid
    from fusionnode.plan.anchors import sim_of
    from fusionnode.plan.cluster import load_cluster_dict
    from fusionnode.plan.evaluate import make_context

    devs = [{"id": f"d{i}", "tflops": 10, "memory_gb": 4, "site": "a" if i % 2 else "b"} for i in range(16)]
    c = load_cluster_dict(
        {
            "name": "two",
            "devices": devs,
            "links": {
                "intra_site": {"bandwidth_gbps": 10, "latency_ms": 1},
                "inter_site": {"bandwidth_gbps": 0.05, "latency_ms": 50},
            },
        }
    )
    g = gpt2_like_graph(24, 512, 64)
    price = SyncPrice("sparseloco", inner_steps=10, wire_ratio=28 / 1024)
    p = plan(g, c, 64, compress=False, sync=price)
    mine = simulate(g, c, p, sync=price).step_time_s
    ctx = make_context(g, c, 64, None, True, None, None, fence.MAX_BLOCKS, False, sync=price)
    best_grid = min(sim_of(g, ctx, ev) for ev in grid.even_grids(ctx))
    assert mine <= best_grid * (1 + 1e-9), (mine, best_grid, [len(pl.stages) for pl in p.pipelines])
