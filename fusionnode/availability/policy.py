"""Whether this peer is available: the pure pause/resume state machine and its advertisement.

Causes of a pause, by precedence: manual > schedule > owner. Hysteresis on the owner: pause after
``confirm_samples`` consecutive active samples (default 2, i.e. within about 2 check intervals);
resume only after ``grace_s`` seconds with no active sample. ``advertisement`` turns a state into
what the peer record says."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable
from typing import Literal

from fusionnode.availability.schedule import Schedule
from fusionnode.errors import ConfigError

DEFAULT_GRACE = 60.0  # seconds the owner must stay idle before this peer contributes again
DEFAULT_CONFIRM_SAMPLES = 2  # consecutive "owner active" samples before pausing (one spike is not use)

WHEN = ("idle", "always")
REASONS = ("owner", "schedule", "manual")  # causes of a pause, lowest to highest precedence
Availability = Literal["available", "paused"]


@dataclasses.dataclass(frozen=True)
class AvailabilityPolicy:
    when: str = "idle"  # "idle": yield to the owner; "always": ignore owner activity
    grace_s: float = DEFAULT_GRACE  # seconds idle before resuming after the owner was active
    confirm_samples: int = DEFAULT_CONFIRM_SAMPLES  # consecutive active samples before pausing

    def __post_init__(self) -> None:
        if self.when not in WHEN:
            raise ConfigError(f"--when must be one of {', '.join(WHEN)}, got {self.when!r}")
        if self.grace_s < 0:
            raise ConfigError("grace must be >= 0 seconds")
        if self.confirm_samples < 1:
            raise ConfigError("confirm_samples must be >= 1")


@dataclasses.dataclass(frozen=True)
class AvailabilityState:
    manual: bool = False  # paused by hand until resume
    outside_schedule: bool = False  # the last check found local time outside every window
    owner_paused: bool = False  # the owner-activity latch (set after confirm, cleared after grace)
    active_streak: int = 0  # consecutive samples with the owner active
    idle_since: float | None = None  # monotonic seconds: first idle sample while owner_paused

    @property
    def reason(self) -> str | None:
        """Why we are paused (the highest-precedence cause), or None when available."""
        if self.manual:
            return "manual"
        if self.outside_schedule:
            return "schedule"
        if self.owner_paused:
            return "owner"
        return None

    @property
    def availability(self) -> Availability:
        return "available" if self.reason is None else "paused"


def observe(
    state: AvailabilityState,
    policy: AvailabilityPolicy,
    *,
    now: float,
    owner_active: bool | None,
    in_schedule: bool = True,
) -> AvailabilityState:
    """One check: ``now`` in monotonic seconds; ``owner_active`` None when not measured (when=always)."""
    outside = not in_schedule
    if policy.when == "always" or owner_active is None:
        return dataclasses.replace(
            state, outside_schedule=outside, owner_paused=False, active_streak=0, idle_since=None
        )
    if owner_active:
        streak = state.active_streak + 1
        return dataclasses.replace(
            state,
            outside_schedule=outside,
            active_streak=streak,
            owner_paused=state.owner_paused or streak >= policy.confirm_samples,
            idle_since=None,
        )
    owner_paused, idle_since = state.owner_paused, state.idle_since
    if owner_paused:
        idle_since = now if idle_since is None else idle_since
        if now - idle_since >= policy.grace_s:
            owner_paused, idle_since = False, None
    return dataclasses.replace(
        state, outside_schedule=outside, active_streak=0, owner_paused=owner_paused, idle_since=idle_since
    )


def pause_manual(state: AvailabilityState) -> AvailabilityState:
    return dataclasses.replace(state, manual=True)


def resume_manual(state: AvailabilityState) -> AvailabilityState:
    """Lifts a manual pause only; a schedule or owner pause in force stays."""
    return dataclasses.replace(state, manual=False)


def advertisement(
    state: AvailabilityState, schedule: Schedule | None, now_local: dt.datetime
) -> tuple[Availability, str | None]:
    """(availability, next_window) for the peer record: next_window is the ISO start of the next
    schedule window while paused by the schedule, else None."""
    if state.reason == "schedule" and schedule is not None:
        return "paused", schedule.next_start(now_local).isoformat(timespec="minutes")
    return state.availability, None


def describe(policy: AvailabilityPolicy, schedule: Schedule | None, signals: Iterable[str]) -> str:
    """One log line at startup."""
    return (
        f"contributing when={policy.when} schedule={schedule or 'any time'} "
        f"signals={','.join(signals) or '-'} grace={policy.grace_s:g}s confirm={policy.confirm_samples}"
    )
