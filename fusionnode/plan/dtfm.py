"""DT-FM's scheduler (Yuan et al., NeurIPS 2022), re-implemented from its paper and public
description as a baseline: it is not the authors' code, and its results are labelled "dtfm".

Given a shape (D data-parallel replicas x S pipeline stages) and the devices' pairwise delay and
bandwidth, DT-FM searches which devices form each of the S data-parallel groups ("partitions" of
D devices that hold the same layers) and how the groups are chained into pipelines:

* score of a partition into groups (plan/dtfm_cost.py): ``DP + 2 * PP``, DP the slowest member's
  all-reduce inside its group, PP the cheapest open-loop travelling-salesman path through the
  groups, where going from group a to group b costs their bottleneck bipartite matching (the
  perfect matching of a's devices to b's whose slowest activation transfer is fastest); the
  matchings give each pipeline its device per stage;
* search: a steady-state genetic algorithm over balanced partitions (GCMA): a random initial
  population, then per trial two random parents, a five-point crossover of their group labels
  (rebalanced to equal group sizes), a local refinement of the child, and the child replaces the
  worse parent when it scores better. Published settings (DT-FM's scheduler): population 100,
  4,900 trials. The paper's refinement moves devices in cycles between groups (cyclic
  partitioning); this re-implementation restricts cycles to length two (swaps), taking the best
  improving swap of the balanced graph-partition objective (the groups' summed all-reduce edge
  costs) until none improves, at most `refine_swaps` times.

Devices beyond D x S (when the worker count is not a multiple) form an idle group that the search
may exchange with the others. The open-loop path is exact (Held-Karp) up to HELD_KARP_MAX groups,
nearest neighbour from every start beyond. Layers are split evenly over the stages and the batch
evenly over the pipelines, as in DT-FM.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import time
from collections.abc import Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from fusionnode.plan.cluster import Cluster
from fusionnode.plan.dtfm_cost import dp_edge_costs, pp_edge_costs
from fusionnode.plan.estimator import Chain
from fusionnode.plan.evaluate import Context, Evaluated
from fusionnode.plan.grid import even_split, price_grid

log = logging.getLogger(__name__)

POPULATION = 100  # DT-FM's published population size
TRIALS = 4900  # DT-FM's published number of trials (offspring)
CROSSOVER_POINTS = 5  # five-point crossover
HELD_KARP_MAX = 12  # exact open-loop TSP up to this many groups
PLANNER_POPULATION = 12  # the cheaper budget the planner runs DT-FM with as one of its candidates
PLANNER_TRIALS = 36


@dataclasses.dataclass(frozen=True)
class DtfmResult:
    pipelines: tuple[tuple[int, ...], ...]  # D pipelines, S devices each (cluster indices, stage order)
    score_s: float  # DP + 2 * PP of the best partition
    dp_s: float
    pp_s: float
    trials: int
    seconds: float  # search wall time


def bottleneck_matching(cost: np.ndarray) -> tuple[float, np.ndarray]:
    """Perfect matching of rows to columns of a square cost matrix minimising the largest matched
    cost -> (that cost, col index per row). Binary search on the sorted costs; at each threshold a perfect
    matching within it exists iff the 0/1 assignment problem (1 above it) has cost 0."""
    n = cost.shape[0]
    if n == 1:
        return float(cost[0, 0]), np.zeros(1, dtype=int)
    vals = np.unique(cost)
    lower = max(float(cost.min(axis=1).max()), float(cost.min(axis=0).max()))
    lo = int(np.searchsorted(vals, lower))
    hi = len(vals) - 1
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        over = (cost > vals[mid]).astype(float)  # a perfect matching avoiding these exists iff
        rows, cols = linear_sum_assignment(over)  # the cheapest assignment of the 0/1 costs is 0
        if over[rows, cols].sum() == 0:
            best, hi = (float(vals[mid]), cols), mid - 1
        else:
            lo = mid + 1
    assert best is not None  # the full threshold always matches
    return best[0], np.asarray(best[1], dtype=int)


def open_loop_path(w: np.ndarray) -> tuple[float, list[int]]:
    """Cheapest Hamiltonian path (any start, any end) through a symmetric cost matrix."""
    g = w.shape[0]
    if g == 1:
        return 0.0, [0]
    if g > HELD_KARP_MAX:
        best = (math.inf, [])
        for start in range(g):
            path, used, total = [start], {start}, 0.0
            while len(path) < g:
                row = [(w[path[-1], j], j) for j in range(g) if j not in used]
                c, j = min(row)
                total += c
                path.append(j)
                used.add(j)
            if total < best[0]:
                best = (total, path)
        return best
    full = 1 << g
    dp = np.full((full, g), np.inf)
    parent = np.full((full, g), -1, dtype=int)
    for j in range(g):
        dp[1 << j, j] = 0.0
    masks = np.arange(full)
    pop = np.array([bin(m).count("1") for m in range(full)])
    cols = np.arange(g)
    for k in range(1, g):  # extend every path of k groups by one group, all masks at once
        layer = masks[pop == k]
        cand = dp[layer][:, :, None] + w[None, :, :]  # [mask, last, nxt]
        last = np.argmin(cand, axis=1)
        val = np.take_along_axis(cand, last[:, None, :], axis=1)[:, 0, :]
        free = (layer[:, None] >> cols[None, :]) & 1 == 0
        mi, nx = np.nonzero(free)
        dp[layer[mi] | (1 << nx), nx] = val[mi, nx]
        parent[layer[mi] | (1 << nx), nx] = last[mi, nx]
    end = int(np.argmin(dp[full - 1]))
    total = float(dp[full - 1, end])
    path, mask, cur = [], full - 1, end
    while cur >= 0:
        path.append(cur)
        prev = parent[mask, cur]
        mask ^= 1 << cur
        cur = int(prev)
    return total, path[::-1]


class Scheduler:
    """DT-FM's search for one cluster, shape and sizes (module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        workers: Sequence[int],
        replicas: int,
        stages: int,
        grad_bytes: float,
        act_bytes: float,
        seed: int = 0,
    ):
        if replicas * stages > len(workers) or replicas < 1 or stages < 1:
            raise ValueError(f"shape {replicas} x {stages} does not fit {len(workers)} workers")
        self.workers = np.asarray(workers, dtype=int)
        self.n = len(workers)
        self.d, self.s = replicas, stages
        idx = self.workers
        self.dp_w = dp_edge_costs(cluster, grad_bytes, replicas)[np.ix_(idx, idx)]
        self.pp_w = pp_edge_costs(cluster, act_bytes)[np.ix_(idx, idx)]
        self.sym_dp = self.dp_w + self.dp_w.T
        self.sizes = [replicas] * stages + (
            [self.n - replicas * stages] if self.n > replicas * stages else []
        )
        self.rng = random.Random(seed)

    # ---- the score ---------------------------------------------------------------------------
    def groups(self, labels: np.ndarray) -> list[np.ndarray]:
        return [np.nonzero(labels == g)[0] for g in range(self.s)]

    def dp_cost(self, groups: list[np.ndarray]) -> float:
        worst = 0.0
        for m in groups:
            if len(m) > 1:
                worst = max(worst, float(self.dp_w[np.ix_(m, m)].sum(axis=1).max()))
        return worst

    def pp_cost(self, groups: list[np.ndarray]) -> tuple[float, list[int], dict]:
        s = self.s
        w = np.zeros((s, s))
        matches: dict[tuple[int, int], np.ndarray] = {}
        for a in range(s):
            for b in range(a + 1, s):
                c = self.pp_w[np.ix_(groups[a], groups[b])]
                c = np.maximum(c, self.pp_w[np.ix_(groups[b], groups[a])].T)
                w[a, b], matches[(a, b)] = bottleneck_matching(c)
                w[b, a] = w[a, b]
        total, path = open_loop_path(w)
        return total, path, matches

    def score(self, labels: np.ndarray) -> tuple[float, float, float]:
        groups = self.groups(labels)
        dp = self.dp_cost(groups)
        pp = self.pp_cost(groups)[0] if self.s > 1 else 0.0
        return dp + 2.0 * pp, dp, pp

    # ---- the genetic algorithm ---------------------------------------------------------------
    def random_labels(self) -> np.ndarray:
        labels = np.concatenate([np.full(k, g) for g, k in enumerate(self.sizes)])
        perm = list(range(self.n))
        self.rng.shuffle(perm)
        return labels[np.asarray(perm)]

    def crossover(self, p1: np.ndarray, p2: np.ndarray) -> np.ndarray:
        """Five points of p1 copied into p2, then group sizes restored (an overfull group's
        surplus devices, in device order, move to the groups that lack)."""
        child = p2.copy()
        for v in self.rng.sample(range(self.n), min(CROSSOVER_POINTS, self.n)):
            child[v] = p1[v]
        counts = np.bincount(child, minlength=len(self.sizes))
        for v in range(self.n):
            g = child[v]
            if counts[g] > self.sizes[g]:
                short = next(h for h in range(len(self.sizes)) if counts[h] < self.sizes[h])
                counts[g] -= 1
                counts[short] += 1
                child[v] = short
        return child

    def refine(self, labels: np.ndarray, max_swaps: int) -> np.ndarray:
        """Best improving swaps of the balanced graph-partition objective (module docstring)."""
        labels = labels.copy()
        ng = len(self.sizes)
        onehot = np.zeros((self.n, ng))
        onehot[np.arange(self.n), labels] = 1.0
        for _ in range(max_swaps):
            conn = self.sym_dp @ onehot  # [v, g]: v's cost to the members of g
            if ng > self.s:
                conn[:, self.s] = 0.0  # the idle group costs nothing
            own = conn[np.arange(self.n), labels]
            to_other = conn[:, labels]  # [v, u]: v's cost to u's group
            live = (labels < self.s).astype(float)
            # v joins u's group (losing u), u joins v's group (losing v)
            delta = to_other + to_other.T - own[:, None] - own[None, :]
            delta -= self.sym_dp * (live[None, :] + live[:, None])
            delta[labels[:, None] == labels[None, :]] = np.inf
            i, j = np.unravel_index(int(np.argmin(delta)), delta.shape)
            if not delta[i, j] < -1e-12:
                break
            onehot[i, labels[i]] = 0.0
            onehot[j, labels[j]] = 0.0
            labels[i], labels[j] = labels[j], labels[i]
            onehot[i, labels[i]] = 1.0
            onehot[j, labels[j]] = 1.0
        return labels

    def search(
        self, population: int = POPULATION, trials: int = TRIALS, refine_swaps: int | None = None
    ) -> DtfmResult:
        t0 = time.perf_counter()
        swaps = self.n if refine_swaps is None else refine_swaps
        pop = [self.random_labels() for _ in range(population)]
        scores = [self.score(x)[0] for x in pop]
        for _ in range(trials):
            a, b = self.rng.randrange(population), self.rng.randrange(population)
            child = self.refine(self.crossover(pop[a], pop[b]), swaps)
            sc = self.score(child)[0]
            worse = a if scores[a] >= scores[b] else b
            if sc < scores[worse]:
                pop[worse], scores[worse] = child, sc
        best = pop[int(np.argmin(scores))]
        total, dp, pp = self.score(best)
        return DtfmResult(
            pipelines=self.pipelines(best),
            score_s=total,
            dp_s=dp,
            pp_s=pp,
            trials=trials,
            seconds=time.perf_counter() - t0,
        )

    def pipelines(self, labels: np.ndarray) -> tuple[tuple[int, ...], ...]:
        """Pipelines (cluster indices) from a partition: groups in path order, devices of
        consecutive groups joined by their bottleneck matchings."""
        groups = self.groups(labels)
        if self.s == 1:
            return tuple((int(self.workers[v]),) for v in groups[0])
        _, path, matches = self.pp_cost(groups)
        lanes = [[int(v)] for v in groups[path[0]]]
        for prev, nxt in itertools.pairwise(path):
            if prev < nxt:
                col = matches[(prev, nxt)]
                step = {int(groups[prev][r]): int(groups[nxt][col[r]]) for r in range(self.d)}
            else:
                col = matches[(nxt, prev)]
                step = {int(groups[prev][col[r]]): int(groups[nxt][r]) for r in range(self.d)}
            for lane in lanes:
                lane.append(step[lane[-1]])
        return tuple(tuple(int(self.workers[v]) for v in lane) for lane in lanes)


def stage_sizes(chain: Chain, batch: int, replicas: int, stages: int) -> tuple[float, float]:
    """(gradient bytes per stage, activation bytes per boundary per replica) for DT-FM's score: the
    model's parameters split evenly over the stages, and a replica's batch share of the activations
    crossing the even split's boundaries (their mean)."""
    split = even_split(chain.blocks, stages)
    grad = float(chain.params[-1]) / stages
    cuts = [float(chain.cut[b]) for b in split[1:-1]]
    act = (sum(cuts) / len(cuts) if cuts else 0.0) * batch / replicas
    return grad, act


def dtfm_search(
    ctx: Context,
    replicas: int,
    stages: int,
    population: int = POPULATION,
    trials: int = TRIALS,
    seed: int = 0,
) -> tuple[DtfmResult, Evaluated | None]:
    """DT-FM's layout for this shape, and that layout priced under ctx's estimator (layers split
    evenly, batch split evenly, the best micro-batch size per pipeline); None if it does not fit."""
    grad, act = stage_sizes(ctx.chain, ctx.batch, replicas, stages)
    sch = Scheduler(ctx.est.cluster, ctx.workers, replicas, stages, grad, act, seed=seed)
    res = sch.search(population=population, trials=trials)
    split = even_split(ctx.chain.blocks, stages)
    return res, price_grid(ctx, res.pipelines, [split] * replicas)
