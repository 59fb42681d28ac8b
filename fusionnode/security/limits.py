"""Per-peer resource limits of a node: concurrent streams, bytes in flight, RPC rate.

One peer cannot exhaust a node's memory or handlers: past its caps its new streams are closed at
once, its frames wait for its own byte budget (or are refused when a single frame exceeds it), and
its calls beyond the rate are refused, while every other peer keeps its own budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from fusionnode.errors import ProtocolError

DEFAULT_MAX_STREAMS_PER_PEER = 256  # concurrent inbound streams (RPC + data) from one peer
DEFAULT_MAX_INFLIGHT_BYTES_PER_PEER = 512 << 20  # bytes of frames being received/handled (512 MiB)
DEFAULT_RPC_RATE_PER_PEER = 500.0  # RPC calls per second, sustained, from one peer
DEFAULT_RPC_BURST_PER_PEER = 1000  # RPC calls allowed in a burst
DEFAULT_INFLIGHT_WAIT_S = 30.0  # seconds a frame waits for its peer's byte budget before refusal

# Job-level caps (any peer may act as a driver: these bound what one driver can make a node hold)
MAX_STAGES_PER_DRIVER = 64  # stages one driver may hold on one worker at once
MAX_SHARDS_PER_DRIVER = 16  # optimizer shards (jobs) one driver may hold on one host at once
MAILBOX_SLACK_BYTES = 256 << 20  # bytes a job's peer may have waiting in our mailbox beyond the state
# the job declares (activations and gradients of micro-batches that arrive before they are used)


@dataclasses.dataclass(frozen=True)
class PeerLimits:
    max_streams: int = DEFAULT_MAX_STREAMS_PER_PEER
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES_PER_PEER  # bytes
    rpc_rate: float = DEFAULT_RPC_RATE_PER_PEER  # calls per second
    rpc_burst: int = DEFAULT_RPC_BURST_PER_PEER  # calls
    inflight_wait_s: float = DEFAULT_INFLIGHT_WAIT_S  # seconds

    def __post_init__(self) -> None:
        if self.max_streams < 1 or self.max_inflight_bytes < 1 or self.rpc_rate <= 0 or self.rpc_burst < 1:
            raise ValueError(f"PeerLimits must be positive: {self}")
        if self.inflight_wait_s <= 0:
            raise ValueError("inflight_wait_s must be > 0 s")


DEFAULT_PEER_LIMITS = PeerLimits()


class PeerLimiter:
    """Book-keeping of `PeerLimits` for every peer (single event loop; no locks needed)."""

    def __init__(self, limits: PeerLimits = DEFAULT_PEER_LIMITS, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self.streams: dict[str, int] = defaultdict(int)
        self.inflight: dict[str, int] = defaultdict(int)
        self._tokens: dict[str, tuple[float, float]] = {}  # peer -> (tokens, at)
        self._released: dict[str, asyncio.Event] = {}
        self.refused: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def _refuse(self, peer: str, what: str) -> bool:
        self.refused[peer][what] += 1
        return False

    def open_stream(self, peer: str) -> bool:
        if self.streams[peer] >= self.limits.max_streams:
            return self._refuse(peer, "streams")
        self.streams[peer] += 1
        return True

    def close_stream(self, peer: str) -> None:
        self.streams[peer] -= 1
        if self.streams[peer] <= 0:
            del self.streams[peer]

    def allow_call(self, peer: str) -> bool:
        now = self._clock()
        tokens, at = self._tokens.get(peer, (float(self.limits.rpc_burst), now))
        tokens = min(float(self.limits.rpc_burst), tokens + (now - at) * self.limits.rpc_rate)
        if tokens < 1.0:
            self._tokens[peer] = (tokens, now)
            return self._refuse(peer, "rate")
        self._tokens[peer] = (tokens - 1.0, now)
        if len(self._tokens) > 4 * 4096:  # forget peers whose bucket is full again
            full = float(self.limits.rpc_burst)
            for p, (t, a) in list(self._tokens.items()):
                if t + (now - a) * self.limits.rpc_rate >= full:
                    del self._tokens[p]
        return True

    async def reserve(self, peer: str, nbytes: int) -> None:
        """Take `nbytes` of the peer's in-flight budget, waiting for its own frames to be released."""
        cap = self.limits.max_inflight_bytes
        if nbytes > cap:
            self._refuse(peer, "bytes")
            raise ProtocolError(f"frame of {nbytes} bytes exceeds this node's per-peer budget of {cap} bytes")
        deadline = self._clock() + self.limits.inflight_wait_s
        while self.inflight[peer] + nbytes > cap:
            left = deadline - self._clock()
            if left <= 0:
                self._refuse(peer, "bytes")
                raise ProtocolError(f"peer has {self.inflight[peer]} bytes in flight; budget {cap} bytes")
            event = self._released.setdefault(peer, asyncio.Event())
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                pass
        self.inflight[peer] += nbytes

    def release(self, peer: str, nbytes: int) -> None:
        self.inflight[peer] -= nbytes
        if self.inflight[peer] <= 0:
            del self.inflight[peer]
        event = self._released.get(peer)
        if event is not None:
            event.set()
            if peer not in self.inflight:
                del self._released[peer]

    def status(self) -> dict[str, Any]:
        return {
            "streams": dict(self.streams),
            "inflight_bytes": dict(self.inflight),
            "refused": {p: dict(r) for p, r in self.refused.items()},
        }
