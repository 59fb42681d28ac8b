"""What a plan's data-parallel sync costs per step under a sync mode (issue 19).

`--sync step` pushes every stage's float32 gradients to the optimizer hosts and pulls the
parameters back after every step: the estimator's `stage_sync_time` and `host_bound`, and the
simulator's host links, price exactly that. `--sync diloco|sparseloco` moves a pseudo-gradient up
and an update down once per round of H inner steps, encoded by the round's codec to `wire_ratio`
of the float32 bytes (fusionnode/sync.py `SyncConfig.wire_ratio`). Its cost per step is the round's
exchange, priced on the same links with the bytes scaled by `wire_ratio`, divided by H: a plan may
put replicas across slow links when the amortised sync is small beside the step.

Pure: numbers in, numbers out; the caller (the driver, `plan`/`simulate`) turns the user's
`--sync` options into a `SyncPrice`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from fusionnode.errors import ConfigError

SYNC_MODES = ("step", "diloco", "sparseloco")


@dataclasses.dataclass(frozen=True)
class SyncPrice:
    mode: str = "step"
    inner_steps: int = 1  # H: steps per round (1: every step)
    wire_ratio: float = 1.0  # bytes on the wire per float32 byte of the parameters, each way

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ConfigError(f"sync mode must be one of {', '.join(SYNC_MODES)}, got {self.mode!r}")
        if (
            isinstance(self.inner_steps, bool)
            or not isinstance(self.inner_steps, int)
            or self.inner_steps < 1
        ):
            raise ConfigError(f"inner steps must be an integer >= 1, got {self.inner_steps!r}")
        if not (isinstance(self.wire_ratio, int | float) and 0 < self.wire_ratio <= 1):
            raise ConfigError(f"the sync's wire ratio must lie in (0, 1], got {self.wire_ratio!r}")
        if self.mode == "step" and (self.inner_steps != 1 or self.wire_ratio != 1.0):
            raise ConfigError("--sync step moves float32 gradients every step (H = 1, wire ratio 1)")

    @property
    def rounds(self) -> bool:
        return self.mode != "step"

    def round_bytes(self, param_bytes: float) -> float:
        """Bytes one way of a round's exchange for `param_bytes` of float32 parameters."""
        return param_bytes * self.wire_ratio

    def per_step(self, round_s: float) -> float:
        """The per-step amortised cost of a round's exchange that takes `round_s` seconds."""
        return round_s / self.inner_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> SyncPrice:
        if not raw:
            return cls()
        return cls(
            mode=str(raw.get("mode", "step")),
            inner_steps=int(raw.get("inner_steps", 1)),
            wire_ratio=float(raw.get("wire_ratio", 1.0)),
        )


EVERY_STEP = SyncPrice()


def amortised_sync_s(round_s: float, price: SyncPrice | None) -> float:
    """The per-step data-parallel sync cost: a round's exchange (`round_s`, priced with
    `price.round_bytes`) over its H steps; `--sync step` (None or EVERY_STEP) pays it every step."""
    if price is None or not math.isfinite(round_s):
        return round_s
    return price.per_step(round_s)
