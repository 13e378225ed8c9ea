"""The loss gate (issue 39): a commit that raised the loss of a private batch beyond the
round's allowance is taken back on this side; the rest of the exchange is untouched."""

from __future__ import annotations

import torch

from gasloc_p2p.protocol.blame import LossGate
from gasloc_p2p.protocol.guard import GuardRule, UpdateGuard
from gasloc_p2p.protocol.memory import MemoryExchange
from tests.session_helpers import OUTER, node


def test_rises_of_a_round_share_its_allowance_and_only_a_rise_alone_beyond_it_is_bad():
    values = iter([2.0, 2.01, 2.0, 2.015, 2.0, 2.2, 2.0, 1.5, 2.0, float("nan"), 2.0, 2.015])
    gate = LossGate(lambda: next(values), share=0.01)  # 0.02 nats a round at loss 2
    verdicts = []
    for round_ in (0, 0, 0, 0, 0, 1):
        before = gate.measure()
        verdicts.append(gate.judge(before, round_))
    # +0.01 kept; +0.015 finds 0.01 left: full (not bad); +0.2 alone beyond: bad; a fall is
    # kept and earns no credit; NaN is bad; a new round's allowance is whole again
    assert verdicts == ["", "full", "bad", "", "bad", ""]
    assert gate.taken_back == 3 and gate.bad == 2


def _pair(loss_of_a):
    pair = []
    for name, seed in (("A", 1), ("B", 2)):
        rules, engine = node(name, seed)
        engine.guard = UpdateGuard(GuardRule(trust_after=1, round_budget=1e9,
                                             block_budget=1e9), OUTER.w)
        engine.guard.round_end({0: 1.0})
        pair.append((rules, engine))
    pair[0][1].gate = LossGate(lambda: loss_of_a(pair[0][1].state.theta), share=0.01)
    return pair


def test_a_commit_that_raises_the_loss_is_taken_back_here_and_kept_by_the_peer():
    target = None

    def loss(theta: torch.Tensor) -> float:  # A's "loss": its distance from where it was
        return 2.0 + 100 * float((theta - target).pow(2).mean())

    a, b = _pair(loss)
    target = a[1].state.theta.clone()
    before_a, before_b = a[1].state.theta.clone(), b[1].state.theta.clone()
    MemoryExchange(a, b, 0).run()
    # A took its correction back (to rounding): the move raised its loss by far more than 1%
    assert torch.allclose(a[1].state.theta, before_a, rtol=0, atol=1e-6)
    assert a[1].gate.taken_back == 1 and a[1].gate.bad == 1
    assert (b[1].state.theta - before_b).abs().max() > 1e-3  # the peer decided for itself
    assert a[1].guard.demerits(b[0].me.peer_id) == 0  # one small batch's verdict blames no one


def test_a_commit_that_lowers_the_loss_stays():
    target = None

    def loss(theta: torch.Tensor) -> float:  # lower towards B
        return 2.0 + 100 * float((theta - target).pow(2).mean())

    a, b = _pair(loss)
    target = b[1].state.theta.clone()
    before_a = a[1].state.theta.clone()
    moved_b = b[1].state.theta.clone()
    MemoryExchange(a, b, 0).run()
    moved = a[1].state.theta - before_a
    assert moved.abs().max() > 1e-3 and a[1].gate.taken_back == 0
    assert torch.allclose(moved, -(b[1].state.theta - moved_b), rtol=0, atol=1e-6)


def test_a_state_measured_after_a_commit_is_not_measured_again():
    calls = []

    def loss() -> float:
        calls.append(1)
        return 2.0 + 0.001 * len(calls)

    gate = LossGate(loss, share=0.01)
    before = gate.measure((5, 7))
    assert gate.judge(before, 0, (5, 8)) == "" and len(calls) == 2
    assert gate.measure((5, 8)) == 2.002 and len(calls) == 2  # commits back to back
    assert gate.measure((6, 8)) == 2.003 and len(calls) == 3  # a step came between
    assert gate.measure(None) and len(calls) == 4  # a lock that does not count: always
    assert gate.measured == 4
