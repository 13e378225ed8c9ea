"""The pure-consensus toy (docs/algorithm.md section 1): the real GASLoC drivers with no training.

Each worker starts at its own random point in ``R^DIM`` (standard normal, seeded) and takes no
gradient steps: its "inner phase" leaves its parameters unchanged, so the drift is zero and
``eta`` has nothing to scale. Only the driver's gossip (the same matchings, exchanger and
weights as a training run) and the outer momentum act, so the consensus distance
``mean_i ||x_i - mean(x)||^2`` shows how fast a configuration reaches agreement: the effect
the momentum is claimed to accelerate on sparse graphs. The momentum memory starts at each
worker's own point (as it starts at ``theta_0`` when training), so round 0 takes no jump.
The sync driver runs it (``--mode sync``), and so does the asynchronous one (``--mode async``,
the daemon's node state and exchange events; ``--H 1`` makes each "step" a round), which is
where momentum ``acid`` (A2CiD2) lives.
"""

from __future__ import annotations

from typing import cast

import torch

from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.workers import SimWorkers, Worker

DIM = 512  # coordinates per worker; every coordinate follows the same linear dynamics


class _Counter:
    """A worker without a model: its index and the steps it took."""

    def __init__(self, index: int) -> None:
        self.index, self.steps = index, 0


class ConsensusWorkers(SimWorkers):
    """Stand-in for :class:`SimWorkers` with parameters only: what the sync driver touches
    (``cfg``, ``theta0``, ``thetas``, the step budget) and a consensus "evaluation"."""

    def __init__(self, cfg: SimConfig) -> None:  # no model, data or optimizer to build
        self.cfg = cfg
        dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
        gen = torch.Generator().manual_seed(cfg.seed)
        self.thetas = torch.randn(cfg.workers, DIM, generator=gen, dtype=torch.float64).to(dtype)
        self.theta0 = self.thetas.mean(dim=0)  # the exchanger's starting references
        self.counts = [0] * cfg.workers
        # what the async driver reads of a worker: its index and step count
        self.workers = cast("list[Worker]", [_Counter(i) for i in range(cfg.workers)])
        self.start = self._distance()

    @property
    def tokens_per_step(self) -> int:
        return 0

    def inner_step(self, i: int) -> float:
        """No gradient: the step only counts toward the budget (one step is one round)."""
        self.counts[i] += 1
        self.workers[i].steps += 1
        return 0.0

    def mean_steps(self) -> float:
        return sum(self.counts) / self.cfg.workers

    def finished(self) -> bool:
        return min(self.counts) >= self.cfg.steps

    def round_steps(self) -> list[int]:
        return [min(self.cfg.h_of(i), self.cfg.steps - c) for i, c in enumerate(self.counts)]

    def _distance(self) -> float:
        return float(((self.thetas - self.thetas.mean(dim=0)) ** 2).sum(dim=1).mean())

    def trace_loss(self) -> float:
        return self._distance() / self.start

    def consensus(self) -> float:
        return self._distance()

    def evaluate(self) -> dict[str, float]:
        """``val_loss``: consensus distance relative to the start (the toy's objective);
        ``consensus``: the distance itself; ``mean_drift``: how far the network mean moved
        (zero up to rounding: mixing and momentum keep it)."""
        rel = self._distance() / self.start
        drift = float((self.thetas.mean(dim=0) - self.theta0).abs().max())
        return {"val_loss": rel, "worst_val_loss": rel, "consensus": self._distance(),
                "mean_drift": drift}
