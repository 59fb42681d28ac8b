"""Leaving poorly connected devices out (plan/prune.py): parameter-balanced splits, the cheapest
subsets of data-parallel groups, and the planner on DT-FM's worldwide setting."""

import itertools

import numpy as np

from fusionnode.bench.plan import gpt2_like_graph
from fusionnode.plan import dtfm, fence, grid
from fusionnode.plan.cluster import load_cluster_dict
from fusionnode.plan.dtfm_cost import dtfm_step_time
from fusionnode.plan.dtfm_scenarios import scenario, with_activation_bytes
from fusionnode.plan.estimator import Chain
from fusionnode.plan.evaluate import make_context, ring_variant
from fusionnode.plan.planner import plan
from fusionnode.plan.prune import cheapest_subsets, param_split, pruned_layouts
from fusionnode.plan.simulator import simulate


def _heaviest(prefix, cuts):
    return max(prefix[b] - prefix[a] for a, b in itertools.pairwise(cuts))


def test_param_split_is_the_min_max_partition():
    g = gpt2_like_graph(4, 64, 16)
    chain = Chain.from_graph(g, fence.coarsen(g, fence.MAX_BLOCKS))
    prefix = np.asarray(chain.params, dtype=float)
    for stages in (2, 3, 4):
        cuts = param_split(chain, stages)
        assert cuts[0] == 0 and cuts[-1] == chain.blocks and len(cuts) == stages + 1
        assert all(a < b for a, b in itertools.pairwise(cuts))
        best = min(
            _heaviest(prefix, [0, *inner, chain.blocks])
            for inner in itertools.combinations(range(1, chain.blocks), stages - 1)
        )
        assert _heaviest(prefix, cuts) == best
        assert _heaviest(prefix, cuts) <= _heaviest(prefix, grid.even_split(chain.blocks, stages))


def test_cheapest_subsets_are_exact():
    rng = np.random.default_rng(3)
    n = 7
    w = rng.uniform(1.0, 10.0, (n, n))
    w = w + w.T
    np.fill_diagonal(w, 0.0)

    def path_cost(order):
        return sum(w[a, b] for a, b in itertools.pairwise(order))

    got = cheapest_subsets(w, 3)
    assert [len(s) for s in got] == [6, 5, 4, 3]
    for kept in got:
        mine = min(path_cost(p) for p in itertools.permutations(kept))
        best = min(
            min(path_cost(p) for p in itertools.permutations(sub))
            for sub in itertools.combinations(range(n), len(kept))
        )
        assert abs(mine - best) < 1e-9


def _both(g, c, p):
    return simulate(g, c, p).step_time_s, dtfm_step_time(g, c, p).step_s


def test_planner_leaves_the_far_regions_out_on_dtfm_worldwide(monkeypatch):
    """DT-FM's worldwide setting, a 24-layer model: the plan leaves the worst-linked regions idle
    and is at least 10% faster than the best even grid and DT-FM's layout under both the simulator
    and DT-FM's cost model, and faster under both than the planner without pruned layouts."""
    import fusionnode.plan.anchors as anchors
    from fusionnode.plan.anchors import dtfm_of, grids_by_dtfm, sim_of

    g = with_activation_bytes(gpt2_like_graph(24, 1024, 512), 0.5)
    c = load_cluster_dict(scenario("dtfm-worldwide"))
    batch = 512
    p = plan(g, c, batch, compress=False, dp_sync="auto")
    used = {st.devices[0] for pl in p.pipelines for st in pl.stages}
    assert len(used) < c.size
    sites = {c.devices[c.index(d)].site for d in used}
    assert not sites & {"Tokyo", "Seoul"}, sites
    ps, pd = _both(g, c, p)

    ctx = make_context(g, c, batch, None, True, None, None, fence.MAX_BLOCKS, False)
    grids = grid.even_grids(ctx)
    shape = grid.grid_shape(grids_by_dtfm(g, ctx, grids)[0][1])
    _, layout = dtfm.dtfm_search(ctx, *shape, population=20, trials=200)
    refs = [layout, *grids]
    priced = [v for ev in refs for v in (ev, ring_variant(ctx, ev)) if v is not None]
    ref_sim = min(sim_of(g, ctx, v) for v in priced)
    ref_dtfm = min(dtfm_of(g, ctx, v) for v in priced)
    assert ref_sim / ps >= 1.1, (ref_sim, ps)
    assert ref_dtfm / pd >= 1.1, (ref_dtfm, pd)
    # the pruned layouts of DT-FM's layout itself: some leave the far regions out
    assert any(len(ev.pipelines[0]) < shape[1] for ev in pruned_layouts(ctx, layout))

    monkeypatch.setattr(anchors, "pruned_layouts", lambda ctx, ev: [])
    qs, qd = _both(g, c, plan(g, c, batch, compress=False, dp_sync="auto"))
    assert ps < qs and pd < qd, (ps, pd, qs, qd)
