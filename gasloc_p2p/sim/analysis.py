"""Reading simulated runs: interpolated time-to-target, loss at a token budget, paired CIs.

Pure functions over a run's logged points (``history``: full evaluations; ``trace``: the quick
loss at every round end), so the tables in ``docs/results/`` and the tests share one reading.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

Point = Mapping[str, float]

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (then 1.96)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("a confidence interval needs at least two samples")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def time_to_target(points: Sequence[Point], target: float, x: str = "sim_seconds",
                   y: str = "loss") -> float | None:
    """``x`` at which ``y`` first reaches ``target``, linearly interpolated between the two
    logged points around the first crossing; None if never reached."""
    for k, p in enumerate(points):
        if p[y] <= target:
            if k == 0:
                return p[x]
            q = points[k - 1]
            frac = (q[y] - target) / (q[y] - p[y])
            return q[x] + frac * (p[x] - q[x])
    return None


def value_at(points: Sequence[Point], x: str, at: float, y: str) -> float | None:
    """``y`` at ``x == at``, linearly interpolated; None outside the logged range."""
    for q, p in zip(points, points[1:], strict=False):
        if q[x] <= at <= p[x]:
            if p[x] == q[x]:
                return p[y]
            return q[y] + (at - q[x]) / (p[x] - q[x]) * (p[y] - q[y])
    if points and points[-1][x] == at:
        return points[-1][y]
    return None


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t interval); half-width NaN for fewer than two values."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def paired_ci(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean of the paired differences ``a_k - b_k`` (same seed k) and its 95% t half-width."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    return mean_ci([x - y for x, y in zip(a, b, strict=True)])
