"""`verify.check`: a driver hands one stage's audit to a verifier peer it trusts, which judges it
(verify/audit.py `judge_audit`: commitments, decoding, the recompute) and answers the verdict
(train/verifier_peer.py). The audit's payloads and the stage's parameters do not ride in the call:
they are streamed first as `verify_audit` / `verify_params` data messages (a unary call over 4 MiB
fails in p2pd). Re-exported by wire/job.py, whose RPC table names them."""

from __future__ import annotations

from typing import Any

from fusionnode.wire.job_base import JobMessage
from fusionnode.wire.job_base import bad as _bad
from fusionnode.wire.typed import message

MAX_VERIFY_MESSAGES = 4096  # data messages one `verify.check` may name (audit chunks + parameter messages)
MAX_VERIFY_WAIT_S = 600.0  # seconds: the longest a verifier waits for a check's messages


@message
class VerifyCheck(JobMessage):
    """`verify.check`: judge stage `stage`'s audit of step `step` of the caller's job `job`. Its
    `chunks` audit messages (kind `verify_audit`) and `params` parameter messages (kind
    `verify_params`) are keyed (job, ticket, index, stage): index 0..chunks-1 for the audit's chunks,
    as the worker sent them; chunks..chunks+params-1 for the parameters it should have computed with."""

    job: str
    stage: int
    step: int
    ticket: int  # the data messages' `step` key: one per check of this caller
    chunks: int
    params: int
    assignment: dict[str, Any]  # the stage as the driver assigned it (verify/verifier.py's map)
    commit: dict[str, Any]  # its report's commitments
    listed: dict[str, list[str]]  # the parts it showed, per micro-batch (its `job.audit` reply)
    src: str  # the worker that sent the audit
    mbs: list[int]  # the micro-batches checked
    grads: bool  # a gradient check: every micro-batch and the parameter gradients
    losses: list[float]  # the stage's reported losses (last stage)
    micro_batches: int  # micro-batches of the step
    rel_tol: float
    pushed: dict[str, dict[str, str]] | None = None  # the hosts' digests: contributor -> name -> digest
    link: dict[str, Any] | None = None  # the job's link codec: {"compress", "link_options", "job"}
    wait_s: float = 30.0  # how long to wait for the data messages

    def __post_init__(self) -> None:
        if not 0 < self.chunks <= MAX_VERIFY_MESSAGES or not 0 <= self.params <= MAX_VERIFY_MESSAGES:
            raise _bad(f"verify.check: chunks must be in [1, {MAX_VERIFY_MESSAGES}] and params in [0, it]")
        if not 0 <= self.ticket < 1 << 62 or not 0 < self.wait_s <= MAX_VERIFY_WAIT_S:
            raise _bad(f"verify.check: ticket must be in [0, 2^62), wait_s in (0, {MAX_VERIFY_WAIT_S:.0f}]")
        if self.micro_batches < 1 or any(not 0 <= mb < self.micro_batches for mb in self.mbs):
            raise _bad("verify.check: mbs must be micro-batch indices below micro_batches")
        if not self.rel_tol > 0:
            raise _bad("verify.check: rel_tol must be positive")


@message
class VerifyCheckReply(JobMessage):
    verdict: str  # '' when the stage's work matches; else why not
    seconds: float = 0.0  # the verifier's time judging it (after its messages arrived)


__all__ = ["MAX_VERIFY_MESSAGES", "VerifyCheck", "VerifyCheckReply"]
