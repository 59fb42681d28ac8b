"""Pricing a configuration (pipelines as device orders) under the cost model, and building its Plan.

A pipeline's options (a split per micro-batch size, with its data-parallel sync) cached in a
`Context`; the batch shared between pipelines to minimise the slowest (`evaluate_config`); an
evaluated configuration turned into a Plan (`build_plan`); the step time of an existing Plan
(`evaluate_plan`). Every search (planner, anchors, grids, DT-FM, baselines, the exhaustive
reference) prices through here, with plan/estimator.py's cost model."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from fusionnode.errors import ConfigError, PlanError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan import fence
from fusionnode.plan.cluster import Cluster
from fusionnode.plan.dpsync import ring_sync_s
from fusionnode.plan.estimator import (
    DEFAULT_EFFICIENCY,
    PLAN_KEEP_FLOOR,
    USABLE_MEMORY_FRACTION,
    Chain,
    Estimator,
    PipelineCost,
)
from fusionnode.plan.hosts import assign_param_names, choose_hosts
from fusionnode.plan.plan import OptimizerHost, PipelinePlan, Plan, Prediction, StagePlan
from fusionnode.plan.shared import shared_host_bound
from fusionnode.plan.split import (
    DP_ITERATIONS,
    DP_ITERATIONS_LARGE,
    best_split,
    micro_batch_sizes,
    refine_split,
    split_dp,
)
from fusionnode.plan.syncprice import SyncPrice, amortised_sync_s

SYNC_CAP_FRACTIONS = (0.75, 0.5, 0.25)  # sync caps (x the fastest split's sync) the DP is re-run with
SMALL_CLUSTER = 8  # up to this many workers: DP at every micro-batch size, then local search


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to run a pipeline: a split at micro-batch size u, with its sync time."""

    cost: PipelineCost
    sync_s: float

    @property
    def u(self) -> int:
        return self.cost.micro_batch_size

    def time(self, samples: int) -> float:
        if samples <= 0:
            return 0.0
        return self.cost.pipeline_time(-(-samples // self.u)) + self.sync_s

    def capacity(self, tau: float) -> int:
        """Most samples this option runs within tau seconds."""
        return self.cost.capacity(tau - self.sync_s) * self.u


@dataclasses.dataclass
class Context:
    est: Estimator
    chain: Chain
    batch: int
    hosts: list[tuple[int, float]]
    workers: list[int]
    micro_batches: int | None = None  # fixed by the user, else chosen
    sizes: list[int] = dataclasses.field(default_factory=list)
    exhaustive_sizes: bool = False  # run the split DP at every micro-batch size (small instances)
    _splits: dict = dataclasses.field(default_factory=dict)
    _host_terms: tuple | None = None
    evaluations: int = 0

    def _key(self, devices: tuple[int, ...], u: int) -> tuple:
        """Pipelines of identical devices on identical links split identically: cache by that."""
        est = self.est
        spf = est.seconds_per_flop_all()
        cap = est.capacities()
        links = tuple(est.link(a, b) for a, b in itertools.pairwise(devices))
        return (tuple(float(spf[d]) for d in devices), tuple(float(cap[d]) for d in devices), links, u)

    def split(self, devices: tuple[int, ...], u: int) -> PipelineCost | None:
        key = self._key(devices, u)
        if key not in self._splits:
            self.evaluations += 1
            its = DP_ITERATIONS if self.exhaustive_sizes else DP_ITERATIONS_LARGE
            self._splits[key] = best_split(self.est, self.chain, devices, u, its)
        cost = self._splits[key]
        if cost is None or cost.devices == devices:
            return cost
        return dataclasses.replace(cost, devices=devices)

    def refine(self, cost: PipelineCost, multi: bool, samples: int) -> PipelineCost:
        """refine_split for a pipeline running `samples` samples, cached like the splits."""
        if cost.stages < 2:
            return cost
        key = ("refine", tuple(self.hosts), multi, *self._key(cost.devices, cost.micro_batch_size))
        key = (*key, cost.split, samples)
        if key not in self._splits:
            self._splits[key] = refine_split(
                self.est, self.chain, cost, lambda c: Option(c, self.sync(c, multi)).time(samples)
            )
        c = self._splits[key]
        return c if c.devices == cost.devices else dataclasses.replace(c, devices=cost.devices)

    def reprice(self, cost: PipelineCost, u: int) -> PipelineCost | None:
        """The same split at another micro-batch size (AdaTopK ratios re-chosen)."""
        key = ("reprice", *self._key(cost.devices, u), cost.split)
        if key not in self._splits:
            c = self.est.evaluate(self.chain, cost.devices, cost.split, u)
            self._splits[key] = c if c.fits else None
        c = self._splits[key]
        if c is None or c.devices == cost.devices:
            return c
        return dataclasses.replace(c, devices=cost.devices)

    def sync_terms(self, multi: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """Per device (fixed seconds, seconds per parameter byte) of a stage's sync; None when the
        sync depends on the pipeline (offload off)."""
        if not self.est.offload:
            return None
        key = tuple(self.hosts)
        if self._host_terms is None or self._host_terms[0] != key:
            bw = self.est.cluster.bandwidth_bps
            lat = self.est.cluster.latency_s
            n = bw.shape[0]
            fixed = np.zeros(n)
            per_byte = np.zeros(n)
            for h, share in self.hosts:
                if share <= 0:
                    continue
                mask = np.arange(n) != h
                fixed[mask] += 2.0 * lat[mask, h]
                per_byte[mask] += 2.0 * share * 8.0 * self.est.sync.wire_ratio / bw[mask, h]
            self._host_terms = (key, fixed, per_byte)
        return self._host_terms[1], self._host_terms[2]

    def sync(self, cost: PipelineCost, multi: bool) -> float:
        """The pipeline's data-parallel sync (Estimator.stage_sync_time, vectorised over hosts)."""
        terms = self.sync_terms(multi)
        if terms is None:
            outside = self.est.outside_bandwidth(cost.devices, self.workers)
            return max(
                self.est.stage_sync_time(d, p, self.hosts, multi, float(o))
                for d, p, o in zip(cost.devices, cost.param_bytes, outside, strict=True)
            )
        fixed, per_byte = terms
        round_s = max(
            (float(fixed[d] + p * per_byte[d]) if p > 0 else 0.0)
            for d, p in zip(cost.devices, cost.param_bytes, strict=True)
        )
        return amortised_sync_s(round_s, self.est.sync)

    def sync_variants(self, base: PipelineCost, multi: bool) -> list[PipelineCost]:
        """Splits that trade a slower bottleneck for a shorter sync: the DP re-run with every
        stage's sync capped at SYNC_CAP_FRACTIONS of the base split's sync."""
        terms = self.sync_terms(multi)
        if terms is None:
            return []
        y0 = self.sync(base, multi)
        if y0 <= 0:
            return []
        key = ("sync", tuple(self.hosts), *self._key(base.devices, base.micro_batch_size), base.split)
        if key not in self._splits:
            out = []
            for frac in SYNC_CAP_FRACTIONS:
                split = split_dp(
                    self.est,
                    self.chain,
                    base.devices,
                    base.micro_batch_size,
                    max(base.compute_s),
                    y0 * frac,
                    terms,
                )
                if split is not None and tuple(split) != base.split:
                    c = self.est.evaluate(self.chain, base.devices, split, base.micro_batch_size)
                    if c.fits:
                        out.append(c)
            self._splits[key] = out
        return [
            c if c.devices == base.devices else dataclasses.replace(c, devices=base.devices)
            for c in self._splits[key]
        ]

    def options(self, devices: tuple[int, ...], multi: bool, share_hint: int | None = None) -> list[Option]:
        """Options of a pipeline over these devices (in order); [] if none fits.

        With the micro-batch count free: the split DP runs at a reference size (about four
        micro-batches per stage), the split is re-priced at nearby sizes, and the DP runs again
        at the best of them."""
        hint = share_hint or self.batch
        s = len(devices)
        if self.micro_batches is not None:
            sizes = sorted({max(1, -(-b // self.micro_batches)) for b in (hint, max(1, hint // 2), hint * 2)})
            out = []
            for u in (x for x in sizes if x <= self.batch):
                cost = self.split(devices, u)
                if cost is not None:
                    out.extend(
                        Option(c, self.sync(c, multi)) for c in [cost, *self.sync_variants(cost, multi)]
                    )
            return out
        if self.exhaustive_sizes:
            base = self.sizes
        else:
            ref = max(1, hint // (4 * s))
            i0 = max(0, min(len(self.sizes) - 1, int(math.log2(ref))))
            base = self.sizes[max(0, i0 - 2) : i0 + 3]
        u0 = base[len(base) // 2] if not self.exhaustive_sizes else None
        costs: dict[int, PipelineCost] = {}
        dp_sizes = base if u0 is None else [u0]
        for u in dp_sizes:
            c = self.split(devices, u)
            if c is not None:
                costs[u] = c
        if u0 is not None:
            ref_cost = costs.get(u0)
            if ref_cost is None:  # the reference size does not fit: try the smallest
                u0 = base[0]
                ref_cost = self.split(devices, u0)
                if ref_cost is None:
                    return []
                costs[u0] = ref_cost
            for u in base:
                if u not in costs:
                    c = self.reprice(ref_cost, u)
                    if c is not None:
                        costs[u] = c
            best_u = min(costs, key=lambda u: Option(costs[u], 0.0).time(hint))
            if best_u != u0:
                c = self.split(devices, best_u)
                if c is not None and c.bottleneck_s < costs[best_u].bottleneck_s:
                    costs[best_u] = c
        out = []
        for u, c in sorted(costs.items()):
            refined = self.refine(c, multi, hint)
            if refined is not c:
                out.append(Option(refined, self.sync(refined, multi)))
            out.append(Option(c, self.sync(c, multi)))
            if self.exhaustive_sizes or u == u0:
                out.extend(Option(v, self.sync(v, multi)) for v in self.sync_variants(c, multi))
        return out


def pipe_time(opts: Sequence[Option], samples: int, fixed_m: int | None) -> tuple[float, Option | None]:
    best, arg = math.inf, None
    for o in opts:
        if fixed_m is not None and -(-samples // o.u) > fixed_m:
            continue
        t = o.time(samples)
        if t < best:
            best, arg = t, o
    return best, arg


@dataclasses.dataclass(frozen=True)
class Evaluated:
    step_s: float
    pipelines: tuple[tuple[int, ...], ...]  # used pipelines (device orders)
    shares: tuple[int, ...]
    choices: tuple[Option, ...]
    hosts: tuple[tuple[int, float], ...]
    dp_sync: str = ""  # "ring": priced by `ring_variant` (the optimizer on the workers); else the estimator's
    origin: str = ""  # "pruned": a layout with devices left out (plan/prune.py); else ""


def evaluate_config(ctx: Context, pipelines: Sequence[tuple[int, ...]]) -> Evaluated | None:
    """Best batch shares for these pipelines; None if they cannot run the batch at all."""
    pipes = [p for p in pipelines if p]
    if not pipes:
        return None
    multi = len(pipes) > 1
    hint = max(1, ctx.batch // len(pipes))
    opts = [ctx.options(p, multi, hint) for p in pipes]
    live = [i for i, o in enumerate(opts) if o]
    if not live:
        return None
    fixed_m = ctx.micro_batches
    # all options of all live pipelines as arrays, for a vectorised capacity(tau)
    flat = [(k, o) for k, i in enumerate(live) for o in opts[i]]
    owner = np.array([k for k, _ in flat])
    uu = np.array([o.u for _, o in flat], dtype=float)
    tt = np.array([o.cost.period_s for _, o in flat])
    ff = np.array([o.cost.fill_s for _, o in flat])
    yy = np.array([o.sync_s for _, o in flat])
    mcap = np.full(len(flat), np.inf) if fixed_m is None else np.full(len(flat), float(fixed_m))
    starts = np.searchsorted(owner, np.arange(len(live)))

    def capacities(tau: float) -> np.ndarray:
        left = tau - yy - ff
        m = np.where(left >= -1e-12 * ff, np.floor(np.maximum(left, 0.0) / tt * (1 + 1e-12)) + 1, 0.0)
        per = np.minimum(np.maximum(m, 0.0), mcap) * uu
        return np.maximum.reduceat(per, starts)

    # bisection on the step time tau: the smallest tau whose capacities cover the batch
    hi = min(pipe_time(opts[i], ctx.batch, fixed_m)[0] for i in live)
    if not math.isfinite(hi):
        hi = 1.0
        while capacities(hi).sum() < ctx.batch:
            hi *= 2
            if hi > 1e12:
                return None
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if capacities(mid).sum() >= ctx.batch:
            hi = mid
        else:
            lo = mid
    capv = capacities(hi)
    caps = {i: int(min(ctx.batch, capv[k])) for k, i in enumerate(live)}
    surplus = sum(caps.values()) - ctx.batch
    for i in sorted(live, key=lambda i: -caps[i]):  # trim the surplus, biggest shares first
        take = min(surplus, caps[i])
        caps[i] -= take
        surplus -= take
    used = [i for i in live if caps[i] > 0]
    # second pass: re-evaluate with the real pipeline count (sync of a single pipeline is 0 off-load)
    if len(used) != len(pipes):
        return evaluate_config(ctx, [pipes[i] for i in used]) if len(used) < len(pipes) else None
    choices, times = [], []
    for i in used:
        t, o = pipe_time(opts[i], caps[i], fixed_m)
        if o is None:
            return None
        choices.append(o)
        times.append(t)
    total_params = float(ctx.chain.params[-1])
    shared = shared_host_bound(
        ctx.est, [(o.cost, -(-caps[i] // o.u)) for i, o in zip(used, choices, strict=True)], ctx.hosts
    )
    step = (
        max(max(times), ctx.est.host_bound(total_params, ctx.hosts, len(used)), shared)
        + ctx.est.step_overhead_s
    )
    return Evaluated(
        step_s=step,
        pipelines=tuple(pipes[i] for i in used),
        shares=tuple(caps[i] for i in used),
        choices=tuple(choices),
        hosts=tuple(ctx.hosts),
    )


def ring_variant(ctx: Context, ev: Evaluated) -> Evaluated | None:
    """`ev`'s pipelines, shares and splits with the optimizer on the workers and the data-parallel sync
    by ring all-reduce among the replicas of each stage (plan/dpsync.py) instead of optimizer hosts
    (one pipeline: nothing to synchronise); None when the optimizer state does not fit the workers."""
    local = copy.copy(ctx.est)  # the same calibration, with the optimizer state on the workers
    local.offload = False
    choices, times, layout = [], [], []
    for devices, share, opt in zip(ev.pipelines, ev.shares, ev.choices, strict=True):
        c = opt.cost
        cost = local.evaluate(ctx.chain, c.devices, c.split, c.micro_batch_size, ratios=list(c.ratios))
        if not cost.fits:
            return None
        choices.append(Option(cost, 0.0))
        times.append(cost.pipeline_time(-(-share // c.micro_batch_size)))
        layout.append((devices, c.split))
    cl = ctx.est.cluster
    sync = ring_sync_s(cl.bandwidth_bps, cl.latency_s, ctx.chain.params, layout)
    shared = shared_host_bound(
        local,
        [(o.cost, -(-x // o.u)) for o, x in zip(choices, ev.shares, strict=True)],
        ring=True,
    )
    return dataclasses.replace(
        ev,
        step_s=max(max(times) + sync, shared) + local.step_overhead_s,
        choices=tuple(choices),
        hosts=(),
        dp_sync="ring",
    )


def with_shares(ctx: Context, ev: Evaluated, shares: Sequence[int]) -> Evaluated | None:
    """`ev`'s pipelines, splits, micro-batch sizes and sync with other batch shares (summing to the
    batch, each at least one sample), re-priced by the closed form; None where a share is not
    allowed (ctx.micro_batches fixes the micro-batch count, a share of zero)."""
    shares = tuple(int(x) for x in shares)
    if len(shares) != len(ev.pipelines) or sum(shares) != ctx.batch or min(shares) < 1:
        return None
    if ctx.micro_batches is not None:
        return None
    moved = dataclasses.replace(ev, shares=shares)
    if ev.dp_sync == "ring":
        return ring_variant(ctx, moved)
    times = [o.time(x) for o, x in zip(ev.choices, shares, strict=True)]
    bound = ctx.est.host_bound(float(ctx.chain.params[-1]), list(ev.hosts), len(shares))
    shared = shared_host_bound(
        ctx.est, [(o.cost, -(-x // o.u)) for o, x in zip(ev.choices, shares, strict=True)], ev.hosts
    )
    return dataclasses.replace(moved, step_s=max(max(times), bound, shared) + ctx.est.step_overhead_s)


def worker_indices(cluster: Cluster) -> list[int]:
    return [i for i, d in enumerate(cluster.devices) if d.is_worker]


def check_fits(
    graph: OpGraph, cluster: Cluster, est: Estimator, workers: Sequence[int], chain: Chain
) -> None:
    need = float(chain.params[-1]) * est.param_factor()
    have = float(sum(est.capacity(d) for d in workers))
    if need > have:
        extra = "" if est.offload else "; --offload on would need about half"
        raise PlanError(
            f"model {graph.model_name!r} needs {need / 1e9:.2f} GB for weights and gradients"
            f"{'' if est.offload else ' and optimizer state'} but the {len(workers)} workers of cluster "
            f"{cluster.name!r} have {have / 1e9:.2f} GB usable ({USABLE_MEMORY_FRACTION:.0%} of memory_gb){extra}"
        )
    blocks = np.diff(chain.params) * est.param_factor()
    biggest = float(blocks.max())
    top = max(est.capacity(d) for d in workers)
    if biggest > top:
        raise PlanError(
            f"the largest indivisible block of {graph.model_name!r} needs {biggest / 1e9:.2f} GB, the largest "
            f"worker has {top / 1e9:.2f} GB usable; a device with at least {biggest / 1e9 / USABLE_MEMORY_FRACTION:.2f} "
            "memory_gb would fit"
        )


def _validate_inputs(graph: OpGraph, batch_size: int, micro_batches: int | None) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size must be a positive integer, got {batch_size!r}")
    if micro_batches is not None and micro_batches < 1:
        raise ConfigError(f"micro-batches must be >= 1, got {micro_batches!r}")
    if graph.num_nodes == 0:
        raise ConfigError(f"model {graph.model_name!r} has no operators")


def make_context(
    graph: OpGraph,
    cluster: Cluster,
    batch_size: int,
    micro_batches: int | None,
    offload: bool,
    efficiency: float | None,
    estimator: Estimator | None,
    max_blocks: int,
    compress: bool = True,
    keep_floor: float = PLAN_KEEP_FLOOR,
    sync: SyncPrice | None = None,
) -> Context:
    _validate_inputs(graph, batch_size, micro_batches)
    est = estimator or Estimator(
        cluster,
        DEFAULT_EFFICIENCY if efficiency is None else efficiency,
        offload=offload,
        compress=compress,
        keep_floor=keep_floor,
        sync=sync,
    )
    chain = Chain.from_graph(graph, fence.coarsen(graph, max_blocks))
    workers = worker_indices(cluster)
    check_fits(graph, cluster, est, workers, chain)
    hosts = choose_hosts(cluster, workers, float(chain.params[-1]), spread=True) if est.offload else []
    return Context(
        est=est,
        chain=chain,
        batch=batch_size,
        hosts=hosts,
        workers=workers,
        micro_batches=micro_batches,
        sizes=micro_batch_sizes(batch_size),
        exhaustive_sizes=len(workers) <= SMALL_CLUSTER,
    )


def build_plan(graph: OpGraph, ctx: Context, ev: Evaluated, seq_len: int | None, strategy: str) -> Plan:
    cluster = ctx.est.cluster
    bounds = ctx.chain.bounds
    pipes = []
    memory: dict[str, float] = {}
    for devices, share, opt in zip(ev.pipelines, ev.shares, ev.choices, strict=False):
        c = opt.cost
        stages = []
        for k, d in enumerate(devices):
            dev_id = cluster.devices[d].id
            stages.append(
                StagePlan(
                    devices=(dev_id,),
                    lo=int(bounds[c.split[k]]),
                    hi=int(bounds[c.split[k + 1]]),
                    keep_ratio=float(c.ratios[k]),
                    compute_s=float(c.compute_s[k]),
                    comm_s=float(c.comm_s[k]),
                    memory_bytes=float(c.memory_bytes[k]),
                )
            )
            memory[dev_id] = float(c.memory_bytes[k])
        m = -(-share // opt.u)
        pipes.append(
            PipelinePlan(
                stages=tuple(stages),
                micro_batches=m,
                micro_batch_size=opt.u,
                batch_share=int(share),
                time_s=float(opt.time(share)),
            )
        )
    names = assign_param_names(graph, ev.hosts) if ev.hosts else []
    hosts = tuple(
        OptimizerHost(cluster.devices[h].id, float(share), tuple(nm))
        for (h, share), nm in zip(ev.hosts, names, strict=False)
    )
    seq = graph.seq_len if seq_len is None else seq_len
    tokens = ctx.batch * (seq if seq > 0 else 1)
    p = Plan(
        model=graph.model_name,
        batch_size=ctx.batch,
        seq_len=seq,
        num_nodes=graph.num_nodes,
        pipelines=tuple(pipes),
        offload=ctx.est.offload and ev.dp_sync != "ring",
        dp_sync="ring" if ev.dp_sync == "ring" or not ctx.est.offload else "hosts",
        optimizer_hosts=hosts,
        prediction=Prediction(
            step_time_s=float(ev.step_s),
            tokens_per_s=float(tokens / ev.step_s) if ev.step_s > 0 else 0.0,
            device_memory_bytes=tuple(sorted(memory.items())),
        ),
        strategy=strategy,
        cluster=cluster.name,
    )
    p.validate(graph)
    return p


def evaluate_plan(
    graph: OpGraph,
    cluster: Cluster,
    p: Plan,
    estimator: Estimator | None = None,
    sync: SyncPrice | None = None,
) -> float:
    """The cost model's step time for an existing plan, with the plan's own keep-ratios (and the
    data-parallel sync priced by `sync`, every step by default)."""
    est = estimator or Estimator(cluster, offload=p.offload, sync=sync)
    bounds = sorted({0, graph.num_nodes} | {s.lo for pl in p.pipelines for s in pl.stages})
    chain = Chain.from_graph(graph, bounds)
    pos = {b: i for i, b in enumerate(bounds)}
    hosts = [(cluster.index(h.device), h.share) for h in p.optimizer_hosts]
    workers = worker_indices(cluster)
    multi = len(p.pipelines) > 1
    ring = p.dp_sync == "ring" and multi
    times, layout, costs = [], [], []
    for pl in p.pipelines:
        devs = [cluster.index(s.devices[0]) for s in pl.stages]
        split = [pos[s.lo] for s in pl.stages] + [chain.blocks]
        ratios = [s.keep_ratio for s in pl.stages]
        cost = est.evaluate(chain, devs, split, pl.micro_batch_size, ratios=ratios)
        ctx = Context(est, chain, p.batch_size, hosts, workers)
        times.append(cost.pipeline_time(pl.micro_batches) + (0.0 if ring else ctx.sync(cost, multi)))
        layout.append((devs, split))
        costs.append((cost, pl.micro_batches))
    if ring:  # the replicas' ring all-reduce (plan/dpsync.py) after the slowest pipeline
        sync = ring_sync_s(cluster.bandwidth_bps, cluster.latency_s, chain.params, layout)
        return max(max(times) + sync, shared_host_bound(est, costs, ring=True)) + est.step_overhead_s
    return (
        max(
            max(times),
            est.host_bound(float(chain.params[-1]), hosts, len(p.pipelines)),
            shared_host_bound(est, costs, hosts),
        )
        + est.step_overhead_s
    )
