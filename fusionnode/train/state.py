"""The driver's state of a job: its book-keeping (`Job`), its pipelines, and the mutable state of one run.

Plain data shared by the driver's modules (placement, step, recovery); no network here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch

from fusionnode.sync import SyncConfig
from fusionnode.train.rebalance import (
    DEFAULT_WINDOW,
    RUN_HISTORY,
    Bans,
    PeerBook,
    SpeedBook,
    Trigger,
    stage_flops,
)
from fusionnode.wire.job import StageAssignment, StepReport

logger = logging.getLogger(__name__)

HISTORY_KEPT = 500  # step records of a running job the status lists (the metrics file has them all)
FINISHED_HISTORY_POINTS = 100  # step records of a finished job the status lists (about 2 KB each)


@dataclasses.dataclass
class Pipeline:
    replica: int
    peers: list[str]
    bounds: list[int]
    samples: int  # sequences of each step's batch this pipeline trains on
    micro_batches: int
    first_stage: int = 0  # global id of its first stage

    @property
    def mb_size(self) -> int:
        return self.samples // self.micro_batches


class Job:
    """Book-keeping of one running job on its driver."""

    def __init__(self, spec: Any, driver: str):
        self.spec = spec
        self.driver = driver
        self.pipelines: list[Pipeline] = []
        self.stages: list[dict[str, Any]] = []  # flat, by global stage id
        self.hosts: list[str] = []
        self.offload = False
        self.sync = SyncConfig()  # --sync (issue 19): diloco/sparseloco close rounds on the hosts
        self.round_bytes = 0  # bytes the stages sent at the last step's round end (issue 19)
        self.rounds_closed = 0
        self.contrib: Any = None  # verify.contrib.ContribPolicy of the rounds (None: off)
        self.caps: dict[str, Any] = {}  # peer -> the capabilities its plan's ping answered (verify/compat.py)
        self.hosts_applied: list[int] = []  # the hosts' applied steps at the last re-plan (round ledger)
        self.round_host_bytes: dict[str, list[int]] = {}  # host -> cumulative [received, sent], rounds
        self.step = 0
        self.loss: float | None = None
        self.tokens_per_s = 0.0
        self.plan_version = 0
        self.started = time.time()
        self.state = "planning"
        self.history: list[dict[str, Any]] = []
        self.aliases: dict[str, str] = {}  # tied parameter names -> the name named_parameters() reports
        # frozen parameters (the base of a LoRA job): shipped to the stages once, never trained, never
        # on an optimizer host; the driver's copy is the value every checkpoint records
        self.frozen: dict[str, torch.Tensor] = {}
        self.host_counters: list[dict[str, Any]] = []  # the optimizer hosts' push counters, last step
        self.phases: dict[
            str, float
        ] = {}  # seconds of the last step's phases (feed, stages, optimizer, commit)
        self.lease_s = 60.0  # seconds a worker keeps a stage without hearing from this driver
        self.secret = ""  # proves to optimizer hosts that we own the job's shards (kept in our checkpoints)
        self.fresh_optimizer = False  # the hosts' last restore had no common shard checkpoint
        self.feedback_shipped = False  # sparseloco: the stages last shipped were given error feedback
        self.feedback_fresh: dict[int, list[str]] = {}  # ... except these names, per replica (part)
        self.model_bytes = 0  # bytes of the model's parameters (fp32): what a peer may send us at once
        self.events: list[dict[str, Any]] = []  # replan / join / leave / failure / recovered, in order
        self.validation: list[dict[str, Any]] = []  # {"step", "loss"}: held-out loss where it was measured

    def count_round(self, step: int, per_stage: list[dict[str, list[int]]], known: int | None = None) -> None:
        """--sync rounds (issue 19): fold the stages' [sent to, received from] bytes per host of
        step `step`'s commits into the hosts' cumulative [received, sent] (the step record's
        optimizer_hosts; measured at the stages' ends of the same streams). `known`: the rounds
        known closed after it (--sync-overlap, whose commits report the previous round's bytes);
        else a commit that reported bytes closed one more."""
        self.round_bytes = 0
        closed = False
        for stage in per_stage:
            for host, (to_host, from_host) in stage.items():
                acc = self.round_host_bytes.setdefault(host, [0, 0])
                acc[0] += to_host
                acc[1] += from_host
                self.round_bytes += to_host
                closed = True
        self.rounds_closed = known if known is not None else self.rounds_closed + int(closed)
        self.host_counters = [
            {
                "host": h,
                "received_bytes": self.round_host_bytes.get(h, [0, 0])[0],
                "sent_bytes": self.round_host_bytes.get(h, [0, 0])[1],
                "rounds_closed": self.rounds_closed,
            }
            for h in self.hosts
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.spec.job_id,
            "model": self.spec.model,
            "state": self.state,
            "step": self.step,
            "steps": self.spec.steps,
            "loss": self.loss,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "plan_version": self.plan_version,
            "offload": self.offload,
            "optimizer_hosts": self.hosts,
            "stages": [
                {k: s[k] for k in ("stage", "replica", "pos", "peer", "lo", "hi", "n_params")}
                for s in self.stages
            ],
            "history": self.history[-HISTORY_KEPT:] if self.state == "running" else self._thin_history(),
            "events": self.events[-200:],
            "validation": self.validation,
        }

    def _thin_history(self) -> list[dict[str, Any]]:
        """A finished job's curve in at most FINISHED_HISTORY_POINTS records: evenly spaced, with
        the last ones whole (what the dashboard reads the stages' utilisation from)."""
        hist = self.history[-HISTORY_KEPT:]
        if len(hist) <= FINISHED_HISTORY_POINTS:
            return hist
        tail = FINISHED_HISTORY_POINTS // 10
        stride = math.ceil((len(hist) - tail) / (FINISHED_HISTORY_POINTS - tail))
        return hist[: len(hist) - tail : stride] + hist[-tail:]


@dataclasses.dataclass
class Run:
    """What a running job's plan changes need (the driver's mutable state of one run)."""

    traced: Any
    canonical: dict[str, str]
    full: dict[str, torch.Tensor]  # initial parameters (their names and shapes)
    sample: torch.Tensor
    host_of: dict[str, str] | None
    host_index: dict[str, int]
    params: dict[str, Any]
    metrics: Any
    emit: Any
    flops: list[float]
    strategy: str
    n_stages: int
    shares: list[int]
    stage_args: list[StageAssignment]
    seq_len: int
    known: set[str]  # workers seen so far (a new one is a "join")
    move_s: float  # seconds the last plan change took (the cost of moving)
    rebalance_every: int
    min_gain: float
    source: Any = None
    first_step: int = 0
    gone: set[str] = dataclasses.field(default_factory=set)  # peers that left gracefully
    # the driver's table (speeds and bans across all its jobs); a run of its own by default
    book: PeerBook = dataclasses.field(default_factory=PeerBook)
    steps_on_plan: int = 0  # steps run on the plan in force (its first one warms up, unmeasured)
    since_check: int = 0  # steps measured since the last rebalance check
    target_time_s: float | None = None  # per micro-batch compute time of the slowest stage, last step
    names_by_stage: dict[int, list[str]] | None = None  # --sync rounds: what each stage sends (issue 19)
    # this run's samples per peer since the plan began (RUN_HISTORY at most): what rebalancing reads,
    # the median of the last DEFAULT_WINDOW as a speed and the ones before as the speed it had
    recent: SpeedBook = dataclasses.field(
        default_factory=lambda: SpeedBook(RUN_HISTORY, quantile=0.5, recent=DEFAULT_WINDOW)
    )
    trigger: Trigger = dataclasses.field(default_factory=Trigger)  # rebalancing's noise-aware trigger
    escalator: Any = None  # train.escalate.Escalator: when a re-plan by the planner beats the moves
    checks: Any = None  # train.checks.StepChecks when the job's work is spot-checked
    scorer: Any = None  # train.scoring.RoundScorer when the rounds' contributions are scored
    # (step, plan version) whose starting state the optimizer hosts keep as the mark (checked jobs):
    # a liar caught later in the same plan has every step since undone (train/checks.py)
    mark: tuple[int, int] | None = None

    @property
    def bans(self) -> Bans:
        return self.book.bans

    def work(self, job: Job, a: StageAssignment) -> float:
        """Work of a stage per step, in the unit of every measured speed: the graph FLOPs of its
        operators (per sequence) x the sequences its pipeline trains on each step."""
        return stage_flops(self.flops, a.lo, a.hi) * job.pipelines[a.replica].samples

    def observe(self, job: Job, reports: list[StepReport]) -> None:
        """Stage timings of a step (every pipeline) feed the run's and the driver's measured speeds
        (the first step of a plan warms up)."""
        self.steps_on_plan += 1
        if self.steps_on_plan == 1:
            return
        self.since_check += 1
        for a, r in zip(self.stage_args, reports, strict=True):
            w, secs = self.work(job, a), float(r.compute_s)
            self.recent.record(a.peer, w, secs)
            self.book.speeds.record(a.peer, w, secs)

    def speeds(self) -> dict[str, float]:
        return self.recent.speeds()

    async def event(self, job: Job, kind: str, **fields: Any) -> None:
        """Records an event of the job (metrics file, status, the client's stream, the log)."""
        rec = self.metrics.event(kind, **fields)
        job.events.append(rec)
        logger.warning("job %s: %s %s", job.spec.job_id, kind, {k: v for k, v in fields.items()})
        await self.emit({"type": "event", "kind": kind, **fields})


def stage_rows(stage_args: list[StageAssignment]) -> list[dict[str, Any]]:
    return [
        {
            "stage": a.stage,
            "replica": a.replica,
            "pos": a.pos,
            "peer": a.peer,
            "lo": a.lo,
            "hi": a.hi,
            "n_params": len(a.param_specs),
            "shared": a.shared_names,
        }
        for a in stage_args
    ]
