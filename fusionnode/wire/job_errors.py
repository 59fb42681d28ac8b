"""The job protocol's errors: the closed set of machine-readable error codes, and the typed error
that carries a code and the peer to blame from the raising handler to the caller.

A failed call answers `Reply{ok: false, error: text, result: {"code": ..., "blame": peer id}}`
(`error_result`); the caller's `remote_error` reads it back into a `JobError`, and `Failure.of` is
what the driver's recovery decides on: codes and peer ids, never text. The RPCs that may answer each
code are in wire/job.py's table (protocol/SPEC.md, section 13).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Final

from fusionnode.errors import DeadlineError, PeerError


class ErrorCode:
    """Machine-readable reasons of a failed call (`Reply.result["code"]`), a closed set."""

    BAD_REQUEST: Final = "bad_request"  # a request that does not match its message type or bounds
    FORBIDDEN: Final = "forbidden"  # the caller may not do that (not the job's driver, not a worker)
    NOT_HELD: Final = "not_held"  # no such stage or shard here (lease expired, released, never assigned)
    NO_ROOM: Final = "no_room"  # over this peer's offered capacity or per-driver limits
    LEAVING: Final = "leaving"  # this peer is draining: re-plan without it, do not ban it
    BAD_TENSOR: Final = "bad_tensor"  # `blame` sent a tensor of the wrong name, shape, dtype or values
    ABORTED: Final = "aborted"  # the step was cancelled by the driver
    NO_REPORT: Final = "no_report"  # `job.step_result` for a step this stage has no report of
    UNANSWERED: Final = "unanswered"  # the call's stream closed before its reply (transient)
    DEADLINE: Final = "deadline"  # a wait ran past its deadline
    RING_BROKEN: Final = "ring_broken"  # a gradient all-reduce lost `blame`, the ring member it waited on
    VERSION_SKEW: Final = (
        "version_skew"  # `blame` runs another version of the checks: re-plan without it, no ban
    )
    FAILED: Final = "failed"  # anything else
    ALL: ClassVar[frozenset[str]]


ErrorCode.ALL = frozenset(v for k, v in vars(ErrorCode).items() if k.isupper() and isinstance(v, str))


class JobError(PeerError):
    """A refusal or failure with a machine-readable `code` and, where another peer caused it, the
    full peer id to `blame`."""

    def __init__(self, code: str, message: str, blame: str = ""):
        if code not in ErrorCode.ALL:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.blame = blame


def error_result(exc: BaseException) -> dict[str, Any]:
    """The `Reply.result` of a failed call: its code and the peer to blame (empty for other errors)."""
    if isinstance(exc, JobError):
        out = {"code": exc.code}
        if exc.blame:
            out["blame"] = exc.blame
        return out
    if isinstance(exc, DeadlineError):
        return {"code": ErrorCode.DEADLINE}
    return {}


def remote_error(text: str, result: dict[str, Any]) -> JobError:
    """The caller's exception for a `Reply{ok: false}` (`text` says who refused what)."""
    code = result.get("code")
    blame = result.get("blame")
    return JobError(
        code if isinstance(code, str) and code in ErrorCode.ALL else ErrorCode.FAILED,
        text,
        blame if isinstance(blame, str) and len(blame) <= 128 else "",
    )


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failed call as recovery sees it: code, the peer to blame (full id, "" if none), text."""

    code: str
    text: str
    blame: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        if isinstance(exc, JobError):
            return cls(exc.code, str(exc), exc.blame)
        if isinstance(exc, (DeadlineError, TimeoutError)):
            return cls(ErrorCode.DEADLINE, str(exc) or "deadline passed")
        return cls(ErrorCode.FAILED, str(exc) or type(exc).__name__)
