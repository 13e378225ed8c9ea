"""GASLoC synchronous rounds: the invariants of ALGORITHM.md section 1, in float64."""

from __future__ import annotations

import random

import pytest
import torch
from gasloc_p2p.core.gasloc import OuterConfig, SyncGasloc, mix, mix_pair_

from gasloc_p2p.core.diloco import NesterovOuter, outer_gradient
from gasloc_p2p.core.topology import complete_edges, mixing_matrix, random_matching, ring_edges
from tests import toy

ETA, GAMMA = toy.ETA, toy.GAMMA
run_diloco = toy.run_diloco


def run_gasloc(n: int, rounds: int, H: int, variant: str, seed: int = 0) -> list[torch.Tensor]:
    thetas, ws = toy.workers(n, seed)
    state = SyncGasloc(toy.theta0(seed), n, OuterConfig(eta=ETA, gamma=GAMMA, variant=variant))
    W = mixing_matrix(n, complete_edges(n), 1.0 / n)
    history = []
    for _ in range(rounds):
        anchors = thetas.clone()
        for w in ws:
            w.inner(H)
        state.outer_step(anchors, thetas, W)
        history.append(thetas.clone())
    return history


def test_mixed_complete_graph_equals_nesterov_diloco_on_every_worker():
    n, rounds = 4, 12
    ref = run_diloco(n, rounds, H=5)
    got = run_gasloc(n, rounds, H=5, variant="mixed")
    for t in range(rounds):
        for i in range(n):
            torch.testing.assert_close(got[t][i], ref[t], rtol=0, atol=1e-10)
    assert (ref[-1] - ref[0]).norm() > 1e-2  # the run moved: the comparison is not vacuous


def test_unmixed_matches_diloco_mean_with_prescribed_drifts_only():
    n, rounds, numel = 4, 10, 7
    gen = torch.Generator().manual_seed(3)
    theta0 = torch.randn(numel, dtype=torch.float64, generator=gen)
    drifts = [torch.randn(n, numel, dtype=torch.float64, generator=gen) * 0.1 for _ in range(rounds)]
    W = mixing_matrix(n, complete_edges(n), 1.0 / n)
    state = SyncGasloc(theta0, n, OuterConfig(eta=ETA, gamma=GAMMA, variant="unmixed"))
    thetas = theta0.repeat(n, 1)
    global_p = theta0.clone()
    outer = NesterovOuter(numel, ETA, GAMMA, torch.float64)
    for t in range(rounds):
        anchors = thetas.clone()
        thetas += drifts[t]
        state.outer_step(anchors, thetas, W)
        outer.step_(global_p, outer_gradient(global_p, global_p + drifts[t]))
        torch.testing.assert_close(thetas.mean(dim=0), global_p, rtol=0, atol=1e-10)
    # With real training the unmixed workers' drifts differ from DiLoCo's and so do the models.
    ref = run_diloco(n, rounds, H=5)
    got = run_gasloc(n, rounds, H=5, variant="unmixed")
    assert (got[-1].mean(dim=0) - ref[-1]).abs().max() > 1e-6


def test_nesterov_outer_matches_torch_sgd():
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64, generator=gen))
    mine = p.detach().clone()
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    outer = NesterovOuter(5, 0.7, 0.9, torch.float64)
    for _ in range(6):
        g = torch.randn(5, dtype=torch.float64, generator=gen)
        p.grad = g.clone()
        sgd.step()
        outer.step_(mine, g)
    torch.testing.assert_close(mine, p.detach(), rtol=0, atol=1e-14)


def test_pair_mixing_preserves_pair_sum_and_network_mean():
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(8, 1000, dtype=torch.float64, generator=gen)
    before = y[2] + y[5]
    mix_pair_(y[2], y[5], 0.5)
    torch.testing.assert_close(y[2] + y[5], before, rtol=0, atol=1e-13)
    torch.testing.assert_close(y[2], y[5])  # w = 1/2 is the exact pair average
    pairs = random_matching(ring_edges(8), random.Random(0))
    z = mix(y, mixing_matrix(8, pairs, 0.3))
    torch.testing.assert_close(z.mean(dim=0), y.mean(dim=0), rtol=0, atol=1e-13)
    assert (z - y).abs().max() > 1e-3


def test_gamma0_eta1_H1_sgd_is_gossip_sgd():
    n, rounds, lr = 6, 15, 0.05
    rng_a, rng_b = random.Random(5), random.Random(5)
    thetas, ws = toy.workers(n, sgd_lr=lr)
    state = SyncGasloc(toy.theta0(), n, OuterConfig(eta=1.0, gamma=0.0))
    ref_thetas, ref_ws = toy.workers(n, sgd_lr=lr)
    for _ in range(rounds):
        anchors = thetas.clone()
        for w in ws:
            w.inner(1)
        state.outer_step(anchors, thetas, mixing_matrix(n, random_matching(ring_edges(n), rng_a), 0.5))
        # D-PSGD by hand: one SGD step each, then average with the matched partner
        for w in ref_ws:
            w.inner(1)
        for i, j in random_matching(ring_edges(n), rng_b):
            avg = (ref_thetas[i] + ref_thetas[j]) / 2
            ref_thetas[i] = avg
            ref_thetas[j] = avg
    torch.testing.assert_close(thetas, ref_thetas, rtol=0, atol=1e-12)


@pytest.mark.parametrize("variant", ["mixed", "unmixed"])
def test_momentum_memory_starts_at_theta0(variant):
    # gamma > 0 on round one extrapolates from theta_0: a wrong initial memory changes theta.
    n = 2
    theta0 = torch.zeros(3, dtype=torch.float64)
    state = SyncGasloc(theta0, n, OuterConfig(eta=1.0, gamma=0.5, variant=variant))
    thetas = torch.ones(n, 3, dtype=torch.float64)
    state.outer_step(torch.zeros(n, 3, dtype=torch.float64), thetas, torch.eye(n, dtype=torch.float64))
    torch.testing.assert_close(thetas, torch.full((n, 3), 1.5, dtype=torch.float64))


def test_outer_config_rejects_bad_values():
    for bad in [OuterConfig(eta=0), OuterConfig(gamma=1.0), OuterConfig(variant="both")]:
        with pytest.raises(ValueError):
            bad.validate()


@pytest.mark.parametrize(
    ("variant", "after_round1", "after_round2"),
    [("mixed", [3.0, 3.0], [3.5, 3.5]), ("unmixed", [2.5, 3.5], [4.25, 2.75])],
)
def test_variants_by_hand(variant, after_round1, after_round2):
    # Two workers, exact pair average, eta = 1, gamma = 1/2; values computed on paper.
    state = SyncGasloc(torch.zeros(1), 2, OuterConfig(eta=1.0, gamma=0.5, variant=variant))
    W = mixing_matrix(2, [(0, 1)], 0.5)
    thetas = torch.tensor([[1.0], [3.0]])
    state.outer_step(torch.zeros(2, 1), thetas, W)
    assert thetas.flatten().tolist() == after_round1
    anchors = thetas.clone()
    thetas += torch.tensor([[1.0], [-1.0]])
    state.outer_step(anchors, thetas, W)
    assert thetas.flatten().tolist() == after_round2


def test_momentum_warmup_ramps_gamma_linearly_then_holds():
    cfg = OuterConfig(eta=0.5, gamma=0.9, warmup_rounds=3)
    assert [cfg.gamma_at(t) for t in range(5)] == pytest.approx([0.0, 0.3, 0.6, 0.9, 0.9])
    assert OuterConfig(gamma=0.9).gamma_at(0) == 0.9  # off by default
    with pytest.raises(ValueError, match="warmup_rounds"):
        OuterConfig(warmup_rounds=-1).validate()


def test_warmup_round_steps_use_the_ramped_momentum():
    n, numel = 3, 5
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(numel, dtype=torch.float64, generator=gen)
    plain = SyncGasloc(theta0, n, OuterConfig(eta=1.0, gamma=0.6))
    ramped = SyncGasloc(theta0, n, OuterConfig(eta=1.0, gamma=0.6, warmup_rounds=2))
    W = mixing_matrix(n, ring_edges(n), 0.3)
    for t, gamma in enumerate((0.0, 0.3, 0.6)):
        y = theta0 + torch.randn(n, numel, dtype=torch.float64, generator=gen)
        z = mix(y, W)
        expected = z + gamma * (z - ramped.memory)
        got = ramped.accelerate(y, z, torch.empty_like(y))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        full = plain.accelerate(y, z, torch.empty_like(y))
        assert (t == 2) == bool(torch.allclose(full - z, got - z)), t


def test_memory_can_start_at_each_workers_own_point():
    start = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    state = SyncGasloc(start, 2, OuterConfig(eta=1.0, gamma=0.5))
    z = start.clone()
    out = state.accelerate(start, z, torch.empty_like(z))
    torch.testing.assert_close(out, start)  # no jump on round 0: z equals the memory
    with pytest.raises(ValueError, match="rows"):
        SyncGasloc(start, 3, OuterConfig())
