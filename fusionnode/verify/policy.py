"""The verification options of a job: `--verify-policy` and `--verify-rate`, with their defaults.

- ``off``: no checks (workers keep no ledger, send no digests),
- ``sample``: each micro-batch of each stage is checked with probability ``rate`` (the default),
- ``all``: every micro-batch of every stage (rate 1; for tests and audits).

``auto`` resolves to ``sample`` at ``DEFAULT_PUBLIC_RATE`` in a public swarm and to ``off`` in a
private one or a local one (train/checks.py: a peer listening on loopback only reaches only this
machine's processes) (a swarm key keeps strangers out; its members are trusted to compute honestly, and
``--verify-policy sample`` still checks them, at ``DEFAULT_PRIVATE_RATE`` unless a rate is given).

Why 0.2 and 0.3 in a public swarm (`--verify-rate` unset): each micro-batch of a stage is spot-checked
with probability ``rate`` = 0.2, and each stage's parameter gradients with probability ``grad_rate``
= 0.3 per step (a gradient check recomputes all of its micro-batches, so it also catches any lie in
the step's activations or input gradients). A worker that lies only in the gradients it pushes is
found by gradient checks alone: it escapes 20 steps with probability 0.7^20 = 0.08% (0.25 gave
0.75^20 = 0.32%: 100 seeded runs then miss 2 or more with probability 4%, seen once in three
benchmarks). A stage that lies on a quarter of its 4 micro-batches escapes 20 steps with
probability 0.03%. The expected recompute per stage and step, m x (0.3 + 0.7 x 0.2) = 1.76
micro-batches of 4, is what 0.25 for both cost (1.75). An explicit ``--verify-rate P`` sets both.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("auto", "off", "sample", "all")
DEFAULT_PUBLIC_RATE = 0.2  # fraction of micro-batches spot-checked in a public swarm
DEFAULT_PUBLIC_GRAD_RATE = 0.3  # fraction of (step, stage)s whose parameter gradients are checked there
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
        return self.policy != "off" and self.rate > 0

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
