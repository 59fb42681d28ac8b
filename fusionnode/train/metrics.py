"""Training metrics as JSON lines: one record per step, one per event (re-plan, join, leave, failure...).

Each line is a JSON object with `"type": "step"` or `"type": "event"`, and a wall-clock `ts`
(seconds since the epoch). Step records carry at least `REQUIRED_STEP_KEYS`; event records
carry `event` (one of `EVENT_KINDS`) and free-form fields. Lines are flushed as they are written.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fusionnode.errors import ConfigError

logger = logging.getLogger(__name__)

REQUIRED_STEP_KEYS = ("step", "loss", "tokens", "step_time_s", "wire_bytes", "plan_version")
EVENT_KINDS = frozenset(
    {
        "start",
        "end",
        "replan",
        "join",
        "leave",
        "failure",
        "recovered",
        "checkpoint",
        "resume",
        "eval",
        "refused",
        "verify",  # the job's work is spot-checked: policy, rate, commitment to the check secret
        "caught",  # a worker failed a spot-check: banned from the job, its step replayed
        "dispute",  # two neighbours' commitments disagree and neither failed its check: step replayed
        "rollback",  # a spot-check run while the next step did found a lie: the hosts undid that step
        "scored",  # a round's contributions judged on a held-out batch: scores, verdict, weights
        "notice",  # the driver did other than asked, and says what (fewer stages, no rebalancing)
        "rebalance_check",  # what a straggler check saw: predicted gain, measured noise, decision
    }
)


def _jsonable(value: Any) -> Any:
    """Plain JSON values; numpy/torch scalars via .item(); NaN and infinities become null."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


@dataclass
class MetricsSummary:
    """Running totals of the step records written so far."""

    steps: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    tokens: int = 0
    step_time_s: float = 0.0  # sum of step times, seconds
    wire_bytes: int = 0
    events: dict[str, int] = field(default_factory=dict)  # count per event kind

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "first_loss": self.first_loss,
            "last_loss": self.last_loss,
            "tokens": self.tokens,
            "step_time_s": self.step_time_s,
            "wire_bytes": self.wire_bytes,
            "tokens_per_s": self.tokens_per_s,
            "events": dict(self.events),
        }


class MetricsWriter:
    """Writes step and event records to a JSONL file (or nowhere when `path` is None) and sums them up."""

    def __init__(self, path: str | Path | None, *, append: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self.summary = MetricsSummary()
        self._file: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a" if append else "w", encoding="utf-8")

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(_jsonable(record), allow_nan=False, sort_keys=False) + "\n")
        self._file.flush()

    def step(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write one step record; missing required keys raise ValueError. Returns the record as written."""
        missing = [k for k in REQUIRED_STEP_KEYS if k not in record]
        if missing:
            raise ValueError(f"step record lacks {', '.join(missing)}: {record!r}")
        if "type" in record or "event" in record:
            raise ValueError("step records may not set 'type' or 'event'")
        full = {"type": "step", "ts": time.time(), **record}
        self._write(full)
        s = self.summary
        loss = _jsonable(record["loss"])
        s.steps += 1
        if s.first_loss is None:
            s.first_loss = loss
        s.last_loss = loss
        s.tokens += int(record["tokens"])
        s.step_time_s += float(record["step_time_s"])
        s.wire_bytes += int(record["wire_bytes"])
        return full

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one event record (`kind` in EVENT_KINDS). Returns the record as written."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; known: {', '.join(sorted(EVENT_KINDS))}")
        if "type" in fields or "ts" in fields:
            raise ValueError("event fields may not set 'type' or 'ts'")
        full = {"type": "event", "event": kind, "ts": time.time(), **fields}
        self._write(full)
        self.summary.events[kind] = self.summary.events.get(kind, 0) + 1
        return full

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, event records) of a metrics file, in file order. A torn last line is ignored."""
    steps: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                logger.warning("%s: ignoring a torn last line", path)
                continue
            raise ConfigError(f"{path}:{number}: not a JSON object: {exc}") from exc
        (events if record.get("type") == "event" else steps).append(record)
    return steps, events
