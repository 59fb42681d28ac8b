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
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Final

from fusionnode.wire.job_base import MAX_LEASE_S as MAX_LEASE_S
from fusionnode.wire.job_base import MIN_LEASE_S as MIN_LEASE_S
from fusionnode.wire.job_base import JobMessage as JobMessage
from fusionnode.wire.job_base import Specs as Specs
from fusionnode.wire.job_base import bad as _bad
from fusionnode.wire.job_errors import ErrorCode as ErrorCode
from fusionnode.wire.job_errors import Failure as Failure
from fusionnode.wire.job_errors import JobError as JobError
from fusionnode.wire.job_errors import error_result as error_result
from fusionnode.wire.job_errors import remote_error as remote_error
from fusionnode.wire.job_opt import OptApply as OptApply
from fusionnode.wire.job_opt import OptApplyReply as OptApplyReply
from fusionnode.wire.job_opt import OptHeld as OptHeld
from fusionnode.wire.job_opt import OptHeldReply as OptHeldReply
from fusionnode.wire.job_opt import OptInit as OptInit
from fusionnode.wire.job_opt import OptInitReply as OptInitReply
from fusionnode.wire.job_opt import OptLoad as OptLoad
from fusionnode.wire.job_opt import OptLoadReply as OptLoadReply
from fusionnode.wire.job_opt import OptPull as OptPull
from fusionnode.wire.job_opt import OptPullReply as OptPullReply
from fusionnode.wire.job_opt import OptReady as OptReady
from fusionnode.wire.job_opt import OptReadyReply as OptReadyReply
from fusionnode.wire.job_opt import OptRelease as OptRelease
from fusionnode.wire.job_opt import OptReplan as OptReplan
from fusionnode.wire.job_opt import OptReplanReply as OptReplanReply
from fusionnode.wire.job_opt import OptRollback as OptRollback
from fusionnode.wire.job_opt import OptRollbackReply as OptRollbackReply
from fusionnode.wire.job_rounds import OptRoundHeld as OptRoundHeld
from fusionnode.wire.job_rounds import OptRoundHeldReply as OptRoundHeldReply
from fusionnode.wire.job_rounds import OptRoundPull as OptRoundPull
from fusionnode.wire.job_rounds import OptRoundVerdict as OptRoundVerdict
from fusionnode.wire.job_rounds import OptRoundVerdictReply as OptRoundVerdictReply
from fusionnode.wire.job_stage import MAX_RING_ID as MAX_RING_ID
from fusionnode.wire.job_stage import AllReduceRing as AllReduceRing
from fusionnode.wire.job_stage import Offload as Offload
from fusionnode.wire.job_stage import StageAssignment as StageAssignment
from fusionnode.wire.job_stage import ring_mb as ring_mb
from fusionnode.wire.job_verify import VerifyCheck as VerifyCheck
from fusionnode.wire.job_verify import VerifyCheckReply as VerifyCheckReply
from fusionnode.wire.typed import message

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
    JOB_RESIZE: Final = "job.resize"  # a held stage's new batch share (rebalancing between pipelines)
    JOB_WITHDRAW: Final = "job.withdraw"  # a fused step queued ahead, not started: never run (ROUNDS.md)
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
    OPT_ROUND_HELD: Final = "opt.round_held"  # --contrib-policy score: a held round's contributions
    OPT_ROUND_VERDICT: Final = "opt.round_verdict"  # ... and the driver's weights, which close it
    OPT_ROLLBACK: Final = "opt.rollback"  # undo the last applied step (a spot-check caught a lie in it)
    VERIFY_CHECK: Final = "verify.check"  # judge a stage's audit for its driver (a verifier peer)
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
    FETCH_INNER: Final = "fetch_inner"  # worker -> driver: a transition check's tensors (what="inner")
    OPT_PARAMS: Final = "opt_params"  # driver -> optimizer host: a shard's initial parameters
    PUSH: Final = "push"  # worker -> optimizer host: a parameter's gradient of a step
    PULLED: Final = "pulled"  # optimizer host -> caller of `opt.pull`: parameters, mb = first + index
    AUDIT: Final = "audit"  # worker -> driver: a checked step's kept messages, mb = chunk index
    PSEUDOGRAD: Final = "pseudograd"  # worker -> optimizer host: a sync round's pseudo-gradients
    ROUND_UPDATE: Final = "round_update"  # optimizer host -> caller of `opt.round_pull`, mb = first + index
    ROUND_CONTRIB: Final = "round_contrib"  # optimizer host -> driver: a held round's replica, mb = replica
    FEEDBACK: Final = "error_feedback"  # sparseloco accumulators: `job.fetch`, or before `job.start`
    ALLREDUCE: Final = "allreduce"  # stage -> next member of its ring: a chunk of gradients, mb = ring_mb()
    OPT_STATE: Final = (
        "opt_state"  # a local optimizer's state, one parameter's: `job.fetch`, or before `job.start`
    )
    VERIFY_AUDIT: Final = "verify_audit"  # driver -> verifier peer: an audit's chunk (`verify.check`)
    VERIFY_PARAMS: Final = "verify_params"  # driver -> verifier peer: the checked stage's parameters
    ALL: ClassVar[frozenset[str]]


TensorKind.ALL = frozenset(v for k, v in vars(TensorKind).items() if k.isupper() and isinstance(v, str))
FETCH_KIND: Final = {
    "params": TensorKind.FETCH_PARAMS,
    "grads": TensorKind.FETCH_GRADS,
    "feedback": TensorKind.FEEDBACK,
    "optim": TensorKind.OPT_STATE,  # offload off: the stage's optimizer state (runtime/optstate.py)
    "inner": TensorKind.FETCH_INNER,
}


# ---------------------------------------------------------------- typed messages


# ---- worker (job.*): StageAssignment and its parts are in wire/job_stage.py


@message
class AssignReply(JobMessage):
    accepted: bool
    free_bytes: int


@message
class StageRef(JobMessage):
    """`job.start`: build the stage from the `params` messages sent before it (and `feedback` error
    feedback accumulators of a resumed --sync sparseloco job, and `optim` local optimizer state
    messages of a stage moved with its state: runtime/optstate.py)."""

    job: str
    stage: int
    feedback: int = 0
    optim: int = 0


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
    # fused inner steps (--round-close time, runtime/fused.py): with `commit_lr` the stage applies its
    # inner optimizer step right after the backward, no job.commit (gradients clipped to `commit_clip`
    # by the stage's own norm); `close_round` (CommitRequest.round's map) first closes the round whose
    # last inner step was the stage's previous fused step. Left out otherwise (older peers refuse them)
    commit_lr: float | None = None
    commit_clip: float | None = None
    close_round: dict[str, Any] | None = None
    after_step: int | None = None  # fused, queued ahead: starts once the stage's fused step `after_step` ends

    def __post_init__(self) -> None:
        if self.micro_batches < 1 or self.mb_size < 1:
            raise _bad(f"micro_batches and mb_size must be >= 1, got {self.micro_batches}, {self.mb_size}")
        if self.commit_lr is None and (self.commit_clip, self.close_round, self.after_step) != (None,) * 3:
            raise _bad("commit_clip, close_round and after_step belong to a fused step: give commit_lr")
        if self.commit_clip is not None and not self.commit_clip > 0:
            raise _bad(f"commit_clip must be > 0, got {self.commit_clip}")


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
    round_bytes: dict[str, list[int]] | None = None  # fused steps: per host [sent, received] (as a commit)


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
    # fused steps: `step`'s inner step was applied by its job.step (StepRequest.commit_lr); only
    # close `round` (the job's last round, which no later step closes)
    close_only: bool | None = None


@message
class CommitReply(JobMessage):
    applied: int
    again: bool = False  # a retried commit already applied
    prefetching: bool = False  # offload: pulling the new parameters from the hosts
    round_bytes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # host -> [sent, received]


@message
class WithdrawRequest(JobMessage):  # `job.withdraw`: the fused step `step` sent queued ahead is not to run
    job: str
    stage: int
    step: int


@message
class WithdrawReply(JobMessage):
    withdrawn: bool  # true: it never runs (its job.step answers `aborted`); false: it started or ran


@message
class FetchRequest(JobMessage):
    """`job.fetch`: send the stage's parameters or gradients to the driver."""

    job: str
    stage: int
    what: str = "params"
    # the `step` of the data messages that answer it: -1, or a number the driver uses once, so a copy
    # re-sent for a retried call can never be read as a later fetch's answer (the checks' fetches)
    tag: int = -1
    # what="feedback": the accumulators as they were once the stage had closed round `round` (-1: as
    # they are, and so omitted: an older worker refuses a field it does not know; a checkpoint of rounds
    # closed by time, taken while the stage may close the next one)
    round: int | None = None

    def __post_init__(self) -> None:
        if self.what not in FETCH_KIND:
            raise _bad(f"what must be one of {sorted(FETCH_KIND)}, got {self.what!r:.40}")
        if not -1 <= self.tag < 1 << 62:
            raise _bad(f"tag must be -1 or a non-negative integer below 2^62, got {self.tag!r:.40}")
        if self.round is not None and not -1 <= self.round < 1 << 62:
            raise _bad(f"round must be -1 or a non-negative integer below 2^62, got {self.round!r:.40}")


@message
class CountReply(JobMessage):
    """How many data messages follow (`job.fetch`)."""

    count: int


@message
class ResizeRequest(JobMessage):
    """`job.resize`: from the next step on the stage's pipeline trains on `samples` sequences per
    step (what its gradient pushes report to the optimizer hosts) and the stage needs `need_bytes`
    (its activations grow or shrink with the micro-batch size): a batch share moved between
    pipelines, with no parameter moved."""

    job: str
    stage: int
    samples: int
    need_bytes: int
    # offload off: the new weights of the stage's all-reduce rings, one per pipeline (their shares of
    # the batch, in the rings' member order); a ring's check applies (positive, summing to 1)
    weights: list[float] | None = None

    def __post_init__(self) -> None:
        if self.samples < 1 or self.need_bytes < 0:
            raise _bad(f"samples must be >= 1 and need_bytes >= 0, got {self.samples}, {self.need_bytes}")


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
    """`job.ping`: liveness; with `job`, renews the leases the caller holds here for that job; with
    `caps` true, asks for the peer's check capabilities (verify/compat.py): a peer from before them
    refuses the unknown field with `bad_request`, which reads as the old capabilities."""

    job: str | None = None
    caps: bool | None = None


@message
class PingReply(JobMessage):
    alive: bool
    draining: bool
    jobs: int
    stages: int
    caps: dict[str, Any] | None = None  # only when asked: {"commit": [algs], "dither": [modes]}


@message
class DebugSlow(JobMessage):
    """`debug.slow`: the peer's own compute slow-down factor (tests; needs FUSIONNODE_DEBUG=1)."""

    factor: float = 1.0


# ---- optimizer host (opt.*): its messages are in wire/job_opt.py (--sync rounds: wire/job_rounds.py)


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
                 _E.RING_BROKEN, _E.VERSION_SKEW)),
        RpcSpec(Rpc.JOB_STEP_RESULT, StepRequest, StepReport, "the stage's driver (the job.step request again: its recall)",
                (_E.NOT_HELD, _E.FORBIDDEN, _E.ABORTED, _E.NO_REPORT)),
        RpcSpec(Rpc.JOB_COMMIT, CommitRequest, CommitReply, "the stage's driver",
                (_E.NOT_HELD, _E.FORBIDDEN, _E.BAD_TENSOR, _E.DEADLINE)),
        RpcSpec(Rpc.JOB_FETCH, FetchRequest, CountReply, "the stage's driver", (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.JOB_RELEASE, ReleaseRequest, ReleaseReply, "the stage's driver",
                (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.JOB_PING, PingRequest, PingReply, "any peer", ()),
        RpcSpec(Rpc.JOB_AUDIT, AuditRequest, AuditReply, "the stage's driver", (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.JOB_RESIZE, ResizeRequest, AssignReply, "the stage's driver",
                (_E.NOT_HELD, _E.FORBIDDEN, _E.NO_ROOM)),
        RpcSpec(Rpc.JOB_WITHDRAW, WithdrawRequest, WithdrawReply, "the stage's driver", (_E.NOT_HELD, _E.FORBIDDEN)),
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
        RpcSpec(Rpc.OPT_ROUND_HELD, OptRoundHeld, OptRoundHeldReply, "the shard's driver",
                (_E.NOT_HELD, _E.FORBIDDEN, _E.DEADLINE)),
        RpcSpec(Rpc.OPT_ROUND_VERDICT, OptRoundVerdict, OptRoundVerdictReply, "the shard's driver",
                (_E.NOT_HELD, _E.FORBIDDEN, _E.DEADLINE)),
        RpcSpec(Rpc.OPT_ROLLBACK, OptRollback, OptRollbackReply, "the shard's driver", (_E.NOT_HELD, _E.FORBIDDEN)),
        RpcSpec(Rpc.VERIFY_CHECK, VerifyCheck, VerifyCheckReply, "any peer, where the verifier serves checks",
                (_E.FORBIDDEN, _E.NO_ROOM, _E.DEADLINE)),
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
