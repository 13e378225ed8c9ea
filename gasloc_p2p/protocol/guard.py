"""Bounded updates: clip or refuse a peer's correction that is implausibly large (no I/O).

A gossip correction is ``c = -w (ref_out - ref_in)`` after both messages are folded in, so its
size is known once the peer's payload is checked, before anything is applied. Both sides hold
the same references, so both see the same ``||ref_in - ref_out||``; a side whose guard refuses
aborts before ``Commit`` and neither applies. ``c_i = -c_j`` stays exact unless a side clips
(below), which honest nodes near consensus never do.

The rule, per fragment, on the RMS of ``ref_in - ref_out`` (the pair's distance, without ``w``),
has two limits. Up to the *soft* limit the exchange commits as is; between the soft and the
*hard* limit it commits with its weight scaled by ``soft / distance`` (clipped: this node moves
by at most ``w * soft``, as with an update just inside the soft limit; the peer's side clips by
its own limits); beyond the hard limit it is refused and the peer backed off.

- soft, after ``warmup`` accepted exchanges of that fragment: ``factor`` times the median of
  the last ``window`` accepted (unclipped) distances (robust: a few large honest outliers or a
  few accepted attacker payloads do not move the median), and never less than ``floor`` times
  this node's own scale (so a swarm in perfect consensus still accepts small differences);
- soft, during the warm-up: ``warmup_factor`` times this node's own scale, the larger of the
  RMS of its public iterate's displacement from ``theta_0`` and the RMS of ``theta_0`` itself;
- hard: ``hard_factor`` times that own scale (at least the soft limit);
- and a peer clipped more than ``max_clips`` times in a row is refused as well: an honest node
  that is far away comes closer with every clipped exchange, one that stays far (an attacker
  pulling every node towards ``theta_0``, say) is backed off after a bounded influence.

Why clip rather than refuse between the two: the median measures how far apart nodes that are
already near consensus are, and an honest node can be much farther away than that: one that
joined late from ``theta_0`` or trained through a partition (seen in a 3-process swarm: a
joiner 20 s late was 9x the median of its peers' distances and both refused it for good).
Clipping pulls such a node in over a few exchanges, while an attacker gains nothing over
staying just inside the soft limit. The hard limit still refuses what no honest node of the
run can be (an offset of 1e4 against parameters of RMS 0.05).

Independently of the size, the peer's displacement from ``theta_0`` must be *significantly*
positively correlated with this node's: its cosine with ours must be at least ``min_z /
sqrt(n)`` over a fragment of ``n`` elements (and at least ``min_cosine``, off by default).
Honest nodes start from one ``theta_0`` and see data of one distribution, so their
displacements share a component; but in high dimensions that component can be small against
each node's own noise (two honest nodes of a 99.5M-parameter Llama measured cosine 0.015 after
a few steps; `make bench-direction`: 0.021 to 0.041 over its first 8 steps), so no fixed
cosine separates them from noise at every model size. A scale-free test does: for a
direction independent of ours (random noise, whatever its RMS) the cosine is about
``N(0, 1/n)``, so ``cos * sqrt(n)`` is a z-score and ``min_z = 4`` accepts such noise with
probability about 3e-5; a sign-flipped delta has the negated cosine of an honest one, so it is
refused whenever the honest one would be accepted. An honest cosine of 0.015 at
``n = 1e8`` is a z-score of 150. Both sides compute the same cosine and ``n``.

Values are plain floats: the engine computes them (tensor work, in a worker thread).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

MAX_STREAKS = 4096  # peers whose clip streak is remembered (least recently clipped forgotten)


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
    hard_factor: float = 64.0  # refuse beyond this many times the own scale (clip below)
    max_clips: int = 8  # a peer clipped more often than this in a row is refused

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
        self._streaks: OrderedDict[str, int] = OrderedDict()  # peer -> clips in a row
        self._lock = threading.Lock()

    def limits(self, fragment: int, own_scale: float) -> tuple[float, float]:
        """The soft (clip beyond) and hard (refuse beyond) RMS distances for ``fragment``."""
        r = self.rule
        with self._lock:
            hist = list(self._history.get(fragment, ()))
        if len(hist) < r.warmup:
            soft = r.warmup_factor * own_scale
        else:
            soft = max(r.factor * statistics.median(hist), r.floor * own_scale)
        return soft, max(soft, r.hard_factor * own_scale)

    def screen(self, fragment: int, distance: float, own_scale: float, peer: str = "") -> float:
        """The factor on the exchange's weight: 1 within the soft limit, ``soft / distance``
        up to the hard limit; ImplausibleUpdate beyond it (or if ``distance`` is not finite),
        or if ``peer`` would be clipped more than ``max_clips`` times in a row (an honest node
        far away comes closer with every clipped exchange; one that stays far does not)."""
        if not self.rule.enabled:
            return 1.0
        soft, hard = self.limits(fragment, own_scale)
        if not distance <= hard:  # also catches NaN
            raise ImplausibleUpdate(f"implausible update: RMS distance {distance:.3g} on "
                                    f"fragment {fragment} exceeds the limit {hard:.3g}")
        with self._lock:
            streak = self._streaks.pop(peer, 0) + 1  # popped: a within-limit one ends it
            streak = streak if distance > soft else 0
            if 0 < streak <= self.rule.max_clips:
                self._streaks[peer] = streak
                while len(self._streaks) > MAX_STREAKS:
                    self._streaks.popitem(last=False)
        if streak > self.rule.max_clips:  # the streak starts over after the backoff
            raise ImplausibleUpdate(f"implausible update: RMS distance {distance:.3g} on "
                                    f"fragment {fragment} above the soft limit {soft:.3g} for "
                                    f"{streak} exchanges in a row")
        return 1.0 if distance <= soft else soft / distance

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
        """Record the RMS distance of an exchange committed unclipped."""
        with self._lock:
            hist = self._history.setdefault(fragment, deque(maxlen=self.rule.window))
            hist.append(distance)

    def accepted(self, fragment: int) -> int:
        with self._lock:
            return len(self._history.get(fragment, ()))
