"""The optimizer hosts' messages (`opt.*`, protocol/SPEC.md section 13): a shard's announcement and
load, the step's readiness, apply and pull, re-plans, rollbacks and release. Re-exported by
wire/job.py, whose RPC table names them (the round messages are wire/job_rounds.py's)."""

from __future__ import annotations

from typing import Any

from fusionnode.wire.job_base import JobMessage, Specs
from fusionnode.wire.job_base import bad as _bad
from fusionnode.wire.typed import message


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
    contrib: dict[str, Any] | None = None  # --contrib-policy: {clip, score} (verify/contrib.py)

    def __post_init__(self) -> None:
        if self.secret is not None and not 16 <= len(self.secret) <= 256:
            raise _bad("the job secret must be a string of 16 to 256 characters")
        if self.host_index < 0:
            raise _bad(f"host_index must be >= 0, got {self.host_index}")
        check_expected(self.expected)
        c = self.contrib
        if c is not None:
            clip = c.get("clip") if isinstance(c, dict) else None
            if (
                not isinstance(c, dict)
                or set(c) - {"clip", "score"}
                or not isinstance(c.get("score", False), bool)
                or not (
                    clip is None
                    or (isinstance(clip, int | float) and not isinstance(clip, bool) and clip >= 1)
                )
            ):
                raise _bad("contrib must be {clip: a number >= 1 or null, score: a boolean}")


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
    keep: bool = False  # keep the state before this step, so that opt.rollback can undo it
    mark: bool = False  # also keep it as the mark: opt.rollback to it undoes every step since


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
class OptRollback(JobMessage):
    """`opt.rollback`: back to the state after `step` (the store's count), undoing the one applied
    step kept by `opt.apply` with `keep`; pending contributions are dropped."""

    job: str
    step: int


@message
class OptRollbackReply(JobMessage):
    applied_step: int
    undone: bool  # whether a step was undone (False: the shard had not applied it)


@message
class OptRelease(JobMessage):
    """`opt.release`: drop the shard."""

    job: str
