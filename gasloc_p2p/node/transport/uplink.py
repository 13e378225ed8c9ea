"""How many exchanges this node's uplink carries at once without missing a peer's deadline.

An exchange sends one payload up the node's uplink. On a fast link several run at once; on a
slow one (a home's 1 Mbit/s) each payload in flight divides the rate, and two of them already
take longer than the per-message deadline the peer holds us to (a 0.85 MB payload takes 6.8 s
at 1 Mbit/s; two at once 13.6 s; the default deadline 15 s): both exchanges fail, and a third
party's would have. A node whose uplink is the slow side does better running exchanges one
after another (bench_nat: the homes' exchanges with each other failed 6 of 8 times with two
payloads on one uplink).

The rate is this node's own measurement: the time from the first byte of its payload to the
peer's Ready (the peer has it all and checked it), the best of the last ``window`` exchanges.
The best, not the mean: a peer that reads slowly or delays its Ready lowers only its own sample
and cannot shrink the node's capacity for everyone; one that answers Ready early raises it,
which gives back the limit the node had without a measurement (nothing worse).

The attack that knows this: members whose keys are all of the node's last ``window`` partners
(slow readers, each above the minimum transfer rate) push every fast sample out of the window
and bring the node down to one exchange at a time, then hold that one. So the rate used never
falls below a quarter of the best the node ever measured (``FLOOR``): such members can cut a
fast node's exchanges at once by 4x at most, never to one (a 100 Mbit/s node stays at the
inbound limits for the test model), and a home's one slot was one already. Pure: no I/O, no
clock.
"""

from __future__ import annotations

import math
from collections import deque

MIN_SAMPLE_BYTES = 64 * 1024  # smaller payloads time the round trip, not the rate
MARGIN = 0.5  # the slots fill at most half of the peer's deadline
FLOOR = 0.25  # the rate used is at least this share of the best ever measured


class UplinkMeter:
    """The best recent upload rate of this node's payloads, and the exchanges it allows."""

    def __init__(self, window: int = 16) -> None:
        self._rates: deque[float] = deque(maxlen=window)
        self._best = 0.0  # the best sample ever (only ever grows)

    def sample(self, nbytes: int, seconds: float) -> None:
        """One payload of ``nbytes`` went up in ``seconds`` (first byte to the peer's Ready)."""
        if nbytes >= MIN_SAMPLE_BYTES and math.isfinite(seconds) and seconds > 0:
            self._rates.append(nbytes / seconds)
            self._best = max(self._best, nbytes / seconds)

    def rate(self) -> float | None:
        """Bytes/s: the best of the window, at least ``FLOOR`` of the best ever; None before
        the first sample."""
        return max(max(self._rates), FLOOR * self._best) if self._rates else None

    def slots(self, payload_bytes: int, chunk_bytes: int, chunk_s: float,
              deadline_s: float) -> int | None:
        """Exchanges at once whose payloads, sharing the measured rate, each still meet the
        peer's deadlines with room to spare: one message (``chunk_bytes``, or the payload if
        smaller) within ``chunk_s`` and the whole payload within ``deadline_s``; at least 1;
        None (no limit of its own) before a measurement."""
        rate = self.rate()
        if rate is None or payload_bytes <= 0:
            return None
        message_s = min(chunk_bytes, payload_bytes) / rate
        payload_s = payload_bytes / rate
        fits = min(MARGIN * chunk_s / message_s, MARGIN * deadline_s / payload_s)
        return max(1, math.floor(fits))
