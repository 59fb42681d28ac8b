"""The worker's compute hook for tests and benchmarks: a straggler slow-down, device pacing, a liar.

A `WorkerService` runs without a hook in production: nothing here is read or slept on. A
daemon started with ``fusionnode join --debug`` (or ``FUSIONNODE_DEBUG=1`` in its environment,
how `bench faults` and `bench testbed` start theirs) gets a `PacingHook` on its state dir
(`hook_from_env`). Before each step the hook reads two files there:

- ``debug_slow``: a factor >= 1; after each forward and backward the worker sleeps
  ``(factor - 1) x`` its compute time (a straggler). The ``debug.slow`` RPC, which only the
  peer itself may call, sets the same factor.
- ``debug_pace``: an emulated device speed in TFLOP/s; a forward of n samples then takes at
  least ``n x flops_per_sample / speed`` seconds and a backward twice that (the worker sleeps
  out the rest), so a testbed of peers sharing one CPU computes at the speeds of the devices
  it emulates whatever else the CPU is doing.
- ``debug_lie``: a JSON object; the worker then lies the way it says (fusionnode/verify/liar.py:
  scaled, noisy, stale or another micro-batch's tensors, a random parameter gradient), for the
  spot-checks' tests and `fusionnode bench verify`. The hook's ``liar`` attribute holds it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

DEBUG_ENV = "FUSIONNODE_DEBUG"  # "1" installs the PacingHook in a daemon's worker
DEBUG_SLOW_FILE = "debug_slow"  # in the state dir: a float factor >= 1 multiplying compute time
DEBUG_PACE_FILE = "debug_pace"  # in the state dir: emulated TFLOP/s (forward + backward paced to it)


class ComputeHook(Protocol):
    """What a worker calls around its compute when a hook is installed."""

    def before_step(self) -> None:
        """Once per step, before its first micro-batch."""

    def set_slow_factor(self, factor: float) -> float:
        """The ``debug.slow`` RPC: a new slow-down factor (clamped to >= 1); returns it."""

    async def after_compute(self, compute_s: float, flops: float) -> None:
        """After a forward or backward that took `compute_s` seconds and `flops` FLOPs."""


class PacingHook:
    """Slow-down factor and emulated device speed, read from files in `state_dir` each step."""

    def __init__(self, state_dir: str | os.PathLike[str] | None) -> None:
        self.state_dir = None if state_dir is None else Path(state_dir)
        self.slow_factor = 1.0  # compute time multiplier
        self.pace_tflops = 0.0  # emulated device speed (0: off)
        self.liar: Any = None  # a verify.liar.Liar read from debug_lie (None: honest)
        self._lie_text = ""

    def before_step(self) -> None:
        if self.state_dir is None:  # the factor only comes from the debug.slow RPC
            return
        self._read_liar()
        try:
            text = (self.state_dir / DEBUG_SLOW_FILE).read_text(encoding="utf-8")
            self.slow_factor = max(1.0, float(text.strip() or 1.0))
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            logger.warning("cannot read the debug slow-down factor: %s", exc)
        try:
            pace = float((self.state_dir / DEBUG_PACE_FILE).read_text(encoding="utf-8").strip() or 0.0)
            self.pace_tflops = pace if pace > 0 and math.isfinite(pace) else 0.0
        except FileNotFoundError:
            self.pace_tflops = 0.0
        except (OSError, ValueError) as exc:
            logger.warning("cannot read the debug device speed: %s", exc)

    def _read_liar(self) -> None:
        """The lie in debug_lie (kept across steps while the file says the same: a stale or other
        lie replays what the liar kept from earlier micro-batches)."""
        from fusionnode.verify.liar import DEBUG_LIE_FILE, Liar

        try:
            text = (self.state_dir / DEBUG_LIE_FILE).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            self.liar, self._lie_text = None, ""
            return
        except OSError as exc:
            logger.warning("cannot read the debug lie: %s", exc)
            return
        if text == self._lie_text:
            return
        self._lie_text = text
        try:
            self.liar = Liar.from_dict(json.loads(text)) if text else None
        except (ValueError, TypeError) as exc:
            logger.warning("cannot read the debug lie: %s", exc)
            self.liar = None

    def set_slow_factor(self, factor: float) -> float:
        self.slow_factor = max(1.0, float(factor))
        return self.slow_factor

    async def after_compute(self, compute_s: float, flops: float) -> None:
        """Stretch a compute of `compute_s` seconds by the slow-down factor, and to at least
        `flops` at the emulated device speed."""
        extra = (self.slow_factor - 1.0) * compute_s if self.slow_factor > 1.0 else 0.0
        if self.pace_tflops > 0 and flops > 0:
            extra = max(extra, flops / (self.pace_tflops * 1e12) - compute_s)
        if extra > 0:
            await asyncio.sleep(extra)


def hook_from_env(state_dir: str | os.PathLike[str] | None) -> PacingHook | None:
    """The hook a daemon installs: a PacingHook when ``FUSIONNODE_DEBUG=1`` (``join --debug``)
    , else None (production: no hook, no file read)."""
    if os.environ.get(DEBUG_ENV) != "1":
        return None
    return PacingHook(state_dir)
