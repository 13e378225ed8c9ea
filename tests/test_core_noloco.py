"""NoLoCo's outer step, pinned on a toy by hand and against its special cases."""

from __future__ import annotations

import pytest
import torch

from gasloc_p2p.core.noloco import NolocoConfig, NolocoOuter, exact_round_


def test_update_by_hand_two_rounds():
    """alpha 0.5, beta 0.8, gamma 0.25 on scalars: phi0 = (0, 0)."""
    outer = NolocoOuter(torch.zeros(1, dtype=torch.float64), 2,
                        NolocoConfig(alpha=0.5, beta=0.8, gamma=0.25))
    thetas = torch.tensor([[1.0], [3.0]], dtype=torch.float64)  # after the inner steps
    exact_round_(outer, thetas, [(0, 1)])
    # Delta = phi - theta' = (-1, -3), mean -2; phi gaps 0
    # delta = -0.8 * -2 = 1.6 on both; phi = 1.6 on both
    assert thetas.flatten().tolist() == pytest.approx([1.6, 1.6])
    thetas = torch.tensor([[2.6], [1.6]], dtype=torch.float64)
    # pretend the phis drifted apart (as they do with quantized or partial pulls)
    outer.phi[1] = 1.0
    exact_round_(outer, thetas, [(0, 1)])
    # Delta = (1.6-2.6, 1.0-1.6) = (-1, -0.6), mean -0.8; phi mean 1.3, gaps (0.3, -0.3)
    # delta_0 = 0.5*1.6 + 0.64 - 0.075 = 1.365; delta_1 = 0.8 + 0.64 + 0.075 = 1.515
    assert thetas.flatten().tolist() == pytest.approx([1.6 + 1.365, 1.0 + 1.515])
    assert outer.delta.flatten().tolist() == pytest.approx([1.365, 1.515])


def test_alpha0_beta1_gamma1_is_pairwise_averaging_of_trained_models():
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(7, generator=gen, dtype=torch.float64)
    outer = NolocoOuter(theta0, 4, NolocoConfig(alpha=0.0, beta=1.0, gamma=1.0))
    for _ in range(3):
        thetas = outer.phi + torch.randn(4, 7, generator=gen, dtype=torch.float64)
        expected = thetas.clone()
        expected[[0, 2]] = thetas[[0, 2]].mean(dim=0)
        expected[[1, 3]] = thetas[[1, 3]].mean(dim=0)
        exact_round_(outer, thetas, [(0, 2), (1, 3)])
        torch.testing.assert_close(thetas, expected, rtol=0, atol=1e-12)


def test_alone_replica_takes_a_plain_momentum_step():
    outer = NolocoOuter(torch.zeros(2, dtype=torch.float64), 3, NolocoConfig(0.5, 0.7, 0.5))
    thetas = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]], dtype=torch.float64)
    exact_round_(outer, thetas, [(0, 1)])
    torch.testing.assert_close(thetas[2], torch.tensor([1.4, 1.4], dtype=torch.float64))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="consensus"):
        NolocoConfig(gamma=1.5).validate()
    with pytest.raises(ValueError, match="momentum"):
        NolocoConfig(alpha=1.0).validate()
