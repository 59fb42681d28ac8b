"""Data-parallel sync priced both ways (plan/dpsync.py, evaluate.ring_variant): the ring's formula and
groups, and the planner taking the ring where the optimizer hosts are far and the hosts where they pay."""

import numpy as np
import pytest

from fusionnode.bench.plan import gpt2_like_graph
from fusionnode.errors import ConfigError, PlanError
from fusionnode.plan.cluster import load_cluster_dict
from fusionnode.plan.dpsync import ring_finish, ring_groups, ring_sync_s, ring_time
from fusionnode.plan.evaluate import evaluate_plan
from fusionnode.plan.plan import Plan
from fusionnode.plan.planner import plan
from fusionnode.plan.simulator import simulate


def test_ring_time_is_two_k_minus_one_over_k_bytes_on_the_slowest_link():
    bw = np.array([[1.0, 8e9, 4e9], [8e9, 1.0, 2e9], [4e9, 2e9, 1.0]])
    lat = np.array([[0, 1e-3, 2e-3], [1e-3, 0, 5e-3], [2e-3, 5e-3, 0]])
    # ring 0 -> 1 -> 2 -> 0: slowest link 1-2 (2 Gbit/s), slowest latency 5 ms
    assert ring_time(bw, lat, [0, 1, 2], 3e9) == pytest.approx(2 * 2 / 3 * 3e9 * 8 / 2e9 + 2 * 2 * 5e-3)
    assert ring_time(bw, lat, [0], 3e9) == 0.0 and ring_time(bw, lat, [0, 1], 0.0) == 0.0


def test_rings_follow_the_blocks_each_pair_of_stages_holds():
    params = np.array([0.0, 10, 30, 60, 100])  # 4 blocks of 10, 20, 30, 40 bytes
    aligned = [([0, 1], [0, 2, 4]), ([2, 3], [0, 2, 4])]
    assert sorted(ring_groups(params, aligned)) == [((0, 2), (0, 0), 30.0), ((1, 3), (1, 1), 70.0)]
    skewed = [([0, 1], [0, 1, 4]), ([2, 3], [0, 3, 4])]  # cut after block 1 vs after block 3
    assert sorted(ring_groups(params, skewed)) == [
        ((0, 2), (0, 0), 10.0),
        ((1, 2), (1, 0), 50.0),
        ((1, 3), (1, 1), 40.0),
    ]
    bw = np.full((4, 4), 8e9)
    lat = np.zeros((4, 4))
    # device 1 and 2 are each in two rings, one after the other
    assert ring_sync_s(bw, lat, params, skewed) == pytest.approx((50 + 40) * 8 / 8e9)
    done = [[1.0, 2.0], [1.5, 3.0]]
    fin = ring_finish(bw, lat, params, skewed, done)
    assert fin[0] == fin[1] and fin[0] > 3.0


def _site_cluster(worker_host_gbps: float, worker_worker_gbps: float) -> dict:
    """Four workers and one optimizer-only host; the links between workers and to the host as given."""
    n = 5
    bw = [[worker_worker_gbps] * n for _ in range(n)]
    lat = [[1.0] * n for _ in range(n)]
    for i in range(4):
        bw[i][4] = bw[4][i] = worker_host_gbps
    devs = [{"id": f"w{i}", "tflops": 1, "memory_gb": 2, "roles": ["worker"]} for i in range(4)]
    devs.append({"id": "host", "tflops": 1, "memory_gb": 2, "roles": ["optimizer"], "ram_gb": 64})
    return {"name": "dp", "devices": devs, "links": {"matrix": {"bandwidth_gbps": bw, "latency_ms": lat}}}


def test_auto_takes_the_ring_where_the_hosts_are_far_and_the_hosts_where_they_pay():
    g = gpt2_like_graph(8, 256, 64, vocab=4096)
    far = load_cluster_dict(_site_cluster(worker_host_gbps=0.02, worker_worker_gbps=10))
    hosts = plan(g, far, 256, compress=False)
    auto = plan(g, far, 256, compress=False, dp_sync="auto")
    assert hosts.dp_sync == "hosts" and hosts.optimizer_hosts
    assert (
        auto.dp_sync == "ring" and not auto.offload and not auto.optimizer_hosts and len(auto.pipelines) > 1
    )
    assert auto.prediction.step_time_s < hosts.prediction.step_time_s
    assert evaluate_plan(g, far, auto) == pytest.approx(auto.prediction.step_time_s, rel=1e-6)
    assert simulate(g, far, auto).step_time_s < simulate(g, far, hosts).step_time_s
    # a star: every worker close to the host, far from the others; replicas sync through the host
    star = load_cluster_dict(_site_cluster(worker_host_gbps=10, worker_worker_gbps=0.02))
    p = plan(g, star, 256, compress=False, dp_sync="auto")
    assert len(p.pipelines) > 1 and p.dp_sync == "hosts" and p.optimizer_hosts
    # the choice is the plan's: it survives JSON, and a plan that says both is refused
    back = Plan.from_json(auto.to_json())
    assert back.dp_sync == "ring" and back == auto
    with pytest.raises(PlanError, match="dp_sync"):
        Plan.from_dict({**auto.to_dict(), "offload": True}).validate(g)
    with pytest.raises(ConfigError, match="dp_sync"):
        plan(g, far, 256, offload=False, dp_sync="auto")
