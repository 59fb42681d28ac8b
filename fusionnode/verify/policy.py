"""The verification options of a job: `--verify-policy` and `--verify-rate`, with their defaults.

- ``off``: no checks (workers keep no ledger, send no digests),
- ``sample``: each stage's step is checked whole (every micro-batch and the parameter gradients) with
  probability ``grad_rate``, else each of its micro-batches with probability ``rate`` (the default),
- ``all``: every micro-batch of every stage (rate 1; for tests and audits).

``auto`` resolves to ``sample`` at ``DEFAULT_PUBLIC_RATE`` in a public swarm and to ``off`` in a
private one or a local one (train/checks.py: a peer listening on loopback only reaches only this
machine's processes) (a swarm key keeps strangers out; its members are trusted to compute honestly, and
``--verify-policy sample`` still checks them, at ``DEFAULT_PRIVATE_RATE`` unless a rate is given).

Why 0 and 0.45 in a public swarm (`--verify-rate` unset), derived from the detection target (each
kind of lie caught within 20 steps in 99 of 100 runs, with margin): each stage's step is checked
whole with probability ``grad_rate`` = 0.45 (a gradient check recomputes all of its micro-batches and
compares their activations, input gradients and the parameter gradients it pushed), and no
micro-batch is spot-checked alone (``rate`` = 0). Per stage and step, with m = 4 micro-batches
(verify/selector.py `miss_probability`):

- a worker lying only in the gradients it pushes is found by gradient checks alone: it escapes 20
  steps with probability 0.55^20 = 6.4e-6;
- a stage lying on each micro-batch with probability 1/4 (the bench's fraction liar, the binding
  case) escapes a step with probability 0.45 x 0.75^4 + 0.55 = 0.692, 20 steps with 6.4e-4 (100
  runs miss 2 or more with probability 0.2%); any lie on every micro-batch, 6.4e-6.

The rates before (0.2 per micro-batch, 0.3 per stage and step) left the gradient liar at 8.0e-4 and
the fraction liar at 2.9e-4, for 1.76 recomputed micro-batches per stage and step, in 71% of the
stage-steps. Against a liar on a small fraction of micro-batches, what counts is the recomputed
share alone (1.80 now), however it is split; but every checked stage-step also costs the driver a
parameter fetch, an audit and a hand-over to the check process, which now come in 45% of them
(37% fewer). An explicit ``--verify-rate P`` sets both rates to P.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("auto", "off", "sample", "all")
DEFAULT_PUBLIC_RATE = 0.0  # fraction of micro-batches spot-checked alone in a public swarm
DEFAULT_PUBLIC_GRAD_RATE = 0.45  # fraction of (step, stage)s checked whole (all micro-batches, gradients)
DEFAULT_PRIVATE_RATE = 0.05  # with --verify-policy sample in a private swarm and no --verify-rate


@dataclass(frozen=True)
class VerifyPolicy:
    policy: str  # "off" | "sample" | "all" (resolved)
    rate: float  # probability that one micro-batch of one stage is checked
    grad_rate: float = -1.0  # probability that a stage's parameter gradients are checked in a step (-1: rate)

    def __post_init__(self) -> None:
        if self.grad_rate < 0:
            object.__setattr__(self, "grad_rate", self.rate)

    @property
    def on(self) -> bool:
        return self.policy != "off" and (self.rate > 0 or self.grad_rate > 0)

    def to_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "rate": self.rate, "grad_rate": self.grad_rate}


def resolve_policy(
    policy: str | None, rate: float | None, *, private: bool, grad_rate: float | None = None
) -> VerifyPolicy:
    """The policy in force from the user's choice (None: auto) and whether the swarm is private;
    `grad_rate` (the train param ``verify_grad_rate``) overrides the gradient checks' rate of
    ``sample``. Raises ValueError on a bad value."""
    policy = policy or "auto"
    if policy not in POLICIES:
        raise ValueError(f"verify policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    for what, r in (("rate", rate), ("gradient check rate", grad_rate)):
        if r is not None and not (isinstance(r, int | float) and 0 <= r <= 1):
            raise ValueError(f"verify {what} must be a number in [0, 1], got {r!r}")
    if policy == "auto":
        policy = "off" if private else "sample"
    if policy == "off":
        return VerifyPolicy("off", 0.0)
    if policy == "all":
        return VerifyPolicy("all", 1.0)
    if rate is not None:
        out = VerifyPolicy("sample", float(rate))
    elif private:
        out = VerifyPolicy("sample", DEFAULT_PRIVATE_RATE)
    else:
        out = VerifyPolicy("sample", DEFAULT_PUBLIC_RATE, DEFAULT_PUBLIC_GRAD_RATE)
    return out if grad_rate is None else VerifyPolicy("sample", out.rate, float(grad_rate))


__all__ = [
    "DEFAULT_PRIVATE_RATE",
    "DEFAULT_PUBLIC_GRAD_RATE",
    "DEFAULT_PUBLIC_RATE",
    "POLICIES",
    "VerifyPolicy",
    "resolve_policy",
]
