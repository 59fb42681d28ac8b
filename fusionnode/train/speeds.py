"""Measured stage speeds and when a rebalance may act on them: the speed table (`SpeedBook`) and
the noise-aware trigger (`Trigger`). Plain data, no network (train/rebalance.py decides the moves).

A straggler is told from timing noise by what noise does not do: it is the same bottleneck peer at
consecutive checks, slower than that peer itself was earlier on the plan (by more than the
standard error of that drop, `SpeedBook.shift`), with a predicted gain over the job's threshold and
over the measured noise of the speeds. Speeds are medians over a short window, so a step or two
that the machine's other load slowed changes nothing.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_WINDOW = 4  # steps of measurements whose median is a peer's speed when rebalancing
RUN_HISTORY = 24  # steps of measurements a run keeps per peer (its window, and the speed before it)
SPEED_WINDOW = 8  # samples per peer the driver's table keeps across jobs (a stall stays in it that long)
PERSIST_CHECKS = 2  # a re-plan needs its gain at this many consecutive checks (one window is noise)
NOISE_SIGMAS = 2.0  # ... and a gain above this many times the measured noise of the stage speeds
# ... and a bottleneck peer that slowed down: its speed since the point its run of samples drops at
# most significantly (`SpeedBook.shift`) fell below its speed before by more than this many standard
# errors of that drop (in log space: to e^-(DROP_SIGMAS x error) of it at most), and by MIN_DROP at
# least: a straggler lost 65% of its speed (2.9x slower). Shared hardware makes a peer 1.5-2.8x
# slower for several steps now and then, which a clean run must ride out: in 9 of 10 recorded clean
# 300-step runs (ring and hosts, load 4-20) no such spell went under 0.36 at two checks in a row,
# while recorded 4x slow-downs measure 0.22-0.34 (tests/test_straggler_replay.py)
DROP_SIGMAS = 2.0
MIN_DROP = 0.65
# ... or, at SOFT_CHECKS consecutive checks, under SOFT_DROP: a 4x slow-down of one of 4 peers on 2
# cores can measure 0.35-0.41 (the others, and its own compute, get its core share back while it
# sleeps: run b2 of issue 18's s7t5 note never moved), while in the 11 recorded clean runs and 2 new
# ones no spell stayed under 0.42 at 3 checks in a row (the longest such streak: 2)
SOFT_DROP = 0.42
SOFT_CHECKS = 3


def _quantile(v: Sequence[float], q: float) -> float:
    """The q-quantile of v, linearly interpolated (0 for no values)."""
    x = sorted(v)
    if not x:
        return 0.0
    pos = min(max(q, 0.0), 1.0) * (len(x) - 1)
    i = int(pos)
    return x[i] + (x[min(i + 1, len(x) - 1)] - x[i]) * (pos - i)


def _median(v: Sequence[float]) -> float:
    return _quantile(v, 0.5)


class SpeedBook:
    """Measured compute speed of peers: work (graph FLOPs x sequences) per second of compute over
    each peer's last `window` samples. The driver keeps one for its lifetime (every job, every
    layout feeds it, and a stall is recorded in it); each run keeps a short one (recent behaviour)."""

    def __init__(
        self, window: int = SPEED_WINDOW, *, quantile: float | None = None, recent: int | None = None
    ):
        self.window = window
        # recent: speeds and noise read the last `recent` samples; the ones before are the
        # reference a slow-down is measured against (`slowdown`)
        self.recent = recent or window
        # quantile q: a peer's speed is the q-quantile of its samples' speeds (0.5: the median) and
        # the noise is robust (scaled MAD), so a step or two that the machine's other load slowed
        # neither drags a speed down nor passes for a slow-down (what rebalancing's short window
        # needs); None: work over seconds of the whole window (the driver's long table)
        self.quantile = quantile
        self.robust = quantile is not None
        self.samples: dict[str, collections.deque[tuple[float, float]]] = {}
        self.stalls: dict[str, int] = {}

    def record(self, peer: str, work: float, seconds: float) -> None:
        if not (work > 0 and seconds > 0 and math.isfinite(work) and math.isfinite(seconds)):
            return
        self.samples.setdefault(peer, collections.deque(maxlen=self.window)).append((work, seconds))

    def stall(self, peer: str, work: float, seconds: float) -> None:
        """A peer took `work` and did not deliver within `seconds` (a failed step): its speed counts
        the stall as a sample of that work over that time, so it stays slow for `window` samples."""
        self.stalls[peer] = self.stalls.get(peer, 0) + 1
        self.record(peer, max(work, 1.0), seconds)

    def forget(self, peer: str) -> None:
        self.samples.pop(peer, None)

    def clear(self) -> None:
        self.samples.clear()

    def noise(self, peers: Iterable[str] | None = None) -> float:
        """The timing noise of the measured stage speeds: the median over peers (with two samples
        or more) of the relative standard error of their mean speed over the window (the spread of
        their per-sample speeds / sqrt(samples)). The median, so one peer's real slow-down (a level
        shift inside its window) does not count as noise; 0 if unknown."""
        cvs = []
        for p in self.samples if peers is None else peers:
            q = self._last(p)
            if len(q) < 2:
                continue
            v = [w / s for w, s in q]
            if self.robust:
                med = _median(v)
                if med > 0:  # 1.4826 MAD estimates the spread; the median's error is 1.2533x the mean's
                    sd = 1.4826 * _median([abs(x - med) for x in v])
                    cvs.append(1.2533 * sd / med / math.sqrt(len(v)))
                continue
            mean = sum(v) / len(v)
            if mean > 0:
                sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1))
                cvs.append(sd / mean / math.sqrt(len(v)))
        cvs.sort()
        return cvs[len(cvs) // 2] if cvs else 0.0

    def _last(self, peer: str) -> list[tuple[float, float]]:
        q = self.samples.get(peer)
        return list(q)[-self.recent :] if q else []

    def slowdown(self, peer: str) -> float | None:
        """The peer's speed over the last `recent` samples / its speed (median) over the samples
        before them: ~1 for a steady peer, 0.25 for one that slowed 4x; None while fewer than
        `recent` samples precede the window (nothing to compare with)."""
        q = list(self.samples.get(peer, ()))
        before, last = q[: -self.recent], q[-self.recent :]
        if len(before) < self.recent or not last:
            return None
        ref = _median([w / s for w, s in before])
        return _median([w / s for w, s in last]) / ref if ref > 0 else None

    def shift(self, peer: str) -> tuple[float, float] | None:
        """(slowed, error) of the peer's latest lasting slow-down: its run of samples split at the
        point where the drop of its (log) speed is the most significant, with at least `recent`
        samples on each side, the last one now: `slowed` is the median speed after the split / the
        median before (~1 for a steady peer, 0.25 for one that slowed 4x), `error` the standard error
        of that log ratio (the pooled robust spread of both sides around their own medians, x 1.2533
        for a median, over sqrt(1/n_before + 1/n_after)). None while fewer than 2 x `recent`
        samples are in. Unlike `slowdown`, a slow-down that began before the window is not part of
        the speed it is compared with, nor of the noise it is measured against (its own level shift
        would otherwise pass for noise): the split follows where it began."""
        x = [math.log(w / s) for w, s in self.samples.get(peer, ())]
        n, m = len(x), self.recent
        best: tuple[float, float, float] | None = None  # (z, slowed, error)
        for k in range(m, n - m + 1):
            before, after = x[:k], x[k:]
            mb, ma = _median(before), _median(after)
            resid = [abs(v - mb) for v in before] + [abs(v - ma) for v in after]
            err = 1.2533 * 1.4826 * _median(resid) * math.sqrt(1.0 / k + 1.0 / (n - k))
            z = (mb - ma) / err if err > 0 else (math.inf if mb > ma else 0.0)
            if best is None or z > best[0]:
                best = (z, math.exp(ma - mb), err)
        return None if best is None else (best[1], best[2])

    def spread(self, peers: Iterable[str] | None = None) -> float:
        """The step-to-step spread of stage speeds, in log space (timing noise multiplies): the
        median over peers of the robust standard deviation (1.4826 MAD) of the log of each one's
        per-step speeds before the last `recent` (the reference a slow-down is measured against: a
        slow-down shifts the other peers' speeds too, on shared hardware). The median, so one odd
        peer does not set it; 0 if unknown."""
        sds = []
        for p in self.samples if peers is None else peers:
            v = [math.log(w / s) for w, s in list(self.samples.get(p, ()))[: -self.recent]]
            if len(v) >= 3:
                med = _median(v)
                sds.append(1.4826 * _median([abs(x - med) for x in v]))
        sds.sort()
        return sds[len(sds) // 2] if sds else 0.0

    def speeds(self) -> dict[str, float]:
        out = {}
        for p in self.samples:
            q = self._last(p)
            if self.quantile is not None:
                v = _quantile([w / s for w, s in q], self.quantile) if q else 0.0
                if v > 0:
                    out[p] = v
                continue
            work, secs = sum(w for w, _ in q), sum(s for _, s in q)
            if work > 0 and secs > 0:
                out[p] = work / secs
        return out


@dataclass
class Trigger:
    """When a rebalance decision may be acted on: the predicted gain must clear both the job's
    threshold and NOISE_SIGMAS x the measured noise of stage speeds, at `persist` consecutive checks
    (a real slow-down persists; a noisy window does not)."""

    persist: int = PERSIST_CHECKS
    sigmas: float = NOISE_SIGMAS
    drop_sigmas: float = DROP_SIGMAS
    min_drop: float = MIN_DROP
    soft_drop: float = SOFT_DROP  # 0: no soft tier
    soft_checks: int = SOFT_CHECKS
    streak: int = 0
    culprit: str | None = None  # the peer that held the job back at the streak's checks
    hard: int = 0  # the streak's last checks in a row with the bottleneck under the drop bar

    def threshold(self, min_gain: float, noise: float) -> float:
        return max(min_gain, self.sigmas * noise)

    def reset(self) -> None:
        self.streak, self.culprit, self.hard = 0, None, 0

    def drop_bar(self, min_gain: float, spread: float) -> float:
        """How far (a fraction of its earlier speed) the bottleneck's speed must have fallen: by
        `min_gain` and `min_drop` at least, and by `drop_sigmas` x `spread`, the measured standard
        error of its log drop (`SpeedBook.shift`)."""
        return 1.0 - min(1.0 - min_gain, 1.0 - self.min_drop, math.exp(-self.drop_sigmas * spread))

    def check(
        self,
        wants: bool,
        gain: float,
        min_gain: float,
        noise: float,
        culprit: str | None = None,
        slowed: float | None = 0.0,
        spread: float = 0.0,
    ) -> tuple[bool, str]:
        """(act now?, why) for a decision that `wants` to move with this predicted `gain`, held back
        by `culprit` (the bottleneck peer), whose speed is now `slowed` x its earlier speed on the
        plan (None: not measured long enough to say). A streak needs the same culprit at every
        check, and that culprit slowed down by more than `drop_bar` (a fraction of its speed set by
        the measured `spread`, the standard error of its drop): timing noise makes a random peer
        look slow now and then, and the flops of a stage are not its seconds everywhere (a plan's imbalance that was
        there from its start is no straggler: the next plan prices measured speeds); a straggler
        is the same bottleneck each time, slower than it was."""
        bar = self.threshold(min_gain, noise)
        if not wants or gain < bar:
            self.reset()
            return False, f"gain {gain:.0%} under the bar {bar:.0%} (noise {noise:.1%})"
        drop = self.drop_bar(min_gain, spread)
        hard = slowed is not None and slowed <= 1.0 - drop
        soft = slowed is not None and slowed < min(self.soft_drop, math.exp(-self.drop_sigmas * spread))
        if not (hard or soft):
            self.reset()
            now = "not measured long enough" if slowed is None else f"at {slowed:.0%} of its earlier speed"
            return False, (
                f"gain {gain:.0%} over the bar {bar:.0%}, but the bottleneck {str(culprit)[:12]}… is {now} "
                f"(a slow-down needs under {1.0 - drop:.0%}, spread {spread:.0%})"
            )
        if self.streak and culprit != self.culprit:
            self.streak = self.hard = 0  # another peer holds the job back now: a new streak
        self.streak += 1
        self.hard = self.hard + 1 if hard else 0
        self.culprit = culprit
        if self.hard < self.persist and self.streak < self.soft_checks:
            return False, f"gain {gain:.0%} over the bar {bar:.0%}: check {self.streak} of {self.persist}"
        n = self.hard if self.hard >= self.persist else self.streak
        self.reset()
        return True, f"gain {gain:.0%} over the bar {bar:.0%} at {n} checks in a row"
