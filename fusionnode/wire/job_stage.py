"""`job.assign`'s message (part of the job protocol, wire/job.py, which re-exports it): a stage
proposal, with where its parameters live under offload (`Offload`) and the ring all-reduces it
takes part in without (`AllReduceRing`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fusionnode.wire.job_base import MAX_LEASE_S, MIN_LEASE_S, JobMessage, Specs
from fusionnode.wire.job_base import bad as _bad
from fusionnode.wire.typed import message


@message
class Offload(JobMessage):
    """Where a stage's parameters live when the optimizer runs on optimizer hosts."""

    hosts: dict[str, str]  # parameter name -> host peer id
    host_index: dict[str, int]  # parameter name -> index of its host
    contributor: str  # this stage's contributor key at the hosts
    samples: int  # samples this stage's pipeline contributes per step


MAX_RING_ID = (1 << 20) - 1  # ring ids of a job fit the top bits of an `allreduce` message's mb


@message
class AllReduceRing(JobMessage):
    """A ring all-reduce of gradients among the stages (one per pipeline) that hold the same
    parameters, when the optimizer runs on the workers (offload off) with several pipelines."""

    id: int  # the ring's number in the job, in [0, MAX_RING_ID]
    members: list[str]  # peer of each member, in ring order (member i sends to member i + 1)
    member_stages: list[int]  # the members' global stage ids, in the same order
    weights: list[float]  # each member's share of the batch (samples / batch size); they sum to 1
    names: list[str]  # the parameters reduced, flattened in this order

    def __post_init__(self) -> None:
        k = len(self.members)
        if not 0 <= self.id <= MAX_RING_ID:
            raise _bad(f"ring id must be in [0, {MAX_RING_ID}], got {self.id}")
        if k < 2 or len(self.member_stages) != k or len(self.weights) != k:
            raise _bad(f"a ring needs >= 2 members, with one stage and one weight each (got {k})")
        if len(set(self.member_stages)) != k:
            raise _bad("a ring's member stages must be distinct")
        if not all(math.isfinite(w) and w > 0 for w in self.weights) or abs(sum(self.weights) - 1) > 1e-6:
            raise _bad(f"ring weights must be positive and sum to 1, got {self.weights!r:.80}")
        if not self.names or len(set(self.names)) != len(self.names):
            raise _bad("a ring reduces a non-empty list of distinct parameter names")


def ring_mb(ring: int, phase: int, hop: int, piece: int) -> int:
    """The `mb` of an `allreduce` message: ring id, phase (0 reduce-scatter, 1 all-gather), hop and
    piece (the chunk of the hop's segment) packed into one key below 2^61."""
    if not (0 <= ring <= MAX_RING_ID and phase in (0, 1) and 0 <= hop < 1 << 19 and 0 <= piece < 1 << 20):
        raise ValueError(f"ring message index out of range: {(ring, phase, hop, piece)}")
    return (ring << 40) | (phase << 39) | (hop << 20) | piece


@message
class StageAssignment(JobMessage):
    """`job.assign`: a stage proposal (driver -> worker)."""

    job: str
    stage: int  # global id of the stage among all pipelines of the job
    num_stages: int  # stages in its pipeline
    driver: str  # the job's driver (must be the caller)
    description: dict[str, Any]  # the portable sub-DAG (protocol/SUBDAG.md)
    param_specs: Specs
    spec: dict[str, Any]  # the job spec (train/spec.py)
    pos: int | None = None  # position in its pipeline (default: stage)
    replica: int = 0
    prev_stage: int | None = None  # default: stage - 1
    next_stage: int | None = None  # default: stage + 1
    peer: str = ""  # the assignee
    prev: str = ""  # peer of the previous stage ("" for the first)
    next: str = ""  # peer of the next stage ("" for the last)
    recv_specs: Specs = dataclasses.field(default_factory=dict)
    send_specs: Specs = dataclasses.field(default_factory=dict)
    shared_names: list[str] = dataclasses.field(default_factory=list)
    frozen: list[str] = dataclasses.field(default_factory=list)
    need_bytes: int = 0  # bytes the driver estimates the stage takes
    lease_s: float | None = None  # default: the worker's configured lease
    lo: int = 0  # operators [lo, hi) of the job's OP-DAG
    hi: int = 0
    flops_per_sample: float = 0.0  # forward flops of one sample (emulated device speed in tests)
    link_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    bw_next: float | None = None  # measured bandwidth to the next stage's peer, bit/s
    bw_prev: float | None = None
    offload: dict[str, Any] | None = None  # Offload.to_wire(), when hosts run the optimizer
    sync: dict[str, Any] | None = None  # --sync diloco|sparseloco: SyncConfig.to_dict() (protocol/ROUNDS.md)
    allreduce: list[dict[str, Any]] | None = None  # AllReduceRing.to_wire() of each ring this stage is in

    def __post_init__(self) -> None:
        if self.need_bytes < 0:
            raise _bad(f"need_bytes must be a non-negative integer, got {self.need_bytes!r:.40}")
        if self.lease_s is not None and not MIN_LEASE_S <= self.lease_s <= MAX_LEASE_S:  # NaN fails too
            raise _bad(f"lease_s must be in [{MIN_LEASE_S:g}, {MAX_LEASE_S:g}] seconds, got {self.lease_s!r}")
        if self.num_stages < 1 or (self.pos is not None and not 0 <= self.pos < self.num_stages):
            raise _bad(f"position {self.pos} of a pipeline of {self.num_stages} stages")
        for bw in (self.bw_next, self.bw_prev):
            if bw is not None and not (math.isfinite(bw) and bw > 0):
                raise _bad(f"a link bandwidth must be a positive number, got {bw!r}")
        if self.offload is not None:
            Offload.from_wire(self.offload)
        if self.allreduce is not None:  # (a worker ignores them when `offload` is set)
            ids = [AllReduceRing.from_wire(r).id for r in self.allreduce]
            if len(set(ids)) != len(ids):
                raise _bad("a stage's rings must have distinct ids")

    @property
    def position(self) -> int:
        return self.stage if self.pos is None else self.pos

    @property
    def offload_plan(self) -> Offload | None:
        return None if self.offload is None else Offload.from_wire(self.offload)

    @property
    def rings(self) -> list[AllReduceRing]:
        return [AllReduceRing.from_wire(r) for r in self.allreduce or ()]
