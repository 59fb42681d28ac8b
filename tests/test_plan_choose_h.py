"""H chosen for a communication budget (plan/choose_h.py, `--sync-budget`): the search on a synthetic
cost, the real planner and simulator, the `plan`/`simulate`/`train` commands and their refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fusionnode import cli
from fusionnode.errors import ConfigError
from fusionnode.graph.trace import graph_for
from fusionnode.messages import format_plan
from fusionnode.plan.choose_h import (
    H_MAX,
    choose_inner_steps,
    plan_for_sync,
    smallest_fitting,
    sync_share,
)
from fusionnode.plan.cluster import load_cluster
from fusionnode.plan.planner import plan
from fusionnode.plan.simulator import simulate
from fusionnode.plan.syncprice import SyncPrice
from fusionnode.sync import DEFAULT_SYNC_BUDGET, SyncConfig

GRAPH = graph_for("gpt2-tiny", 128)
HOME = load_cluster("home-volunteers-4")


def sim(compute_s: float, exchange_s: float, h: int) -> SimpleNamespace:
    """A simulated step (plan/simulator.SimResult's fields the search reads): the exchange of a
    round over H steps after the compute."""
    return SimpleNamespace(
        step_time_s=compute_s + exchange_s / h,
        pipeline_finish_s=(compute_s,),
        sync_finish_s=(compute_s + exchange_s / h,),
    )


def test_the_smallest_h_of_one_plan_is_exact() -> None:
    # share(H) = (8.1/H) / (1 + 8.1/H) = 8.1 / (H + 8.1) <= 0.1  <=>  H >= 72.9
    measure = lambda h: sync_share(sim(1.0, 8.1, h), h)  # noqa: E731
    h, at, fits = smallest_fitting(measure, 0.1, 1)
    assert (h, fits) == (73, True)
    assert at.share <= 0.1 < measure(72).share
    assert at.sync_s == pytest.approx(8.1 / 73) and at.round_s == pytest.approx(73 + 8.1)
    assert smallest_fitting(measure, 0.9, 1)[0] == 1  # within budget every step
    h, at, fits = smallest_fitting(lambda h: sync_share(sim(1.0, 1e4, h), h), 0.1, 1)
    assert (h, fits) == (H_MAX, False) and at.share > 0.1


# layouts as the planner might choose them: (compute s, a round's exchange s); the share of the
# step the amortised exchange takes is exchange / (compute H + exchange)
ONE = (1.0, 2.1)  # one pipeline: within 10% from H = 19 (2.1 / (H + 2.1) <= 0.1)
MANY = (0.5, 4.1)  # replicas across slow links: faster steps, more sync: from H = 74
CHEAP = (0.5, 0.1)  # a layout whose sync hides behind compute: from H = 2


def search(below: tuple[float, float], above: tuple[float, float], switch: int):
    """The planner picks `below` under rounds shorter than `switch` steps, else `above`."""
    layouts = {"below": below, "above": above}
    return choose_inner_steps(
        lambda h: "below" if h < switch else "above", lambda p, h: sim(*layouts[p], h), 0.1
    )


def test_the_search_follows_the_planner_to_a_plan_within_budget_at_its_own_h() -> None:
    c = search(ONE, MANY, switch=30)  # at H = 19 the planner still picks ONE, within budget: done
    assert (c.inner_steps, c.plan, c.tried, c.fits) == (19, "below", (1, 19), True)
    c = search(ONE, MANY, switch=10)  # at 19 the planner picks MANY, over budget there: on to 74
    assert (c.inner_steps, c.plan, c.tried, c.fits) == (74, "above", (1, 19, 74), True)
    assert c.at.share <= 0.1 and "the smallest H within the budget of 10%" in c.line()
    # the plan where the search stops keeps within budget below that H: H comes down to its smallest
    c = search(ONE, CHEAP, switch=10)
    assert (c.inner_steps, c.plan, c.tried) == (2, "above", (1, 19))


def test_an_unreachable_budget_ends_at_h_max_and_says_so() -> None:
    choice = choose_inner_steps(lambda h: "B", lambda p, h: sim(0.5, 1e5, h), 0.1)
    assert choice.inner_steps == H_MAX and not choice.fits
    assert "still over the budget" in choice.line()


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), float("inf"), True, "0.1"])
def test_a_budget_outside_0_1_is_refused(bad) -> None:
    with pytest.raises(ConfigError, match="--sync-budget"):
        choose_inner_steps(lambda h: None, lambda p, h: sim(1, 1, h), bad)
    with pytest.raises(ConfigError, match="--sync-budget"):
        SyncConfig("diloco", budget=bad)


def test_the_real_planner_gets_an_h_that_keeps_its_plan_within_budget() -> None:
    cfg = SyncConfig("diloco", codec="q8", budget=0.02)

    def plan_with(price: SyncPrice):
        return plan(GRAPH, HOME, 16, seq_len=128, compress=False, sync=price)

    def simulate_with(p, price: SyncPrice):
        return simulate(GRAPH, HOME, p, sync=price)

    p, price, fixed, choice = plan_for_sync(cfg, plan_with, simulate_with)
    h = choice.inner_steps
    assert choice.fits and 1 < h <= H_MAX
    assert price == SyncPrice("diloco", h, 0.25)
    assert fixed == SyncConfig("diloco", codec="q8", inner_steps=h)  # the job's H from now on
    share = sync_share(simulate_with(p, price), h)
    assert share.share <= 0.02 < sync_share(simulate_with(p, SyncPrice("diloco", h - 1, 0.25)), h - 1).share
    assert choice.at == share
    # the budget bought replicas across the slow links: more than the every-step plan has
    assert len(p.pipelines) > len(plan(GRAPH, HOME, 16, seq_len=128, compress=False).pipelines)
    # a tighter budget needs longer rounds; a given H is taken as it is
    loose = plan_for_sync(SyncConfig("diloco", codec="q8", budget=0.2), plan_with, simulate_with)[3]
    assert loose.inner_steps < h
    _, price, same, none = plan_for_sync(SyncConfig("diloco", inner_steps=7), plan_with, simulate_with)
    assert none is None and price.inner_steps == 7 and same.inner_steps == 7


BASE = ["--cluster", "home-volunteers-4", "--model", "gpt2-tiny", "--batch-size", "16", "--seq-len", "128"]


def test_plan_and_simulate_choose_h_without_inner_steps(capsys) -> None:
    sync = ["--sync", "diloco", "--sync-codec", "q8", "--compress", "none"]
    assert cli.main(["simulate", *BASE, *sync, "--sync-budget", "0.05", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    chosen = doc["sync"]["chosen"]
    assert chosen["budget"] == 0.05 and chosen["fits"] and chosen["share"] <= 0.05
    assert doc["sync"]["inner_steps"] == chosen["inner_steps"] > 1
    assert doc["sync"]["round_s"] == pytest.approx(chosen["inner_steps"] * doc["plan"]["sim_step_s"])
    assert cli.main(["plan", *BASE, *sync, "--sync-budget", "0.05"]) == 0
    out = capsys.readouterr().out
    assert f"H = {chosen['inner_steps']} chosen for --sync-budget 0.05" in out
    assert f"a round of H = {chosen['inner_steps']} steps takes" in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--sync", "diloco", "--sync-budget", "0"], "--sync-budget 0.0: must lie in (0, 1]"),
        (["--sync", "diloco", "--sync-budget", "1.5"], "--sync-budget 1.5: must lie in (0, 1]"),
        (["--sync", "diloco", "--sync-budget", "-1"], "--sync-budget -1.0: must lie in (0, 1]"),
        (["--sync", "diloco", "--sync-budget", "nan"], "--sync-budget nan: must be a number"),
        (["--sync", "step", "--sync-budget", "0.1"], "--sync-budget: --sync step"),
        (["--sync", "diloco", "--sync-budget", "0.1", "--inner-steps", "5"], "give one"),
    ],
)
def test_bad_budgets_exit_2_naming_the_option(tmp_path, capsys, args, says) -> None:
    for command in ("plan", "simulate"):
        assert cli.main([command, *BASE, *args]) == 2
        assert says in capsys.readouterr().err
    state = tmp_path / "state"
    with pytest.raises(SystemExit) as info:  # a swarm job: refused before the daemon is asked
        cli.main(["train", "--state-dir", str(state), "--planner", "fusion", *args])
    assert info.value.code == 2
    assert says in capsys.readouterr().err.strip().splitlines()[-1]
    assert not state.exists()


@pytest.mark.parametrize("where", [["--local", "--replicas", "2"], ["--replicas", "2"]])
def test_a_budget_needs_the_planner_that_prices_the_sync(tmp_path, capsys, where) -> None:
    """`train --local` and `--planner simple` do not price the sync: they run H = 15 unless given,
    and refuse a budget (exit 2, nothing started)."""
    state = tmp_path / "state"
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--state-dir", str(state), *where, "--sync", "sparseloco", "--sync-budget", "0.1"])
    assert info.value.code == 2
    assert "--sync-budget: only the planner prices the sync" in capsys.readouterr().err
    assert not state.exists()


def test_train_sync_settings_carry_the_budget_only_where_the_planner_chooses() -> None:
    from fusionnode.sync import sync_from_args

    def args(**kw):
        base = dict(
            sync="diloco",
            inner_steps=None,
            outer_lr=None,
            outer_momentum=0.9,
            sync_codec=None,
            topk_density=1 / 64,
            topk_chunk=4096,
            ef_decay=0.95,
            planner="fusion",
            sync_budget=None,
        )
        return SimpleNamespace(**{**base, **kw})

    assert sync_from_args(args()).budget == DEFAULT_SYNC_BUDGET
    assert sync_from_args(args(sync_budget=0.3)).budget == 0.3
    assert sync_from_args(args(planner="simple")).budget is None  # H = 15 (the default)
    assert sync_from_args(args(planner="simple")).inner_steps == 15
    assert sync_from_args(args(inner_steps=4)).budget is None
    assert sync_from_args(args(sync="step")).budget is None
    assert SyncConfig.from_dict(SyncConfig("sparseloco", budget=0.1).to_dict()).budget == 0.1


def test_the_plan_event_says_which_h_was_chosen() -> None:
    chosen = {"inner_steps": 12, "budget": 0.1, "fits": True, "share": 0.093, "step_s": 0.5, "round_s": 6.0}
    ev = {"stages": [], "prediction": {"sync": {"mode": "diloco", "chosen": chosen}}}
    lines = format_plan(ev)
    assert any("rounds of H = 12 steps, chosen for a sync budget of 10%" in line for line in lines)
    assert not any("rounds of H" in line for line in format_plan({"stages": []}))


def test_the_driver_chooses_h_once_for_a_budget_and_the_rounds_follow_it(tmp_path) -> None:
    """`train --planner fusion --sync sparseloco` without --inner-steps: the driver's planner chooses
    H for the budget (in-memory network, tests/memnet.py), says so in the plan event, and the job's
    rounds close every H steps on the hosts and workers alike."""
    import asyncio

    from test_components import Swarm, small_spec

    spec = small_spec(steps=6, micro_batches=2)
    s = Swarm(tmp_path, workers=4, hosts=1)
    n = len(s.ids)
    cluster = {
        "version": 1,
        "name": "slow-homes",
        "devices": [
            {"id": pid, "tflops": 0.002, "memory_gb": 4.0, "roles": ["worker"] if i < 4 else ["optimizer"]}
            for i, pid in enumerate(s.ids)
        ],
        "links": {
            "matrix": {
                "bandwidth_gbps": [[1.0 if i == j else 0.02 for j in range(n)] for i in range(n)],
                "latency_ms": [[0.0] * n for _ in range(n)],
            }
        },
    }
    sync = SyncConfig("sparseloco", topk_density=1 / 16, chunk=256, budget=0.15)
    params = {"spec": spec.to_dict(), "planner": "fusion", "offload": "on", "cluster": cluster}
    asyncio.run(s.driver.run_job({**params, "sync": sync.to_dict()}, s.emit))
    plan_ev = next(e for e in s.events if e["type"] == "plan")
    chosen = plan_ev["prediction"]["sync"]["chosen"]
    h = chosen["inner_steps"]
    # slow devices, 20 Mbit/s links: replicas, and rounds of a few steps (one closes mid-job)
    assert 1 < h < spec.steps and len({st["replica"] for st in plan_ev["stages"]}) > 1
    assert plan_ev["prediction"]["sync"]["inner_steps"] == h
    assert chosen["budget"] == 0.15 and chosen["fits"] and chosen["share"] <= 0.15
    assert all(type(v) in (int, float, bool, list) for v in chosen.values())  # plain numbers on the wire
    assert any(f"rounds of H = {h} steps" in line for line in format_plan(plan_ev))
    steps = s.steps()
    assert len(steps) == spec.steps
    closed = [e["step"] for e in steps if "round_closed" in e]
    assert closed == [k for k in range(spec.steps) if (k + 1) % h == 0 or k + 1 == spec.steps]
    assert all(hh["rounds_closed"] == len(closed) for hh in steps[-1]["optimizer_hosts"])
