"""Escalating a rebalance: the whole job re-planned by the planner, fed the measured stage speeds,
when moving batch shares or re-splitting the pipelines in place is not enough.

A share move (cheap: no parameter moves) and a re-split of each pipeline over its own peers keep the
job's shape: 2 pipelines stay 2, each keeps a micro-batch per step, so a slowed peer keeps a floor of
work. The planner, given the measured speeds, may prefer another shape: the slowed peer idle
(plan/prune.py and the search leave slow devices out), one pipeline fewer, a spare taken in. It is
asked only while a peer of the plan is a clear straggler, and its layout is adopted when

- the job was laid out by the planner (`train`'s default), or its first plan only by the user's
  shape or planner (`--reshape`): a job whose shape the user gave (`--stages`, `--replicas`,
  `--shares`: the simple planner), another planner the user chose, or a cluster document the user
  gave keeps its shape (share moves and re-splits only, train/rebalance.py);
- a peer of the plan runs under OUTLIER (0.35) x the median speed of the plan's other peers (over
  the run's window of measured steps, a median per peer: swarm_cluster.outliers): timing noise on
  shared hardware makes a peer 1.5-2x slower for a while (the driver's own peer is ~2x slower on one
  machine from the start), rarely ~2.7x for a whole window (0.37 was the lowest in clean 300-step
  runs at load 10-20, 1 to 2 windows each); so a clean run all but never asks, and a peer slow from
  the first step is asked about (no slow-down relative to its own past is needed, unlike the share
  move's trigger);
- the planner's layout beats the current one, both scored by the planner's cost model over the same
  cluster (measured speeds, the job's optimizer hosts, or with the optimizer on the workers a ring
  all-reduce among the replicas of each stage; dense links), by more than the job's
  threshold and NOISE_SIGMAS x the measured noise of the other peers' stage speeds (the straggler's
  window holds its slow-down, no noise), at PERSIST_CHECKS checks in a row
  with the same straggler (timing noise makes a random peer look slow now and then), or at the check
  where the share move's trigger acts on that same straggler (its own rule: 2 checks in a row, a
  drop under MIN_DROP, a gain over the noise); a straggler whose own speed dropped on the plan
  under the trigger's SOFT_DROP (has_dropped: in the trigger's reach) waits for the trigger, for
  PERSIST_CHECKS + HOLD_CHECKS checks in a row at most;
- the time it saves over the steps left (that gain x the measured step time) exceeds what moving
  costs: the last re-placement's measured seconds (stages released, new ones placed, parameters
  shipped).

A ring job's (`--offload off`) new stages take the parameters and the AdamW state of the old ones
along (recovery.adopt: ringrecovery.survivor_state), whatever the new shape.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fusionnode.train.speeds import (
    DEFAULT_WINDOW,
    NOISE_SIGMAS,
    PERSIST_CHECKS,
    SOFT_CHECKS,
    SOFT_DROP,
)
from fusionnode.train.swarm_cluster import OUTLIER, outliers  # noqa: F401  (OUTLIER: re-exported)

logger = logging.getLogger(__name__)

# the gain over the current layout (or the share move this check would make) a re-plan by the planner
# needs, unless the job's own threshold (--rebalance-gain) is lower; and over NOISE_SIGMAS x the noise.
# Lower than the share move's 25%: the planner is asked only about a clear straggler (OUTLIER), its
# layout must win at PERSIST_CHECKS checks in a row and pay for its move, and its cost model
# under-states what dropping a straggler gains on shared cores (14% predicted, 38% measured, bench
# faults --pipelines 2)
ESCALATE_GAIN = 0.10
# a straggler whose own speed fell under this fraction of its earlier speed on the plan (SpeedBook.shift)
# dropped on it within the reach of the share move's trigger (its soft tier): its re-plan waits for
# that trigger to act on it (a drop under MIN_DROP at 2 checks in a row or under SOFT_DROP at
# SOFT_CHECKS, a gain over the noise), which a load spell of a clean run rarely passes, for at most
# HOLD_CHECKS checks past the escalation's own streak (in recorded clean runs no spell stayed under
# SOFT_DROP past 2 checks; a straggler the trigger misses is re-planned then). A drop the trigger
# cannot act on (a 2x straggler measures ~0.5) and a peer slow since the plan began (no drop) are
# re-planned at the escalation's own streak of PERSIST_CHECKS checks
DROPPED = SOFT_DROP
HOLD_CHECKS = SOFT_CHECKS
STEP_TIME_STEPS = 4  # the measured step time a gain is priced at: the median of the last this many


def has_dropped(run: Any, peer: str) -> bool:
    """Whether `peer`'s speed fell on the plan under DROPPED x its earlier speed (SpeedBook.shift): a
    drop the share move's trigger can act on."""
    shift = run.recent.shift(peer)
    return shift is not None and shift[0] < DROPPED


def pinned(strategy: str, params: Mapping[str, Any]) -> str | None:
    """Why the job keeps its shape (None: the planner laid it out and may lay it out anew): the user's
    layout (`--stages`, `--replicas`, `--shares`: the simple planner follows them), another planner
    the user chose (a baseline such as even or grid keeps its rule), or a cluster document the user
    gave (its devices' figures are the user's, not measured). `--reshape` (params "reshape"): the
    user's layout or planner laid out the first plan only, and the planner may re-plan it."""
    if params.get("cluster"):
        return "planned over the cluster document given"
    if strategy != "fusion" and not params.get("reshape"):
        return f"laid out by the {strategy} planner"
    return None


@dataclass(frozen=True)
class Escalation:
    adopt: bool
    reason: str
    current_s: float  # the current layout's step time under the planner's model (seconds)
    candidate_s: float  # the planner's layout's
    saved_s: float = 0.0  # measured seconds the move would save over the steps left

    @property
    def gain(self) -> float:
        return 1.0 - self.candidate_s / self.current_s if self.current_s > 0 else 0.0


def decide_escalation(
    current_s: float,
    candidate_s: float,
    *,
    same: bool,
    step_s: float,
    steps_left: int,
    move_cost_s: float,
    min_gain: float,
    noise: float = 0.0,
    sigmas: float = NOISE_SIGMAS,
) -> Escalation:
    """Whether the planner's layout (predicted `candidate_s`) is worth a re-plan away from the current
    one (`current_s`, same model): a gain over max(min_gain, sigmas x noise), and the measured
    `step_s` x gain x `steps_left` seconds saved over `move_cost_s`. `same`: the planner chose the
    current layout. (The caller passes min(ESCALATE_GAIN, the job's threshold) as `min_gain`.)"""
    if same or not (current_s > 0 and math.isfinite(current_s) and math.isfinite(candidate_s)):
        return Escalation(False, "the planner keeps the current layout", current_s, candidate_s)
    gain = 1.0 - candidate_s / current_s
    bar = max(min_gain, sigmas * noise)
    if gain < bar:
        return Escalation(
            False,
            f"the planner's layout gains {gain:.0%}, under the bar {bar:.0%} (noise {noise:.1%})",
            current_s,
            candidate_s,
        )
    saved = gain * step_s * steps_left
    if saved <= move_cost_s:
        return Escalation(
            False,
            f"the planner's layout saves {saved:.1f} s over {steps_left} steps, moving costs {move_cost_s:.1f} s",
            current_s,
            candidate_s,
            saved,
        )
    return Escalation(
        True,
        f"the planner predicts step {current_s:.3f} s -> {candidate_s:.3f} s ({gain:.0%} faster, "
        f"{saved:.1f} s saved over {steps_left} steps against {move_cost_s:.2f} s to move)",
        current_s,
        candidate_s,
        saved,
    )


def as_plan(
    pipelines: Sequence[Any],
    hosts: Sequence[str],
    *,
    model: str,
    batch_size: int,
    seq_len: int,
    num_nodes: int,
    offload: bool = True,
) -> Any:
    """The job's pipelines (train/state.py `Pipeline`s) as a Plan the cost model scores: dense links,
    the optimizer state on `hosts` in equal shares, or with `offload` False on the workers, the
    replicas of each stage synced by ring all-reduce (priced by plan/dpsync.py)."""
    from fusionnode.plan.plan import OptimizerHost, PipelinePlan, Plan, StagePlan

    pipes = []
    for p in pipelines:
        stages = tuple(
            StagePlan((peer,), int(p.bounds[i]), int(p.bounds[i + 1])) for i, peer in enumerate(p.peers)
        )
        m = max(1, int(p.micro_batches))
        pipes.append(PipelinePlan(stages, m, max(1, math.ceil(p.samples / m)), int(p.samples)))
    return Plan(
        model=model,
        batch_size=batch_size,
        seq_len=seq_len,
        num_nodes=num_nodes,
        pipelines=tuple(pipes),
        offload=offload,
        optimizer_hosts=tuple(OptimizerHost(h, 1.0 / len(hosts)) for h in hosts) if offload else (),
    )


def score(
    graph: Any,
    doc: Mapping[str, Any],
    current: Sequence[Any],
    candidate: Sequence[Any],
    hosts: Sequence[str],
    model: str,
    batch_size: int,
    seq_len: int,
    cheap: Sequence[Any] | None = None,
    offload: bool = True,
) -> tuple[float, float]:
    """(current, candidate) step times under the planner's cost model over the cluster document
    `doc` (measured speeds): the current pipelines scored as the better of themselves and `cheap`
    (after a share move), both with the optimizer state on `hosts` (`offload` False: on the workers,
    a ring all-reduce among the replicas) and dense links."""
    from fusionnode.plan.cluster import load_cluster_dict
    from fusionnode.plan.evaluate import evaluate_plan

    cluster = load_cluster_dict(dict(doc), "swarm")
    kw = {
        "model": model,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "num_nodes": graph.num_nodes,
        "offload": offload,
    }
    cur = evaluate_plan(graph, cluster, as_plan(current, hosts, **kw))
    if cheap:
        cur = min(cur, evaluate_plan(graph, cluster, as_plan(cheap, hosts, **kw)))
    return cur, evaluate_plan(graph, cluster, as_plan(candidate, hosts, **kw))


def shape(pipelines: Sequence[Any]) -> list[tuple[tuple[str, ...], tuple[int, ...], int]]:
    return [(tuple(p.peers), tuple(p.bounds), int(p.samples)) for p in pipelines]


async def _score_off_loop(
    job: Any,
    run: Any,
    doc: Mapping[str, Any],
    candidate: Sequence[Any],
    hosts: Sequence[str],
    cheap: Sequence[Any] | None = None,
) -> tuple[float, float]:
    """`score` of the job's pipelines against `candidate` for `run`'s traced graph, in a thread (the
    planner's cost model takes a while; the driver's loop goes on)."""
    import asyncio

    spec = job.spec
    return await asyncio.to_thread(
        score,
        run.traced.graph,
        doc,
        job.pipelines,
        candidate,
        hosts,
        spec.model,
        spec.batch_size,
        run.seq_len,
        cheap,
        bool(job.offload),
    )


class Escalator:
    """One run's escalation state: the streak of checks at which the planner's layout won."""

    def __init__(self, persist: int = PERSIST_CHECKS):
        self.persist = persist
        self.streak = 0
        self.culprit: str | None = None  # the straggler at the streak's checks (the same one each time)
        self.last: Escalation | None = None
        self.tflops: dict[str, float] = {}  # the planner's view of the peers at the last prediction

    def reset(self) -> None:
        self.streak, self.culprit = 0, None

    async def check(
        self,
        recovery: Any,
        job: Any,
        run: Any,
        step: int,
        workers: list[str],
        noise: float,
        cheap: Sequence[Any] | None = None,
        confirmed: Any = None,
    ) -> bool:
        """At a rebalance check: re-plans the job with the planner when the module's rule says so (its
        layout must also beat `cheap`, the pipelines after the share move this check would make).
        `confirmed`: the peer the share move's trigger acts on at this check (which took the same
        bottleneck at 2 checks in a row, a drop to under MIN_DROP of its speed and a gain over the
        noise): when it is the straggler, a winning layout is adopted at this check, not a streak
        later (the move would otherwise come first and the planner's a window after it). With the
        optimizer on the workers (a ring) the layouts are priced with the ring all-reduce and the new
        stages take their AdamW state along (recovery.adopt). True when it re-planned."""
        if pinned(run.strategy, run.params) or job.sync.rounds:
            return False
        in_plan = [p for pipe in job.pipelines for p in pipe.peers]
        if any(len(run.recent.samples.get(p, ())) < DEFAULT_WINDOW for p in in_plan):
            self.reset()  # a new plan, or a peer not measured a window long yet
            return False
        speeds = run.speeds()
        slow = sorted(outliers(speeds, in_plan), key=lambda p: speeds[p])  # the slowest first
        if not slow or any(p not in workers for p in in_plan):
            self.reset()
            return False
        # the noise of the other peers' speeds: the straggler's window holds its level shift, which is
        # no timing noise (the check's figure is a median over the plan's peers, which with two peers
        # counts it half)
        calm = [p for p in in_plan if p not in slow]
        noise = run.recent.noise(calm) if calm else noise
        esc, pipelines = await self.predict(
            recovery, job, run, step, workers, speeds, noise, cheap, leave_out=slow
        )
        self.last = esc
        streak = (self.streak if slow[0] == self.culprit else 0) + 1  # this check's, if it wants
        # a drop within the trigger's reach: only the trigger confirms it, for HOLD_CHECKS more checks
        held = has_dropped(run, slow[0]) and streak < self.persist + HOLD_CHECKS
        ready = confirmed == slow[0] or (not held and streak >= self.persist)
        run.metrics.event(  # the metrics file only: what the planner predicted
            "rebalance_check",
            step=step,
            escalation=True,
            gain=round(esc.gain, 4),
            noise=round(noise, 4),
            culprit=slow[0],
            wants=esc.adopt,
            acts=esc.adopt and ready,
            reason=esc.reason,
            planned=[[p[:12] for p in pipe.peers] + [pipe.samples] for pipe in pipelines],
            tflops=self.tflops,
        )
        logger.info(
            "escalation check at step %d (stragglers %s): %s", step, [p[:12] for p in slow], esc.reason
        )
        if not esc.adopt:
            self.reset()
            return False
        self.streak, self.culprit = streak, slow[0]  # another straggler than before: a new streak
        if not ready:
            return False
        self.reset()
        await recovery.adopt(
            job,
            run,
            workers,
            reason=f"rebalance (re-planned; straggler {slow[0][:12]}…): {esc.reason}",
            pipelines_=pipelines,
        )
        return True

    async def cluster(
        self, recovery: Any, job: Any, run: Any, workers: list[str], speeds: Mapping[str, float]
    ) -> tuple[dict[str, Any], list[str], list[str]]:
        """(the swarm's cluster document at the measured speeds, its workers, the job's hosts)."""
        from fusionnode.train.swarm_cluster import cluster_from_records

        records = await recovery.membership.peers()
        ids = {r.peer_id for r in records}
        workers = [w for w in workers if w in ids]
        hosts = [h for h in job.hosts if h in ids]
        measured = {**run.book.speeds.speeds(), **speeds}  # the run's window first, then the driver's
        doc = cluster_from_records(records, workers, hosts, measured)
        self.tflops = {d["id"][:12]: round(d["tflops"], 5) for d in doc["devices"]}  # for the record
        return doc, workers, hosts

    async def confirms(
        self,
        recovery: Any,
        job: Any,
        run: Any,
        step: int,
        workers: list[str],
        layouts: Sequence[Any],
        shares: Sequence[int],
    ) -> bool:
        """Whether a rebalance move that takes in a peer the plan left idle (a spare: `layouts`, one
        per pipeline, with `shares`) also wins under the planner's cost model at the measured speeds,
        by min(ESCALATE_GAIN, the job's threshold), for a planner's job (others: always). The move's
        own model prices an unmeasured spare by its advertisement, blind to cores it shares with the
        plan's peers (on one machine a spare adds none), and the planner left it idle for a reason.
        A ring job (--offload off) is priced with its ring all-reduce and no hosts."""
        import dataclasses

        if pinned(run.strategy, run.params):
            return True
        doc, _workers, hosts = await self.cluster(recovery, job, run, workers, run.speeds())
        moved = [
            dataclasses.replace(p, peers=list(lay.peers), bounds=list(lay.bounds), samples=int(n))
            for p, lay, n in zip(
                job.pipelines, layouts, list(shares) or [p.samples for p in job.pipelines], strict=True
            )
        ]
        cur_s, new_s = await _score_off_loop(job, run, doc, moved, hosts)
        gain = 1.0 - new_s / cur_s if cur_s > 0 else 0.0
        bar = min(ESCALATE_GAIN, run.min_gain)
        ok = gain >= bar
        run.metrics.event(  # the metrics file only
            "rebalance_check",
            step=step,
            confirm=True,
            gain=round(gain, 4),
            acts=ok,
            reason=f"the planner's model gives the move to a spare {gain:.0%} (needs {bar:.0%})",
            tflops=self.tflops,
        )
        return ok

    async def predict(
        self,
        recovery: Any,
        job: Any,
        run: Any,
        step: int,
        workers: list[str],
        speeds: Mapping[str, float],
        noise: float,
        cheap: Sequence[Any] | None = None,
        leave_out: Sequence[str] = (),
    ) -> tuple[Escalation, list[Any]]:
        """The planner's layout over the live workers but `leave_out` (the clear stragglers) at the
        measured speeds, and the decision (the current layout scored as the better of itself and
        `cheap`, over every worker). A straggler is planned no work: its speed is what its slow-down
        made it, and may change again; and on a shared machine the planner's model gave it a sliver
        of the layers (a 4-stage pipeline, 5 of 103 operators on the straggler) that ran at 0.64-0.68x the
        same job on the other 3 peers (bench faults --reshape --offload off), the overhead of its
        process and stage unpriced. Where keeping it was worth more, the current layout wins the
        decision."""
        from fusionnode.plan.cluster import subset_doc

        doc, workers, hosts = await self.cluster(recovery, job, run, workers, speeds)
        graph = run.traced.graph
        spec = job.spec
        keep = [w for w in workers if w not in set(leave_out)] or workers
        pipelines, _hosts, _pred = await recovery.placement.planned_layout(
            "fusion",
            spec,
            graph,
            keep,
            {**run.params, "cluster": subset_doc(doc, {*keep, *hosts})},
            bool(job.offload),
            run.seq_len,
        )
        cur_s, new_s = await _score_off_loop(job, run, doc, pipelines, hosts, cheap)
        times = [r["step_time_s"] for r in job.history[-STEP_TIME_STEPS:]]
        esc = decide_escalation(
            cur_s,
            new_s,
            same=shape(pipelines) == shape(job.pipelines),
            step_s=statistics.median(times) if times else 0.0,
            steps_left=spec.steps - step,
            move_cost_s=run.move_s,
            min_gain=min(ESCALATE_GAIN, run.min_gain),
            noise=noise,
        )
        return esc, pipelines
