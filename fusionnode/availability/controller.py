"""The async runner of availability: sample, feed the state machine, tell the node what to advertise.

Samples the owner's activity every ``interval_s``, feeds it and the schedule to the state machine
(policy.py), and calls ``on_change(availability, next_window)`` whenever what this peer should
advertise changes; pause and resume by hand."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fusionnode.availability.activity import ActivityMonitor, ActivitySample
from fusionnode.availability.policy import (
    AvailabilityPolicy,
    AvailabilityState,
    advertisement,
    observe,
    pause_manual,
    resume_manual,
)
from fusionnode.availability.schedule import Schedule
from fusionnode.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_CHECK_INTERVAL = 2.0  # seconds between two samples of owner activity

OnChange = Callable[[str, "str | None"], Awaitable[None]]


class AvailabilityController:
    """Runs the state machine on a timer and tells the node what to advertise.

    ``monitor`` None means ``--when always`` (only the schedule and manual pauses apply).
    ``on_change(availability, next_window)`` runs once per change of what we advertise, never
    concurrently with itself; if it raises, it is logged and retried at the next check.
    """

    def __init__(
        self,
        monitor: ActivityMonitor | None,
        schedule: Schedule | None,
        on_change: OnChange,
        *,
        policy: AvailabilityPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        local_now: Callable[[], dt.datetime] = lambda: dt.datetime.now().astimezone(),
        interval_s: float = DEFAULT_CHECK_INTERVAL,
    ):
        if interval_s <= 0:
            raise ConfigError("the activity check interval must be > 0 seconds")
        self.monitor = monitor
        self.schedule = schedule
        self.on_change = on_change
        self.policy = policy or AvailabilityPolicy(when="idle" if monitor is not None else "always")
        self.clock = clock
        self.local_now = local_now
        self.interval_s = interval_s
        self._state = AvailabilityState()
        self._published: tuple[str, str | None] = ("available", None)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.last_sample: ActivitySample | None = None
        self.changed_at: float | None = None  # monotonic seconds of the last on_change that succeeded

    @property
    def state(self) -> AvailabilityState:
        return self._state

    def status(self) -> dict[str, Any]:
        s = self._state
        return {
            "availability": s.availability,
            "reason": s.reason,
            "when": self.policy.when,
            "schedule": str(self.schedule) if self.schedule else None,
            "next_window": self._published[1],
            "signals": list(self.monitor.signals) if self.monitor else [],
            "last_sample": self.last_sample.to_dict() if self.last_sample else None,
        }

    async def check(self) -> None:
        """One tick: sample, update the state, publish if the advertisement changed."""
        sample = None
        if self.monitor is not None and self.policy.when == "idle":
            sample = await asyncio.to_thread(self.monitor.sample)
            self.last_sample = sample
        now_local = self.local_now()
        in_schedule = self.schedule.contains(now_local) if self.schedule else True
        before = self._state.reason
        self._state = observe(
            self._state,
            self.policy,
            now=self.clock(),
            owner_active=None if sample is None else sample.active,
            in_schedule=in_schedule,
        )
        if self._state.reason != before:
            why = "; ".join(sample.reasons) if sample is not None and sample.reasons else ""
            logger.info("availability: %s (%s) %s", self._state.availability, self._state.reason, why)
        await self._publish()

    async def _publish(self) -> None:
        async with self._lock:
            ad = advertisement(self._state, self.schedule, self.local_now())
            if ad == self._published:
                return
            try:
                await self.on_change(*ad)
            except Exception:
                logger.exception("on_change%s failed; will retry at the next check", ad)
                return
            self._published = ad
            self.changed_at = self.clock()

    def _apply_schedule(self) -> None:
        """Takes the schedule's verdict for now into the state, without sampling the owner."""
        if self.schedule is not None:
            inside = self.schedule.contains(self.local_now())
            self._state = dataclasses.replace(self._state, outside_schedule=not inside)

    async def run(self) -> None:
        """Checks every interval_s until cancelled (primes the monitor's counters first); the schedule
        applies from the start, not only after the first interval."""
        self._apply_schedule()
        await self._publish()
        if self.monitor is not None:
            await asyncio.to_thread(self.monitor.sample)
        while True:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except TimeoutError:
                pass
            await self.check()

    async def pause(self, reason: str = "manual") -> dict[str, Any]:
        """Pause by hand until resume(); returns status() once on_change has run."""
        if reason != "manual":
            raise ConfigError(f"only a manual pause can be requested, not {reason!r}")
        self._state = pause_manual(self._state)
        await self._publish()
        return self.status()

    async def resume(self) -> dict[str, Any]:
        """Lifts a manual pause; a schedule or owner pause still in force keeps us paused."""
        self._state = resume_manual(self._state)
        self._apply_schedule()  # the schedule's verdict now, even before the first periodic check
        await self._publish()
        return self.status()
