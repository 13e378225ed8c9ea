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

Independently of the size, the peer's displacement from ``theta_0`` must point the same way
as this node's (cosine at least ``min_cosine``): honest nodes start from one ``theta_0`` and see
data of one distribution, so their displacements correlate; a sign-flipped delta or random
noise does not. Both sides compute the same cosine.

Values are plain floats: the engine computes them (tensor work, in a worker thread).
"""

from __future__ import annotations

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
    min_cosine: float = 0.05  # of the two displacements from theta_0 (-1: off)

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

    def screen_direction(self, fragment: int, cosine: float) -> None:
        """ImplausibleUpdate if the peer's displacement from ``theta_0`` points away from ours
        (a sign-flipped or random delta): honest nodes share ``theta_0`` and the data's
        distribution, so their displacements are positively correlated."""
        if self.rule.enabled and not cosine >= self.rule.min_cosine:
            raise ImplausibleUpdate(f"implausible update: its displacement from theta_0 has "
                                    f"cosine {cosine:.3f} with ours on fragment {fragment} "
                                    f"(minimum {self.rule.min_cosine:g})")

    def accept(self, fragment: int, distance: float) -> None:
        """Record the RMS distance of a committed exchange."""
        with self._lock:
            hist = self._history.setdefault(fragment, deque(maxlen=self.rule.window))
            hist.append(distance)

    def accepted(self, fragment: int) -> int:
        with self._lock:
            return len(self._history.get(fragment, ()))
