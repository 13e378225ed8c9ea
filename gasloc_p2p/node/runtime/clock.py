"""The node's clock seam: what its timers read and wait on.

:class:`WallClock` is ``time.monotonic`` and ``asyncio.sleep``; :class:`ManualClock` only moves
when a test calls :meth:`ManualClock.advance`, so timer behaviour (the gossip loop's random
intervals, the announcer, peer refresh, progress log and checkpoint timers, peer backoff) is
tested in virtual time, without sleeping. :func:`every` is the node's periodic-job loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

log = logging.getLogger(__name__)


class Clock(Protocol):
    """Monotonic seconds and an awaitable sleep on the same time line."""

    def monotonic(self) -> float:
        """Seconds since an arbitrary origin; never goes back."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock (cancellable)."""
        ...


class WallClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class ManualClock:
    """A clock for tests: time stands still until :meth:`advance` moves it.

    Sleepers wake in deadline order, each seeing :meth:`monotonic` equal to its own deadline,
    and the event loop runs between two wake-ups, so a loop that sleeps again re-arms before a
    later deadline is reached (exactly as under real time, with no real waiting).
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + max(0.0, seconds), next(self._order), future))
        await future

    @property
    def sleepers(self) -> int:
        """Sleeps in progress (cancelled ones excluded)."""
        return sum(not f.done() for _, _, f in self._sleepers)

    async def advance(self, seconds: float, settle: int = 5) -> None:
        """Move time forward by ``seconds``, waking every sleeper whose deadline passes.

        ``settle``: event-loop turns given after each wake-up (and at the end) so the woken
        tasks run up to their next sleep.
        """
        end = self.now + seconds
        await _turns(settle)
        while self._sleepers and self._sleepers[0][0] <= end:
            deadline, _, future = heapq.heappop(self._sleepers)
            self.now = max(self.now, deadline)
            if not future.done():
                future.set_result(None)
                await _turns(settle)
        self.now = end
        await _turns(settle)


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def every(clock: Clock, period_s: float, job: Callable[[], Awaitable[None]], name: str,
                first_now: bool = False) -> None:
    """Run ``job`` every ``period_s`` seconds of ``clock`` (at once first if ``first_now``);
    an error is logged and the job retried at the next period, never fatal. Runs until
    cancelled."""
    wait = not first_now
    while True:
        if wait:
            await clock.sleep(period_s)
        wait = True
        try:
            await job()
        except Exception as exc:
            log.warning("%s failed: %s; retrying in %g s", name, exc, period_s)
