"""`fusionnode bench testbed`: its calibration arithmetic, the workers' device pacing, and one real
run on loopback (user-space token buckets: no root needed)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from fusionnode.bench import testbed
from fusionnode.plan.cluster import load_cluster_dict
from fusionnode.runtime.hooks import DEBUG_PACE_FILE, DEBUG_SLOW_FILE, PacingHook, hook_from_env
from fusionnode.runtime.stagejob import mb_rows


def _step(step_time, stages, phases=None):
    return {
        "step_time_s": step_time,
        "tokens_per_s": 2048 / step_time,
        "loss": 3.0,
        "wire_bytes": 10,
        "phases": phases or {},
        "stages": [{"compute_s": c, "wait_s": w, "link_s": link, "links": {}} for c, w, link in stages],
    }


def test_step_overhead_is_the_time_outside_the_slowest_stage():
    run = {
        "steps": [_step(9.0, [(1, 1, 1)])]
        + [_step(1.0 + k * 0.01, [(0.5, 0.3, 0.1), (0.2, 0.1, 0.0)]) for k in range(5)]
    }
    # the first step is warm-up; then step - (0.5 + 0.3 + 0.1), median of 0.10 .. 0.14
    assert testbed.step_overhead(run, warmup=1) == pytest.approx(0.12)


def test_peer_cluster_keeps_bandwidth_and_drops_latency():
    path = testbed.resolve_cluster_path("testbed-4-mixed")
    doc = testbed.peer_cluster(__import__("pathlib").Path(path), ["a", "b", "c", "d"], [1.0, 2.0, 3.0, 4.0])
    c = load_cluster_dict(doc)
    assert [d.tflops for d in c.devices] == [1.0, 2.0, 3.0, 4.0]
    assert c.bandwidth_bps[0, 1] == pytest.approx(1e9) and c.bandwidth_bps[1, 2] == pytest.approx(8e6)
    assert float(c.latency_s.max()) == 0.0  # the testbed does not emulate latency: not told to the planner
    assert c.step_overhead_s == 0.0
    assert load_cluster_dict({**doc, "step_overhead_ms": 40}).step_overhead_s == pytest.approx(0.04)


def test_link_paths_say_which_path_each_link_took_during_a_run():
    import numpy as np

    bw = np.array([[0, 1e9, 8e6], [1e9, 0, 8e6], [8e6, 8e6, 0]])
    before = {(0, 1): {"direct": 100}, (1, 2): {"libp2p": 50}}
    after = {
        (0, 1): {"direct": 300},  # 200 more bytes direct on a 1 Gbit/s link
        (1, 2): {"libp2p": 50},  # idle during the run: not listed
        (2, 0): {"libp2p": 70, "direct": 5},  # a slow link that (wrongly) also went direct
    }
    rows = testbed.link_paths(before, after, bw, ["p0", "p1", "p2"])
    assert rows == [
        {
            "from": "p0",
            "to": "p1",
            "bandwidth_bps": 1e9,
            "path": "direct",
            "bytes": {"direct": 200},
            "expected": "direct",
        },
        {
            "from": "p2",
            "to": "p0",
            "bandwidth_bps": 8e6,
            "path": "direct+libp2p",
            "bytes": {"libp2p": 70, "direct": 5},
            "expected": "libp2p",
        },
    ]
    line = testbed.paths_line(rows)
    assert line.startswith("direct 1 (1000 Mbit/s), direct+libp2p 1 (8 Mbit/s)")
    assert "OFF THE RULE: p2->p0 direct+libp2p (expected libp2p)" in line
    assert testbed.paths_line([]) == "no link carried tensors"


def test_measured_speed_is_positive_and_plausible():
    v = testbed.measured_speed(32, batch=2, repeats=2)
    assert 1e-4 < v < 100  # TFLOP/s of one CPU thread on gpt2-tiny


def test_pacing_stretches_compute_to_the_emulated_speed(tmp_path, monkeypatch):
    monkeypatch.delenv("FUSIONNODE_DEBUG", raising=False)
    assert hook_from_env(tmp_path) is None  # production: no hook, the files are never read
    monkeypatch.setenv("FUSIONNODE_DEBUG", "1")
    w = hook_from_env(tmp_path)
    assert isinstance(w, PacingHook) and w.slow_factor == 1.0 and w.pace_tflops == 0.0
    (tmp_path / DEBUG_PACE_FILE).write_text("0.001\n")  # 1 GFLOP/s
    (tmp_path / DEBUG_SLOW_FILE).write_text("1.0\n")
    w.before_step()
    assert w.pace_tflops == pytest.approx(0.001)

    async def timed(compute_s, flops):
        t0 = time.perf_counter()
        await w.after_compute(compute_s, flops)
        return time.perf_counter() - t0

    # 1e8 FLOPs at 1 GFLOP/s = 0.1 s, of which 0.02 s were already computed: sleeps the other 0.08
    assert 0.075 <= asyncio.run(timed(0.02, 1e8)) < 0.5
    # compute already slower than the pace: no extra sleep
    assert asyncio.run(timed(0.2, 1e8)) < 0.05
    # a slow-down factor still applies, whichever is longer wins
    w.slow_factor = 3.0
    assert 0.1 <= asyncio.run(timed(0.05, 1e6)) < 0.5
    (tmp_path / DEBUG_PACE_FILE).unlink()
    w.before_step()
    assert w.pace_tflops == 0.0


def test_mb_rows():
    import torch

    assert mb_rows({"x": torch.zeros(3, 8), "y": torch.zeros(3)}) == 3
    assert mb_rows({}) == 0


def test_bad_arguments_are_refused(capsys):
    assert testbed.main(["--headroom", "0.5"]) == 2
    assert "--headroom" in capsys.readouterr().err
    assert testbed.main(["--configs", "baseline,turbo"]) == 2
    assert "turbo" in capsys.readouterr().err
    assert testbed.main(["--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


@pytest.mark.e2e
def test_testbed_runs_on_loopback(tmp_path, capsys):
    """The whole benchmark, small: 4 real peers, user-space links, calibration, three configurations
    (one of them a --sync round mode: 2 replicas x 2 stages, its one round closed at the last step).
    The cluster is testbed-4-slow-compute with its p1-p2 link slowed to 50 Mbit/s: that link keeps
    libp2p, the 1 Gbit/s ones go direct, and the results say which path each link took."""
    out = tmp_path / "out"
    doc = json.loads(Path(testbed.resolve_cluster_path("testbed-4-slow-compute")).read_text())
    doc["links"]["pairs"] = [{"a": "p1", "b": "p2", "bandwidth_gbps": 0.05, "latency_ms": 0.5}]
    cluster = tmp_path / "slow-link.json"
    cluster.write_text(json.dumps(doc))
    rc = testbed.main(
        [
            "--network",
            "userspace",
            "--cluster",
            str(cluster),
            "--steps",
            "4",
            "--warmup",
            "1",
            "--calibration-steps",
            "3",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
            "--configs",
            "baseline,fusionnode,fusionnode-sparseloco",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "user-space token buckets" in text and "fusionnode" in text
    res = json.loads((out / "results.json").read_text())["results"][0]
    assert res["network"] == "userspace" and res["step_overhead_s"]["offload"] >= 0
    rows = {r["config"]: r for r in res["rows"]}
    assert set(rows) == {"baseline", "fusionnode", "fusionnode-sparseloco"}
    for name, r in rows.items():
        assert r["tokens_per_s"] > 0
        if name == "fusionnode-sparseloco":  # --planner simple lays the replicas out, predicting nothing
            assert r["predicted_step_time_s"] is None
            continue
        assert r["predicted_step_time_s"] > 0 and r["prediction_error"] is not None
    runs = json.loads((out / "runs.json").read_text())
    assert [r["config"] for r in runs] == [
        "calibration-speeds",
        "calibration-overhead-local",
        "calibration-overhead-offload",
        "baseline",
        "fusionnode",
        "fusionnode-sparseloco",
    ]
    hosts = runs[-1]["steps"][-1]["optimizer_hosts"]  # the sync mode's round reached the hosts
    assert hosts and all(h["rounds_closed"] == 1 and h["received_bytes"] > 0 for h in hosts)
    assert all(h["rounds_closed"] == 0 for h in runs[-1]["steps"][-2]["optimizer_hosts"])
    assert len(runs[2]["plan"]["stages"]) == 1  # the overhead is measured on one peer, no link in the way
    # the path each link's tensors took, measured per run: direct on the 1 Gbit/s links, libp2p on
    # the 50 Mbit/s one, which the baseline's even split p0 -> p1 -> p2 -> p3 crosses both ways
    for name, r in rows.items():
        assert r["paths"], name
        assert all(p["path"] == p["expected"] and sum(p["bytes"].values()) > 0 for p in r["paths"]), r[
            "paths"
        ]
    base = {(p["from"], p["to"]): p["path"] for p in rows["baseline"]["paths"]}
    assert base[("p1", "p2")] == base[("p2", "p1")] == "libp2p", base
    assert base[("p0", "p1")] == base[("p2", "p3")] == "direct", base
    assert "paths, baseline: direct" in text and "libp2p 2 (50 Mbit/s)" in text
    assert all("phases" in s for r in runs for s in r["steps"])
