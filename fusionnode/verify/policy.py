"""The verification options of a job: `--verify-policy` and `--verify-rate`, with their defaults.

- ``off``: no checks (workers keep no ledger, send no digests),
- ``sample``: each micro-batch of each stage is checked with probability ``rate`` (the default),
- ``all``: every micro-batch of every stage (rate 1; for tests and audits).

``auto`` resolves to ``sample`` at ``DEFAULT_PUBLIC_RATE`` in a public swarm and to ``off`` in a
private one (a swarm key keeps strangers out; its members are trusted to compute honestly, and
``--verify-policy sample`` still checks them, at ``DEFAULT_PRIVATE_RATE`` unless a rate is given).

Why 0.25: a stage that lies on ``f`` of its ``m`` micro-batches per step escapes ``n`` steps with
probability ``(1 - 0.25 f)^(m n)`` (selector.steps_to_catch); at least 17 lied micro-batches in 20
steps (f x m >= 0.85) are caught within 20 steps with probability >= 0.99 (0.75^17 = 0.0075).
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("auto", "off", "sample", "all")
DEFAULT_PUBLIC_RATE = 0.25  # fraction of micro-batches checked in a public swarm
DEFAULT_PRIVATE_RATE = 0.05  # with --verify-policy sample in a private swarm and no --verify-rate


@dataclass(frozen=True)
class VerifyPolicy:
    policy: str  # "off" | "sample" | "all" (resolved)
    rate: float  # probability that one micro-batch of one stage is checked

    @property
    def on(self) -> bool:
        return self.policy != "off" and self.rate > 0

    def to_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "rate": self.rate}


def resolve_policy(policy: str | None, rate: float | None, *, private: bool) -> VerifyPolicy:
    """The policy in force from the user's choice (None: auto) and whether the swarm is private.
    Raises ValueError on a bad value."""
    policy = policy or "auto"
    if policy not in POLICIES:
        raise ValueError(f"verify policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if rate is not None and not (isinstance(rate, int | float) and 0 <= rate <= 1):
        raise ValueError(f"verify rate must be a number in [0, 1], got {rate!r}")
    if policy == "auto":
        policy = "off" if private else "sample"
    if policy == "off":
        return VerifyPolicy("off", 0.0)
    if policy == "all":
        return VerifyPolicy("all", 1.0)
    default = DEFAULT_PRIVATE_RATE if private else DEFAULT_PUBLIC_RATE
    return VerifyPolicy("sample", float(default if rate is None else rate))


__all__ = ["DEFAULT_PRIVATE_RATE", "DEFAULT_PUBLIC_RATE", "POLICIES", "VerifyPolicy", "resolve_policy"]
