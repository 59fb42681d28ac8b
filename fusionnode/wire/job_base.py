"""The base of the job protocol's typed messages (wire/job.py): how a message that does not match is
refused (`bad_request`), and the bounds they share."""

from __future__ import annotations

from typing import Any

from fusionnode.wire.job_errors import ErrorCode, JobError
from fusionnode.wire.typed import FieldError, TypedMessage

MAX_LEASE_S = 600.0  # seconds: longest lease a driver may ask a worker to hold a stage without renewal
MIN_LEASE_S = 1.0  # seconds: shortest lease


def bad(what: str) -> JobError:
    return JobError(ErrorCode.BAD_REQUEST, what)


class JobMessage(TypedMessage):
    """Base of the job's messages: a map that does not match is refused with `bad_request`."""

    @classmethod
    def from_wire(cls, args: Any) -> Any:
        try:
            return super().from_wire(args)
        except FieldError as exc:
            raise bad(str(exc)) from None


Specs = dict[str, dict[str, Any]]  # tensor name -> {"shape": [...], "dtype": "float32"}
