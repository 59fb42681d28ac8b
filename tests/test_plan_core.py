"""Cluster files, estimator primitives, Plan JSON, bad input."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from fusionnode.bench.plan import gpt2_like_graph, random_graph
from fusionnode.errors import ConfigError, PlanError
from fusionnode.plan import fence
from fusionnode.plan.baselines import contiguous_split_plan
from fusionnode.plan.cluster import bundled_clusters, load_cluster, load_cluster_dict
from fusionnode.plan.estimator import (
    TOPK_WIRE_FACTOR,
    Chain,
    Estimator,
    choose_ratio,
    link_comm,
    link_time,
    wire_bytes,
)
from fusionnode.plan.plan import Plan
from fusionnode.plan.planner import plan
from fusionnode.plan.split import _link_cost_vector, split_dp

SMALL = {
    "name": "small",
    "devices": [
        {"id": "a", "tflops": 10, "memory_gb": 2, "site": "x"},
        {"id": "b", "tflops": 20, "memory_gb": 2, "site": "x"},
        {"id": "c", "tflops": 10, "memory_gb": 2, "site": "y"},
    ],
    "links": {
        "intra_site": {"bandwidth_gbps": 10, "latency_ms": 0.1},
        "inter_site": {"bandwidth_gbps": 0.1, "latency_ms": 20},
    },
}


def test_link_precedence_and_uplink_cap():
    d = json.loads(json.dumps(SMALL))
    d["devices"][2]["uplink_gbps"] = 0.01
    d["links"]["pairs"] = [{"a": "a", "b": "b", "bandwidth_gbps": 1, "latency_ms": 5}]
    c = load_cluster_dict(d)
    bw, lat = c.bandwidth_bps, c.latency_s
    assert bw[0, 1] == bw[1, 0] == 1e9 and lat[0, 1] == pytest.approx(5e-3)  # pair beats site default
    assert bw[0, 2] == 0.01e9  # uplink cap beats the inter-site default
    assert lat[0, 2] == pytest.approx(20e-3)
    m = {"bandwidth_gbps": [[0, 1, 2], [1, 0, 3], [2, 3, 0]]}
    d["links"] = {"matrix": m}
    c = load_cluster_dict(d)
    assert c.bandwidth_bps[1, 2] == 0.01e9 and c.bandwidth_bps[0, 1] == 1e9


def test_count_expands_ids_and_sites():
    c = load_cluster_dict({"devices": [{"id": "g", "count": 3, "tflops": 1, "memory_gb": 1, "site": "s"}]})
    assert [d.id for d in c.devices] == ["g-0", "g-1", "g-2"]


@pytest.mark.parametrize("name", bundled_clusters())
def test_bundled_clusters_load(name):
    c = load_cluster(name)
    assert c.size >= 4
    assert np.all(c.bandwidth_bps > 0)
    assert np.all(c.bandwidth_bps == c.bandwidth_bps.T)


def test_bundled_set():
    names = set(bundled_clusters())
    assert {"single-server-8", "two-universities", "geo-48", "volunteer-1000"} <= names
    assert load_cluster("geo-48").size == 48 and load_cluster("volunteer-1000").size == 1000


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(devices=[]), "non-empty"),
        (lambda d: d["devices"][0].pop("tflops"), "missing field 'tflops'"),
        (lambda d: d["devices"][0].update(memory_gb=-1), "'memory_gb' must be > 0"),
        (lambda d: d["links"]["inter_site"].update(bandwidth_gbps=0), "'bandwidth_gbps' must be > 0"),
        (
            lambda d: d["links"].update(pairs=[{"a": "a", "b": "zz", "bandwidth_gbps": 1}]),
            "unknown device 'zz'",
        ),
        (lambda d: d["links"].update(pairs=[{"a": "a", "b": "b", "bandwidth_gbps": -3}]), "must be > 0"),
        (lambda d: d["devices"].append(dict(d["devices"][0])), "duplicate device id"),
        (lambda d: d["links"].update(matrix={"bandwidth_gbps": [[1, 2], [2, 1]]}), "must be 3 x 3"),
        (lambda d: d["devices"][0].update(roles=["boss"]), "'roles'"),
    ],
)
def test_bad_cluster(mutate, message):
    d = json.loads(json.dumps(SMALL))
    mutate(d)
    with pytest.raises(ConfigError, match=message):
        load_cluster_dict(d)


def test_bad_cluster_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_cluster(str(p))
    with pytest.raises(ConfigError, match="no such file and no bundled cluster"):
        load_cluster("no-such-cluster")


def test_choose_ratio_rule():
    bw, lat = 1e8, 0.01  # 100 Mbit/s
    nbytes = 10e6  # 0.8 s dense
    assert choose_ratio(nbytes, bw, lat, 1.0) == 1.0  # fits: dense
    r = choose_ratio(nbytes, bw, lat, 0.21)
    assert link_time(wire_bytes(nbytes, r), bw, lat) == pytest.approx(0.21)
    assert r == pytest.approx(0.2 * bw / 8 / (nbytes * TOPK_WIRE_FACTOR))
    assert choose_ratio(nbytes, bw, lat, 0.005) == 0.01  # below latency: k_min
    assert choose_ratio(nbytes, bw, lat, 0.0101, k_min=0.05) == 0.05
    assert wire_bytes(100, 0.1) == pytest.approx(100 * 0.1 * 6 / 4)


def test_link_cost_vector_matches_choose_ratio():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1e7, 50)
    for bw, lat, target in [(1e8, 0.01, 0.05), (1e9, 0.001, 0.5), (8e6, 0.03, 0.02)]:
        vec = _link_cost_vector(x, bw, lat, target)
        ref = [link_comm(v, bw, lat, choose_ratio(v, bw, lat, target))[0] for v in x]
        np.testing.assert_allclose(vec, ref, rtol=1e-12)


def test_estimator_compute_and_calibration():
    c = load_cluster_dict(SMALL)
    est = Estimator(c, efficiency=0.5)
    t = est.compute_time(0, 1e12)
    assert t == pytest.approx(3 * 1e12 / (10e12 * 0.5))
    est.calibrate("a", 2.0)
    assert est.compute_time(0, 1e12) == pytest.approx(2 * t)
    err = est.prediction_error({("a", 1e12): 2 * t})
    assert err["a"] == pytest.approx(0.0)
    with pytest.raises(ConfigError):
        est.calibrate("a", 0.0)


def test_split_dp_is_exact_on_chains():
    """The DP equals brute force over all splits (same cost function, fixed device order)."""
    import itertools

    rng = random.Random(1)
    for _ in range(6):
        g = random_graph(rng, rng.randint(5, 9))
        c = load_cluster_dict(json.loads(json.dumps(SMALL)))
        est = Estimator(c)
        chain = Chain.from_graph(g)
        devs = [0, 1, 2]
        split = split_dp(est, chain, devs, 2)
        got = est.evaluate(chain, devs, split, 2, compress=False).bottleneck_s
        best = min(
            est.evaluate(chain, devs, [0, *cut, chain.blocks], 2, compress=False).bottleneck_s
            for cut in itertools.combinations(range(1, chain.blocks), 2)
        )
        assert got == pytest.approx(best)


def test_coarsen_keeps_block_boundaries():
    g = gpt2_like_graph(40, 64, 16)
    bounds = fence.coarsen(g, max_blocks=64)
    assert bounds[0] == 0 and bounds[-1] == g.num_nodes and len(bounds) - 1 <= 64
    cut = g.cut_bytes()
    names = {g.nodes[b - 1].name for b in bounds[1:-1]}
    # fences after residual adds, where only the residual stream (T * H fp32) crosses
    assert sum(n.endswith(("add_1", "add_2")) for n in names) >= 40
    cheap = [b for b in bounds[1:-1] if cut[b] <= 16 * 64 * 4 + 16 * 8]  # + the token ids the loss needs
    assert len(cheap) >= len(bounds) - 2 - 3  # all but a few embedding / head side cuts


def test_fence_levels_split_on_slow_links():
    c = load_cluster("two-universities")
    levels = fence.fence_levels(c, range(c.size))
    assert [len(x) for x in levels] == [1, 2]
    assert sorted(len(g) for g in levels[1]) == [8, 8]
    assert {c.devices[d].site for d in levels[1][0]} == {"uni-a"}


def test_plan_json_roundtrip_and_schema():
    jsonschema = pytest.importorskip("jsonschema")
    from pathlib import Path

    g = gpt2_like_graph(4, 64, 32, name="gpt2-test")
    c = load_cluster("testbed-6-two-sites")
    p = plan(g, c, 16)
    text = p.to_json()
    assert Plan.from_json(text) == p
    schema = json.loads((Path(__file__).parent.parent / "protocol" / "plan.schema.json").read_text())
    jsonschema.validate(json.loads(text), schema)
    cschema = json.loads((Path(__file__).parent.parent / "protocol" / "cluster.schema.json").read_text())
    for name in bundled_clusters():
        from importlib import resources

        doc = json.loads((resources.files("fusionnode.plan") / "clusters" / f"{name}.json").read_text())
        jsonschema.validate(doc, cschema)
    q = contiguous_split_plan(g, ["a", "b", "c"], 16, 4)
    assert Plan.from_json(q.to_json()) == q
    jsonschema.validate(json.loads(q.to_json()), schema)


def test_every_node_exactly_once():
    g = gpt2_like_graph(6, 64, 32)
    for p in (
        plan(g, load_cluster("testbed-4-mixed"), 8),
        contiguous_split_plan(g, ["x", "y", "z"], 8, 4, by="nodes"),
    ):
        for pl in p.pipelines:
            nodes = [i for st in pl.stages for i in st.nodes]
            assert nodes == list(range(g.num_nodes))
        assert sum(pl.batch_share for pl in p.pipelines) == 8
    bad = Plan.from_json(p.to_json().replace('"hi": ' + str(p.pipelines[0].stages[0].hi), '"hi": 1', 1))
    with pytest.raises(PlanError):
        bad.validate(g)


def test_model_too_big_for_cluster():
    g = gpt2_like_graph(48, 1600, 1024)
    with pytest.raises(PlanError, match=r"needs 13.10 GB .* have 7.20 GB usable"):
        plan(g, load_cluster_dict({"devices": [{"id": "x", "count": 2, "tflops": 1, "memory_gb": 4}]}), 8)
    with pytest.raises(PlanError, match=r"no pipeline .* fits"):  # weights fit, activations do not
        plan(g, load_cluster("testbed-4-mixed"), 8)


def test_device_too_small_for_any_block():
    d = json.loads(json.dumps(SMALL))
    for dev in d["devices"]:
        dev["memory_gb"] = 0.02
    d["devices"].append({"id": "many", "count": 40, "tflops": 1, "memory_gb": 0.02, "site": "x"})
    g = random_graph(random.Random(3), 8)
    assert max(n.param_bytes for n in g.nodes) * 2 > 0.02e9
    with pytest.raises(
        PlanError, match=r"largest indivisible block .* needs .* GB, the largest worker has 0.02 GB"
    ):
        plan(g, load_cluster_dict(d), 4)


def test_bad_plan_arguments():
    g = random_graph(random.Random(0), 6)
    c = load_cluster_dict(SMALL)
    with pytest.raises(ConfigError):
        plan(g, c, 0)
    with pytest.raises(ConfigError):
        plan(g, c, 4, micro_batches=0)
    with pytest.raises(ConfigError):
        Plan.from_json("[1, 2]")
    with pytest.raises(ConfigError):
        contiguous_split_plan(g, [], 4, 2)
    with pytest.raises(PlanError):
        contiguous_split_plan(g, [f"d{i}" for i in range(20)], 4, 2)


def test_offload_off_needs_more_memory():
    g = random_graph(random.Random(5), 10)
    c = load_cluster_dict(SMALL)
    on = plan(g, c, 8, offload=True)
    off = plan(g, c, 8, offload=False)
    assert on.optimizer_hosts and not off.optimizer_hosts
    assert math.isfinite(off.prediction.step_time_s)
    names = sorted(n for h in on.optimizer_hosts for n in h.param_names)
    assert names == sorted({n for node in g.nodes for n in node.param_names})


def test_subset_doc_filters_devices_matrix_and_pairs():
    from fusionnode.plan.cluster import subset_doc

    doc = {
        "version": 1,
        "devices": [{"id": x, "tflops": 1.0, "memory_gb": 4} for x in "abc"],
        "links": {
            "matrix": {
                "bandwidth_gbps": [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
                "latency_ms": [[0, 1, 2], [3, 4, 5], [6, 7, 8]],
            },
            "pairs": [
                {"a": "a", "b": "c", "bandwidth_gbps": 0.5},
                {"a": "a", "b": "b", "bandwidth_gbps": 0.1},
            ],
        },
    }
    sub = subset_doc(doc, {"a", "c"})
    assert [d["id"] for d in sub["devices"]] == ["a", "c"]
    assert sub["links"]["matrix"]["bandwidth_gbps"] == [[1, 3], [7, 9]]
    assert sub["links"]["pairs"] == [{"a": "a", "b": "c", "bandwidth_gbps": 0.5}]
    c = load_cluster_dict(sub)
    assert c.size == 2 and c.bandwidth_bps[0, 1] == pytest.approx(3e9)  # the matrix row and column kept
    assert len(doc["devices"]) == 3  # the original is untouched
