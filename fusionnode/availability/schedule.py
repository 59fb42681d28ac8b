"""When this peer may contribute by the clock: local-time windows and the next window's start.

Windows such as "22:00-07:00,12:00-13:00" (a window may cross midnight); the start of the next one
is advertised as ``next_window`` while the peer is paused by the schedule."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re

from fusionnode.errors import ConfigError

_WINDOW_RE = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")
MINUTES_PER_DAY = 24 * 60


@dataclasses.dataclass(frozen=True)
class Window:
    """One local-time window [start, end) in minutes after midnight; end <= start crosses midnight."""

    start_min: int
    end_min: int

    def contains(self, minute: int) -> bool:
        if self.start_min < self.end_min:
            return self.start_min <= minute < self.end_min
        return minute >= self.start_min or minute < self.end_min  # crosses midnight

    def __str__(self) -> str:
        def hm(m: int) -> str:
            return f"{m // 60:02d}:{m % 60:02d}"

        return f"{hm(self.start_min)}-{hm(self.end_min)}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Local-time windows in which this peer may contribute. Parse with ``Schedule.parse``."""

    windows: tuple[Window, ...]

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """'22:00-07:00' or '22:00-07:00,12:00-13:30'; '24:00' is allowed as an end; start == end is refused."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError("--schedule is empty; expected windows like 22:00-07:00[,12:00-13:00]")
        windows = []
        for part in text.split(","):
            m = _WINDOW_RE.match(part)
            if not m:
                raise ConfigError(f"cannot read schedule window {part.strip()!r}; expected HH:MM-HH:MM")
            sh, sm, eh, em = (int(g) for g in m.groups())
            if sh > 23 or sm > 59 or em > 59 or eh > 24 or (eh == 24 and em != 0):
                raise ConfigError(f"schedule window {part.strip()!r} has an impossible time of day")
            start, end = sh * 60 + sm, eh * 60 + em
            if start == end % MINUTES_PER_DAY and end != MINUTES_PER_DAY:
                raise ConfigError(
                    f"schedule window {part.strip()!r} starts where it ends; for all day write 00:00-24:00"
                )
            windows.append(Window(start, end % MINUTES_PER_DAY if end != MINUTES_PER_DAY else 0))
        return cls(tuple(windows))

    def contains(self, when: dt.datetime) -> bool:
        minute = when.hour * 60 + when.minute
        return any(w.contains(minute) for w in self.windows)

    def next_start(self, when: dt.datetime) -> dt.datetime:
        """The first window start strictly after ``when`` (same tzinfo as ``when``)."""
        base = when.replace(second=0, microsecond=0)
        best: dt.datetime | None = None
        for w in self.windows:
            cand = base.replace(hour=w.start_min // 60, minute=w.start_min % 60)
            if cand <= when:
                cand += dt.timedelta(days=1)
            if best is None or cand < best:
                best = cand
        assert best is not None  # parse() never yields an empty schedule
        return best

    def __str__(self) -> str:
        return ",".join(str(w) for w in self.windows)
