"""Which micro-batches the driver checks: driver-secret randomness, revealed after the commitments.

The driver draws a 32-byte secret per job and publishes only its SHA-256 (``commitment``). Whether
micro-batch ``mb`` of stage ``stage`` at step ``step`` is checked is ``HMAC-SHA256(secret, "step:stage:mb")``
read as a number in [0, 1) compared with the check rate: each micro-batch independently, so learning
that one was checked says nothing of another. Without the secret the choice is unpredictable (HMAC
is a PRF); with it anyone can recompute every choice afterwards, and the secret matches the
published commitment (``reveal``/``check_reveal``), so the driver cannot have chosen after the fact
either. The driver asks for a checked micro-batch's tensors only once the worker's report, which
carries its commitments for every micro-batch, has arrived.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from dataclasses import dataclass

SECRET_BYTES = 32  # per job, from os.urandom


@dataclass(frozen=True)
class CheckSelector:
    secret: bytes

    @classmethod
    def fresh(cls) -> CheckSelector:
        return cls(os.urandom(SECRET_BYTES))

    @property
    def commitment(self) -> str:
        """SHA-256 of the secret (hex): published when the job starts."""
        return hashlib.sha256(self.secret).hexdigest()

    def draw(self, step: int, stage: int, mb: int) -> float:
        """A number in [0, 1) fixed by the secret and (step, stage, micro-batch)."""
        mac = hmac.new(self.secret, f"{int(step)}:{int(stage)}:{int(mb)}".encode(), hashlib.sha256).digest()
        return int.from_bytes(mac[:8], "big") / 2**64

    def chosen(self, step: int, stage: int, micro_batches: int, rate: float) -> list[int]:
        """The micro-batches of this stage checked at this step (each with probability `rate`)."""
        if rate <= 0:
            return []
        return [mb for mb in range(micro_batches) if self.draw(step, stage, mb) < rate]

    def reveal(self) -> str:
        """The secret (hex), once the job is over: anyone can then recompute every choice."""
        return self.secret.hex()


def check_reveal(commitment: str, secret_hex: str) -> bool:
    """Whether a revealed secret is the one the published commitment bound the driver to."""
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        return False
    return hmac.compare_digest(hashlib.sha256(secret).hexdigest(), commitment)


def catch_probability(rate: float, lied_micro_batches: float) -> float:
    """Probability that at least one of `lied_micro_batches` independently drawn checks hits a lie."""
    if rate >= 1:
        return 1.0 if lied_micro_batches > 0 else 0.0
    return 1.0 - (1.0 - rate) ** lied_micro_batches


def miss_probability(rate: float, grad_rate: float, micro_batches: int, fraction: float, steps: int) -> float:
    """Probability that a stage lying on each of its `micro_batches` with probability `fraction`
    (independently) escapes `steps` steps: per step, a gradient check (probability `grad_rate`)
    recomputes every micro-batch and so misses only a step without a lie; otherwise each micro-batch
    is spot-checked with probability `rate`."""
    m, f = micro_batches, fraction
    per_step = grad_rate * (1 - f) ** m + (1 - grad_rate) * (1 - rate * f) ** m
    return per_step**steps


def steps_to_catch(rate: float, micro_batches: int, fraction: float, confidence: float = 0.99) -> int:
    """Steps within which a stage that lies on `fraction` of its `micro_batches` per step is caught
    with probability `confidence` (each micro-batch lied on with probability `fraction`, checked
    with probability `rate`, independently): the smallest n with 1 - (1 - rate*fraction)^(m n) >= c."""
    p = rate * fraction
    if p <= 0:
        return math.inf  # type: ignore[return-value]
    if p >= 1:
        return 1
    return max(1, math.ceil(math.log(1 - confidence) / (micro_batches * math.log(1 - p))))


__all__ = [
    "SECRET_BYTES",
    "CheckSelector",
    "catch_probability",
    "check_reveal",
    "miss_probability",
    "steps_to_catch",
]
