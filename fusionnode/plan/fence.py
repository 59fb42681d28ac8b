"""OP-Fence: group devices by link bandwidth, order groups along fast links, and pick the cuts of
the OP-DAG a fence (stage boundary) may fall on.

* `coarsen` keeps only cuts where the crossing bytes are a local minimum (block boundaries of a
  transformer: the residual stream alone crosses), at most `max_blocks` of them, evenly spread
  over the minima, so the split DP stays small on large graphs.
* `fence_levels` is single-linkage clustering on log bandwidth (a maximum spanning tree cut at
  bandwidth thresholds): fast groups stay together, fences fall on the slow links between them.
* `order_devices` lays groups out as a path that follows the fastest inter-group links.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from fusionnode.graph.dag import OpGraph
from fusionnode.plan.cluster import Cluster

log = logging.getLogger(__name__)

MAX_BLOCKS = 64  # most chain blocks the split DP works on
LEVEL_DECADE = 0.5  # bandwidth thresholds are spaced this many decades (log10) apart
MAX_LEVELS = 6  # most groupings fence_levels returns
ORDER_STARTS = 8  # path starts order_groups tries when there are more groups than this


def coarsen(graph: OpGraph, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Allowed cut positions (node ids, including 0 and n): all of them for small graphs, else the
    local minima of cut_bytes, thinned evenly to at most max_blocks blocks."""
    n = graph.num_nodes
    if n <= max_blocks:
        return list(range(n + 1))
    cut = graph.cut_bytes()
    cand = [c for c in range(1, n) if cut[c] <= cut[c - 1] and cut[c] <= cut[c + 1]]
    if len(cand) < max_blocks // 2:  # too few minima (odd graph): add the cheapest other cuts
        rest = sorted((c for c in range(1, n) if c not in set(cand)), key=lambda c: (cut[c], c))
        cand = sorted(set(cand) | set(rest[: max_blocks - 1 - len(cand)]))
    need = max_blocks - 1
    if len(cand) > need:
        # the `need` cheapest minima; among equally cheap ones (the residual stream between
        # transformer blocks, and between a block's attention and MLP halves), those nearest to
        # evenly spaced shares of the FLOPs, so blocks carry even work and no stage is a sliver
        thr = sorted(cut[c] for c in cand)[need - 1]
        below = [c for c in cand if cut[c] < thr]
        ties = [c for c in cand if cut[c] == thr]
        cand = sorted(set(below) | set(_even_flop_picks(graph, ties, need - len(below))))
    return [0, *cand, n]


def _even_flop_picks(graph: OpGraph, ties: list[int], k: int) -> list[int]:
    """k of the cut positions `ties`, each the unused one nearest (in prefix FLOPs) to one of k
    evenly spaced FLOP targets; evenly spaced by position when the graph has no FLOPs."""
    if k <= 0:
        return []
    pf = np.asarray(graph.prefix_flops(), dtype=float)
    key = pf[ties] if pf[-1] > 0 else np.asarray(ties, dtype=float)
    top = float(pf[-1]) if pf[-1] > 0 else float(graph.num_nodes)
    targets = np.linspace(0.0, top, k + 2)[1:-1]
    free = np.ones(len(ties), dtype=bool)
    out = []
    for t in targets:
        dist = np.where(free, np.abs(key - t), np.inf)
        i = int(np.argmin(dist))
        free[i] = False
        out.append(ties[i])
    return out


def symmetric_bandwidth(cluster: Cluster, devices: Sequence[int]) -> np.ndarray:
    idx = np.asarray(devices, dtype=int)
    bw = cluster.bandwidth_bps[np.ix_(idx, idx)]
    return np.minimum(bw, bw.T)


def _max_spanning_tree(w: np.ndarray) -> list[tuple[int, int, float]]:
    """Prim's algorithm on a dense weight matrix (maximising), O(n^2) with numpy."""
    n = w.shape[0]
    if n <= 1:
        return []
    in_tree = np.zeros(n, dtype=bool)
    in_tree[0] = True
    best = w[0].copy()
    parent = np.zeros(n, dtype=int)
    best[0] = -np.inf
    edges = []
    for _ in range(n - 1):
        cand = np.where(in_tree, -np.inf, best)
        j = int(np.argmax(cand))
        edges.append((int(parent[j]), j, float(w[parent[j], j])))
        in_tree[j] = True
        better = (w[j] > best) & ~in_tree
        best[better] = w[j][better]
        parent[better] = j
        best[j] = -np.inf
    return edges


def _components(n: int, edges: list[tuple[int, int, float]], threshold: float) -> list[list[int]]:
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b, w in edges:
        if w >= threshold:
            parent[find(a)] = find(b)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def fence_levels(
    cluster: Cluster, devices: Sequence[int], max_levels: int = MAX_LEVELS
) -> list[list[list[int]]]:
    """Groupings of `devices` (cluster indices), finest last: each grouping is a list of groups,
    each group a list of cluster indices whose links (transitively) reach the level's bandwidth."""
    devs = list(devices)
    if not devs:
        return []
    w = symmetric_bandwidth(cluster, devs)
    np.fill_diagonal(w, 0.0)
    tree = _max_spanning_tree(np.log10(np.maximum(w, 1.0)))
    if not tree:
        return [[devs]]
    logs = sorted({round(e[2] / LEVEL_DECADE) * LEVEL_DECADE for e in tree})
    # thresholds between consecutive bandwidth levels; each split the tree further
    thresholds = [-math.inf] + [x + LEVEL_DECADE / 2 for x in logs[:-1]]
    if len(thresholds) > max_levels:
        pick = np.linspace(0, len(thresholds) - 1, max_levels).round().astype(int)
        thresholds = [thresholds[i] for i in sorted(set(pick.tolist()))]
    out: list[list[list[int]]] = []
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for t in thresholds:
        comps = _components(len(devs), tree, t)
        key = tuple(tuple(c) for c in comps)
        if key in seen:
            continue
        seen.add(key)
        out.append([[devs[i] for i in c] for c in comps])
    return out


def order_within(cluster: Cluster, group: Sequence[int]) -> list[int]:
    """Inside a fast group: most memory first (early 1F1B stages hold more micro-batches), then speed."""
    return sorted(group, key=lambda d: (-cluster.devices[d].memory_gb, -cluster.devices[d].tflops, d))


def order_groups(cluster: Cluster, groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """Order groups as a path along fast links: greedy nearest neighbour from every start (from the
    ORDER_STARTS fastest groups when there are many), keeping the path whose slowest hop is fastest
    (ties: largest sum of log bandwidth)."""
    g = len(groups)
    if g <= 1:
        return [list(x) for x in groups]
    order = np.concatenate([np.asarray(x, dtype=int) for x in groups])
    starts = np.cumsum([0] + [len(x) for x in groups[:-1]])
    bw = cluster.bandwidth_bps[np.ix_(order, order)]
    link = np.maximum.reduceat(np.maximum.reduceat(bw, starts, axis=0), starts, axis=1)
    np.fill_diagonal(link, 0.0)
    logl = np.log10(np.maximum(link, 1.0))
    speed = [sum(cluster.devices[d].tflops for d in x) for x in groups]
    first = sorted(range(g), key=lambda i: -speed[i])[: ORDER_STARTS if g > ORDER_STARTS else g]
    best_key, best_path = None, None
    for start in first:
        path = [start]
        used = np.zeros(g, dtype=bool)
        used[start] = True
        hops = []
        for _ in range(g - 1):
            row = np.where(used, -np.inf, logl[path[-1]])
            nxt = int(np.argmax(row))
            hops.append(float(row[nxt]))
            path.append(nxt)
            used[nxt] = True
        key = (min(hops), sum(hops))
        if best_key is None or key > best_key:
            best_key, best_path = key, path
    assert best_path is not None
    return [list(groups[i]) for i in best_path]


def order_devices(cluster: Cluster, groups: Sequence[Sequence[int]]) -> list[int]:
    """A pipeline order over groups: groups as a fast path, devices inside by memory."""
    return [d for grp in order_groups(cluster, [order_within(cluster, x) for x in groups]) for d in grp]
