"""Hostile contributions: a bound on gradient norms and a ban list with a growing ban (pure, no I/O).

`NormBound` keeps, per parameter, the norms of the last accepted contributions; a new contribution
whose norm exceeds `factor` x their median is refused (until `min_history` norms are known, nothing
is refused on norm: there is nothing to compare with). `BanList` bans a peer for `base_s`, doubling at
each new offence up to `max_s` (Petals bans a peer 15 s, doubling).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

DEFAULT_NORM_FACTOR = 1e4  # a contribution may have at most this x the running median norm (in the
# first 20 steps of the GPT-2 e2e run honest per-parameter norms rose over 100x above their median)
DEFAULT_NORM_HISTORY = 32  # accepted norms remembered per parameter
DEFAULT_MIN_HISTORY = 8  # accepted norms needed before the bound applies
DEFAULT_BAN_BASE_S = 15.0  # seconds of the first ban; doubles at each further offence
DEFAULT_BAN_MAX_S = 3600.0  # seconds: longest ban
MAX_TRACKED_PEERS = 4096  # offenders remembered; the ones whose ban ended longest ago go first


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    norm_factor: float = DEFAULT_NORM_FACTOR
    norm_history: int = DEFAULT_NORM_HISTORY
    min_history: int = DEFAULT_MIN_HISTORY
    ban_base_s: float = DEFAULT_BAN_BASE_S  # seconds
    ban_max_s: float = DEFAULT_BAN_MAX_S  # seconds

    def __post_init__(self) -> None:
        if self.norm_factor <= 1 or self.norm_history < 1 or self.min_history < 1:
            raise ValueError("norm_factor must be > 1, norm_history and min_history >= 1")
        if not 0 < self.ban_base_s <= self.ban_max_s:
            raise ValueError("need 0 < ban_base_s <= ban_max_s")


class NormBound:
    """Running median of accepted contribution norms per key (e.g. (job, parameter name)).

    Each norm is kept with the step it was pushed for, so that steps a job undoes (a rollback after
    a spot-check, pending pushes dropped at a re-plan) leave no trace (`forget_steps`): their replay
    records them again, and the bound a replayed step meets is the one it met the first time. A
    few more norms than the median reads are kept for that (REPLAY_SLACK)."""

    REPLAY_SLACK = 128  # norms kept beyond norm_history: a rollback of up to this many steps is exact

    def __init__(self, config: GuardConfig = GuardConfig()):
        self.config = config
        self._norms: dict[Any, deque[tuple[int | None, float]]] = {}

    def bound(self, key: Any) -> float | None:
        """The largest acceptable norm for `key`, or None while too few norms are known."""
        hist = self._norms.get(key)
        if hist is None or len(hist) < self.config.min_history:
            return None
        last = list(hist)[-self.config.norm_history :]
        median = statistics.median(n for _step, n in last)
        if median <= 0.0:  # all-zero history (an unused parameter): no scale to compare with
            return None
        return self.config.norm_factor * median

    def check(self, key: Any, norm: float) -> str | None:
        """None if acceptable, else why not. Non-finite norms are never acceptable."""
        if not math.isfinite(norm):
            return "non-finite gradient"
        limit = self.bound(key)
        if limit is not None and norm > limit:
            return (
                f"gradient norm {norm:.3g} exceeds {self.config.norm_factor:g} x running median ({limit:.3g})"
            )
        return None

    def record(self, key: Any, norm: float, step: int | None = None) -> None:
        maxlen = self.config.norm_history + self.REPLAY_SLACK
        self._norms.setdefault(key, deque(maxlen=maxlen)).append((step, float(norm)))

    def forget(self, pred: Callable[[Any], bool]) -> None:
        for key in [k for k in self._norms if pred(k)]:
            del self._norms[key]

    def forget_steps(self, pred: Callable[[Any], bool], from_step: int) -> int:
        """Drops the norms of the keys matching `pred` recorded for steps >= `from_step` (undone
        steps, replayed later); how many."""
        dropped = 0
        for key in [k for k in self._norms if pred(k)]:
            hist = self._norms[key]
            kept = [(s, n) for s, n in hist if s is None or s < from_step]
            dropped += len(hist) - len(kept)
            if len(kept) != len(hist):
                hist.clear()
                hist.extend(kept)
        return dropped


@dataclasses.dataclass
class _Offender:
    strikes: int
    until: float
    reason: str


class BanList:
    """Peers banned for a growing interval; `offences` counts every offence by its kind."""

    def __init__(self, config: GuardConfig = GuardConfig(), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._peers: dict[str, _Offender] = {}
        self.offences: dict[str, int] = {}
        self.dropped_while_banned = 0

    def ban(self, peer: str, kind: str, detail: str = "") -> float:
        """Record an offence of `kind`; returns the ban's length in seconds."""
        self.offences[kind] = self.offences.get(kind, 0) + 1
        now = self._clock()
        off = self._peers.get(peer)
        strikes = 1 if off is None else off.strikes + 1
        length = min(self.config.ban_base_s * 2 ** (strikes - 1), self.config.ban_max_s)
        self._peers[peer] = _Offender(strikes, now + length, f"{kind}: {detail}" if detail else kind)
        if len(self._peers) > MAX_TRACKED_PEERS:
            oldest = min(self._peers, key=lambda p: self._peers[p].until)
            del self._peers[oldest]
        return length

    def is_banned(self, peer: str) -> bool:
        off = self._peers.get(peer)
        return off is not None and self._clock() < off.until

    def status(self) -> dict[str, Any]:
        now = self._clock()
        return {
            "offences": dict(self.offences),
            "dropped_while_banned": self.dropped_while_banned,
            "banned": {
                p: {"for_s": round(o.until - now, 1), "strikes": o.strikes, "reason": o.reason}
                for p, o in self._peers.items()
                if o.until > now
            },
        }
