"""Bounded updates: reject a peer's payload whose correction is implausibly large (no I/O).

A gossip correction is ``c = -w (ref_out - ref_in)`` after both messages are folded in, so its
size is known once the peer's payload is checked, before anything is applied. Both sides hold
the same references, so both see the same ``||ref_in - ref_out||``; the side whose guard trips
aborts before ``Commit`` and neither applies (``c_i = -c_j`` stays exact).

The rule, per fragment, on the RMS of ``ref_in - ref_out`` (the pair's distance, without ``w``):

- after ``warmup`` accepted exchanges of that fragment: at most ``factor`` times the median of
  the last ``window`` accepted distances (robust: a few large honest outliers or a few accepted
  attacker payloads do not move the median), and never less than ``floor`` times this node's
  own scale (so a swarm in perfect consensus still accepts small differences);
- during the warm-up: at most ``warmup_factor`` times this node's own scale, the larger of the
  RMS of its public iterate's displacement from ``theta_0`` and the RMS of ``theta_0`` itself.

Independently of the size, the peer's displacement from ``theta_0`` must be *significantly*
positively correlated with this node's: its cosine with ours must be at least ``min_z /
sqrt(n)`` over a fragment of ``n`` elements (and at least ``min_cosine``, off by default).
Honest nodes start from one ``theta_0`` and see data of one distribution, so their
displacements share a component; but in high dimensions that component can be small against
each node's own noise (two honest nodes of a 99.5M-parameter Llama measured cosine 0.015 after
a few steps; `make bench-direction`: 0.021 to 0.041 over its first 8 steps), so no fixed
cosine separates them from noise at every model size. A scale-free test does: for a
direction independent of ours (random noise, whatever its RMS) the cosine is about ``N(0, 1/n)``, so ``cos * sqrt(n)`` is a z-score and ``min_z = 4`` accepts such noise
with probability about 3e-5; a sign-flipped delta has the negated cosine of an honest one, so
it is refused whenever the honest one would be accepted. An honest cosine of 0.015 at
``n = 1e8`` is a z-score of 150. Both sides compute the same cosine and ``n``.

Values are plain floats: the engine computes them (tensor work, in a worker thread).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass


class ImplausibleUpdate(ValueError):
    """A peer's payload would move this node by an implausible amount; nothing was applied."""


@dataclass(frozen=True)
class GuardRule:
    """Thresholds of :class:`UpdateGuard` (see the module docstring)."""

    factor: float = 8.0
    window: int = 32
    warmup: int = 8
    warmup_factor: float = 4.0
    floor: float = 0.05
    min_z: float = 4.0  # the cosine must be >= min_z / sqrt(n) (negative: no such test)
    min_cosine: float = -1.0  # and >= this fixed value (-1: off)

    def min_direction(self, numel: int) -> float:
        """The smallest acceptable cosine over a fragment of ``numel`` elements (-1: none)."""
        z = self.min_z / math.sqrt(max(numel, 1)) if self.min_z >= 0 else -1.0
        return max(self.min_cosine, z)

    @property
    def enabled(self) -> bool:
        return self.factor > 0


class UpdateGuard:
    """Recent accepted pair distances per fragment, and the limit a new one must meet.

    Thread-safe: screening and recording run in the engine's worker threads.
    """

    def __init__(self, rule: GuardRule) -> None:
        self.rule = rule
        self._history: dict[int, deque[float]] = {}
        self._lock = threading.Lock()

    def limit(self, fragment: int, own_scale: float) -> float:
        """The largest acceptable RMS distance for ``fragment`` now."""
        r = self.rule
        with self._lock:
            hist = list(self._history.get(fragment, ()))
        if len(hist) < r.warmup:
            return r.warmup_factor * own_scale
        return max(r.factor * statistics.median(hist), r.floor * own_scale)

    def screen(self, fragment: int, distance: float, own_scale: float) -> None:
        """ImplausibleUpdate if ``distance`` (RMS) is non-finite or above the limit."""
        if not self.rule.enabled:
            return
        limit = self.limit(fragment, own_scale)
        if not distance <= limit:  # also catches NaN
            raise ImplausibleUpdate(f"implausible update: RMS distance {distance:.3g} on "
                                    f"fragment {fragment} exceeds the limit {limit:.3g}")

    def screen_direction(self, fragment: int, cosine: float, numel: int) -> None:
        """ImplausibleUpdate if the peer's displacement from ``theta_0`` is not significantly
        aligned with ours over ``numel`` elements (a sign-flipped or random delta): honest
        nodes share ``theta_0`` and the data's distribution, so theirs are correlated."""
        if not self.rule.enabled:
            return
        least = self.rule.min_direction(numel)
        if not cosine >= least:  # also catches NaN
            raise ImplausibleUpdate(f"implausible update: its displacement from theta_0 has "
                                    f"cosine {cosine:.3g} with ours on fragment {fragment} "
                                    f"(minimum {least:.3g} over {numel} elements)")

    def accept(self, fragment: int, distance: float) -> None:
        """Record the RMS distance of a committed exchange."""
        with self._lock:
            hist = self._history.setdefault(fragment, deque(maxlen=self.rule.window))
            hist.append(distance)

    def accepted(self, fragment: int) -> int:
        with self._lock:
            return len(self._history.get(fragment, ()))
