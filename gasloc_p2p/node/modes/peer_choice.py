"""Whom to gossip with: uniform, or preferring peers whose exchanges were fast (no I/O).

``uniform`` draws partners uniformly at random (the GASLoC analysis assumes it). ``bandwidth``
keeps, per peer, an exponential moving average of the throughput this node *measured* on its
committed exchanges with that peer (payload bytes both ways over the exchange's wall time, in
either role; a peer's own claims are never used) and draws:

- with probability ``explore``, uniformly among the candidates, so a slow peer still takes part
  in consensus and a peer that got faster is noticed;
- otherwise proportionally to the measured throughput. A peer never measured counts as the
  fastest known one (optimism: it gets measured soon); a failed exchange halves the estimate.

So on uneven links the fast peers exchange mostly among themselves (each exchange over a fast
link takes less wall time, so more of them fit in a round), while every slow peer still gets
about ``explore / n`` of the draws plus the exchanges it starts itself. The table is bounded
(least recently measured peers are forgotten).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

CHOICES = ("uniform", "bandwidth")
MAX_PEERS = 1024  # measured peers remembered
EMA = 0.3  # weight of the newest measurement

T = TypeVar("T")


class PeerChooser:
    """Draws gossip partners (see the module docstring). Not thread-safe: use from one loop."""

    def __init__(self, mode: str, explore: float, rng: random.Random) -> None:
        if mode not in CHOICES:
            raise ValueError(f"peer choice must be one of {CHOICES}, got {mode!r}")
        if not 0.0 <= explore <= 1.0:
            raise ValueError(f"explore must be in [0, 1], got {explore}")
        self.mode, self.explore, self.rng = mode, explore, rng
        self._rate: OrderedDict[str, float] = OrderedDict()  # peer -> bytes/s
        self.explored = self.exploited = 0  # draws of each kind (bandwidth mode)

    def observe(self, peer_id: str, nbytes: int, seconds: float) -> None:
        """One committed exchange with ``peer_id``: ``nbytes`` payload bytes both ways in
        ``seconds`` of wall time."""
        if seconds <= 0 or nbytes <= 0:
            return
        rate = nbytes / seconds
        old = self._rate.pop(peer_id, None)
        self._rate[peer_id] = rate if old is None else (1 - EMA) * old + EMA * rate
        while len(self._rate) > MAX_PEERS:
            self._rate.popitem(last=False)

    def failed(self, peer_id: str) -> None:
        """An exchange with ``peer_id`` failed (timeout, error): halve its estimate."""
        if peer_id in self._rate:
            self._rate[peer_id] *= 0.5

    def throughput(self, peer_id: str) -> float | None:
        """The measured bytes/s of ``peer_id`` (None if never measured)."""
        return self._rate.get(peer_id)

    def rates(self) -> dict[str, float]:
        return dict(self._rate)

    def pick(self, options: Sequence[T], k: int, key: Callable[[T], str]) -> list[T]:
        """Up to ``k`` distinct options in order of preference (``key``: an option's peer id)."""
        k = min(k, len(options))
        if self.mode == "uniform":
            return self.rng.sample(list(options), k)
        left, out = list(options), list[T]()
        known = [r for r in (self._rate.get(key(o)) for o in left) if r is not None]
        optimistic = max(known) if known else 1.0
        while len(out) < k:
            if self.rng.random() < self.explore:
                self.explored += 1
                index = self.rng.randrange(len(left))
            else:
                self.exploited += 1
                weights = [self._rate.get(key(o), optimistic) for o in left]
                index = self._weighted(weights)
            out.append(left.pop(index))
        return out

    def _weighted(self, weights: list[float]) -> int:
        total = sum(weights)
        if not total > 0:
            return self.rng.randrange(len(weights))
        x, acc = self.rng.random() * total, 0.0
        for i, w in enumerate(weights):
            acc += w
            if x < acc:
                return i
        return len(weights) - 1
