"""`fusionnode bench testbed` against hivemind: the comparison's arithmetic, table and plot, the
hivemind peer runner (2 real peers on loopback, NAT features off), and the netns comparison end
to end (slow; skipped where network namespaces are unavailable)."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import psutil
import pytest

from fusionnode.bench import compare, hivemind_peer, systems, testbed
from fusionnode.sync import SyncConfig

NETDEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    1000      10    0    0    0     0          0         0     1000      10    0    0    0     0       0          0
   to1: 5000000    4000    0    0    0     0          0         0   123456     100    0    0    0     0       0          0
  to12:       0       0    0    0    0     0          0         0       44       1    0    0    0     0       0          0
  eth0:       0       0    0    0    0     0          0         0    99999       1    0    0    0     0       0          0
"""


def test_netdev_counts_transmit_bytes_of_the_testbed_links_only():
    assert compare.parse_netdev_tx(NETDEV) == 123456 + 44
    assert compare.parse_netdev_tx(NETDEV, prefix="lo") == 1000


def test_time_to_target_uses_the_running_mean():
    curve = [{"step": i, "t": float(i + 1), "loss": v} for i, v in enumerate([5.0, 3.0, 4.0, 2.9, 2.9, 2.8])]
    assert compare.running_mean([5.0, 3.0, 4.0], 3) == [5.0, 4.0, 4.0]
    # single points dip below 3.0 at t=2 and t=4, the 3-step mean only at t=6 (2.867)
    assert compare.time_to_target(curve, 3.0) == 6.0
    assert compare.time_to_target(curve, 4.0) == 2.0
    assert compare.time_to_target(curve, 1.0) is None


def _swarm():
    # peer 1 is slow: still in epoch 0 when peer 0 finished epoch 1 (local updates do not wait)
    return {
        "peers": [
            {
                "index": 0,
                "steps": [
                    {"epoch": 0, "loss": 5.0, "samples": 4, "compute_s": 1.0, "t": 1.0},
                    {"epoch": 1, "loss": 4.0, "samples": 4, "compute_s": 1.0, "t": 2.0},
                    {"epoch": 2, "loss": 9.0, "samples": 4, "compute_s": 1.0, "t": 9.0},  # past --steps
                ],
                "done": {"complete": True, "epoch": 2, "t": 8.0},
            },
            {
                "index": 1,
                "steps": [
                    {"epoch": 0, "loss": 6.0, "samples": 2, "compute_s": 2.0, "t": 3.0},
                    {"epoch": 1, "loss": 3.0, "samples": 2, "compute_s": 2.0, "t": 10.0},
                ],
                "done": {"complete": True, "epoch": 2, "t": 10.0},
            },
        ]
    }


def test_hivemind_curve_is_sample_weighted_per_epoch_and_runs_forward():
    curve = compare.hivemind_curve(_swarm(), steps=2)
    assert [p["step"] for p in curve] == [0, 1]
    assert curve[0]["loss"] == pytest.approx((5.0 * 4 + 6.0 * 2) / 6)
    assert curve[1]["loss"] == pytest.approx((4.0 * 4 + 3.0 * 2) / 6)
    assert [p["t"] for p in curve] == [3.0, 10.0]
    assert compare.hivemind_wall(_swarm()) == 10.0
    assert compare.hivemind_utilisation(_swarm()) == pytest.approx([0.3, 0.4])


def test_hivemind_curve_measures_the_shared_batch_where_there_is_one():
    swarm = _swarm()
    swarm["peers"][0]["steps"][0]["shared"] = True  # epoch 0: peer 0's share of FusionNode's batch
    swarm["peers"][1]["steps"][0]["shared"] = True
    swarm["peers"][0]["steps"].insert(1, {"epoch": 0, "loss": 1.0, "samples": 4, "compute_s": 1.0, "t": 1.5})
    curve = compare.hivemind_curve(swarm, steps=2)
    assert curve[0]["loss"] == pytest.approx((5.0 * 4 + 6.0 * 2) / 6)  # the extra step (1.0) left out
    assert curve[1]["loss"] == pytest.approx((4.0 * 4 + 3.0 * 2) / 6)  # no shared step: all of them


def test_fusionnode_curve_and_utilisation():
    steps = [
        {
            "step_time_s": 2.0,
            "loss": 5.0,
            "stages": [{"peer": "a", "compute_s": 1.0}, {"peer": "b", "compute_s": 0.5}],
        },
        {
            "step_time_s": 2.0,
            "loss": 4.0,
            "stages": [{"peer": "a", "compute_s": 1.0}, {"peer": "b", "compute_s": 1.5}],
        },
    ]
    assert [(p["t"], p["loss"]) for p in compare.fusionnode_curve(steps)] == [(2.0, 5.0), (4.0, 4.0)]
    # device c holds no stage: it does not compute at all
    assert compare.fusionnode_utilisation(steps, ["a", "b", "c"]) == [0.5, 0.5, 0.0]


def _rows():
    base = compare.row(
        "baseline",
        kind="fusionnode",
        curve=[{"step": i, "t": 2.0 * (i + 1), "loss": 5.0 - i} for i in range(4)],
        wall_s=8.0,
        tokens=4 * 16 * 128,
        bytes_sent=10 * 2**20,
        val_loss=2.5,
        utilisation=[0.5, 0.9],
    )
    hm = compare.row(
        "hivemind-avg",
        kind="hivemind",
        curve=[{"step": i, "t": 10.0 * (i + 1), "loss": 5.0 - 0.5 * i} for i in range(4)],
        wall_s=40.0,
        tokens=4 * 16 * 128,
        bytes_sent=None,
        val_loss=None,
        utilisation=[0.1, 0.1],
        settings={"matchmaking_time": 5.0},
    )
    return base, hm


def test_target_is_a_loss_every_hivemind_system_reaches_unless_given(capsys, tmp_path):
    base, hm = _rows()
    assert base["final_loss"] == pytest.approx(3.0) and base["tokens_per_s"] == pytest.approx(1024)
    # hivemind ran: the highest of its systems' final 3-step means (4.0), so every one reaches it
    both = compare.finish([dict(base), dict(hm)], None)
    assert both["target_loss"] == pytest.approx(4.0) and "hivemind-avg" in both["target_source"]
    assert [r["time_to_target_s"] for r in both["rows"]] == [6.0, 40.0]
    assert both["speedups"] == [
        {
            "system": "baseline",
            "versus": "hivemind-avg",
            "times_sooner": pytest.approx(40 / 6),
            "at_least": False,
        }
    ]
    # no hivemind: the baseline's own final mean
    alone = compare.finish([dict(base)], None)
    assert alone["target_loss"] == pytest.approx(3.0) and "baseline" in alone["target_source"]
    assert alone["rows"][0]["time_to_target_s"] == 8.0  # its final mean, at its last step
    comp = compare.finish([base, hm], 3.0)
    assert comp["target_source"] == "--target-loss"
    assert hm["time_to_target_s"] is None  # hivemind's 3-step mean ends at 4.0
    # a hivemind system that never reached the target: a lower bound, its whole run (40 s) over 8 s
    assert comp["speedups"] == [
        {"system": "baseline", "versus": "hivemind-avg", "times_sooner": pytest.approx(5.0), "at_least": True}
    ]
    comp2 = compare.finish([dict(base), dict(hm)], 4.5)
    assert comp2["rows"][1]["time_to_target_s"] == 30.0  # mean of 5.0, 4.5, 4.0

    compare.print_comparison("home", "netns", comp)
    out = capsys.readouterr().out
    assert "not reached" in out and "matchmaking_time=5.0" in out and "50% 90%" in out
    assert "baseline reached the target at least 5.0x sooner than hivemind-avg" in out
    res = [{"cluster": "home", "network": "netns", "comparison": comp}]
    compare.write_curves_csv(res, tmp_path / "curves.csv")
    lines = (tmp_path / "curves.csv").read_text().splitlines()
    assert lines[0] == "cluster,system,step,t_s,loss" and len(lines) == 1 + 8
    pytest.importorskip("matplotlib")
    assert compare.plot_loss_vs_time(res, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hivemind_settings_follow_its_guidance():
    fast = hivemind_peer.hivemind_settings(4, 4 * 842496, 1e9)
    assert fast["matchmaking_time"] == 5.0 and fast["averaging_timeout"] == 60.0  # the default floor
    # 1.7 MB of fp16 over 10 Mbit/s: an all-reduce moves 2 x 3/4 of it, ~2 s; 2x that is below 60 s
    assert hivemind_peer.hivemind_settings(4, 4 * 842496, 1e7)["averaging_timeout"] == 60.0
    slow = hivemind_peer.hivemind_settings(4, 4 * 100_000_000, 1e7)
    assert slow["averaging_timeout"] == pytest.approx(2 * 2 * 2e8 * 0.75 * 8 / 1e7, rel=0.01)
    assert hivemind_peer.local_batch(16, 4) == 4 and hivemind_peer.local_batch(16, 6) == 3


def test_hivemind_systems_are_refused_on_userspace_links(capsys):
    assert testbed.main(["--network", "userspace", "--configs", "baseline,hivemind-avg"]) == 2
    err = capsys.readouterr().err
    assert "hivemind-avg" in err and "netns" in err
    assert testbed.main(["--configs", "hivemind-turbo"]) == 2
    assert "hivemind-avg" in capsys.readouterr().err  # the valid names are listed
    assert testbed.main(["--hivemind-timeout", "0"]) == 2


def test_sync_configurations_are_jobs_the_train_command_accepts():

    from fusionnode.sync import sync_from_args

    names = [c[0] for c in systems.SYNC_CONFIGS]
    assert names == ["fusionnode-diloco", "fusionnode-sparseloco", "fusionnode-dp"]
    assert set(systems.system_names()) >= {"baseline", "fusionnode", *names, *systems.HIVEMIND_SYSTEMS}
    for name, options, compress, fields in systems.SYNC_CONFIGS[:2]:
        sync = SyncConfig.from_dict(options["sync"])  # what the driver reads from params["sync"]
        assert sync.rounds and sync.inner_steps == systems.SYNC_INNER_STEPS == 10
        assert name == f"fusionnode-{sync.mode}" and compress == "none" and fields == {}
        # `train`'s own check of a round mode against the planner and offload: it must pass
        assert sync_from_args(_train_args(sync, options)) == sync
        # 2 replicas x 2 stages fit every bundled testbed (4 or more devices)
        assert options["replicas"] * options["stages"] == 4
    diloco, sparse = (SyncConfig.from_dict(c[1]["sync"]) for c in systems.SYNC_CONFIGS[:2])
    # the settings `fusionnode bench sync` found good, fixed before the run
    assert (diloco.outer_lr, diloco.outer_momentum) == (1.0, 0.0)
    assert (sparse.topk_density, sparse.chunk, sparse.codec) == (1 / 16, 256, "ctopk2")
    line = systems.settings_of({**systems.SYNC_CONFIGS[0][1], "cluster": {}, "peers": []})
    assert line["sync"] == "diloco" and line["H"] == 10 and line["outer_momentum"] == 0.0
    assert "0.7" in line["why"] and "cluster" not in line
    line = systems.settings_of(systems.SYNC_CONFIGS[1][1])
    assert line["density"] == "1/16" and line["chunk"] == 256
    assert systems.settings_of({"planner": "fusion", "offload": "on"}) == {
        "planner": "fusion",
        "offload": "on",
    }


def test_data_parallel_configuration_shares_the_batch_by_speed():

    from fusionnode.sync import sync_from_args

    # each next sample to the replica that would finish soonest: the slowest replica's time is least
    # 6/10 = 0.6, 5/7 = 0.71, 3/5 = 0.6, 2/3 = 0.67: 84% balance (7, 4, 3, 2 is 1% faster, 82%)
    assert systems.speed_shares(16, [10, 7, 5, 3]) == [6, 5, 3, 2]
    assert systems.speed_shares(25, [10, 7, 5, 3]) == [10, 7, 5, 3]
    assert systems.speed_shares(32, [10, 7, 5, 3]) == [13, 9, 6, 4]
    assert systems.speed_shares(4, [1, 1, 1, 1]) == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        systems.speed_shares(3, [1, 1, 1, 1])
    name, options, compress, fields = systems.SYNC_CONFIGS[-1]
    assert name == systems.DP_NAME and compress == "none" and fields == {}
    got = systems.resolve_options(options, 16, [3.6, 2.5, 1.8, 1.1])
    assert got["shares"] == [7, 4, 3, 2] and got["optimizer_hosts"] == 4 and got["stages"] == 1
    assert options["shares"] == "speed"  # the fixed configuration is not changed by a testbed
    assert systems.resolve_options({"planner": "fusion"}, 16, [1.0]) == {"planner": "fusion"}
    sync = SyncConfig.from_dict(options["sync"])
    assert (sync.mode, sync.inner_steps, sync.codec, sync.topk_density, sync.chunk) == (
        "sparseloco",
        4,
        "ctopk2",
        1 / 16,
        256,
    )
    assert sync.overlap and sync.overlap_steps == 1  # the exchange overlaps the next round's first step
    assert sync_from_args(_train_args(sync, options)) == sync
    line = systems.settings_of(got)
    assert line["shares"] == [7, 4, 3, 2] and line["H"] == 4 and line["density"] == "1/16"
    assert "one replica per device" in line["why"] and line["overlap"] == "the update 1 inner step(s) late"
    # the blocking variant runs only when named
    (blocking,) = [c for c in systems.OPTIONAL_CONFIGS if c[0] == f"{systems.DP_NAME}-blocking"]
    assert SyncConfig.from_dict(blocking[1]["sync"]) == SyncConfig(
        **{**sync.to_dict(), "overlap": False, "overlap_steps": None}
    )
    assert blocking[0] not in systems.default_system_names()


def _train_args(sync: SyncConfig, options: dict) -> argparse.Namespace:
    """`train`'s options for a testbed configuration's sync, planner and offload."""
    return argparse.Namespace(
        sync=sync.mode,
        inner_steps=sync.inner_steps,
        outer_lr=sync.outer_lr,
        outer_momentum=sync.outer_momentum,
        sync_codec=sync.codec,
        topk_density=sync.topk_density,
        topk_chunk=sync.chunk,
        ef_decay=sync.ef_decay,
        sync_overlap=sync.overlap,
        overlap_steps=sync.overlap_steps,
        planner=options["planner"],
        offload=options["offload"],
        rebalance_every=0,
    )


def _p2pd_cmdlines() -> list[list[str]]:
    """Command lines of the p2pd daemons this test process started (through its peers)."""
    out = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if child.name() == "p2pd":
                out.append(child.cmdline())
        except psutil.Error:
            pass
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("mode", hivemind_peer.MODES)
def test_hivemind_peers_train_on_loopback(tmp_path, mode):
    """2 real hivemind peers, loopback only, NAT port mapping / AutoNAT / relay service off: both reach
    the last epoch, average with each other, and save parameters FusionNode's evaluate accepts."""
    seen: list[list[list[str]]] = []
    res = hivemind_peer.run_local_swarm(
        mode,
        2,
        tmp_path,
        steps=2,
        batch_size=8,
        seq_len=32,
        pace_tflops=[0.0004, 0.0004],  # ~1 s per local step: the trackers see each other's progress
        timeout_s=240,
        at_start=lambda: seen.append(_p2pd_cmdlines()),
    )
    assert res["exit_codes"] == [0, 0]
    daemons = seen[0]
    assert len(daemons) >= 2
    for cmd in daemons:
        args = " ".join(cmd)
        assert "-natPortMap=0" in args and "-autonat=0" in args and "-relayService=0" in args
        assert "/ip4/127.0.0.1/" in args and "0.0.0.0" not in args
    for peer in res["peers"]:
        assert peer["done"]["complete"] and peer["done"]["epoch"] >= 2
        # each epoch's first local step trained on the peer's half of FusionNode's batch of that step
        firsts = {}
        for r in peer["steps"]:
            firsts.setdefault(r["epoch"], r)
        assert all(r["shared"] and r["samples"] == 4 for r in firsts.values())
        assert {r["epoch"] for r in peer["steps"]} <= {0, 1} and peer["steps"]
        assert all(math.isfinite(r["loss"]) and r["compute_s"] >= 0.3 for r in peer["steps"])
    logs = "".join((tmp_path / f"peer{i}.log").read_text() for i in range(2))
    assert "with 2 peers" in logs  # an averaging round (gradients or parameters) had both peers
    curve = compare.hivemind_curve(res, 2)
    assert [p["step"] for p in curve] == [0, 1]
    val = compare.evaluate_params(res["peers"][0]["params"], batch_size=8, seq_len=32, seed=0)
    assert 0 < val < 6.0  # byte-level: ln(256) = 5.55 at the start


@pytest.mark.slow
@pytest.mark.timeout(900)  # four systems on the netns testbed: 5-7 min on 2 loaded cores
def test_netns_comparison_end_to_end(tmp_path, capsys):
    """The comparison on the netns testbed, small: the baseline, FusionNode's data-parallel
    configuration and both hivemind modes."""
    ok, why = testbed.netns_available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    out = tmp_path / "out"
    rc = testbed.main(
        [
            *("--network", "netns", "--cluster", "home-volunteers-4", "--steps", "4", "--warmup", "1"),
            *("--calibration-steps", "0", "--batch-size", "8", "--seq-len", "32", "--out", str(out)),
            *("--configs", "baseline,fusionnode-dp,hivemind-avg,hivemind-local"),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "time to loss" in text and "hivemind-local" in text
    res = json.loads((out / "results.json").read_text())["results"][0]
    rows = {r["system"]: r for r in res["comparison"]["rows"]}
    assert set(rows) == {"baseline", "fusionnode-dp", "hivemind-avg", "hivemind-local"}
    worst = max(rows["hivemind-avg"]["final_loss"], rows["hivemind-local"]["final_loss"])
    assert res["comparison"]["target_loss"] == pytest.approx(worst)  # every hivemind mode reaches it
    # one replica per device, by speed (0.2/0.14/0.1/0.06 TFLOP/s), every device computing
    assert rows["fusionnode-dp"]["settings"]["shares"] == systems.speed_shares(8, [10, 7, 5, 3])
    assert all(u > 0 for u in rows["fusionnode-dp"]["utilisation"])
    for r in rows.values():
        assert r["bytes_sent"] > 100_000  # every system's traffic crossed the emulated links
        assert len(r["curve"]) == 4 and r["tokens_per_s"] > 0 and math.isfinite(r["val_loss"])
        assert len(r["utilisation"]) == 4 and all(0 <= u <= 1 for u in r["utilisation"])
    assert Path(out / "curves.csv").exists()


def test_round_counts_from_a_hivemind_log():
    log = (
        "Nov 24 01:29:16.273 [INFO] Averaged gradients with 4 peers\n"
        "Nov 24 01:29:26.524 [INFO] Averaged parameters with 2 peers\n"
        "Nov 24 01:29:11.104 [INFO] Skipping pre-scheduled averaging round: there are no other peers\n"
        "Nov 24 01:29:11.104 [INFO] Proceeding with local gradients\n"
        "Nov 24 01:30:23.057 [INFO] Averaging gradients failed with AllreduceException('could not find a group')\n"
    )
    r = hivemind_peer.count_rounds(log)
    assert r == {"averaged": 2, "mean_group": 3.0, "alone": 1, "failed": 1}
    assert hivemind_peer.count_rounds("")["mean_group"] == 0.0
