"""GASLoC in synchronous rounds (docs/algorithm.md section 1), in float64, on the node state.

The synchronous form is the node's :class:`AsyncGaslocState` with every exchange of a round's
matching snapshotted at the synchronized round end and committed before any round ends: what
the simulator's ``--mode sync`` runs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.flat import whole
from gasloc_p2p.core.outer import LocalNesterov, PlainAverage
from gasloc_p2p.core.topology import complete_edges, random_matching, ring_edges
from tests import toy

ETA, GAMMA = toy.ETA, toy.GAMMA
run_diloco = toy.run_diloco


def sync_round(states: Sequence[AsyncGaslocState], edges: Sequence[tuple[int, int]],
               w: float) -> None:
    """Every exchange of ``edges`` from the round's proposals, then every round end."""
    snaps = [s.public_iterate() for s in states]
    for i, j in edges:
        c = (snaps[j] - snaps[i]).mul_(w)
        states[i].apply_correction(c)
        states[j].apply_correction(-c)
    for s in states:
        s.round_end()


def run_gasloc(n: int, rounds: int, H: int, seed: int = 0, gamma: float = GAMMA
               ) -> list[torch.Tensor]:
    thetas, ws = toy.workers(n, seed)
    cfg = AsyncConfig(eta=ETA, gamma=gamma)
    states = [AsyncGaslocState(thetas[i], toy.theta0(seed), cfg) for i in range(n)]
    history = []
    for _ in range(rounds):
        for w in ws:
            w.inner(H)
        sync_round(states, complete_edges(n), 1.0 / n)
        history.append(thetas.clone())
    return history


def test_mixed_complete_graph_equals_nesterov_diloco_on_every_worker():
    n, rounds = 4, 12
    ref = run_diloco(n, rounds, H=5)
    got = run_gasloc(n, rounds, H=5)
    for t in range(rounds):
        for i in range(n):
            torch.testing.assert_close(got[t][i], ref[t], rtol=0, atol=1e-10)
    assert (ref[-1] - ref[0]).norm() > 1e-2  # the run moved: the comparison is not vacuous


def test_nesterov_outer_matches_torch_sgd():
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64, generator=gen))
    mine = p.detach().clone()
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    outer = LocalNesterov(0.7, 0.9).allocate(mine, mine.device, mine)  # the gradient form
    for _ in range(6):
        g = torch.randn(5, dtype=torch.float64, generator=gen)
        p.grad = g.clone()
        sgd.step()
        outer.step_fragment(whole(5), mine, g)
    torch.testing.assert_close(mine, p.detach(), rtol=0, atol=1e-14)


def test_nesterov_without_momentum_keeps_no_buffer_and_is_sgd():
    anchor, g = torch.ones(5, dtype=torch.float64), torch.full((5,), 2.0, dtype=torch.float64)
    outer = AsyncConfig(eta=0.7, gamma=0.0, momentum="local").outer()
    assert isinstance(outer, PlainAverage)
    outer.allocate(anchor, anchor.device, anchor)
    assert outer.state == {}
    outer.step_fragment(whole(5), anchor, g)
    torch.testing.assert_close(anchor, torch.full((5,), 1.0 - 1.4, dtype=torch.float64))


def test_pair_exchanges_preserve_the_network_mean():
    n = 8
    gen = torch.Generator().manual_seed(1)
    thetas = torch.randn(n, 1000, dtype=torch.float64, generator=gen)
    states = [AsyncGaslocState(thetas[i], torch.zeros(1000, dtype=torch.float64),
                               AsyncConfig(eta=1.0, gamma=0.0)) for i in range(n)]
    before = thetas.mean(dim=0)
    pairs = random_matching(ring_edges(n), random.Random(0))
    sync_round(states, pairs, 0.3)
    torch.testing.assert_close(thetas.mean(dim=0), before, rtol=0, atol=1e-13)
    i, j = pairs[0]
    sync_round(states[:0], [], 0.5)  # nothing
    assert (thetas[i] - thetas[j]).abs().max() > 1e-3  # w 0.3 is not the pair average


def test_gamma0_eta1_H1_sgd_is_gossip_sgd():
    n, rounds, lr = 6, 15, 0.05
    rng_a, rng_b = random.Random(5), random.Random(5)
    thetas, ws = toy.workers(n, sgd_lr=lr)
    states = [AsyncGaslocState(thetas[i], toy.theta0(), AsyncConfig(eta=1.0, gamma=0.0))
              for i in range(n)]
    ref_thetas, ref_ws = toy.workers(n, sgd_lr=lr)
    for _ in range(rounds):
        for w in ws:
            w.inner(1)
        sync_round(states, random_matching(ring_edges(n), rng_a), 0.5)
        # D-PSGD by hand: one SGD step each, then average with the matched partner
        for w in ref_ws:
            w.inner(1)
        for i, j in random_matching(ring_edges(n), rng_b):
            avg = (ref_thetas[i] + ref_thetas[j]) / 2
            ref_thetas[i] = avg
            ref_thetas[j] = avg
    torch.testing.assert_close(thetas, ref_thetas, rtol=0, atol=1e-12)


def test_momentum_memory_starts_at_theta0():
    # gamma > 0 on round one extrapolates from theta_0: a wrong initial memory changes theta.
    theta0 = torch.zeros(3, dtype=torch.float64)
    theta = torch.zeros(3, dtype=torch.float64)
    state = AsyncGaslocState(theta, theta0, AsyncConfig(eta=1.0, gamma=0.5))
    theta.fill_(1.0)  # the round's drift
    state.round_end()
    torch.testing.assert_close(theta, torch.full((3,), 1.5, dtype=torch.float64))


def test_mixed_by_hand():
    # Two workers, exact pair average, eta = 1, gamma = 1/2; values computed on paper.
    thetas = torch.zeros(2, 1)
    cfg = AsyncConfig(eta=1.0, gamma=0.5)
    states = [AsyncGaslocState(thetas[i], torch.zeros(1), cfg) for i in range(2)]
    thetas += torch.tensor([[1.0], [3.0]])
    sync_round(states, [(0, 1)], 0.5)
    assert thetas.flatten().tolist() == [3.0, 3.0]
    thetas += torch.tensor([[1.0], [-1.0]])
    sync_round(states, [(0, 1)], 0.5)
    assert thetas.flatten().tolist() == [3.5, 3.5]


def test_no_momentum_buffer_without_momentum():
    theta = torch.ones(4)
    for momentum in ("mixed", "local"):
        state = AsyncGaslocState(theta, torch.zeros(4), AsyncConfig(eta=0.5, gamma=0.0,
                                                                     momentum=momentum))
        assert state.outer.state == {}  # no model-sized buffer the algorithm never reads
    assert AsyncGaslocState(theta, torch.zeros(4), AsyncConfig(gamma=0.1)).outer.state


@pytest.mark.parametrize("momentum", ["mixed", "local"])
def test_gamma0_round_end_is_the_public_iterate_bit_for_bit(momentum):
    gen = torch.Generator().manual_seed(2)
    theta = torch.randn(1000, generator=gen)
    state = AsyncGaslocState(theta, torch.zeros(1000), AsyncConfig(eta=0.7, gamma=0.0,
                                                                   momentum=momentum))
    theta.add_(torch.randn(1000, generator=gen))
    p = state.public_iterate()
    state.round_end()
    assert torch.equal(theta, p) and torch.equal(state.anchor, p)


def test_outer_config_rejects_bad_values():
    for bad in [AsyncConfig(eta=0), AsyncConfig(gamma=1.0), AsyncConfig(momentum="both"),
                AsyncConfig(w=0.6)]:
        with pytest.raises(ValueError):
            bad.validate()
