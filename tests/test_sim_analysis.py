"""Reading runs: interpolated time-to-target, values at a budget, paired t intervals."""

from __future__ import annotations

import math

import pytest

from gasloc_p2p.sim.analysis import mean_ci, paired_ci, t975, time_to_target, value_at

PTS = [{"t": 0.0, "loss": 4.0}, {"t": 10.0, "loss": 3.0}, {"t": 20.0, "loss": 2.0}]


def test_time_to_target_interpolates_between_the_points_around_the_crossing():
    assert time_to_target(PTS, 2.5, x="t") == pytest.approx(15.0)
    assert time_to_target(PTS, 3.0, x="t") == pytest.approx(10.0)
    assert time_to_target(PTS, 5.0, x="t") == 0.0
    assert time_to_target(PTS, 1.9, x="t") is None


def test_value_at_interpolates_and_refuses_to_extrapolate():
    assert value_at(PTS, "t", 5.0, "loss") == pytest.approx(3.5)
    assert value_at(PTS, "t", 20.0, "loss") == pytest.approx(2.0)
    assert value_at(PTS, "t", 25.0, "loss") is None


def test_paired_ci_uses_the_differences_and_student_t():
    mean, half = paired_ci([3.0, 2.0, 1.0], [2.0, 1.5, 0.0])  # diffs 1, 0.5, 1
    assert mean == pytest.approx(2.5 / 3)
    sd = math.sqrt(((1 - 2.5 / 3) ** 2 * 2 + (0.5 - 2.5 / 3) ** 2) / 2)
    assert half == pytest.approx(4.303 * sd / math.sqrt(3))
    assert math.isnan(mean_ci([1.0])[1])
    assert t975(1) == 12.706 and t975(100) == 1.96
    with pytest.raises(ValueError):
        paired_ci([1.0], [1.0, 2.0])
