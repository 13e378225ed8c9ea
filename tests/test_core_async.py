"""Asynchronous GASLoC node state (docs/algorithm.md section 2) against the synchronous forms."""

from __future__ import annotations

import random

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState, exchange_weight
from gasloc_p2p.core.topology import complete_edges, mixing_matrix, random_matching
from tests import toy

ETA = 0.7


def allreduce_(states: list[AsyncGaslocState]) -> None:
    """Every node moves its public iterate to the network mean (complete graph, w = 1/n)."""
    ps = torch.stack([s.public_iterate() for s in states])
    mean = ps.mean(dim=0)
    for s, p in zip(states, ps, strict=True):
        s.apply_correction(mean - p)


def pair_exchange_(si: AsyncGaslocState, sj: AsyncGaslocState, w: float) -> None:
    c = (sj.public_iterate() - si.public_iterate()) * w
    si.apply_correction(c)
    sj.apply_correction(-c)


def test_exchanges_at_round_ends_equal_sync_mixed():
    n, rounds, H, gamma = 6, 10, 4, 0.5
    # synchronous reference by the matrix form: y = a + eta (theta' - a), z = W y,
    # theta = z + gamma (z - zprev), with fresh random 1-peer matchings
    rng = random.Random(11)
    thetas, ws = toy.workers(n)
    zprev = toy.theta0().repeat(n, 1)
    ref = []
    for _ in range(rounds):
        anchors = thetas.clone()
        for w in ws:
            w.inner(H)
        y = torch.lerp(anchors, thetas, ETA)
        z = mixing_matrix(n, random_matching(complete_edges(n), rng), 0.5) @ y
        thetas.copy_(torch.lerp(zprev, z, 1.0 + gamma))
        zprev = z
        ref.append(thetas.clone())
    # asynchronous nodes whose exchanges all happen right before synchronized round ends
    rng = random.Random(11)
    a_thetas, a_ws = toy.workers(n)
    cfg = AsyncConfig(eta=ETA, gamma=gamma, w=0.5, momentum="mixed")
    states = [AsyncGaslocState(a_thetas[i], toy.theta0(), cfg) for i in range(n)]
    for t in range(rounds):
        for w in a_ws:
            w.inner(H)
        for i, j in random_matching(complete_edges(n), rng):
            pair_exchange_(states[i], states[j], 0.5)
        for s in states:
            s.round_end()
        torch.testing.assert_close(a_thetas, ref[t], rtol=0, atol=1e-11)


@pytest.mark.parametrize("momentum", ["mixed", "local"])
def test_allreduce_equals_diloco_on_every_worker(momentum):
    GAMMA, run_diloco = toy.GAMMA, toy.run_diloco

    n, rounds, H = 4, 10, 5
    ref = run_diloco(n, rounds, H)
    thetas, ws = toy.workers(n)
    cfg = AsyncConfig(eta=ETA, gamma=GAMMA, w=0.5, momentum=momentum)
    states = [AsyncGaslocState(thetas[i], toy.theta0(), cfg) for i in range(n)]
    for t in range(rounds):
        for w in ws:
            w.inner(H)
        if momentum == "mixed":  # the paper's order: mix the proposals, then extrapolate
            allreduce_(states)
            for s in states:
                s.round_end()
        else:  # local momentum steps on own drift, then the exchange averages the results
            for s in states:
                s.round_end()
            allreduce_(states)
        for i in range(n):
            torch.testing.assert_close(thetas[i], ref[t], rtol=0, atol=1e-10)


def test_correction_moves_public_iterate_and_keeps_drift():
    theta = torch.arange(5.0, dtype=torch.float64)
    s = AsyncGaslocState(theta, torch.zeros(5, dtype=torch.float64), AsyncConfig(eta=0.7))
    theta.add_(1.0)  # inner steps
    assert s.anchor is not None  # eta < 1 reads it
    drift = s.theta - s.anchor
    p = s.public_iterate()
    c = torch.full((5,), 0.25, dtype=torch.float64)
    s.apply_correction(c)
    torch.testing.assert_close(s.theta - s.anchor, drift)
    torch.testing.assert_close(s.public_iterate(), p + c)


def test_local_round_end_by_hand():
    # a = 0, theta = -1 (drift d = a - theta = 1), gamma = 0.5, eta = 1:
    # round 1: m = 1, theta = 0 - (1 + 0.5) = -1.5; round 2 with d = 1 again: m = 1.5,
    # theta = -1.5 - (1 + 0.75) = -3.25.
    theta = torch.zeros(1, dtype=torch.float64)
    s = AsyncGaslocState(theta, theta.clone(), AsyncConfig(eta=1.0, gamma=0.5, momentum="local"))
    theta.sub_(1.0)
    s.round_end()
    assert theta.item() == -1.5 and s.anchor.item() == -1.5
    theta.sub_(1.0)
    s.round_end()
    assert theta.item() == -3.25 and s.rounds == 2


def test_stale_exchanges_are_downweighted():
    assert exchange_weight(0.5, 0) == exchange_weight(0.5, 1) == 0.5
    assert exchange_weight(0.5, 2) == 0.25
    assert exchange_weight(0.5, 3) == 0.5 / 3
    # the simulator's --max-staleness moves the allowance, the rule stays
    assert exchange_weight(0.5, 3, allowance=3) == 0.5
    assert exchange_weight(0.5, 5, allowance=3) == 0.5 / 3


def test_async_config_rejects_bad_values():
    for bad in [AsyncConfig(w=0.7), AsyncConfig(momentum="nesterov"), AsyncConfig(gamma=-0.1)]:
        with pytest.raises(ValueError):
            bad.validate()


def test_the_anchor_exists_only_where_it_is_read():
    theta = torch.ones(4)
    assert AsyncGaslocState(theta, theta, AsyncConfig()).anchor is None  # eta 1: p is theta
    assert AsyncGaslocState(theta, theta, AsyncConfig(gamma=0.5)).anchor is None  # mixed
    assert AsyncGaslocState(theta, theta, AsyncConfig(gamma=0.5, momentum="local")).anchor \
        is not None
    assert AsyncGaslocState(theta, theta, AsyncConfig(eta=0.7)).anchor is not None
    assert AsyncGaslocState(theta, theta, AsyncConfig(), keep_anchor=True).anchor is not None


@pytest.mark.parametrize("cfg", [AsyncConfig(), AsyncConfig(eta=0.7), AsyncConfig(gamma=0.5),
                                 AsyncConfig(eta=0.6, gamma=0.5, momentum="local")])
def test_host_chunks_give_the_one_pass_bits(cfg, monkeypatch):
    """Chunked round ends and corrections (what a GPU node runs, its outer state on the host)
    give the bits of one pass: chunks of 7 elements against the whole vector at once."""
    import gasloc_p2p.core.async_state as mod

    def run(chunk: int) -> list[torch.Tensor]:
        monkeypatch.setattr(mod, "TRANSFER_ELEMS", chunk)
        gen = torch.Generator().manual_seed(0)
        theta0 = torch.randn(50, generator=gen, dtype=torch.float64)
        s = AsyncGaslocState(theta0.clone(), theta0, cfg)
        for _ in range(3):
            s.theta.add_(torch.randn(50, generator=gen, dtype=torch.float64) * 0.1)
            s.apply_correction(torch.randn(50, generator=gen, dtype=torch.float64) * 0.01)
            s.round_end()
        return [t for t in (s.theta, s.anchor, *s.outer.state.values()) if t is not None]

    for a, b in zip(run(7), run(1 << 24), strict=True):
        assert torch.equal(a, b)
