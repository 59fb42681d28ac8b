"""The job protocol between driver, worker and optimizer host: RPC names, typed messages, tensor kinds, error codes.

Every RPC of a training job is named here once (`Rpc`), with one frozen dataclass for its request
and one for its reply (`RPCS`); every kind of data message (`TensorKind`) is spelled here and nowhere
else (tests/test_protocol_home.py checks the source), and every machine-readable error code
(`ErrorCode`) once, in wire/job_errors.py. Requests and replies cross the wire as the `args` / `result` maps of `Call` / `Reply`
(protocol/SPEC.md, section 13); `from_wire` refuses a missing or unknown field, a value of the
wrong type and an out-of-bounds value with a `JobError` whose code is `bad_request`, so a field
renamed on one side fails at once, not silently with a default.

A failed call answers `Reply{ok: false, error: text, result: {"code": ..., "blame": peer id}}`:
the codes and `JobError`, which carries the code and the peer to blame, live in wire/job_errors.py
(re-exported here); the driver's recovery decides on codes and peer ids, never on text.

`tensor_message` and `decode_checked` encode and check the tensors of data messages.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Final

from fusionnode.wire.job_errors import ErrorCode as ErrorCode
from fusionnode.wire.job_errors import Failure as Failure
from fusionnode.wire.job_errors import JobError as JobError
from fusionnode.wire.job_errors import error_result as error_result
from fusionnode.wire.job_errors import remote_error as remote_error
from fusionnode.wire.typed import FieldError, TypedMessage, message

MAX_LEASE_S = 600.0  # seconds: longest lease a driver may ask a worker to hold a stage without renewal
MIN_LEASE_S = 1.0  # seconds: shortest lease

# ---------------------------------------------------------------- names


class Rpc:
    """The RPC names (`Call.method`), a closed set: `Rpc.ALL`."""

    JOB_ASSIGN: Final = "job.assign"
    JOB_START: Final = "job.start"
    JOB_STEP: Final = "job.step"
    JOB_STEP_RESULT: Final = "job.step_result"
    JOB_COMMIT: Final = "job.commit"
    JOB_FETCH: Final = "job.fetch"
    JOB_RELEASE: Final = "job.release"
    JOB_PING: Final = "job.ping"
    JOB_AUDIT: Final = "job.audit"  # show a verified step's kept messages (fusionnode/verify/)
    DEBUG_SLOW: Final = "debug.slow"
    OPT_INIT: Final = "opt.init"
    OPT_HELD: Final = "opt.held"
    OPT_LOAD: Final = "opt.load"
    OPT_READY: Final = "opt.ready"
    OPT_APPLY: Final = "opt.apply"
    OPT_PULL: Final = "opt.pull"
    OPT_REPLAN: Final = "opt.replan"
    OPT_RELEASE: Final = "opt.release"
    OPT_ROUND_PULL: Final = "opt.round_pull"  # --sync rounds: a closed round's update (ROUNDS.md)
    DATA_OPEN: Final = "data.open"  # opens a data stream (transport level: SPEC section 8)
    ALL: ClassVar[frozenset[str]]


Rpc.ALL = frozenset(v for k, v in vars(Rpc).items() if k.isupper() and isinstance(v, str))


class TensorKind:
    """`TensorMessage.kind`, a closed set: `TensorKind.ALL`. Keys of the receiver's mailbox are
    (kind, job, step, mb, stage), with `mb` the micro-batch (or the message's index in a series)."""

    INPUT: Final = "input"  # driver -> first stage: a micro-batch's input ids
    TARGET: Final = "target"  # driver -> last stage: its targets
    ACT: Final = "act"  # stage -> next stage: activations
    GRAD: Final = "grad"  # stage -> previous stage: gradients of those activations
    PARAMS: Final = "params"  # driver -> worker: a stage's initial parameters, one per message
    SHARED_GRAD: Final = "shared_grad"  # worker -> driver: gradients of parameters several stages hold
    SHARED_SUM: Final = "shared_sum"  # driver -> worker: their sum
    FETCH_PARAMS: Final = "fetch_params"  # worker -> driver: parameters (`job.fetch` what="params")
    FETCH_GRADS: Final = "fetch_grads"  # worker -> driver: gradients (`job.fetch` what="grads")
    OPT_PARAMS: Final = "opt_params"  # driver -> optimizer host: a shard's initial parameters
    PUSH: Final = "push"  # worker -> optimizer host: a parameter's gradient of a step
    PULLED: Final = "pulled"  # optimizer host -> caller of `opt.pull`: parameters, mb = first + index
    AUDIT: Final = "audit"  # worker -> driver: a checked step's kept messages, mb = chunk index
    PSEUDOGRAD: Final = "pseudograd"  # worker -> optimizer host: a sync round's pseudo-gradients
    ROUND_UPDATE: Final = "round_update"  # optimizer host -> caller of `opt.round_pull`, mb = first + index
    ALLREDUCE: Final = "allreduce"  # stage -> next member of its ring: a chunk of gradients, mb = ring_mb()
    ALL: ClassVar[frozenset[str]]


TensorKind.ALL = frozenset(v for k, v in vars(TensorKind).items() if k.isupper() and isinstance(v, str))
FETCH_KIND: Final = {"params": TensorKind.FETCH_PARAMS, "grads": TensorKind.FETCH_GRADS}


# ---------------------------------------------------------------- typed messages


def _bad(what: str) -> JobError:
    return JobError(ErrorCode.BAD_REQUEST, what)


class JobMessage(TypedMessage):
    """Base of the job's messages: a map that does not match is refused with `bad_request`."""

    @classmethod
    def from_wire(cls, args: Any) -> Any:
        try:
            return super().from_wire(args)
        except FieldError as exc:
            raise _bad(str(exc)) from None


Specs = dict[str, dict[str, Any]]  # tensor name -> {"shape": [...], "dtype": "float32"}


# ---- worker (job.*)


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


@message
class AssignReply(JobMessage):
    accepted: bool
    free_bytes: int


@message
class StageRef(JobMessage):
    """`job.start`: build the stage from the `params` messages sent before it."""

    job: str
    stage: int


@message
class StartReply(JobMessage):
    ready: bool
    params: int


@message
class StepRequest(JobMessage):
    """`job.step`: run one step's micro-batches (1F1B)."""

    job: str
    stage: int
    step: int
    micro_batches: int
    mb_size: int
    target_time_s: float | None = None  # the time one micro-batch may take on a link (compression)
    verify: bool = False  # spot-checked: commit to every message, keep them until the next step

    def __post_init__(self) -> None:
        if self.micro_batches < 1 or self.mb_size < 1:
            raise _bad(f"micro_batches and mb_size must be >= 1, got {self.micro_batches}, {self.mb_size}")


@message
class StepReport(JobMessage):
    """The reply of `job.step` and `job.step_result`: one stage's report of one step."""

    step: int
    stage: int
    losses: list[float]  # the last stage's loss of each micro-batch (empty elsewhere)
    compute_s: float
    wait_s: float
    total_s: float
    sent_bytes: int
    optimizer_bytes: int
    grad_sq: float  # squared norm of the stage's own (not shared) gradients
    links: dict[str, Any]  # {"fwd": counters, "bwd": counters} of the link compressors
    verify: dict[str, Any] | None = None  # with StepRequest.verify: verify.Ledger.commitments()


@message
class AuditRequest(JobMessage):
    """`job.audit`: send the kept messages of micro-batches `mbs` of the last verified step (and,
    with `grads`, the stage's parameter gradients) as `audit` messages."""

    job: str
    stage: int
    step: int
    mbs: list[int]
    grads: bool = False


@message
class AuditReply(JobMessage):
    parts: dict[str, list[str]]  # micro-batch -> the parts shown (verify/ledger.py)
    chunks: int  # `audit` messages that follow


@message
class CommitRequest(JobMessage):
    """`job.commit`: apply the optimizer step (local optimizer), or prefetch the hosts' parameters."""

    job: str
    stage: int
    step: int
    lr: float | None = None  # needed with a local optimizer
    clip_coef: float = 1.0
    round: dict[str, Any] | None = None  # closes a sync round: {id, tokens, names} (protocol/ROUNDS.md)


@message
class CommitReply(JobMessage):
    applied: int
    again: bool = False  # a retried commit already applied
    prefetching: bool = False  # offload: pulling the new parameters from the hosts
    round_bytes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # host -> [sent, received]


@message
class FetchRequest(JobMessage):
    """`job.fetch`: send the stage's parameters or gradients to the driver."""

    job: str
    stage: int
    what: str = "params"

    def __post_init__(self) -> None:
        if self.what not in FETCH_KIND:
            raise _bad(f"what must be one of {sorted(FETCH_KIND)}, got {self.what!r:.40}")


@message
class CountReply(JobMessage):
    """How many data messages follow (`job.fetch`)."""

    count: int


@message
class ReleaseRequest(JobMessage):
    """`job.release`: drop the stage (`abort`: cancel a step in progress first)."""

    job: str
    stage: int
    abort: bool = False


@message
class ReleaseReply(JobMessage):
    released: bool


@message
class PingRequest(JobMessage):
    """`job.ping`: liveness; with `job`, renews the leases the caller holds here for that job."""

    job: str | None = None


@message
class PingReply(JobMessage):
    alive: bool
    draining: bool
    jobs: int
    stages: int


@message
class DebugSlow(JobMessage):
    """`debug.slow`: the peer's own compute slow-down factor (tests; needs FUSIONNODE_DEBUG=1)."""

    factor: float = 1.0


# ---- optimizer host (opt.*)


@message
class OptInit(JobMessage):
    """`opt.init`: announce a shard; the driver's `opt_params` messages for it are accepted from then on."""

    job: str
    driver: str
    host_index: int
    spec: dict[str, Any]
    param_specs: Specs
    expected: dict[str, dict[str, dict[str, Any]]]  # name -> contributor key -> {replica, samples, peer}
    secret: str | None = None  # the job secret (owner of the shard's checkpoints)
    resume: bool = False
    step_deadline_s: float | None = None
    save_every: int = 0
    sync: dict[str, Any] | None = None  # --sync: SyncConfig.to_dict(); a round mode keeps rounds here
    replicas: int = 1  # the job's data-parallel replicas (contributions per round; the host checks >= 1)

    def __post_init__(self) -> None:
        if self.secret is not None and not 16 <= len(self.secret) <= 256:
            raise _bad("the job secret must be a string of 16 to 256 characters")
        if self.host_index < 0:
            raise _bad(f"host_index must be >= 0, got {self.host_index}")
        check_expected(self.expected)


def check_expected(expected: dict[str, dict[str, dict[str, Any]]]) -> None:
    for name, contribs in expected.items():
        for key, c in contribs.items():
            if not isinstance(c.get("peer"), str) or not isinstance(c.get("samples"), int):
                raise _bad(f"expected[{name!r:.40}][{key!r:.40}] needs peer (str) and samples (int)")
            if "replica" not in c:
                raise _bad(f"expected[{name!r:.40}][{key!r:.40}] needs a replica")


@message
class OptInitReply(JobMessage):
    announced: bool
    steps: list[int]  # steps of this owner's checkpoints of the shard (with resume)


@message
class OptHeld(JobMessage):
    """`opt.held`: the caller's own checkpoints of a job here (by its job secret)."""

    job: str
    secret: str


@message
class OptHeldReply(JobMessage):
    held: dict[str, list[int]]  # host index -> steps


@message
class OptLoad(JobMessage):
    """`opt.load`: build the announced shard (and load checkpoint `resume_step`)."""

    job: str
    resume_step: int | None = None
    start_step: int | None = None  # no common checkpoint: the driver's parameters, new optimizer state


@message
class OptLoadReply(JobMessage):
    ready: bool
    applied_step: int
    resumed: int


@message
class OptReady(JobMessage):
    """`opt.ready`: wait until every expected contribution of a step arrived (or `timeout` passed)."""

    job: str
    step: int
    timeout: float | None = None
    digests: bool = False  # also the digests of the committed pushes (spot-checked jobs)


@message
class OptReadyReply(JobMessage):
    complete: bool
    grad_sq: float
    missing: dict[str, list[str]]
    digests: dict[str, dict[str, str]] | None = None  # contributor -> name -> digest of its push


@message
class OptApply(JobMessage):
    """`opt.apply`: apply the step on the shard."""

    job: str
    step: int
    lr: float
    force: bool = False
    clip_coef: float = 1.0
    save: bool = False


@message
class OptApplyReply(JobMessage):
    applied: bool
    step: int
    forced: bool
    updated: int
    missing: list[str]
    counters: dict[str, int]
    rejected: dict[str, int]
    received_bytes: int = 0  # cumulative bytes of the job's data messages this host accepted
    sent_bytes: int = 0  # cumulative bytes it sent as an optimizer host


@message
class OptPull(JobMessage):
    """`opt.pull`: send `names` as `pulled` messages keyed (job, tag, first + i, stage)."""

    job: str
    names: list[str]
    tag: int = 0
    stage: int = -1
    first: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.first < 1 << 40:
            raise _bad(f"first must be in [0, 2^40), got {self.first}")


@message
class OptPullReply(JobMessage):
    count: int
    step: int


@message
class OptReplan(JobMessage):
    """`opt.replan`: new contributors (and the peers allowed to push for them)."""

    job: str
    expected: dict[str, dict[str, dict[str, Any]]]

    def __post_init__(self) -> None:
        check_expected(self.expected)


@message
class OptReplanReply(JobMessage):
    applied_step: int
    dropped: list[int]  # steps whose pending contributions were dropped


@message
class OptRelease(JobMessage):
    """`opt.release`: drop the shard."""

    job: str


@message
class OptRoundPull(
    JobMessage
):  # wait for the round to close, send `round_update`s, mb = first + i (ROUNDS.md)
    job: str
    round: int
    names: list[str]
    stage: int = -1
    first: int = 0  # the host checks it is in [0, 2^40)


# ---------------------------------------------------------------- the RPC table


@dataclasses.dataclass(frozen=True)
class RpcSpec:
    name: str
    request: type
    reply: type
    caller: str  # who may call it
    errors: tuple[str, ...]  # the codes it answers besides bad_request


_E = ErrorCode
RPCS: dict[str, RpcSpec] = {
    s.name: s
    for s in (
        RpcSpec(Rpc.JOB_ASSIGN, StageAssignment, AssignReply, "the job's driver (== driver)",
                (_E.FORBIDDEN, _E.LEAVING, _E.NO_ROOM)),
        RpcSpec(Rpc.JOB_START, StageRef, StartReply, "the stage's driver",
                (_E.NOT_HELD, _E.FORBIDDEN, _E.BAD_TENSOR, _E.DEADLINE)),
        RpcSpec(Rpc.JOB_STEP, StepRequest, StepReport, "the stage's driver",
                (_E.NOT_HELD, _E.FORBIDDEN, _E.LEAVING, _E.BAD_TENSOR, _E.ABORTED, _E.DEADLINE,
                 _E.RING_BROKEN)),
        RpcSpec(Rpc.JOB_STEP_RESULT, StepRequest, StepReport, "the stage's driver (the job.step request again: its recall)",
                (_E.NOT_HELD, _E.FORBIDDEN, _E.ABORTED, _E.NO_REPORT)),
        RpcSpec(Rpc.JOB_COMMIT, CommitRequest, CommitReply, "the stage's driver",
                (_E.NOT_HELD, _E.FORBIDDEN, _E.BAD_TENSOR, _E.DEADLINE)),
        RpcSpec(Rpc.JOB_FETCH, FetchRequest, CountReply, "the stage's driver", (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.JOB_RELEASE, ReleaseRequest, ReleaseReply, "the stage's driver",
                (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.JOB_PING, PingRequest, PingReply, "any peer", ()),
        RpcSpec(Rpc.JOB_AUDIT, AuditRequest, AuditReply, "the stage's driver", (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.DEBUG_SLOW, DebugSlow, DebugSlow, "the peer itself (FUSIONNODE_DEBUG=1)", (_E.FORBIDDEN,)),
        RpcSpec(Rpc.OPT_INIT, OptInit, OptInitReply, "the job's driver (== driver)",
                (_E.FORBIDDEN, _E.NO_ROOM)),
        RpcSpec(Rpc.OPT_HELD, OptHeld, OptHeldReply, "any peer (its own checkpoints, by the job secret)", ()),
        RpcSpec(Rpc.OPT_LOAD, OptLoad, OptLoadReply, "the shard's driver",
                (_E.NOT_HELD, _E.FORBIDDEN, _E.BAD_TENSOR, _E.DEADLINE)),
        RpcSpec(Rpc.OPT_READY, OptReady, OptReadyReply, "the shard's driver", (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.OPT_APPLY, OptApply, OptApplyReply, "the shard's driver", (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.OPT_PULL, OptPull, OptPullReply, "the shard's driver and the plan's workers",
                (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.OPT_REPLAN, OptReplan, OptReplanReply, "the shard's driver", (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.OPT_RELEASE, OptRelease, ReleaseReply, "the shard's driver", (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.OPT_ROUND_PULL, OptRoundPull, CountReply, "the plan's workers", (_E.NOT_HELD, _E.FORBIDDEN, _E.DEADLINE)),
    )
}  # fmt: skip
MESSAGE_TYPES: tuple[type, ...] = tuple(
    dict.fromkeys(
        [Offload, AllReduceRing, *(s.request for s in RPCS.values()), *(s.reply for s in RPCS.values())]
    )
)


async def call(transport: Any, peer: str, method: str, request: Any, **options: Any) -> Any:
    """Calls `method` with a typed request on `peer`; returns the typed reply (`options`: timeout,
    idempotent, recall as `Transport.call` takes them)."""
    spec = RPCS[method]
    if not isinstance(request, spec.request):
        raise TypeError(f"{method} takes a {spec.request.__name__}, got {type(request).__name__}")
    result = await transport.call(peer, method, request.to_wire(), **options)
    try:
        return spec.reply.from_wire(result)
    except JobError as exc:
        raise JobError(
            ErrorCode.FAILED, f"peer {peer[:12]}… answered {method!r} with a bad reply: {exc}"
        ) from None


Handler = Callable[[Any, str], Awaitable[Any]]


def serve(transport: Any, method: str, handler: Handler) -> None:
    """Registers `handler(request, sender) -> reply` for `method`, typed both ways."""
    spec = RPCS[method]

    async def typed(args: dict[str, Any], sender: str) -> dict[str, Any]:
        reply = await handler(spec.request.from_wire(args), sender)
        if not isinstance(reply, spec.reply):
            raise TypeError(f"{method} must answer a {spec.reply.__name__}, got {type(reply).__name__}")
        return reply.to_wire()

    transport.add_rpc(method, typed)


__all__ = [
    "RPCS",
    "AllReduceRing",
    "ErrorCode",
    "Failure",
    "JobError",
    "Rpc",
    "RpcSpec",
    "StageAssignment",
    "StepReport",
    "TensorKind",
    "call",
    "error_result",
    "remote_error",
    "serve",
]
