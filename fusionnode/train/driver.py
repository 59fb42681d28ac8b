"""The driver: the peer that started a job plans it, feeds it, and keeps its books.

It traces the model into an OP-DAG, splits it into contiguous stages, lays one or
more pipelines (data-parallel replicas) over the swarm's workers, proposes the
assignment (each worker may refuse), ships each worker its portable sub-DAG and
parameters, then runs steps: each replica's share of the batch goes to its first
stage as micro-batches, targets to its last stage, and the stages report back.

Optimizer, two ways (the same math):
- local (``offload off``, one pipeline): each worker applies AdamW to its own
  parameters; gradients of parameters two stages share (tied weights) are summed
  by the driver first, and the global gradient norm is clipped exactly.
- offloaded (``offload on``; required with several pipelines): workers push
  gradients to optimizer hosts during backward, the hosts aggregate the replicas
  and apply the step, workers pull the new parameters (prefetched).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import hmac
import itertools
import logging
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any

import torch

from fusionnode.errors import ConfigError, FusionNodeError, PeerError, PlanError
from fusionnode.optim.optimizers import FlatOptimizer
from fusionnode.runtime.schedule import DEFAULT_SCHEDULE, peak_in_flight
from fusionnode.runtime.transport import Transport
from fusionnode.runtime.worker import LEAVING_MARK, decode_checked, tensor_message
from fusionnode.security.limits import MAILBOX_SLACK_BYTES
from fusionnode.sync import SyncConfig
from fusionnode.train.rebalance import DEFAULT_MIN_GAIN, DEFAULT_WINDOW, Bans

logger = logging.getLogger(__name__)

ADATOPK_WARMUP_FRACTION = 0.3  # share of a job's steps sent with the warm-up codec before top-k starts
MAX_PROPOSALS = 4  # rounds of stage proposals before giving up
JOBS_KEPT = 5  # finished jobs the driver's status still lists
HISTORY_KEPT = 500  # step records of a running job the status lists (the metrics file has them all)
FINISHED_HISTORY_POINTS = 100  # step records of a finished job the status lists (about 2 KB each)
ACT_INFLIGHT_FACTOR = 3  # activation memory estimate: saved tensors ~ this many times the stage's outputs
OFFLOAD_CHOICES = ("auto", "on", "off")
STAGE_ID_STRIDE = 1000  # stage ids of plan version v start at (v - 1) * this: no reuse across re-plans
MAX_REPLAYS = 6  # failed attempts of one step before the job gives up
FAILURE_GRACE_S = 0.5  # seconds to let other calls of a failing step report before cancelling them
PING_TIMEOUT_S = 5.0  # seconds a peer has to answer a liveness probe
JOB_SECRET_FILE = "job_secret.key"  # in the state dir: 32 random bytes, from which job secrets derive
DEFAULT_REBALANCE_EVERY = (
    0  # steps between straggler checks; 0 (default): re-plan only on failures and leaves
)


def balanced_bounds(flops: list[float], n_stages: int) -> list[int]:
    """Contiguous split of nodes into n_stages ranges of about equal flops; every range non-empty."""
    n = len(flops)
    if n_stages < 1 or n_stages > n:
        raise PlanError(f"cannot split {n} operators into {n_stages} stages")
    weights = flops if sum(flops) else [1.0] * n
    total = sum(weights)
    bounds, acc, k = [0], 0.0, 1
    for i, w in enumerate(weights):
        acc += w
        # cut after node i once the prefix reaches k/n_stages of the total, leaving a node for each later stage
        if k < n_stages and acc >= total * k / n_stages and n - (i + 1) >= n_stages - k:
            bounds.append(i + 1)
            k += 1
    while len(bounds) < n_stages:  # degenerate weights: single nodes at the end
        bounds.append(n - (n_stages - len(bounds)))
    bounds.append(n)
    return bounds


def crossing_names(graph: Any, cut: int) -> list[str]:
    """Names of tensors produced before node `cut` and consumed at or after it."""
    last: dict[int, int] = {}
    for e in graph.edges:
        last[e.src] = max(last.get(e.src, -1), e.dst)
    return [graph.nodes[src].name for src in sorted(last) if src < cut <= last[src]]


def tensor_spec(graph: Any, name: str) -> dict[str, Any]:
    for node in graph.nodes:
        if node.name == name:
            return {"shape": list(node.out_shape), "dtype": node.out_dtype}
    raise PlanError(f"tensor {name!r} is not in the OP-DAG")


DEFAULT_UNMEASURED_GBPS = 1.0  # link bandwidth assumed between peers whose link nobody probed yet
PLANNERS = ("simple", "fusion", "even", "memory")


def symmetric_links(records: list[Any]) -> dict[tuple[str, str], tuple[float, float]]:
    """(a, b) and (b, a) -> (bits/s, rtt s) of each probed link: where both ends report it, the
    smaller bandwidth and the larger RTT, so one peer cannot advertise a link faster than the probe of
    the peer at its other end measured it (SECURITY.md, attack 8)."""
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for rec in records:
        for other, m in (rec.links or {}).items():
            if m.bandwidth_bps <= 0 or other == rec.peer_id:
                continue
            key = (rec.peer_id, other) if rec.peer_id < other else (other, rec.peer_id)
            bps, rtt = float(m.bandwidth_bps), float(m.rtt_s)
            if key in out:
                bps, rtt = min(bps, out[key][0]), max(rtt, out[key][1])
            out[key] = out[key[::-1]] = (bps, rtt)
    return out


def cluster_from_records(records: list[Any], workers: list[str], hosts: list[str]) -> dict[str, Any]:
    """A cluster document (protocol/CLUSTER.md) of live peers: measured TFLOPS, offered memory, probed links."""
    devices, pairs, seen = [], [], set()
    by_id = {r.peer_id: r for r in records}
    for pid in dict.fromkeys([*workers, *hosts]):
        rec = by_id[pid]
        roles = [
            r
            for r in ("worker", "optimizer")
            if (r == "worker" and pid in workers) or (r == "optimizer" and pid in hosts)
        ]
        devices.append(
            {
                "id": pid,
                "tflops": max(float(rec.device.tflops_fp32), 1e-4),
                "memory_gb": rec.capacity_bytes / 1e9,
                "roles": roles,
            }
        )
    measured = symmetric_links(records)
    for (a, b), (bps, rtt_s) in sorted(measured.items()):
        if a < b and a in by_id and b in by_id and (a, b) not in seen:
            seen.add((a, b))
            pairs.append({"a": a, "b": b, "bandwidth_gbps": bps / 1e9, "latency_ms": rtt_s * 500.0})
    return {
        "version": 1,
        "name": "swarm",
        "devices": devices,
        "links": {
            "inter_site": {"bandwidth_gbps": DEFAULT_UNMEASURED_GBPS, "latency_ms": 1.0},
            "pairs": pairs,
        },
    }


def cluster_links(doc: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(from, to) -> bits/s of every device pair of a cluster document (what a testbed emulates)."""
    from fusionnode.plan.cluster import load_cluster_dict

    c = load_cluster_dict(doc, "cluster")
    ids = [d.id for d in c.devices]
    return {
        (a, b): float(c.bandwidth_bps[i, j]) for i, a in enumerate(ids) for j, b in enumerate(ids) if i != j
    }


def _divisor_at_most(n: int, m: int) -> int:
    return next(k for k in range(min(m, n), 0, -1) if n % k == 0)


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
        self.model_bytes = 0  # bytes of the model's parameters (fp32): what a peer may send us at once
        self.events: list[dict[str, Any]] = []  # replan / join / leave / failure / recovered, in order
        self.validation: list[dict[str, Any]] = []  # {"step", "loss"}: held-out loss where it was measured

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


class _StepFailed(FusionNodeError):
    """A step did not complete: which peers' calls failed (and why), which did not answer a probe."""

    def __init__(self, step: int, errors: dict[str, str], unreachable: list[str]):
        self.step = step
        self.errors = errors
        self.unreachable = unreachable
        self.t0 = time.perf_counter()
        super().__init__(self.summary())

    def summary(self) -> str:
        parts = [f"{p[:12]}…: {e[:300]}" for p, e in sorted(self.errors.items())]
        if self.unreachable:
            parts.append(f"unreachable: {[p[:12] for p in self.unreachable]}")
        return "; ".join(parts)


class _HostFailed(_StepFailed):
    """An optimizer host died: restore every host from the last shard checkpoint and replay."""


@dataclasses.dataclass
class _Run:
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
    stage_args: list[dict[str, Any]]
    seq_len: int
    known: set[str]  # workers seen so far (a new one is a "join")
    move_s: float  # seconds the last plan change took (the cost of moving)
    rebalance_every: int
    min_gain: float
    source: Any = None
    first_step: int = 0
    gone: set[str] = dataclasses.field(default_factory=set)  # peers that left gracefully
    bans: Bans = dataclasses.field(default_factory=Bans)
    steps_on_plan: int = 0
    target_time_s: float | None = None  # per micro-batch compute time of the slowest stage, last step
    samples: dict[str, collections.deque] = dataclasses.field(default_factory=dict)
    names_by_stage: dict[int, list[str]] | None = None  # --sync rounds: what each stage sends (issue 19)

    def observe(self, job: Job, reports: list[dict[str, Any]]) -> None:
        """Stage timings of a step feed the measured speeds (the first step of a plan warms up)."""
        self.steps_on_plan += 1
        if self.steps_on_plan == 1:
            return
        for a, r in zip(self.stage_args, reports, strict=True):
            q = self.samples.setdefault(a["peer"], collections.deque(maxlen=DEFAULT_WINDOW))
            q.append((a["peer"], a["lo"], a["hi"], float(r["compute_s"])))

    def speeds(self) -> dict[str, float]:
        from fusionnode.train.rebalance import measured_speeds

        return measured_speeds(self.flops, [s for q in self.samples.values() for s in q])


def _stage_rows(stage_args: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "stage": a["stage"],
            "replica": a["replica"],
            "pos": a["pos"],
            "peer": a["peer"],
            "lo": a["lo"],
            "hi": a["hi"],
            "n_params": len(a["param_specs"]),
            "shared": a["shared_names"],
        }
        for a in stage_args
    ]


class Driver:
    def __init__(self, transport: Transport, membership: Any, *, config: Any, state_dir: Path):
        self.t = transport
        self.membership = membership
        self.config = config
        self.state_dir = state_dir
        self.jobs: dict[str, Job] = {}
        self._tags = itertools.count(1)  # pull tags of the driver's own parameter fetches

    def status(self) -> list[dict[str, Any]]:
        return [job.to_dict() for job in self.jobs.values()]

    def _forget_old_jobs(self) -> None:
        """Keeps the status bounded: the newest JOBS_KEPT finished jobs, and every running one."""
        finished = [jid for jid, j in self.jobs.items() if j.state not in ("planning", "running")]
        for jid in finished[: max(0, len(finished) - JOBS_KEPT)]:
            del self.jobs[jid]

    # ---- planning ------------------------------------------------------------------------------
    async def _candidates(self, wanted: list[str] | None, role: str) -> list[str]:
        peers = await self.membership.peers()
        ids = [
            p.peer_id
            for p in peers
            if role in p.roles and getattr(p, "availability", "available") == "available"
        ]
        if wanted:
            missing = [w for w in wanted if w not in ids]
            if missing:
                raise ConfigError(f"requested peers are not available {role}s in the swarm: {missing}")
            return list(wanted)
        # a record outlives its peer by up to its TTL: keep those that answer a ping
        dead, _leaving = await self._probe(ids)
        ids = [p for p in ids if p not in dead]
        # the driver's own peer first (it feeds the first stage without a hop), then by id
        return sorted(ids, key=lambda pid: (pid != self.t.peer_id, pid))

    def _layout(
        self,
        spec: Any,
        flops: list[float],
        workers: list[str],
        n_stages: int,
        replicas: int,
        shares: list[int] | None = None,
        bounds: list[int] | None = None,
    ) -> list[Pipeline]:
        """`replicas` pipelines of `n_stages` stages each over the first workers; the batch is shared
        evenly, or by `shares` (samples per replica, summing to the batch size); the operators are
        split to balance FLOPs, or at `bounds` (n_stages + 1 operator indices from 0 to the count)."""
        if replicas < 1 or n_stages < 1:
            raise PlanError("need at least one pipeline of at least one stage")
        if replicas * n_stages > len(workers):
            raise PlanError(
                f"{replicas} pipeline(s) x {n_stages} stage(s) need {replicas * n_stages} workers; "
                f"the swarm has {len(workers)} available"
            )
        if shares is None:
            if spec.batch_size % replicas:
                raise ConfigError(
                    f"batch size {spec.batch_size} does not split evenly into {replicas} replicas"
                )
            shares = [spec.batch_size // replicas] * replicas
        if len(shares) != replicas or sum(shares) != spec.batch_size or min(shares) < 1:
            raise ConfigError(
                f"batch shares {shares} must be {replicas} positive numbers summing to the batch "
                f"size {spec.batch_size}"
            )
        bad = [n for n in shares if n % spec.micro_batches]
        if bad:
            raise ConfigError(
                f"batch shares {bad} do not split into {spec.micro_batches} equal micro-batches"
            )
        if bounds is None:
            bounds = balanced_bounds(flops, n_stages)
        elif (
            len(bounds) != n_stages + 1
            or bounds[0] != 0
            or bounds[-1] != len(flops)
            or any(b <= a for a, b in itertools.pairwise(bounds))
        ):
            raise ConfigError(
                f"bounds {bounds} must be {n_stages + 1} increasing operator indices from 0 to {len(flops)}"
            )
        out, first = [], 0
        for r in range(replicas):
            out.append(
                Pipeline(
                    r,
                    workers[r * n_stages : (r + 1) * n_stages],
                    bounds,
                    int(shares[r]),
                    spec.micro_batches,
                    first,
                )
            )
            first += n_stages
        return out

    def _stage_args(
        self,
        job: Job,
        traced: Any,
        canonical: dict[str, str],
        params: dict[str, torch.Tensor],
        sample: torch.Tensor,
        host_of: dict[str, str] | None,
        host_index: dict[str, int],
        links: dict[tuple[str, str], float] | None = None,
        link_options: dict[str, Any] | None = None,
    ) -> list[dict]:
        from fusionnode.graph.portable import describe_stage
        from fusionnode.optim.store import contributor_key

        graph = traced.graph
        spec = job.spec
        args: list[dict[str, Any]] = []
        for pipe in job.pipelines:
            n = len(pipe.peers)
            descs = [describe_stage(traced, pipe.bounds[i], pipe.bounds[i + 1]) for i in range(n)]
            stage_params = [sorted({canonical.get(k, k) for k in d["params"]}) for d in descs]
            counts: dict[str, int] = {}
            for names in stage_params:
                for name in names:
                    counts[name] = counts.get(name, 0) + 1
            shared = {k for k, v in counts.items() if v > 1}
            for i, d in enumerate(descs):
                lo, hi = pipe.bounds[i], pipe.bounds[i + 1]
                gid = pipe.first_stage + i
                if i == 0:
                    recv = {name: {"shape": [1, *sample.shape[1:]], "dtype": "int64"} for name in d["inputs"]}
                else:
                    recv = {name: tensor_spec(graph, name) for name in crossing_names(graph, lo)}
                send = (
                    {}
                    if i == n - 1
                    else {name: tensor_spec(graph, name) for name in crossing_names(graph, hi)}
                )
                pspecs = {
                    name: {"shape": list(params[name].shape), "dtype": "float32"} for name in stage_params[i]
                }
                pbytes = sum(params[name].numel() * 4 for name in stage_params[i])
                act_bytes = sum(node.out_bytes for node in graph.nodes[lo:hi]) * pipe.mb_size
                in_flight = peak_in_flight(DEFAULT_SCHEDULE, n, i, pipe.micro_batches)
                state_factor = 2 if host_of else 4  # params + grads (+ 2 optimizer states when local)
                a = {
                    "job": spec.job_id,
                    "stage": gid,
                    "pos": i,
                    "num_stages": n,
                    "replica": pipe.replica,
                    "prev_stage": gid - 1,
                    "next_stage": gid + 1,
                    "driver": self.t.peer_id,
                    "prev": pipe.peers[i - 1] if i > 0 else "",
                    "next": pipe.peers[i + 1] if i < n - 1 else "",
                    "description": d,
                    "param_specs": pspecs,
                    "recv_specs": recv,
                    "send_specs": send,
                    "shared_names": sorted(shared & set(pspecs) - set(job.frozen)),
                    "spec": spec.to_dict(),
                    "need_bytes": int(pbytes * state_factor + act_bytes * in_flight * ACT_INFLIGHT_FACTOR),
                    "lease_s": job.lease_s,
                    "lo": lo,
                    "flops_per_sample": float(sum(node.flops for node in graph.nodes[lo:hi])),
                    "hi": hi,
                    "peer": pipe.peers[i],
                    "link_options": link_options or {},
                    "bw_next": (links or {}).get((pipe.peers[i], pipe.peers[i + 1])) if i < n - 1 else None,
                    "bw_prev": (links or {}).get((pipe.peers[i], pipe.peers[i - 1])) if i > 0 else None,
                }
                if job.frozen:
                    a["frozen"] = sorted(set(pspecs) & set(job.frozen))
                if job.sync.rounds:
                    a["sync"] = job.sync.to_dict()
                if host_of:
                    a["offload"] = {
                        "hosts": {name: host_of[name] for name in pspecs if name in host_of},
                        "host_index": {name: host_index[name] for name in pspecs if name in host_index},
                        "contributor": contributor_key(pipe.replica, gid),
                        "samples": pipe.samples,
                    }
                args.append(a)
        return args

    # ---- the job -------------------------------------------------------------------------------
    async def run_job(self, params: dict[str, Any], emit: Any) -> dict[str, Any]:
        from fusionnode.graph.trace import trace_model
        from fusionnode.train.data import BatchSource
        from fusionnode.train.local import build_job_model
        from fusionnode.train.metrics import MetricsWriter
        from fusionnode.train.spec import JobSpec, resolve_seq_len, trajectory_mismatch

        spec = JobSpec.from_dict(params.get("spec") or {})
        ckpt = await asyncio.to_thread(self._read_resume, spec) if params.get("resume") else None
        if ckpt is not None and spec.job_id != ckpt.spec.job_id and not trajectory_mismatch(spec, ckpt.spec):
            # more steps, a longer schedule, another metrics file: the same job, whose optimizer shards
            # the hosts keep under the checkpoint's job id
            spec = dataclasses.replace(spec, job_id=ckpt.spec.job_id)
        if spec.compress == "adatopk":  # warm-up on 8-bit links first: what kept convergence (COMPRESSION.md)
            link_options = dict(params.get("link_options") or {})
            link_options.setdefault("warmup_steps", int(ADATOPK_WARMUP_FRACTION * spec.steps))
            params = {**params, "link_options": link_options}
        offload_choice = params.get("offload") or "auto"
        if offload_choice not in OFFLOAD_CHOICES:
            raise ConfigError(f"offload must be one of {OFFLOAD_CHOICES}, got {offload_choice!r}")
        shares = [int(n) for n in params["shares"]] if params.get("shares") else None
        replicas = len(shares) if shares else int(params.get("replicas") or 1)
        if spec.job_id in self.jobs and self.jobs[spec.job_id].state == "running":
            raise ConfigError(f"job {spec.job_id} is already running on this driver")
        self._forget_old_jobs()
        self.jobs.pop(spec.job_id, None)  # a rerun of the same job is listed last
        job = Job(spec, self.t.peer_id)
        job.sync = SyncConfig.from_dict(params.get("sync"))
        if job.sync.rounds and (params.get("resume") or int(params.get("rebalance_every") or 0) > 0):
            raise ConfigError(f"--sync {job.sync.mode} does not resume or rebalance yet")
        job.lease_s = float(params.get("lease_s") or self.config.lease_s)
        job.secret = self._job_secret(spec.job_id)
        self.jobs[spec.job_id] = job
        metrics = MetricsWriter(spec.metrics_out)
        try:
            model = await asyncio.to_thread(build_job_model, spec)
            seq_len = resolve_seq_len(spec)
            source = await asyncio.to_thread(BatchSource.from_spec, spec, seq_len)
            sample = torch.zeros(1, seq_len, dtype=torch.long)
            traced = await asyncio.to_thread(trace_model, model, sample, spec.model)
            canonical = _canonical_names(model)
            job.aliases = {name: canon for name, canon in canonical.items() if name != canon}
            full = {name: p.detach() for name, p in model.named_parameters()}
            job.model_bytes = sum(t.numel() * 4 for t in full.values())
            job.frozen = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
            start_step = 0
            if params.get("resume"):
                start_step, full, secret = self._load_resume(ckpt, source, full)
                job.secret = secret or job.secret
                metrics.event("recovered", reason="resumed from checkpoint", step=start_step)
            # auto: offload whenever an optimizer host is available, which also lets the job survive a
            # failed worker (its step is replayed on a new plan); a local optimizer cannot
            hosts_available = bool(await self._candidates(params.get("optimizer_peers"), "optimizer"))
            job.offload = offload_choice == "on" or (
                offload_choice == "auto" and (replicas > 1 or hosts_available)
            )
            if replicas > 1 and not job.offload:
                raise ConfigError(
                    "several pipelines synchronise through optimizer hosts: use --offload on|auto"
                )
            workers = await self._candidates(params.get("peers"), "worker")
            if not workers:
                raise PlanError("no worker peers are available in the swarm")
            strategy = params.get("planner") or "simple"
            if strategy not in PLANNERS:
                raise ConfigError(f"planner must be one of {', '.join(PLANNERS)}, got {strategy!r}")
            if strategy != "simple" and offload_choice != "off":
                job.offload = True
            n_stages = int(params.get("stages") or max(1, len(workers) // replicas))
            if params.get("stages") and n_stages * replicas > len(workers):
                raise PlanError(
                    f"--stages {n_stages} x {replicas} pipeline(s) need {n_stages * replicas} workers; the "
                    f"swarm has {len(workers)} available: start more peers, or ask for fewer stages"
                )
            if int(params.get("rebalance_every") or 0) > 0 and not job.offload:
                # --offload auto found no optimizer host: say so rather than never rebalance in silence
                reason = (
                    "--rebalance-every is off for this job: no optimizer host in the swarm, so the "
                    "optimizer state stays on the workers"
                )
                metrics.event("notice", what="rebalance_off", reason=reason)
                await emit({"type": "event", "kind": "notice", "what": "rebalance_off", "reason": reason})
            flops = [node.flops for node in traced.graph.nodes]
            stage_args: list[dict[str, Any]] = []
            prediction: dict[str, Any] = {}
            for _attempt in range(MAX_PROPOSALS):
                if len(workers) < replicas:
                    raise PlanError("every worker refused the job's stages (see the events for the reasons)")
                host_of: dict[str, str] | None = None
                host_index: dict[str, int] = {}
                if strategy == "simple":
                    fewer = max(1, min(n_stages, len(workers) // replicas))
                    if fewer != n_stages:
                        reason = (
                            f"{n_stages} stages planned, {fewer} placed: some workers refused (see above)"
                        )
                        metrics.event("notice", what="fewer_stages", reason=reason)
                        await emit(
                            {"type": "event", "kind": "notice", "what": "fewer_stages", "reason": reason}
                        )
                    n_stages = fewer
                    job.pipelines = self._layout(
                        spec, flops, workers, n_stages, replicas, shares, params.get("bounds")
                    )
                    if job.offload:
                        job.hosts = await self._pick_hosts(params, workers)
                        if params.get("resume"):
                            job.hosts = await self._holders(job, job.hosts, params)
                else:
                    job.pipelines, job.hosts, prediction = await self._planned_layout(
                        strategy, spec, traced.graph, workers, params, job.offload, seq_len
                    )
                    if len(job.pipelines) > 1 and not job.offload:
                        raise ConfigError(
                            "the plan has several pipelines: they need optimizer hosts (--offload)"
                        )
                if job.offload:
                    trained = {n: t for n, t in full.items() if n not in job.frozen}
                    host_of, host_index = self._shard(trained, job.hosts)
                stage_args = self._stage_args(
                    job,
                    traced,
                    canonical,
                    full,
                    sample,
                    host_of,
                    host_index,
                    cluster_links(params["cluster"])
                    if params.get("cluster")
                    else await self._measured_links(),
                    params.get("link_options"),
                )
                refused = await self._propose(stage_args, metrics, emit)
                if not refused:
                    break
                workers = [w for w in workers if w not in refused]
            else:
                raise PlanError("could not place the job's stages after several proposals")
            self._accept(job, stage_args)
            job.stages = _stage_rows(stage_args)
            job.plan_version = 1
            await emit(
                {
                    "type": "plan",
                    "planner": strategy,
                    "prediction": prediction,
                    "plan_version": 1,
                    "stages": job.stages,
                    "num_nodes": traced.graph.num_nodes,
                    "offload": job.offload,
                    "optimizer_hosts": job.hosts,
                }
            )
            job.events.append(
                metrics.event(
                    "replan",
                    reason="initial plan",
                    plan_version=1,
                    stages=len(job.stages),
                    pipelines=len(job.pipelines),
                    offload=job.offload,
                )
            )
            t_move = time.perf_counter()
            if job.offload:
                resume = bool(params.get("resume"))
                applied = await self._init_hosts(
                    job, stage_args, full, host_of, resume=resume, start_step=start_step
                )
                if resume:
                    # the hosts hold the masters and optimizer state: continue from the newest step they
                    # all checkpointed (data depend only on the step); with none in common (other hosts,
                    # or none kept) they started from the driver's checkpoint with new optimizer state
                    if len(set(applied)) != 1:
                        raise PlanError(f"the optimizer hosts resumed at different steps {applied}")
                    if job.fresh_optimizer:
                        metrics.event(
                            "resume",
                            reason="no optimizer checkpoint common to the hosts: new optimizer state",
                            step=start_step,
                            fresh_optimizer=True,
                        )
                    if applied[0] != start_step:
                        metrics.event(
                            "resume",
                            reason="optimizer hosts' newest common checkpoint differs from the driver's",
                            step=applied[0],
                            driver_checkpoint_step=start_step,
                        )
                        start_step = applied[0]
                    full = await self._fetch_params(job, stage_args, host_of, all_names=full)
            await self._ship_params(job, stage_args, full)
            job.state = "running"
            run = _Run(
                traced=traced,
                canonical=canonical,
                full=full,
                sample=sample,
                host_of=host_of,
                host_index=host_index,
                params=params,
                metrics=metrics,
                emit=emit,
                flops=flops,
                strategy=strategy,
                n_stages=max(len(p.peers) for p in job.pipelines),
                shares=[p.samples for p in job.pipelines],
                stage_args=stage_args,
                seq_len=seq_len,
                known=set(workers),
                move_s=time.perf_counter() - t_move,
                rebalance_every=int(params.get("rebalance_every", DEFAULT_REBALANCE_EVERY) or 0),
                min_gain=float(params.get("rebalance_gain", DEFAULT_MIN_GAIN)),
                source=source,
                first_step=start_step,
            )
            await self._train(job, run, source, start_step)
            final = await self._fetch_params(job, run.stage_args, run.host_of)
            result = await self._finish(job, model, final, source, metrics)
            job.state = "done"
            return result
        except (asyncio.CancelledError, Exception) as exc:
            job.state = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
            if isinstance(exc, FusionNodeError):
                metrics.event("failure", reason=str(exc), step=job.step)
            raise
        finally:
            metrics.close()
            await self._release(job)

    async def _planned_layout(
        self,
        strategy: str,
        spec: Any,
        graph: Any,
        workers: list[str],
        params: dict[str, Any],
        offload: bool,
        seq_len: int,
    ) -> tuple[list[Pipeline], list[str], dict[str, Any]]:
        """Pipelines from the planner (OP-Fence + asymmetric DP x PP) or one of its baselines."""
        from fusionnode.plan.baselines import even_plan, memory_plan
        from fusionnode.plan.cluster import load_cluster_dict
        from fusionnode.plan.planner import plan as make_plan

        hosts = await self._candidates(params.get("optimizer_peers"), "optimizer") if offload else []
        doc = params.get("cluster") or cluster_from_records(await self.membership.peers(), workers, hosts)
        known = {d["id"] for d in doc.get("devices", [])}
        missing = [w for w in workers if w not in known]
        if missing:
            raise ConfigError(f"the cluster given for planning does not describe workers {missing[:3]}")
        cluster = load_cluster_dict(doc, "swarm")
        kwargs = {
            "micro_batches": spec.micro_batches,
            "seq_len": seq_len,
            "offload": offload,
            "compress": spec.compress == "adatopk",  # the plan may count on AdaTopK only when it runs
        }
        fn = {"fusion": make_plan, "even": even_plan, "memory": memory_plan}[strategy]
        p = await asyncio.to_thread(fn, graph, cluster, spec.batch_size, **kwargs)
        pipelines, first = [], 0
        for r, pp in enumerate(p.pipelines):
            peers = [st.devices[0] for st in pp.stages]
            bounds = [pp.stages[0].lo, *(st.hi for st in pp.stages)]
            m = _divisor_at_most(pp.batch_share, pp.micro_batches)
            pipelines.append(Pipeline(r, peers, bounds, pp.batch_share, m, first))
            first += len(peers)
        plan_hosts = [h.device for h in p.optimizer_hosts] if offload else []
        if offload and not plan_hosts:
            plan_hosts = await self._pick_hosts(params, workers)
        pred = p.prediction
        simulated = pred.simulated_step_time_s if pred else None
        if pred and simulated is None:  # the event simulation of the same plan, for the record
            from fusionnode.plan.simulator import simulate

            try:
                simulated = (await asyncio.to_thread(simulate, graph, cluster, p)).step_time_s
            except Exception as exc:  # a second opinion only: never fail the job over it
                logger.warning("simulating the plan failed: %s", exc)
        prediction = {
            "strategy": p.strategy,
            "step_time_s": pred.step_time_s if pred else None,
            "tokens_per_s": pred.tokens_per_s if pred else None,
            "simulated_step_time_s": simulated,
        }
        return pipelines, plan_hosts, prediction

    async def _measured_links(self) -> dict[tuple[str, str], float]:
        """(from peer, to peer) -> bandwidth in bits/s, as the peers' link probes measured it."""
        return {k: bps for k, (bps, _rtt) in symmetric_links(await self.membership.peers()).items()}

    async def _holders(self, job: Job, hosts: list[str], params: dict[str, Any]) -> list[str]:
        """On resume: the optimizer peers that hold the job's shards (host index i at position i), when
        they hold a shard for each of the len(hosts) indices; else `hosts`."""
        candidates = await self._candidates(params.get("optimizer_peers"), "optimizer")
        res = await asyncio.gather(
            *(
                self.t.call(
                    c, "opt.held", {"job": job.spec.job_id, "secret": job.secret}, timeout=PING_TIMEOUT_S
                )
                for c in candidates
            ),
            return_exceptions=True,
        )
        best: dict[int, tuple[int, str]] = {}
        for peer, r in zip(candidates, res, strict=True):
            if isinstance(r, dict):
                for idx, steps in (r.get("held") or {}).items():
                    if str(idx).isdigit() and steps:
                        best[int(idx)] = max(best.get(int(idx), (-1, "")), (max(int(x) for x in steps), peer))
        chosen = [best[i][1] for i in range(len(hosts)) if i in best]
        if len(chosen) == len(hosts) and len(set(chosen)) == len(chosen):
            return chosen
        return hosts

    async def _pick_hosts(self, params: dict[str, Any], workers: list[str]) -> list[str]:
        hosts = await self._candidates(params.get("optimizer_peers"), "optimizer")
        if not hosts:
            raise PlanError(
                "--offload on needs at least one peer with the optimizer role (fusionnode join "
                "--role optimizer)"
            )
        # prefer hosts that are not also the job's workers (LuWu: CPU/RAM-rich peers apart from the GPUs)
        hosts.sort(key=lambda h: (h in workers, h != self.t.peer_id, h))
        k = int(params.get("optimizer_hosts") or 1)
        return hosts[: max(1, k)]

    @staticmethod
    def _shard(full: dict[str, torch.Tensor], hosts: list[str]) -> tuple[dict[str, str], dict[str, int]]:
        from fusionnode.optim.sharding import shard_params

        host_of = shard_params({n: t.numel() * 4 for n, t in full.items()}, hosts)
        index = {h: i for i, h in enumerate(hosts)}
        return host_of, {n: index[h] for n, h in host_of.items()}

    async def _init_hosts(
        self,
        job: Job,
        stage_args: list[dict[str, Any]],
        full: dict[str, torch.Tensor],
        host_of: dict[str, str],
        *,
        resume: bool,
        start_step: int | None,
    ) -> list[int]:
        """Gives each host its shard (opt.init, the parameters, opt.load); returns the hosts' applied
        steps. With `resume`, every host loads its checkpoint of the newest step that all of them
        have (an older one if that fails to load); with none, the hosts start from `full` at
        `start_step` with new optimizer state (None: that is an error)."""
        expected = self._expected(job, stage_args)
        names_of = {h: sorted(n for n, hh in host_of.items() if hh == h) for h in job.hosts}
        timeout = self.config.step_timeout_s

        async def announce(i: int, host: str) -> list[int]:
            names = names_of[host]
            res = await self.t.call(
                host,
                "opt.init",
                {
                    "job": job.spec.job_id,
                    "driver": self.t.peer_id,
                    "secret": job.secret,
                    "host_index": i,
                    "spec": job.spec.to_dict(),
                    "param_specs": {n: {"shape": list(full[n].shape), "dtype": "float32"} for n in names},
                    "expected": {n: expected[n] for n in names},
                    "step_deadline_s": self.config.step_timeout_s,
                    "save_every": job.spec.save_every,
                    "resume": resume,
                    "sync": job.sync.to_dict(),
                    "replicas": len(job.pipelines),
                },
                timeout=timeout,
            )
            return [int(x) for x in res.get("steps", [])]

        async def load(i: int, host: str, step: int | None) -> int:
            for idx, name in enumerate(names_of[host]):
                meta = {"job": job.spec.job_id, "stage": i, "step": -1, "mb": idx}
                await self.t.send(host, tensor_message("opt_params", meta, {name: full[name]}))
            args: dict[str, Any] = {"job": job.spec.job_id, "resume_step": step}
            if step is None and start_step:
                args["start_step"] = start_step
            res = await self.t.call(host, "opt.load", args, timeout=timeout)
            return int(res.get("applied_step", 0))

        hosts = list(enumerate(job.hosts))
        steps = await asyncio.gather(*(announce(i, h) for i, h in hosts))
        common = sorted(set.intersection(*(set(x) for x in steps)), reverse=True) if resume and steps else []
        if resume and len({tuple(x) for x in steps}) > 1:
            logger.warning(
                "the optimizer hosts keep different checkpoint steps %s; using %s", steps, common[:1]
            )
        for n, step in enumerate([*common, None]):
            if step is None and start_step is None:
                raise PlanError(f"the optimizer hosts have no checkpoint step in common ({steps})")
            if n > 0:  # a load failed: announce again (each host builds its shard anew)
                await asyncio.gather(*(announce(i, h) for i, h in hosts))
            try:
                applied = list(await asyncio.gather(*(load(i, h, step) for i, h in hosts)))
                job.fresh_optimizer = resume and step is None
                if job.fresh_optimizer:
                    logger.warning(
                        "job %s: no optimizer checkpoint common to all hosts; they start from the "
                        "driver's step-%s checkpoint with new optimizer state",
                        job.spec.job_id,
                        start_step,
                    )
                return applied
            except PeerError as exc:
                if step is None:
                    raise
                logger.warning("optimizer hosts could not load their step-%d checkpoint: %s", step, exc)
        raise AssertionError("unreachable")

    def _accept(self, job: Job, stage_args: list[dict[str, Any]]) -> None:
        """This driver takes data messages of the job (fetched parameters, shared gradients) only from
        the job's stages and hosts, at most the model's bytes (and slack) from each."""
        peers = {a["peer"] for a in stage_args} | set(job.hosts)
        self.t.mailbox.accept(job.spec.job_id, "driver", peers, job.model_bytes + MAILBOX_SLACK_BYTES)

    async def _propose(self, stage_args: list[dict[str, Any]], metrics: Any, emit: Any) -> list[str]:
        results = await asyncio.gather(
            *(self.t.call(a["peer"], "job.assign", a) for a in stage_args), return_exceptions=True
        )
        refused = []
        for a, res in zip(stage_args, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, FusionNodeError):
                    raise res
                refused.append(a["peer"])
                metrics.event("refused", peer=a["peer"], reason=str(res))
                await emit({"type": "event", "kind": "refused", "peer": a["peer"], "reason": str(res)})
        if refused:  # release what the others accepted; the next proposal reassigns
            await asyncio.gather(
                *(
                    self.t.call(a["peer"], "job.release", {"job": a["job"], "stage": a["stage"]})
                    for a in stage_args
                    if a["peer"] not in refused
                ),
                return_exceptions=True,
            )
        return refused

    async def _ship_params(
        self, job: Job, stage_args: list[dict[str, Any]], full: dict[str, torch.Tensor]
    ) -> None:
        async def ship(a: dict[str, Any]) -> None:
            for idx, name in enumerate(sorted(a["param_specs"])):
                meta = {"job": job.spec.job_id, "stage": a["stage"], "step": -1, "mb": idx}
                await self.t.send(a["peer"], tensor_message("params", meta, {name: full[name]}))
            await self.t.call(
                a["peer"],
                "job.start",
                {"job": job.spec.job_id, "stage": a["stage"]},
                timeout=self.config.step_timeout_s,
            )

        await asyncio.gather(*(ship(a) for a in stage_args))

    async def _train(self, job: Job, run: _Run, source: Any, start_step: int) -> None:
        """Runs the steps. With offload a step that fails (a peer died, left, or sent bad tensors)
        is replayed under a new plan without that peer; every `rebalance_every` steps the measured
        stage speeds decide whether a better layout is worth adopting."""
        keepalive = asyncio.ensure_future(self._keep_alive(job, run))
        try:
            await self._steps(job, run, source, start_step)
        finally:
            keepalive.cancel()
            await asyncio.gather(keepalive, return_exceptions=True)

    async def _keep_alive(self, job: Job, run: _Run) -> None:
        """Renews the stages' leases while steps or plan changes take long (a ping a third of a lease)."""
        while True:
            await asyncio.sleep(job.lease_s / 3)
            peers = sorted({a["peer"] for a in run.stage_args})
            await asyncio.gather(
                *(
                    self.t.call(p, "job.ping", {"job": job.spec.job_id}, timeout=PING_TIMEOUT_S)
                    for p in peers
                ),
                return_exceptions=True,
            )

    async def _steps(self, job: Job, run: _Run, source: Any, start_step: int) -> None:
        from fusionnode.train.spec import lr_at

        spec = job.spec
        jid = spec.job_id
        tokens_total, time_total = 0, 0.0
        step = start_step
        failures_in_a_row = 0
        while step < spec.steps:
            t0 = time.perf_counter()
            lr = lr_at(step, spec)
            wire0 = self.t.bytes_sent.get(jid, 0)
            try:
                reports, grad_norm, late = await self._one_step(job, run, step, lr)
            except _HostFailed as fail:
                failures_in_a_row += 1
                if failures_in_a_row > MAX_REPLAYS:
                    raise PlanError(f"step {step}: optimizer hosts keep failing: {fail.summary()}") from None
                step = await self._recover_hosts(job, run, step, fail)
                continue
            except _StepFailed as fail:
                failures_in_a_row += 1
                if job.sync.rounds:
                    raise PeerError(
                        f"step {step} failed ({fail.summary()}); --sync {job.sync.mode} does not recover "
                        "a failed worker yet"
                    ) from None
                if not job.offload:
                    raise PeerError(
                        f"step {step} failed ({fail.summary()}); recovering from a failed worker needs "
                        "the optimizer state off the workers (--offload on)"
                    ) from None
                if failures_in_a_row > MAX_REPLAYS:
                    raise PlanError(
                        f"step {step} failed {failures_in_a_row} times in a row: {fail.summary()}"
                    ) from None
                await self._recover(job, run, source, step, fail)
                continue
            failures_in_a_row = 0
            step_time = time.perf_counter() - t0
            run.target_time_s = max(
                r["compute_s"] / job.pipelines[a["replica"]].micro_batches
                for a, r in zip(run.stage_args, reports, strict=True)
            )
            loss = self._step_loss(job, run.stage_args, reports)
            tokens = spec.batch_size * run.seq_len
            tokens_total += tokens
            time_total += step_time
            wire = sum(r["sent_bytes"] for r in reports) + self.t.bytes_sent.get(jid, 0) - wire0
            wire += job.round_bytes  # pseudo-gradients sent at a round's end (issue 19)
            record = {
                "step": step,
                "loss": loss,
                "tokens": tokens,
                "step_time_s": step_time,
                "wire_bytes": wire,
                "plan_version": job.plan_version,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens / step_time,
                "phases": job.phases,
                "stages": [
                    {
                        "stage": r["stage"],
                        "peer": a["peer"],
                        "compute_s": round(r["compute_s"], 4),
                        "wait_s": round(r["wait_s"], 4),
                        "link_s": round(max(0.0, r.get("total_s", 0.0) - r["compute_s"] - r["wait_s"]), 4),
                        "sent_bytes": r["sent_bytes"],
                        "optimizer_bytes": r.get("optimizer_bytes", 0),
                        "links": r["links"],
                    }
                    for a, r in zip(run.stage_args, reports, strict=True)
                ],
            }
            if job.offload:
                record["optimizer_hosts"] = job.host_counters
            run.metrics.step(record)
            job.history.append(record)
            if len(job.history) > 2 * HISTORY_KEPT:  # the status shows the last HISTORY_KEPT
                del job.history[:-HISTORY_KEPT]
            job.step, job.loss = step + 1, loss
            job.tokens_per_s = tokens_total / time_total
            await run.emit({"type": "step", **record, "steps": spec.steps})
            run.observe(job, reports)
            step += 1
            if late is not None:  # the step was applied, but a worker failed on commit: re-plan now
                await self._recover(job, run, source, step, late)
                continue
            if self._checkpoints_at(spec, step) and step < spec.steps:
                try:
                    await self._checkpoint(
                        job, step, source, await self._fetch_params(job, run.stage_args, run.host_of)
                    )
                except (OSError, FusionNodeError) as exc:  # the earlier checkpoints stay; the job goes on
                    await self._event(run, job, "failure", peer=None, step=step, reason=f"checkpoint: {exc}")
            if (
                job.offload
                and run.rebalance_every
                and step < spec.steps
                and run.steps_on_plan >= run.rebalance_every
            ):
                await self._maybe_rebalance(job, run, step)

    async def _one_step(
        self, job: Job, run: _Run, step: int, lr: float
    ) -> tuple[list[dict[str, Any]], float, _StepFailed | None]:
        """One step on the plan in force: inputs, `job.step` everywhere, the optimizer, commits.

        Raises _StepFailed when the step did not reach the optimizer (it is to be replayed); returns
        a _StepFailed as its third value when only a commit failed after the step was applied."""
        spec = job.spec
        jid = spec.job_id
        stage_args = run.stage_args
        input_name = next(iter(stage_args[0]["recv_specs"]))
        timeout = self.config.step_timeout_s
        sends: dict[str, list[Any]] = {}
        shards = run.source.shard_batches(step, [p.samples for p in job.pipelines])
        for pipe, (xs, ys) in zip(job.pipelines, shards, strict=True):
            first, last = pipe.first_stage, pipe.first_stage + len(pipe.peers) - 1
            for mb, (x, y) in enumerate(
                zip(xs.chunk(pipe.micro_batches), ys.chunk(pipe.micro_batches), strict=True)
            ):
                meta = {"job": jid, "step": step, "mb": mb}
                sends.setdefault(pipe.peers[0], []).append(
                    tensor_message("input", {**meta, "stage": first}, {input_name: x})
                )
                sends.setdefault(pipe.peers[-1], []).append(
                    tensor_message("target", {**meta, "stage": last}, {"target": y})
                )

        async def feed(peer: str, msgs: list[Any]) -> None:
            for msg in msgs:
                await self.t.send(peer, msg)

        # inputs first (as a step always did: the stages find them waiting), then the steps
        phases: dict[str, float] = {}
        t_phase = time.perf_counter()
        await self._gather_or_fail(
            job,
            run,
            step,
            {("send", p): feed(p, msgs) for p, msgs in sends.items()},
            {("send", p): p for p in sends},
        )
        calls = {
            **{
                ("step", a["stage"]): self.t.call(
                    a["peer"],
                    "job.step",
                    {
                        "job": jid,
                        "stage": a["stage"],
                        "step": step,
                        "micro_batches": job.pipelines[a["replica"]].micro_batches,
                        "mb_size": job.pipelines[a["replica"]].mb_size,
                        "target_time_s": run.target_time_s,
                    },
                    timeout=timeout * 2,
                    recall="job.step_result",  # a reply lost to a stream reset: fetch it, the step ran
                )
                for a in stage_args
            },
        }
        peer_of = {("step", a["stage"]): a["peer"] for a in stage_args}
        phases["feed_s"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        results = await self._gather_or_fail(job, run, step, calls, peer_of)
        reports = [results[("step", a["stage"])] for a in stage_args]
        phases["stages_s"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        if run.params.get("dump_grads") and step == run.first_step:
            await self._dump_grads(job, stage_args, run.params["dump_grads"])
        if job.sync.rounds:  # issue 19: each replica steps its own inner optimizer; rounds on the hosts
            grad_norm, commit_by_stage = await self._round_commit_args(
                job, run, stage_args, reports, step, lr
            )
            commit_extra = {}
        elif job.offload:
            try:
                grad_norm, _clip = await self._apply_on_hosts(job, step, lr)
            except (FusionNodeError, OSError, asyncio.TimeoutError) as exc:
                dead, _leaving = await self._probe(list(job.hosts))
                if not dead:
                    raise
                raise _HostFailed(step, {h: str(exc) for h in dead}, dead) from None
            commit_extra: dict[str, Any] = {}
        else:
            shared_sum = await self._sum_shared(job, stage_args, step)
            sq = sum(r["grad_sq"] for r in reports) + FlatOptimizer.grad_sq_norm(shared_sum)
            grad_norm = math.sqrt(sq)
            clip = 1.0 if spec.grad_clip is None else min(1.0, spec.grad_clip / (grad_norm + 1e-6))
            for a in stage_args:
                mine = {k: shared_sum[k] for k in a["shared_names"]}
                if mine:
                    meta = {"job": jid, "step": step, "mb": -1, "stage": a["stage"]}
                    await self.t.send(a["peer"], tensor_message("shared_sum", meta, mine))
            commit_extra = {"lr": lr, "clip_coef": clip}
        phases["optimizer_s"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        if not job.sync.rounds:
            commit_by_stage = {a["stage"]: commit_extra for a in stage_args}
        commits = {
            ("commit", a["stage"]): self.t.call(
                a["peer"],
                "job.commit",
                {"job": jid, "stage": a["stage"], "step": step, **commit_by_stage[a["stage"]]},
                timeout=timeout,
                idempotent=True,  # a commit already applied answers so
            )
            for a in stage_args
        }
        late = None
        try:
            committed = await self._gather_or_fail(
                job, run, step, commits, {("commit", a["stage"]): a["peer"] for a in stage_args}
            )
            if job.sync.rounds:
                await self._round_counters(job, committed)
        except _StepFailed as fail:
            if not job.offload or job.sync.rounds:
                raise PeerError(f"step {step}: a worker failed while applying it: {fail.summary()}") from None
            late = fail
        phases["commit_s"] = time.perf_counter() - t_phase
        job.phases = {k: round(v, 4) for k, v in phases.items()}
        return reports, grad_norm, late

    async def _gather_or_fail(
        self, job: Job, run: _Run, step: int, calls: dict[Any, Any], peer_of: dict[Any, str]
    ) -> dict[Any, Any]:
        """Awaits every call; at the first failure waits a moment for others, cancels the rest, probes
        the plan's peers and raises _StepFailed (so a dead peer is detected as soon as a stream to it
        breaks, not after the step deadline)."""
        tasks = {key: asyncio.ensure_future(coro) for key, coro in calls.items()}
        pending = set(tasks.values())
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if any(t.exception() is not None for t in done if not t.cancelled()):
                    break
            if pending:
                _done, pending = await asyncio.wait(pending, timeout=FAILURE_GRACE_S)
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        errors: dict[str, str] = {}
        for key, t in tasks.items():
            if t.cancelled():
                continue
            exc = t.exception()
            if exc is None:
                continue
            if not isinstance(exc, FusionNodeError | OSError | asyncio.TimeoutError):
                raise exc
            peer = peer_of[key]
            errors[peer] = (errors.get(peer, "") + " | " + str(exc)).strip(" |")
        if not errors:
            return {key: t.result() for key, t in tasks.items()}
        unreachable, draining = await self._probe(
            sorted({a["peer"] for a in run.stage_args} | set(job.hosts))
        )
        dead_hosts = [h for h in job.hosts if h in unreachable]
        if dead_hosts:
            raise _HostFailed(
                step, {h: errors.get(h, "did not answer a liveness probe") for h in dead_hosts}, dead_hosts
            )
        for p in draining:
            errors.setdefault(p, LEAVING_MARK)
        raise _StepFailed(step, errors, unreachable)

    async def _probe(self, peers: list[str]) -> tuple[list[str], list[str]]:
        """(peers that did not answer a ping in PING_TIMEOUT_S, peers that answered they are leaving)."""
        res = await asyncio.gather(
            *(self.t.call(p, "job.ping", {}, timeout=PING_TIMEOUT_S) for p in peers), return_exceptions=True
        )
        dead = [p for p, r in zip(peers, res, strict=True) if isinstance(r, BaseException)]
        leaving = [p for p, r in zip(peers, res, strict=True) if isinstance(r, dict) and r.get("draining")]
        return dead, leaving

    async def _recover(self, job: Job, run: _Run, source: Any, step: int, fail: _StepFailed) -> None:
        """Bans (or forgets) the peers to blame, adopts a plan without them; the step is then replayed."""
        from fusionnode.train.rebalance import blame

        t0 = time.perf_counter()
        now = time.monotonic()
        peers = sorted({a["peer"] for a in run.stage_args})
        verdict = blame(fail.errors, peers, fail.unreachable)
        verdict.pop(self.t.peer_id, None)  # the driver's own peer answered (it is running this)
        if not verdict:  # a transient error (a stream reset, say): recorded, and the step replayed
            await self._event(
                run,
                job,
                "failure",
                peer=None,
                step=step,
                reason=f"transient, every peer still answers ({fail.summary()}); re-planning the same peers",
            )
        for peer, kind in sorted(verdict.items()):
            if kind == "leave":
                run.gone.add(peer)
                await self._event(run, job, "leave", peer=peer, step=step, reason="the peer drained and left")
            else:
                ban_s = run.bans.fail(peer, now)
                await self._event(
                    run,
                    job,
                    "failure",
                    peer=peer,
                    step=step,
                    reason=fail.errors.get(peer) or "did not answer a liveness probe",
                    unreachable=peer in fail.unreachable,
                    ban_s=ban_s,
                )
        workers = await self._live_workers(job, run)
        try:
            await self._adopt(
                job,
                run,
                workers,
                reason=f"replacing {', '.join(sorted('…' + p[-8:] for p in verdict))} at step {step}",
            )
        except (PlanError, ConfigError) as exc:
            ckpt = None
            if job.offload and job.spec.save_dir:
                with contextlib.suppress(FusionNodeError, OSError):
                    ckpt = await self._checkpoint(
                        job,
                        job.step,
                        source,
                        await self._fetch_params(job, [], run.host_of, all_names=run.full),
                    )
            raise PlanError(
                f"the job cannot go on at step {step} without {sorted(p[:12] for p in verdict)}: {exc}"
                + (f"; checkpoint of step {job.step} in {ckpt}" if ckpt else "")
            ) from None
        await self._event(
            run,
            job,
            "recovered",
            step=step,
            time_to_recover_s=round(time.perf_counter() - t0, 3),
            since_failure_s=round(time.perf_counter() - fail.t0, 3),
            plan_version=job.plan_version,
            reason="the step is replayed under the new plan",
        )

    async def _recover_hosts(self, job: Job, run: _Run, step: int, fail: _StepFailed) -> int:
        """Replaces dead optimizer hosts: each takes a dead host's shard (same index, same names),
        every host reloads its latest shard checkpoint (the survivors roll back with it, so all
        hosts agree), the workers are re-planned to the new hosts, and the steps since that
        checkpoint are replayed. Returns the step to continue from."""
        t0 = time.perf_counter()
        spec = job.spec
        if not (spec.save_dir and spec.save_every):
            raise PlanError(
                f"optimizer host(s) {[h[:12] for h in fail.unreachable]} died at step {step} and the job "
                "keeps no optimizer checkpoints to restore them from (--save DIR --save-every N)"
            )
        now = time.monotonic()
        for h in fail.unreachable:
            ban_s = run.bans.fail(h, now)
            await self._event(
                run, job, "failure", peer=h, step=step, role="optimizer", reason=fail.errors[h], ban_s=ban_s
            )
        peers = await self.membership.peers()
        spares = [
            p.peer_id
            for p in sorted(peers, key=lambda r: r.peer_id)
            if "optimizer" in p.roles
            and p.peer_id not in job.hosts
            and not run.bans.banned(p.peer_id, now)
            and p.peer_id not in run.gone
        ]
        workers = {a["peer"] for a in run.stage_args}
        spares.sort(key=lambda h: (h in workers, h))  # prefer peers that are not the job's workers
        hosts = list(job.hosts)
        for i, h in enumerate(hosts):
            if h in fail.unreachable:
                if not spares:
                    raise PlanError(f"no optimizer peer is left to replace host {h[:12]}… at step {step}")
                hosts[i] = spares.pop(0)
        replaced = dict(zip(job.hosts, hosts, strict=True))
        job.hosts = hosts
        run.host_of = {n: replaced[h] for n, h in (run.host_of or {}).items()}
        self._accept(job, run.stage_args)
        # a new host cannot read the dead one's disk: without a shard checkpoint every host has, all
        # start from the driver's own latest checkpoint, with new optimizer state
        fallback, full = None, run.full
        with contextlib.suppress(ConfigError, OSError):
            ckpt = await asyncio.to_thread(self._read_resume, spec)
            fallback, full, _secret = self._load_resume(ckpt, run.source, run.full)
        applied = await self._init_hosts(
            job, run.stage_args, full, run.host_of, resume=True, start_step=fallback
        )
        if len(set(applied)) != 1:
            raise PlanError(
                f"the optimizer hosts restored different steps {applied}: cannot replay consistently"
            )
        resume_at = applied[0]
        workers_now = await self._live_workers(job, run)
        await self._adopt(job, run, workers_now, reason=f"new optimizer host(s) at step {step}")
        job.step = resume_at
        await self._event(
            run,
            job,
            "recovered",
            step=step,
            role="optimizer",
            replay_from=resume_at,
            time_to_recover_s=round(time.perf_counter() - t0, 3),
            plan_version=job.plan_version,
            reason=(
                f"hosts restored from the step-{resume_at} "
                + (
                    "driver checkpoint, with new optimizer state"
                    if job.fresh_optimizer
                    else "shard checkpoint"
                )
                + f"; steps {resume_at}..{step} replayed"
            ),
            fresh_optimizer=job.fresh_optimizer,
        )
        return resume_at

    async def _event(self, run: _Run, job: Job, kind: str, **fields: Any) -> None:
        rec = run.metrics.event(kind, **fields)
        job.events.append(rec)
        logger.warning("job %s: %s %s", job.spec.job_id, kind, {k: v for k, v in fields.items()})
        await run.emit({"type": "event", "kind": kind, **fields})

    async def _live_workers(self, job: Job, run: _Run) -> list[str]:
        """Worker peers now in the swarm, less the banned and the departed; joins are recorded."""
        now = time.monotonic()
        wanted = run.params.get("peers")
        peers = await self.membership.peers()
        ids = [
            p.peer_id
            for p in peers
            if "worker" in p.roles and getattr(p, "availability", "available") == "available"
        ]
        if wanted:
            ids = [w for w in ids if w in wanted] + [w for w in ids if w not in wanted]
        ids = sorted(ids, key=lambda pid: (pid != self.t.peer_id, pid)) if not wanted else ids
        for pid in ids:
            if pid not in run.known:
                run.known.add(pid)
                await self._event(
                    run, job, "join", peer=pid, step=job.step, reason="a new worker is in the swarm"
                )
        return [p for p in run.bans.allowed(ids, now) if p not in run.gone]

    async def _adopt(
        self, job: Job, run: _Run, workers: list[str], *, reason: str, layout: Any = None
    ) -> None:
        """Switches the job to a new plan at a step boundary: releases the old stages (aborting a
        step in progress), lays out new ones (with new stage ids, so no message or contribution of
        the old plan can be taken for the new one), points the optimizer hosts at the new
        contributors (dropping the pending step's partial gradients) and ships each new stage the
        current parameters from the hosts."""
        spec = job.spec
        t0 = time.perf_counter()
        old_args = run.stage_args
        await asyncio.gather(
            *(
                self.t.call(
                    a["peer"],
                    "job.release",
                    {"job": spec.job_id, "stage": a["stage"], "abort": True},
                    timeout=PING_TIMEOUT_S,
                )
                for a in old_args
            ),
            return_exceptions=True,
        )
        current = await self._fetch_params(job, old_args, run.host_of, all_names=run.full)
        base = job.plan_version * STAGE_ID_STRIDE
        candidates = list(workers)
        for _attempt in range(MAX_PROPOSALS):
            if layout is not None:
                pipe = job.pipelines[0]
                job.pipelines = [
                    Pipeline(0, list(layout.peers), list(layout.bounds), pipe.samples, pipe.micro_batches, 0)
                ]
            elif run.strategy == "simple":
                replicas = len(run.shares)
                n_stages = max(1, min(run.n_stages, len(candidates) // replicas))
                job.pipelines = self._layout(spec, run.flops, candidates, n_stages, replicas, run.shares)
            else:
                params = dict(run.params)
                if params.get("cluster"):
                    from fusionnode.plan.cluster import subset_doc

                    params["cluster"] = subset_doc(params["cluster"], set(candidates) | set(job.hosts))
                job.pipelines, _hosts, _pred = await self._planned_layout(
                    run.strategy, spec, run.traced.graph, candidates, params, job.offload, run.seq_len
                )
            for p in job.pipelines:
                p.first_stage += base
            stage_args = self._stage_args(
                job,
                run.traced,
                run.canonical,
                run.full,
                run.sample,
                run.host_of,
                run.host_index,
                await self._measured_links(),
                run.params.get("link_options"),
            )
            refused = await self._propose(stage_args, run.metrics, run.emit)
            if not refused:
                break
            candidates = [w for w in candidates if w not in refused]
            layout = None
            if not candidates:
                break
        else:
            raise PlanError("could not place the job's stages after several proposals")
        if not candidates:
            raise PlanError("no worker is left that accepts the job's stages")
        self._accept(job, stage_args)
        if job.offload:
            expected = self._expected(job, stage_args)
            await asyncio.gather(
                *(
                    self.t.call(
                        h,
                        "opt.replan",
                        {
                            "job": spec.job_id,
                            "expected": {n: expected[n] for n in expected if run.host_of[n] == h},
                        },
                        timeout=self.config.step_timeout_s,
                    )
                    for h in job.hosts
                )
            )
        await self._ship_params(job, stage_args, current)
        run.stage_args = stage_args
        run.steps_on_plan = 0
        run.target_time_s = None
        run.move_s = time.perf_counter() - t0
        job.plan_version += 1
        job.stages = _stage_rows(stage_args)
        await run.emit(
            {
                "type": "plan",
                "planner": run.strategy,
                "prediction": {},
                "plan_version": job.plan_version,
                "stages": job.stages,
                "num_nodes": run.traced.graph.num_nodes,
                "offload": job.offload,
                "optimizer_hosts": job.hosts,
            }
        )
        await self._event(
            run,
            job,
            "replan",
            reason=reason,
            plan_version=job.plan_version,
            step=job.step,
            peers=[a["peer"] for a in stage_args],
            bounds=[[a["lo"], a["hi"]] for a in stage_args],
            move_s=round(run.move_s, 3),
        )

    async def _maybe_rebalance(self, job: Job, run: _Run, step: int) -> None:
        """Straggler rebalancing and use of joined peers (one pipeline): adopt a better layout when
        the measured speeds predict a gain above the threshold that outweighs the cost of moving."""
        from fusionnode.train.rebalance import Layout, decide, fill_speeds

        run.steps_on_plan = 0  # next check after another window
        if len(job.pipelines) != 1:
            return
        workers = await self._live_workers(job, run)
        pipe = job.pipelines[0]
        spares = [w for w in workers if w not in pipe.peers]
        advertised = {
            r.peer_id: float(r.device.tflops_fp32)
            for r in await self.membership.peers()
            if r.peer_id in set(workers)
        }
        speeds = fill_speeds(run.speeds(), advertised, [*pipe.peers, *spares])
        current = Layout(tuple(pipe.peers), tuple(pipe.bounds))
        d = decide(
            current,
            run.flops,
            speeds,
            pipe.micro_batches,
            spares=spares,
            steps_left=job.spec.steps - step,
            move_cost_s=run.move_s,
            min_gain=run.min_gain,
        )
        logger.info("rebalance check at step %d: %s", step, d.reason)
        if d.adopt and d.layout is not None:
            await self._adopt(job, run, workers, reason=f"rebalance: {d.reason}", layout=d.layout)

    @staticmethod
    def _expected(job: Job, stage_args: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
        from fusionnode.optim.store import contributor_key

        expected: dict[str, dict[str, dict[str, Any]]] = {}
        for a in stage_args:
            for name in a["param_specs"]:
                if name in job.frozen:
                    continue
                expected.setdefault(name, {})[contributor_key(a["replica"], a["stage"])] = {
                    "replica": a["replica"],
                    "samples": job.pipelines[a["replica"]].samples,
                    "peer": a["peer"],
                }
        return expected

    @staticmethod
    def _step_loss(job: Job, stage_args: list[dict[str, Any]], reports: list[dict[str, Any]]) -> float:
        """The batch's mean loss: each replica's mean micro-batch loss weighted by its samples."""
        total, weight = 0.0, 0
        for a, r in zip(stage_args, reports, strict=True):
            if a["pos"] == a["num_stages"] - 1:
                n = job.pipelines[a["replica"]].samples
                total += n * sum(r["losses"]) / len(r["losses"])
                weight += n
        return total / weight

    async def _apply_on_hosts(self, job: Job, step: int, lr: float) -> tuple[float, float]:
        """Offload: wait for the hosts to have every contribution, clip globally, apply."""
        jid, ostep = job.spec.job_id, step + 1  # the stores count steps from 1
        ready = await asyncio.gather(
            *(
                self.t.call(
                    h,
                    "opt.ready",
                    {"job": jid, "step": ostep},
                    timeout=self.config.step_timeout_s + 5,
                    idempotent=True,
                )
                for h in job.hosts
            )
        )
        for h, r in zip(job.hosts, ready, strict=True):
            if not r["complete"]:
                logger.warning(
                    "step %d: host %s applies without %s (deadline passed)", step, h[:12], r["missing"]
                )
        grad_norm = math.sqrt(sum(r["grad_sq"] for r in ready))
        clip = 1.0 if job.spec.grad_clip is None else min(1.0, job.spec.grad_clip / (grad_norm + 1e-6))
        applied = await asyncio.gather(
            *(
                self.t.call(
                    h,
                    "opt.apply",
                    {
                        "job": jid,
                        "step": ostep,
                        "lr": lr,
                        "clip_coef": clip,
                        "force": not r["complete"],
                        "save": self._checkpoints_at(job.spec, ostep),  # with the driver's, same step
                    },
                    timeout=self.config.step_timeout_s,
                    idempotent=True,  # a host re-applying an applied step answers with the earlier result
                )
                for h, r in zip(job.hosts, ready, strict=True)
            )
        )
        # what the hosts accepted and rejected (with reasons), for the metrics file
        job.host_counters = [
            {
                "host": h,
                **res.get("counters", {}),
                "rejected": res.get("rejected", {}),
                "received_bytes": res.get("received_bytes", 0),  # cumulative (issue 19)
                "sent_bytes": res.get("sent_bytes", 0),
            }
            for h, res in zip(job.hosts, applied, strict=True)
        ]
        return grad_norm, clip

    async def _round_commit_args(
        self,
        job: Job,
        run: _Run,
        stage_args: list[dict[str, Any]],
        reports: list[dict[str, Any]],
        step: int,
        lr: float,
    ) -> tuple[float, dict[int, dict[str, Any]]]:
        """--sync diloco|sparseloco: per replica, its tied-weight gradient sums and its own clip factor
        (each replica steps alone, as the local reference does); at a round's end, what each stage
        sends. Returns (the replicas' mean gradient norm, the commit arguments per stage)."""
        from fusionnode.optim.rounds import contributing_names, round_of, round_tokens

        spec = job.spec
        if run.names_by_stage is None:
            run.names_by_stage = contributing_names(stage_args)
        round_id = round_of(job.sync, step, spec.steps)
        out: dict[int, dict[str, Any]] = {}
        norms = []
        for pipe in job.pipelines:
            mine = [(a, r) for a, r in zip(stage_args, reports, strict=True) if a["replica"] == pipe.replica]
            shared_sum = await self._sum_shared(job, [a for a, _ in mine], step)
            norm = math.sqrt(sum(r["grad_sq"] for _, r in mine) + FlatOptimizer.grad_sq_norm(shared_sum))
            norms.append(norm)
            clip = 1.0 if spec.grad_clip is None else min(1.0, spec.grad_clip / (norm + 1e-6))
            for a, _ in mine:
                part = {k: shared_sum[k] for k in a["shared_names"]}
                if part:
                    meta = {"job": spec.job_id, "step": step, "mb": -1, "stage": a["stage"]}
                    await self.t.send(a["peer"], tensor_message("shared_sum", meta, part))
                out[a["stage"]] = {"lr": lr, "clip_coef": clip}
                if round_id is not None:
                    out[a["stage"]]["round"] = {
                        "id": round_id,
                        "tokens": round_tokens(job.sync, step, pipe.samples, run.seq_len),
                        "names": run.names_by_stage[a["stage"]],
                    }
        return sum(norms) / len(norms), out

    async def _round_counters(self, job: Job, committed: dict[Any, Any]) -> None:
        """The hosts' cumulative bytes and rounds (the step record's optimizer_hosts), under --sync rounds."""
        job.round_bytes = sum(int(r.get("round_bytes", 0)) for r in committed.values())
        res = await asyncio.gather(
            *(
                self.t.call(h, "opt.counters", {"job": job.spec.job_id}, timeout=self.config.step_timeout_s)
                for h in job.hosts
            )
        )
        job.host_counters = [
            {"host": h, **r.get("counters", {}), **{k: v for k, v in r.items() if k != "counters"}}
            for h, r in zip(job.hosts, res, strict=True)
        ]

    async def _sum_shared(
        self, job: Job, stage_args: list[dict[str, Any]], step: int
    ) -> dict[str, torch.Tensor]:
        total: dict[str, torch.Tensor] = {}
        for a in stage_args:
            if not a["shared_names"]:
                continue
            msg, src = await self.t.mailbox.get(
                ("shared_grad", job.spec.job_id, step, -1, a["stage"]),
                self.config.step_timeout_s,
                sender=a["peer"],
            )
            got = decode_checked(msg, {k: a["param_specs"][k] for k in a["shared_names"]}, None, src)
            for name, g in got.items():
                total[name] = total[name] + g if name in total else g.clone()
        return total

    async def _fetch(self, job: Job, stage_args: list[dict[str, Any]], what: str) -> dict[str, torch.Tensor]:
        """Parameters (or gradients) of replica 0, by name; a name held by several stages is summed for
        gradients (tied weights) and taken once for parameters (the copies are equal)."""
        out: dict[str, torch.Tensor] = {}

        async def one(a: dict[str, Any]) -> dict[str, torch.Tensor]:
            res = await self.t.call(
                a["peer"],
                "job.fetch",
                {"job": job.spec.job_id, "stage": a["stage"], "what": what},
                timeout=self.config.step_timeout_s,
            )
            got: dict[str, torch.Tensor] = {}
            for idx in range(int(res["count"])):
                msg, src = await self.t.mailbox.get(
                    (f"fetch_{what}", job.spec.job_id, -1, idx, a["stage"]),
                    self.config.step_timeout_s,
                    sender=a["peer"],
                )
                got.update(decode_checked(msg, a["param_specs"], None, src))
            return got

        parts = await asyncio.gather(*(one(a) for a in stage_args if a["replica"] == 0))
        for part in parts:
            for name, t in part.items():
                if name in out and what == "grads":
                    out[name] = out[name] + t
                else:
                    out.setdefault(name, t)
        return out

    async def _fetch_params(
        self,
        job: Job,
        stage_args: list[dict[str, Any]],
        host_of: dict[str, str] | None,
        all_names: dict[str, Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The current parameters: from the optimizer hosts with offload (every name of `all_names`,
        or those the stages hold), else from replica 0's stages."""
        if not job.offload:
            return {**job.frozen, **await self._fetch(job, stage_args, "params")}
        out: dict[str, torch.Tensor] = dict(job.frozen)
        specs = {n: s for a in stage_args for n, s in a["param_specs"].items()}
        if all_names is not None:
            specs = {n: {"shape": list(t.shape), "dtype": "float32"} for n, t in all_names.items()}
        for name in job.frozen:  # frozen (LoRA base) tensors never go to the hosts: the driver's copy
            specs.pop(name, None)
        held = set(specs)
        for i, host in enumerate(job.hosts):
            names = sorted(n for n in held if (host_of or {}).get(n, host) == host)
            if not names:
                continue
            tag = -next(self._tags)  # distinct from any pull a worker makes (those are step numbers)
            res = await self.t.call(
                host,
                "opt.pull",
                {"job": job.spec.job_id, "names": names, "tag": tag, "stage": -1},
                timeout=self.config.step_timeout_s,
                idempotent=True,
            )
            for idx in range(int(res["count"])):
                msg, src = await self.t.mailbox.get(
                    (f"pulled{i}", job.spec.job_id, tag, idx, -1), self.config.step_timeout_s, sender=host
                )  # exactly the name asked for at this index, in its shape
                out.update(decode_checked(msg, {names[idx]: specs[names[idx]]}, None, src))
        return out

    async def _dump_grads(self, job: Job, stage_args: list[dict[str, Any]], path: str) -> None:
        from safetensors.torch import save_file

        grads = await self._fetch(job, stage_args, "grads")
        await asyncio.to_thread(save_file, {k: v.contiguous() for k, v in grads.items()}, path)

    @staticmethod
    def _read_resume(spec: Any) -> Any:
        """The driver's checkpoint in the job's --save directory (ConfigError without one)."""
        from fusionnode.train.checkpoint import load_checkpoint

        if not spec.save_dir:
            raise ConfigError("--resume needs the checkpoint directory (--save)")
        ckpt = load_checkpoint(spec.save_dir)
        if ckpt is None:
            raise ConfigError(f"--resume: no complete checkpoint in {spec.save_dir}")
        return ckpt

    @staticmethod
    def _load_resume(
        ckpt: Any, source: Any, full: dict[str, torch.Tensor]
    ) -> tuple[int, dict[str, torch.Tensor], str | None]:
        """(step, parameters, job secret) of the driver's checkpoint."""
        step = source.check_state(ckpt.data_state)
        secret = (ckpt.optimizer_state or {}).get("job_secret")
        return (
            step,
            {name: ckpt.params[name].float() for name in full},
            secret if isinstance(secret, str) else None,
        )

    def _job_secret(self, job_id: str) -> str:
        """The secret that proves this driver owns a job's optimizer shards: derived from a random key
        in this driver's state directory (so a rerun of the same job uses the same shard directory),
        written into every checkpoint of the job (so a resume elsewhere proves it too)."""
        path = Path(self.state_dir) / JOB_SECRET_FILE
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            key = secrets.token_bytes(32)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
        return hmac.new(key, job_id.encode(), hashlib.sha256).hexdigest()[:32]

    @staticmethod
    def _checkpoints_at(spec: Any, step: int) -> bool:
        """Whether the job is checkpointed after `step` steps (every save_every, and the last)."""
        return bool(spec.save_dir) and (
            step == spec.steps or bool(spec.save_every and step % spec.save_every == 0)
        )

    async def _checkpoint(self, job: Job, step: int, source: Any, params: dict[str, torch.Tensor]) -> str:
        """Saves every state-dict name (tied weights under each of their names, stored once), so the
        checkpoint loads strictly into the model (`fusionnode generate`, `export`)."""
        from fusionnode.train.checkpoint import save_checkpoint

        full = {**params, **{alias: params[name] for alias, name in job.aliases.items() if name in params}}
        path = await asyncio.to_thread(
            save_checkpoint,
            job.spec.save_dir,
            step,
            full,
            {"job_secret": job.secret},
            source.state(step),
            job.spec,
        )
        return str(path)

    async def _finish(
        self, job: Job, model: Any, final: dict[str, torch.Tensor], source: Any, metrics: Any
    ) -> dict[str, Any]:
        from fusionnode.train.generate import generate
        from fusionnode.train.local import evaluate

        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(final[name])
        val_loss = await asyncio.to_thread(evaluate, model, source)
        job.validation.append({"step": job.step, "loss": val_loss})
        sample = await asyncio.to_thread(generate, model, "def ", 160, 0.8, 40, job.spec.seed)
        checkpoint = None
        if job.spec.save_dir:
            try:
                checkpoint = await self._checkpoint(job, job.spec.steps, source, final)
            except (OSError, FusionNodeError) as exc:  # the trained result is still reported
                logger.error("job %s: the final checkpoint failed: %s", job.spec.job_id, exc)
                metrics.event("failure", reason=f"final checkpoint: {exc}", step=job.spec.steps)
        return {
            "job": job.spec.job_id,
            "steps": job.step,
            "loss": job.loss,
            "val_loss": val_loss,
            "tokens_per_s": job.tokens_per_s,
            "stages": job.stages,
            "offload": job.offload,
            "optimizer_hosts": job.hosts,
            "checkpoint": checkpoint,
            "metrics_out": job.spec.metrics_out,
            "sample": sample,
            "summary": metrics.summary.as_dict(),
        }

    async def _release(self, job: Job) -> None:
        self.t.mailbox.release(job.spec.job_id, "driver")
        # a job that failed or was cancelled (its `train` client hung up) may have a step in flight on
        # the workers, waiting for micro-batches that will not come: abort it rather than let the
        # release (and any later `leave`) wait out the step's deadline
        abort = job.state != "done"
        calls = [
            self.t.call(
                s["peer"],
                "job.release",
                {"job": job.spec.job_id, "stage": s["stage"], "abort": abort},
                timeout=5,
            )
            for s in job.stages
        ]
        calls += [self.t.call(h, "opt.release", {"job": job.spec.job_id}, timeout=5) for h in job.hosts]
        await asyncio.gather(*calls, return_exceptions=True)


def _canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every state-dict name of a parameter -> the name named_parameters() reports (tied weights share one)."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {name: by_id[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


__all__ = ["Driver", "PeerError", "Pipeline", "balanced_bounds", "crossing_names"]
