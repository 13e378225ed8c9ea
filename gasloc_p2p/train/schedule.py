"""The inner learning-rate schedule, shared by the simulator and the daemon.

Linear warmup, then a half cosine from the peak down to a floor, then the floor for good. The
floor (rather than decaying to zero) matters here: a node may train far past any horizon it was
started with (it joins late, or the run is extended), and a zero learning rate would silently
stop it from learning while it still gossips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the inner step (counted from 0).

    ``lr`` is the peak; the rate rises linearly over ``warmup_steps`` (step 0 already gets
    ``lr / warmup_steps``, so no step is wasted at zero), falls along a half cosine until step
    ``horizon_steps`` and then stays at ``min_lr_ratio * lr``.
    """

    lr: float
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    horizon_steps: int = 1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.horizon_steps < 1:
            raise ValueError(f"horizon_steps must be >= 1, got {self.horizon_steps}")

    def at(self, step: int) -> float:
        """The learning rate of inner step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.horizon_steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * t))
