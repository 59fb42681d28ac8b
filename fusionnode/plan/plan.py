"""The Plan: which devices run which contiguous node ranges, in how many pipelines (protocol/plan.schema.json)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from fusionnode.errors import ConfigError, PlanError
from fusionnode.graph.dag import OpGraph

PLAN_FORMAT_VERSION = 1
DP_SYNC_CHOICES = ("hosts", "ring")  # how a plan's replicas synchronise (Plan.dp_sync)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    devices: tuple[str, ...]  # device ids running this stage (one today; several = tensor parallel later)
    lo: int  # first node id (inclusive)
    hi: int  # last node id (exclusive)
    keep_ratio: float = 1.0  # AdaTopK keep-ratio on the link to the next stage (1.0 = dense)
    compute_s: float = 0.0  # predicted fwd + bwd seconds per micro-batch
    comm_s: float = 0.0  # predicted seconds per micro-batch on the outgoing link (fwd + bwd)
    memory_bytes: float = 0.0  # predicted peak memory on the device

    @property
    def nodes(self) -> range:
        return range(self.lo, self.hi)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    stages: tuple[StagePlan, ...]
    micro_batches: int
    micro_batch_size: int  # samples per micro-batch (the last one may be partial)
    batch_share: int  # samples of the global batch this pipeline runs per step
    time_s: float = 0.0  # predicted pipeline time incl. its data-parallel sync

    @property
    def devices(self) -> list[str]:
        return [d for s in self.stages for d in s.devices]


@dataclasses.dataclass(frozen=True)
class OptimizerHost:
    device: str
    share: float  # fraction of the parameter bytes this host owns
    param_names: tuple[str, ...] = ()  # parameters it owns (keyed by model state-dict name)


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_time_s: float  # estimator closed form
    tokens_per_s: float  # batch_size * seq_len / step_time_s (samples/s when seq_len is 0)
    simulated_step_time_s: float | None = None  # event-driven simulator, when it was run
    device_memory_bytes: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    batch_size: int
    seq_len: int
    num_nodes: int  # nodes in the OP-DAG the plan was made for
    pipelines: tuple[PipelinePlan, ...]
    offload: bool = True
    optimizer_hosts: tuple[OptimizerHost, ...] = ()
    prediction: Prediction | None = None
    # data-parallel sync: "hosts" (optimizer hosts; offload) or "ring" (ring all-reduce among the
    # replicas of each stage, the optimizer on the workers: plan/dpsync.py); "" = as `offload` says
    dp_sync: str = ""
    strategy: str = "fusion"  # "fusion" | "even" | "grid" | "memory" | "contiguous" | "exhaustive"
    cluster: str = ""
    version: int = PLAN_FORMAT_VERSION

    def __post_init__(self) -> None:
        if not self.dp_sync:
            object.__setattr__(self, "dp_sync", "hosts" if self.offload else "ring")

    # ---- checks ------------------------------------------------------------------------------
    def validate(self, graph: OpGraph | None = None) -> None:
        """Every node exactly once per pipeline, shares adding up to the batch; raise PlanError."""
        n = self.num_nodes if graph is None else graph.num_nodes
        if graph is not None and graph.num_nodes != self.num_nodes:
            raise PlanError(f"plan is for {self.num_nodes} nodes, graph has {graph.num_nodes}")
        if not self.pipelines:
            raise PlanError("plan has no pipeline")
        if self.dp_sync not in DP_SYNC_CHOICES or (self.dp_sync == "ring") == self.offload:
            raise PlanError(
                f"dp_sync {self.dp_sync!r} with offload {self.offload}: 'hosts' goes with offload, 'ring' without"
            )
        if sum(p.batch_share for p in self.pipelines) != self.batch_size:
            raise PlanError(
                f"batch shares {[p.batch_share for p in self.pipelines]} do not add up to {self.batch_size}"
            )
        for i, p in enumerate(self.pipelines):
            pos = 0
            for st in p.stages:
                if st.lo != pos or st.hi <= st.lo:
                    raise PlanError(f"pipeline {i}: stage [{st.lo}, {st.hi}) does not continue at node {pos}")
                if not st.devices:
                    raise PlanError(f"pipeline {i}: stage [{st.lo}, {st.hi}) has no device")
                if not 0 < st.keep_ratio <= 1:
                    raise PlanError(f"pipeline {i}: keep ratio {st.keep_ratio} not in (0, 1]")
                pos = st.hi
            if pos != n:
                raise PlanError(f"pipeline {i}: stages end at node {pos}, graph has {n}")
            if p.micro_batches < 1 or p.micro_batch_size < 1:
                raise PlanError(f"pipeline {i}: micro-batches and their size must be >= 1")
            if p.micro_batches * p.micro_batch_size < p.batch_share:
                raise PlanError(
                    f"pipeline {i}: {p.micro_batches} x {p.micro_batch_size} < share {p.batch_share}"
                )
        used = [d for p in self.pipelines for d in p.devices]
        if len(used) != len(set(used)):
            raise PlanError("a device appears in more than one stage")

    @property
    def devices(self) -> list[str]:
        return [d for p in self.pipelines for d in p.devices]

    # ---- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.prediction is not None:
            d["prediction"]["device_memory_bytes"] = dict(self.prediction.device_memory_bytes)
        for p in d["pipelines"]:
            for st in p["stages"]:
                st["devices"] = list(st["devices"])
        for h in d["optimizer_hosts"]:
            h["param_names"] = list(h["param_names"])
        order = [
            "version",
            "strategy",
            "model",
            "cluster",
            "batch_size",
            "seq_len",
            "num_nodes",
            "offload",
            "dp_sync",
        ]
        return {**{k: d[k] for k in order}, **{k: v for k, v in d.items() if k not in order}}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Plan:
        try:
            if d.get("version") != PLAN_FORMAT_VERSION:
                raise ConfigError(f"plan format version {d.get('version')!r} is not supported")
            pipes = tuple(
                PipelinePlan(
                    stages=tuple(
                        StagePlan(
                            devices=tuple(st["devices"]),
                            lo=int(st["lo"]),
                            hi=int(st["hi"]),
                            keep_ratio=float(st.get("keep_ratio", 1.0)),
                            compute_s=float(st.get("compute_s", 0.0)),
                            comm_s=float(st.get("comm_s", 0.0)),
                            memory_bytes=float(st.get("memory_bytes", 0.0)),
                        )
                        for st in p["stages"]
                    ),
                    micro_batches=int(p["micro_batches"]),
                    micro_batch_size=int(p["micro_batch_size"]),
                    batch_share=int(p["batch_share"]),
                    time_s=float(p.get("time_s", 0.0)),
                )
                for p in d["pipelines"]
            )
            hosts = tuple(
                OptimizerHost(h["device"], float(h["share"]), tuple(h.get("param_names", ())))
                for h in d.get("optimizer_hosts", ())
            )
            pr = d.get("prediction")
            pred = None
            if pr is not None:
                sim = pr.get("simulated_step_time_s")
                pred = Prediction(
                    step_time_s=float(pr["step_time_s"]),
                    tokens_per_s=float(pr["tokens_per_s"]),
                    simulated_step_time_s=None if sim is None else float(sim),
                    device_memory_bytes=tuple(
                        (k, float(v)) for k, v in dict(pr.get("device_memory_bytes", {})).items()
                    ),
                )
            return Plan(
                model=str(d["model"]),
                batch_size=int(d["batch_size"]),
                seq_len=int(d["seq_len"]),
                num_nodes=int(d["num_nodes"]),
                pipelines=pipes,
                offload=bool(d.get("offload", True)),
                dp_sync=str(d.get("dp_sync", "")),
                optimizer_hosts=hosts,
                prediction=pred,
                strategy=str(d.get("strategy", "fusion")),
                cluster=str(d.get("cluster", "")),
                version=PLAN_FORMAT_VERSION,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"malformed plan: {exc!r}") from exc

    @staticmethod
    def from_json(text: str) -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"malformed plan JSON: {exc}") from exc
        if not isinstance(d, Mapping):
            raise ConfigError("a plan must be a JSON object")
        return Plan.from_dict(d)
