"""Momentum ``acid`` (A2CiD2's continuous momentum on the node state, a simulator-only research
form): its parameters from the graph, the round end by hand, the invariants, and the
acceleration on a sparse graph through the real asynchronous driver."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.topology import acid_parameters
from gasloc_p2p.sim.acid import AcidState
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.run import run


def test_parameters_match_the_closed_forms_on_ring_and_complete_graph():
    # ring of n, edge rate c = p / 2 (1/2 + 1/2) = p / 2: lambda_2 = c (2 - 2 cos(2 pi / n)),
    # neighbours' effective resistance (n - 1) / (n c), chi2 half of it
    for n, p in ((16, 1.0), (32, 2.0)):
        c = p / 2
        chi1 = 1 / (c * (2 - 2 * math.cos(2 * math.pi / n)))
        chi2 = (n - 1) / (2 * n * c)
        rate, beta = acid_parameters("ring", n, p)
        assert rate == pytest.approx(1 / (2 * math.sqrt(chi1 * chi2)))
        assert beta == pytest.approx(0.5 * math.sqrt(chi1 / chi2))
    rate, beta = acid_parameters("complete", 8, 1.0)
    assert beta == pytest.approx(0.5)  # well connected: plain gossip
    assert acid_parameters("ring", 64, 1.0)[1] > acid_parameters("ring", 16, 1.0)[1] > 1.0
    with pytest.raises(ValueError):
        acid_parameters("ring", 1, 1.0)


def test_round_end_by_hand():
    # anchor 0, theta 2 after the inner steps, x~ = 1, eta = 1, rate r: x~ takes the step
    # (3), x = 2; k = (1 - e^-2r) / 2; x <- 2 + k (3 - 2), x~ <- 3 - k
    r = 0.4
    theta = torch.zeros(1, dtype=torch.float64)
    s = AcidState(theta, theta.clone(), AsyncConfig(eta=1.0, gamma=0.0), r, 0.5)
    s.xtilde.fill_(1.0)
    theta.add_(2.0)
    s.round_end()
    k = (1 - math.exp(-2 * r)) / 2
    assert theta.item() == pytest.approx(2 + k) and s.xtilde.item() == pytest.approx(3 - k)
    assert s.anchor.item() == theta.item()
    assert theta.item() + s.xtilde.item() == pytest.approx(5.0)  # mixing keeps x + x~


def _random_run(cfg: AsyncConfig, acid: tuple[float, float] | None = None, n: int = 6,
                rounds: int = 12, seed: int = 0) -> torch.Tensor:
    """Random drifts, pair exchanges (exact pair corrections) and round ends on ``n`` states
    (``acid``: A2CiD2's rate and beta); rows: theta, then x~ if any."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    theta0 = torch.randn(7, generator=gen, dtype=torch.float64)
    states = [AcidState(theta0.clone(), theta0, cfg, *acid) if acid is not None
              else AsyncGaslocState(theta0.clone(), theta0, cfg) for _ in range(n)]
    for _ in range(rounds):
        for s in states:
            s.theta.add_(torch.randn(7, generator=gen, dtype=torch.float64))
        for _ in range(n):
            i, j = rng.sample(range(n), 2)
            c = cfg.w * (states[j].public_iterate() - states[i].public_iterate())
            states[i].apply_correction(c)
            states[j].apply_correction(-c)
        for s in states:
            s.round_end()
    return torch.stack([torch.cat([s.theta, *([s.xtilde] if isinstance(s, AcidState) else [])])
                        for s in states])


def test_beta_one_half_is_plain_gossip_at_any_rate():
    plain = _random_run(AsyncConfig(eta=0.8, gamma=0.0, momentum="mixed"))
    acid = _random_run(AsyncConfig(eta=0.8, gamma=0.0), (0.7, 0.5))
    torch.testing.assert_close(acid[:, :7], plain[:, :7], rtol=0, atol=1e-12)
    torch.testing.assert_close(acid[:, 7:], acid[:, :7], rtol=0, atol=1e-12)  # x~ = x


def test_network_mean_of_x_plus_x_tilde_moves_only_by_the_drift():
    cfg = AsyncConfig(eta=1.0, gamma=0.0)
    gen = torch.Generator().manual_seed(1)
    starts = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    states = [AcidState(starts[i].clone(), starts[i], cfg, 0.3, 2.0) for i in range(5)]
    total = sum(s.theta + s.xtilde for s in states)
    rng = random.Random(1)
    for _ in range(30):
        i, j = rng.sample(range(5), 2)
        c = 0.5 * (states[j].theta - states[i].theta)
        states[i].apply_correction(c)
        states[j].apply_correction(-c)
        states[rng.randrange(5)].round_end()
    torch.testing.assert_close(sum(s.theta + s.xtilde for s in states), total)


def test_acid_needs_gamma_zero_and_sane_parameters():
    theta = torch.zeros(3)
    for cfg, rate, beta in ((AsyncConfig(gamma=0.5), 0.1, 0.5), (AsyncConfig(), -1.0, 0.5),
                            (AsyncConfig(), 0.1, 0.0)):
        with pytest.raises(ValueError, match="acid|gamma"):
            AcidState(theta, theta, cfg, rate, beta)
    with pytest.raises(ValueError, match="momentum"):
        AsyncConfig(momentum="acid").validate()  # not a node form


def _async_consensus(n: int, graph: str, momentum: str, rounds: int = 120) -> list[float]:
    cfg = SimConfig(task="consensus", mode="async", workers=n, graph=graph, H=1, steps=rounds,
                    eval_every=1, trace_batches=0, eval_workers=False, codec="none",
                    dtype="float64", eta=1.0, gamma=0.0, momentum=momentum,
                    participations_per_round=1.0, latency_s=0.0, bandwidth_mbps=1e6)
    res = run(cfg)
    assert max(p["mean_drift"] for p in res["history"]) < 1e-9  # the network mean is kept
    return [p["val_loss"] for p in res["history"]]


def test_async_consensus_toy_acid_accelerates_agreement_on_a_ring():
    plain, acid = _async_consensus(16, "ring", "mixed"), _async_consensus(16, "ring", "acid")
    assert plain[0] == acid[0] == 1.0
    assert plain[-1] < 0.05  # plain gossip converges, slowly
    assert acid[-1] < plain[-1] / 100  # A2CiD2: the sparse ring agrees much sooner


def test_quantized_exchanges_feed_x_tilde_through_the_protocol_engine():
    # int8 exchanges go through the daemon's engine (ProtocolExchanger): with beta = w the
    # run must equal plain gossip exactly, which holds only if the engine adds every
    # correction to x~ as well (otherwise the mixing would pull x back)
    base = SimConfig(task="consensus", mode="async", workers=6, graph="ring", H=1, steps=40,
                     eval_every=40, trace_batches=0, eval_workers=False, codec="int8",
                     eta=1.0, gamma=0.0, participations_per_round=1.0, seed=3)
    plain = run(base)["final"]["val_loss"]
    same = run(dataclasses.replace(base, momentum="acid", acid_rate=0.5, acid_beta=0.5))
    fast = run(dataclasses.replace(base, momentum="acid"))  # its graph's beta > 1/2
    assert same["final"]["val_loss"] == pytest.approx(plain, rel=1e-5)
    assert fast["final"]["val_loss"] != pytest.approx(plain, rel=1e-3)


def test_simulator_rejects_acid_where_it_does_not_apply():
    from gasloc_p2p.core.options import ConfigError

    ok = SimConfig(algorithm="gasloc", mode="async", momentum="acid", gamma=0.0)
    ok.validate()
    assert ok.acid() == acid_parameters("complete", ok.workers, 2 * ok.start_rate)
    for bad, match in ((dataclasses.replace(ok, gamma=0.5), "set --gamma 0"),
                       (dataclasses.replace(ok, mode="sync"), "async gasloc form"),
                       (dataclasses.replace(ok, acid_beta=0.0), "--acid-beta"),
                       (dataclasses.replace(ok, momentum="nesterov"), "--momentum must be")):
        with pytest.raises(ConfigError, match=match):
            bad.validate()
