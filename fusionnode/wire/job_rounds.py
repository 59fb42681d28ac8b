"""The optimizer hosts' round messages of `--sync diloco|sparseloco` (protocol/ROUNDS.md): the pull of
a closed round's update, and the hold and verdict of `--contrib-policy score`. Re-exported by
wire/job.py, whose RPC table names them."""

from __future__ import annotations

import dataclasses

from fusionnode.wire.job_base import JobMessage
from fusionnode.wire.job_base import bad as _bad
from fusionnode.wire.typed import message


@message
class OptRoundPull(JobMessage):
    """`opt.round_pull`: wait for the round to close, send `round_update`s, mb = first + i (ROUNDS.md)."""

    job: str
    round: int
    names: list[str]
    stage: int = -1
    first: int = 0  # the host checks it is in [0, 2^40)
    # sparseloco: the caller's replica and the names of its own message it kept (it sent them): the
    # host leaves those out of that replica's relayed message (meta `own`; ROUNDS.md)
    replica: int = -1
    kept: list[str] = dataclasses.field(default_factory=list)


@message
class OptRoundHeld(JobMessage):
    """`opt.round_held` (--contrib-policy score): wait until `round` is complete (held for the
    driver's verdict); with `replica` >= 0 send that replica's pseudo-gradients of the shard as one
    `round_contrib` message keyed (job, round, replica, host index)."""

    job: str
    round: int
    replica: int = -1


@message
class OptRoundHeldReply(JobMessage):
    replicas: int
    norms: list[float]  # each replica's pseudo-gradient norm over the shard
    scales: list[float]  # the norm floor's scale of each replica's weight (1: within clip x median)
    tokens: list[float]  # each replica's token weight (from the plan)
    gram: list[list[float]]  # [r][q]: the dot product of replicas r's and q's pseudo-gradients over the shard


@message
class OptRoundVerdict(JobMessage):
    """`opt.round_verdict`: each replica's weight (1 kept, 0 dropped) in the held round, which closes."""

    job: str
    round: int
    weights: list[float]

    def __post_init__(self) -> None:
        if not all(
            isinstance(w, int | float) and not isinstance(w, bool) and 0 <= w <= 1 for w in self.weights
        ):
            raise _bad("verdict weights must be numbers in [0, 1]")


@message
class OptRoundVerdictReply(JobMessage):
    closed: bool  # False: the round was closed by an earlier verdict
    weights: list[float]  # each replica's weight in the outer step's mean (tokens x floor x verdict)
