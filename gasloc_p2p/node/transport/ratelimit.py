"""Upload rate limiting shared by a node's exchanges."""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """Caps the node's sent payload at ``rate_bytes_s`` with bursts of ``burst_bytes``.

    Shared by all exchanges of a node (an event-loop object: not thread-safe). A zero rate
    means no cap.
    """

    def __init__(self, rate_bytes_s: float, burst_bytes: int) -> None:
        self.rate = rate_bytes_s
        self.burst = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._last = time.monotonic()
        self._lock = asyncio.Lock()

    @classmethod
    def from_mbps(cls, mbps: float, burst_bytes: int) -> TokenBucket:
        return cls(mbps * 1e6 / 8, burst_bytes)

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may be sent (requests larger than the burst are allowed)."""
        if self.rate <= 0:
            return
        async with self._lock:  # FIFO among waiters
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.rate)
