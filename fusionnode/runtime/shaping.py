"""User-space link shaping: a token bucket per link, for testbeds where tc/netns is unavailable."""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """User-space bandwidth limit for one link (used where tc/netns is unavailable)."""

    def __init__(self, rate_bps: float, burst_bytes: int = 256 << 10):
        self.rate = rate_bps / 8.0  # bytes per second
        self.burst = burst_bytes
        self.tokens = float(burst_bytes)
        self.last = time.monotonic()

    async def take(self, nbytes: int) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            want = min(nbytes, self.burst)
            if self.tokens >= want:
                self.tokens -= want
                nbytes -= want
                if nbytes <= 0:
                    return
                continue
            await asyncio.sleep((want - self.tokens) / self.rate)
