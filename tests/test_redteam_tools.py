"""The red team's aim and its measure (issue 39): the loss-aware attacks push where the loss
rises, and the push left is read against the clean twin."""

from __future__ import annotations

import asyncio

import torch

from benchmarks.bench_redteam import push_left
from benchmarks.swarm_eval import Evaluator
from benchmarks.tools.redteam import ATTACKS, Ascent, orthogonal_to, unit
from benchmarks.tools.sybil import Tally, direction


def test_the_ascent_aim_raises_the_loss_and_its_opposite_lowers_it():
    evaluator = Evaluator({"eval_interval_steps": 100000})
    at = evaluator.theta0
    d = asyncio.run(Ascent().direction(at))
    assert abs(float(d.pow(2).mean()) - 1.0) < 1e-4
    base = evaluator.loss(at)
    up, down = evaluator.loss(at + 1e-5 * d), evaluator.loss(at - 1e-5 * d)
    assert up > base + 1e-3 and down < base - 1e-3, (base, up, down)
    # a random direction of the same size moves it far less
    r = unit(torch.randn(at.numel(), generator=torch.Generator().manual_seed(3)))
    assert abs(evaluator.loss(at + 1e-5 * r) - base) < 0.1 * (up - base)


def test_orthogonal_aim_has_no_part_along_the_displacement():
    g = torch.Generator().manual_seed(0)
    u, d = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    o = orthogonal_to(u, d)
    assert abs(float(o.double() @ d.double())) < 1e-6 * float(d.norm()) * float(o.norm())
    assert abs(float(o.pow(2).mean()) - 1.0) < 1e-5


def test_push_left_is_read_along_what_was_committed_less_the_clean_twin():
    n = 4096
    theta0 = torch.zeros(n)
    aim = unit(torch.randn(n, generator=torch.Generator().manual_seed(1)))
    shared = 0.3 * aim  # what honest training alone did along the aim (both twins)
    rows = {"attacked": [{"theta": shared + 0.05 * aim}, {"theta": shared}],
            "clean": [{"theta": shared}, {"theta": shared}]}
    tally = Tally()
    tally.add_vector("a0", 0.01 * aim)
    tally.add_vector("a0", 0.01 * aim)  # summed: the direction is what counts
    left = push_left(rows, tally, theta0)
    assert abs(left[0] - 0.05) < 1e-4
    # a victim the attacker never pushed is read along the fixed direction u: nothing there
    assert left[1] < 1e-3 and direction(n).shape == (n,)
    assert {"ascent", "ascent-slow", "rewind"} <= set(ATTACKS)
