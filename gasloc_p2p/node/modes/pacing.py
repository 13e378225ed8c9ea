"""Adaptive gossip pacing (``--pacing compute``): keep exchange work from slowing training by
more than ``1 - target`` (no I/O; the gossip loop feeds it counters).

An exchange never blocks training, but its work competes with it: encoding, decoding, the guard
and the apply run on the node's own cores or device, and hold the training lock to apply
(docs/results/pacing.md: on 2 cores shared by 4 nodes, gossip at 2 exchanges started per round
cost about 14% of the nodes' compute throughput, and the node on the slow link no more than the
others). The trainer
times every inner step and marks the steps during which no exchange work ran ("quiet" steps;
waiting on the network is not work). Over windows of about one round the pacer compares

    utilization = quiet step time / mean step time     (EMA over windows, at most 1)

(a window with fewer than 2 quiet steps uses the last windows' quiet step time)
which measures the slowdown itself, whatever causes it (cores, memory bandwidth, the GIL, the
lock; on a GPU the device), and adjusts the exchanges per round this node *starts*, additive
increase and multiplicative decrease: below ``target`` the rate is multiplied by 0.7 (never below
``--pacing-min-rate``), at or above it raised by a tenth of ``--exchanges-per-round`` (never above
it). It never refuses an inbound exchange to save time, so fast peers are not starved of this
node, and the floor keeps a slow or busy node in consensus. Without ``--pacing`` the same
estimate is made and exported (``gasloc_compute_utilization``); the rate stays
``--exchanges-per-round``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("off", "compute")
EMA = 0.5  # weight of the newest window
DECREASE = 0.7  # rate multiplier of a window below target
INCREASE = 0.1  # share of the maximum rate added after a window at or above target
MIN_QUIET = 2  # quiet steps a window needs to re-estimate the quiet step time


@dataclass(frozen=True)
class Counters:
    """Cumulative trainer counters of one node at one moment (all non-decreasing)."""

    steps: int  # inner steps
    step_s: float  # their total wall time
    quiet_steps: int  # steps during which no exchange work ran
    quiet_s: float  # their total wall time


class Pacer:
    """The pacing controller of one node (see the module docstring)."""

    def __init__(self, target: float, max_per_round: float, min_per_round: float,
                 enabled: bool = True) -> None:
        if not 0.0 < target < 1.0:
            raise ValueError(f"pacing target must be in (0, 1), got {target}")
        if max_per_round < 0 or min_per_round < 0:
            raise ValueError("exchange rates must be >= 0")
        self.target, self.enabled = target, enabled
        self.max_per_round = max_per_round
        self.min_per_round = min(min_per_round, max_per_round)
        self.per_round = max_per_round  # exchanges per round to start now
        self.utilization = math.nan  # EMA over windows
        self.quiet_step_s = math.nan  # EMA of a quiet step's wall time
        self._last: Counters | None = None

    def update(self, now: Counters) -> float:
        """Take the counters at the end of a window; returns the exchanges per round to start
        (``--exchanges-per-round`` when pacing is off or nothing is measured yet)."""
        last, self._last = self._last, now
        if last is None or now.steps <= last.steps:  # first window, or not training
            return self.per_round
        mean_s = (now.step_s - last.step_s) / (now.steps - last.steps)
        quiet = now.quiet_steps - last.quiet_steps
        quiet_s = self.quiet_step_s  # the window's own quiet steps if it has enough
        if quiet >= MIN_QUIET:
            quiet_s = (now.quiet_s - last.quiet_s) / quiet
            self.quiet_step_s = _ema(self.quiet_step_s, quiet_s)
        if math.isnan(quiet_s) or mean_s <= 0:
            return self.per_round
        self.utilization = _ema(self.utilization, min(1.0, quiet_s / mean_s))
        if self.enabled:
            if self.utilization < self.target:
                self.per_round = max(self.min_per_round, self.per_round * DECREASE)
            else:
                self.per_round = min(self.max_per_round,
                                     self.per_round + INCREASE * self.max_per_round)
        return self.per_round


def _ema(old: float, new: float) -> float:
    return new if math.isnan(old) else (1 - EMA) * old + EMA * new
