"""Graphs, matchings, spectral gaps, fragments, and the consensus acceleration of momentum."""

from __future__ import annotations

import random

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.flat import Fragment, Span, layer_fragments
from gasloc_p2p.core.topology import (
    expected_spectral_gap,
    graph_edges,
    laplacian,
    mixing_matrix,
    round_edges,
    spectral_gap,
)


def test_graph_sizes():
    assert len(graph_edges("ring", 16)) == 16
    assert len(graph_edges("complete", 16)) == 120
    assert len(graph_edges("exponential", 16)) == 16 * 4 - 8  # k=8 links i and i+8 once
    assert graph_edges("ring", 2) == [(0, 1)]
    with pytest.raises(ValueError, match="choose one of"):
        graph_edges("torus", 4)


@pytest.mark.parametrize("matching", ["1-peer", "2-peer"])
def test_matchings_respect_degree_and_graph(matching):
    rng = random.Random(0)
    edges = graph_edges("ring", 12)
    for _ in range(50):
        chosen = round_edges(edges, matching, rng)
        degree = [0] * 12
        for i, j in chosen:
            assert (i, j) in edges
            degree[i] += 1
            degree[j] += 1
        assert max(degree) <= (1 if matching == "1-peer" else 2)
        assert len(chosen) >= 4  # maximal matching on a 12-ring has at least 4 edges


def test_laplacian_and_mixing_are_doubly_stochastic():
    edges = graph_edges("exponential", 8)
    lap = laplacian(8, edges)
    assert torch.equal(lap.sum(dim=1), torch.zeros(8, dtype=lap.dtype))
    W = mixing_matrix(8, edges, 0.2)
    torch.testing.assert_close(W.sum(dim=0), torch.ones(8, dtype=W.dtype))
    torch.testing.assert_close(W, W.T)
    with pytest.raises(ValueError, match="too large"):
        mixing_matrix(8, edges, 0.5)


def test_spectral_gap_orders_graphs():
    n = 16
    gaps = {g: expected_spectral_gap(g, n, "1-peer", 0.5) for g in ("ring", "exponential", "complete")}
    assert gaps["ring"] < gaps["exponential"] < gaps["complete"]
    assert spectral_gap(mixing_matrix(n, graph_edges("complete", n), 1 / n)) == pytest.approx(1.0)


def rounds_to_consensus(gamma: float, n: int = 16, factor: float = 1e-3, seed: int = 0) -> int:
    """Pure consensus (no gradients): random pair averaging on ring edges + momentum."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, dtype=torch.float64, generator=gen)
    cfg = AsyncConfig(eta=1.0, gamma=gamma)
    states = [AsyncGaslocState(x[i], x[i], cfg) for i in range(n)]  # memory at the own point
    rng = random.Random(seed)
    edges = graph_edges("ring", n)
    start = (x - x.mean(dim=0)).norm()
    for t in range(1, 2000):
        snaps = [s.public_iterate() for s in states]
        for i, j in round_edges(edges, "1-peer", rng):
            c = (snaps[j] - snaps[i]) * 0.5
            states[i].apply_correction(c)
            states[j].apply_correction(-c)
        for s in states:
            s.round_end()
        if (x - x.mean(dim=0)).norm() < factor * start:
            return t
    return 2000


def test_momentum_accelerates_consensus_on_ring():
    plain = [rounds_to_consensus(0.0, seed=s) for s in range(3)]
    accel = [rounds_to_consensus(0.7, seed=s) for s in range(3)]
    # Measured here with random maximal matchings: about 180 vs 110 rounds (the prototype's toy,
    # 165 vs 58, evidently drew perfect matchings: those give about 155 vs 65 here).
    assert sum(accel) < 0.7 * sum(plain), (plain, accel)


def test_strided_and_sequential_fragments():
    spans = [Span("emb", 0, 10, (10,))]
    spans += [Span(f"blocks.{layer}.w", 10 + 5 * layer, 5, (5,)) for layer in range(4)]
    spans.append(Span("ln_f", 30, 2, (2,)))

    def layer_of(name: str) -> int | None:
        return int(name.split(".")[1]) if name.startswith("blocks.") else None

    strided = layer_fragments(spans, layer_of, 2, "strided")
    assert [f.ranges for f in strided] == [((10, 5), (20, 5)), ((15, 5), (25, 5)), ((0, 10), (30, 2))]
    sequential = layer_fragments(spans, layer_of, 2, "sequential")
    assert [f.ranges for f in sequential] == [((10, 10),), ((20, 10),), ((0, 10), (30, 2))]
    assert sum(f.numel for f in strided) == 32
    with pytest.raises(ValueError, match="only 4 layers"):
        layer_fragments(spans, layer_of, 5)


def test_fragment_gather_and_add():
    buf = torch.arange(10.0)
    frag = Fragment(0, [(7, 2), (1, 3), (4, 2)])  # merges (1,3)+(4,2) into (1,5)
    assert frag.ranges == ((1, 5), (7, 2))
    assert frag.gather(buf).tolist() == [1, 2, 3, 4, 5, 7, 8]
    frag.add_(buf, torch.ones(7), alpha=2.0)
    assert buf.tolist() == [0, 3, 4, 5, 6, 7, 6, 9, 10, 9]
    with pytest.raises(ValueError, match="overlap"):
        Fragment(1, [(0, 3), (2, 3)])
