"""Communication graphs, gossip matchings and their spectral properties.

A graph is a list of undirected edges ``(i, j)`` with ``i < j`` over ``n`` workers. Each gossip
round uses either every edge of the graph ("all") or a random matching drawn from its edges
("1-peer": each worker has at most one partner; "2-peer": the union of two random matchings).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

Edge = tuple[int, int]
GRAPHS = ("ring", "exponential", "complete")
MATCHINGS = ("1-peer", "2-peer", "all")


def ring_edges(n: int) -> list[Edge]:
    if n < 2:
        return []
    if n == 2:
        return [(0, 1)]
    return sorted({_edge(i, (i + 1) % n) for i in range(n)})


def exponential_edges(n: int) -> list[Edge]:
    """Worker ``i`` links to ``i + 2^k mod n`` for every ``2^k < n`` (undirected)."""
    edges: set[Edge] = set()
    k = 1
    while k < n:
        edges.update(_edge(i, (i + k) % n) for i in range(n) if (i + k) % n != i)
        k *= 2
    return sorted(edges)


def complete_edges(n: int) -> list[Edge]:
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


def graph_edges(graph: str, n: int) -> list[Edge]:
    """Edges of a named graph; ValueError listing the valid names otherwise."""
    builders = {"ring": ring_edges, "exponential": exponential_edges, "complete": complete_edges}
    if graph not in builders:
        raise ValueError(f"unknown graph {graph!r}; choose one of {', '.join(GRAPHS)}")
    if n < 1:
        raise ValueError(f"need at least one worker, got n={n}")
    return builders[graph](n)


def random_matching(edges: Sequence[Edge], rng: random.Random) -> list[Edge]:
    """A random maximal matching: shuffled edges taken greedily when both ends are free."""
    order = list(edges)
    rng.shuffle(order)
    used: set[int] = set()
    chosen: list[Edge] = []
    for i, j in order:
        if i not in used and j not in used:
            used.update((i, j))
            chosen.append((i, j))
    return sorted(chosen)


def round_edges(edges: Sequence[Edge], matching: str, rng: random.Random) -> list[Edge]:
    """The edges that communicate in one round under the given matching mode."""
    if matching == "all":
        return list(edges)
    if matching == "1-peer":
        return random_matching(edges, rng)
    if matching == "2-peer":
        first = random_matching(edges, rng)
        second = random_matching([e for e in edges if e not in set(first)], rng)
        return sorted(set(first) | set(second))
    raise ValueError(f"unknown matching {matching!r}; choose one of {', '.join(MATCHINGS)}")


def laplacian(n: int, edges: Sequence[Edge], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Graph Laplacian ``L = D - A`` as a dense ``[n, n]`` tensor."""
    lap = torch.zeros(n, n, dtype=dtype)
    for i, j in edges:
        lap[i, j] -= 1
        lap[j, i] -= 1
        lap[i, i] += 1
        lap[j, j] += 1
    return lap


def mixing_matrix(
    n: int, edges: Sequence[Edge], w: float, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``W = I - w L``: symmetric and doubly stochastic, so ``W @ Y`` keeps the mean of ``Y``.

    Row ``i`` of ``W @ Y`` is ``y_i - sum_{j ~ i} w (y_i - y_j)``. Non-negative entries need
    ``w * max_degree <= 1``.
    """
    degree = [0] * n
    for i, j in edges:
        degree[i] += 1
        degree[j] += 1
    if edges and w * max(degree) > 1 + 1e-12:
        raise ValueError(f"w={w} too large for max degree {max(degree)}: need w*degree <= 1")
    return torch.eye(n, dtype=dtype) - w * laplacian(n, edges, dtype)


def spectral_gap(mixing: torch.Tensor) -> float:
    """``1 - |lambda_2|`` of a symmetric mixing matrix (second largest eigenvalue modulus)."""
    eig = torch.linalg.eigvalsh(mixing.to(torch.float64)).abs().sort(descending=True).values
    return float(1.0 - eig[1]) if eig.numel() > 1 else 1.0


def expected_spectral_gap(
    graph: str, n: int, matching: str, w: float, samples: int = 64, seed: int = 0
) -> float:
    """Spectral gap of the expected mixing matrix ``E[W]`` of a random-matching schedule."""
    rng = random.Random(seed)
    edges = graph_edges(graph, n)
    draws = 1 if matching == "all" else samples
    total = torch.zeros(n, n, dtype=torch.float64)
    for _ in range(draws):
        total += mixing_matrix(n, round_edges(edges, matching, rng), w)
    return spectral_gap(total / draws)


def default_weight(graph: str, n: int, matching: str) -> float:
    """Gossip weight: 1/2 (exact pair average) for matchings, 1/n for complete "all" (exact
    network average), ``1 / (max_degree + 1)`` for other fixed graphs."""
    if matching != "all":
        return 0.5
    if graph == "complete":
        return 1.0 / n
    edges = graph_edges(graph, n)
    degree = [0] * n
    for i, j in edges:
        degree[i] += 1
        degree[j] += 1
    return 1.0 / (max(degree, default=0) + 1)


def acid_parameters(graph: str, n: int, participations_per_round: float) -> tuple[float, float]:
    """A2CiD2's mixing rate and gossip step, ``(eta, alpha~)`` with rounds as the time unit,
    for asynchronous pair gossip on ``graph`` where each node takes part in
    ``participations_per_round`` exchanges per round with a uniformly drawn neighbour.

    The edge ``(i, j)`` fires at rate ``p / 2 (1 / d_i + 1 / d_j)`` (each side starts half
    of its exchanges); with the rate-weighted Laplacian ``L``: ``chi1 = 1 / lambda_2(L)``,
    ``chi2 = max`` over edges of ``1/2 (e_i - e_j)^T L^+ (e_i - e_j)``,
    ``eta = 1 / (2 sqrt(chi1 chi2))`` and ``alpha~ = sqrt(chi1 / chi2) / 2``
    (Nabli et al. 2023, section 3). On the complete graph ``chi1 = chi2`` and ``alpha~`` is
    1/2: plain gossip.
    """
    if n < 2 or participations_per_round <= 0:
        raise ValueError("need n >= 2 and a positive participation rate")
    edges = graph_edges(graph, n)
    degree = [0] * n
    for i, j in edges:
        degree[i] += 1
        degree[j] += 1
    lap = torch.zeros(n, n, dtype=torch.float64)
    for i, j in edges:
        rate = participations_per_round / 2 * (1 / degree[i] + 1 / degree[j])
        lap[i, j] -= rate
        lap[j, i] -= rate
        lap[i, i] += rate
        lap[j, j] += rate
    eig = torch.linalg.eigvalsh(lap)
    chi1 = 1.0 / float(eig[1])
    pinv = torch.linalg.pinv(lap, hermitian=True)
    chi2 = max(0.5 * float(pinv[i, i] + pinv[j, j] - 2 * pinv[i, j]) for i, j in edges)
    return 1.0 / (2.0 * math.sqrt(chi1 * chi2)), 0.5 * math.sqrt(chi1 / chi2)


def _edge(i: int, j: int) -> Edge:
    return (i, j) if i < j else (j, i)

