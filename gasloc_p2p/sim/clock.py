"""Simulated time and bytes: what every driver advances, and the timing model it uses.

A pairwise exchange takes ``bytes / min(bw_i, bw_j) + latency``; a ring all-reduce takes
``2 (n-1)/n * bytes / min(bw) + 2 (n-1) * latency`` (it waits for the slowest link), a ring
all-gather of per-worker messages ``(n-1) (bytes / min(bw) + latency)``; a round of
compute takes the slowest worker's ``steps * step_time_s * compute_factor``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gasloc_p2p.sim.workers import SimWorkers

Record = Callable[[float], None]  # called with the simulated time after each round


class Clock:
    """Simulated seconds and bytes sent per worker."""

    def __init__(self, n: int) -> None:
        self.now = 0.0
        self.bytes_sent = [0] * n


def allreduce_seconds(sim: SimWorkers, nbytes: int) -> float:
    cfg, n = sim.cfg, sim.cfg.workers
    if n == 1:
        return 0.0
    slowest = min(cfg.bandwidth_bytes_s(i) for i in range(n))
    return 2 * (n - 1) / n * nbytes / slowest + 2 * (n - 1) * cfg.latency_s


def allgather_seconds(sim: SimWorkers, nbytes: int) -> float:
    """A ring all-gather of one ``nbytes`` message per worker: ``n - 1`` transfers of a
    message on every link, waiting for the slowest."""
    cfg, n = sim.cfg, sim.cfg.workers
    if n == 1:
        return 0.0
    slowest = min(cfg.bandwidth_bytes_s(i) for i in range(n))
    return (n - 1) * (nbytes / slowest + cfg.latency_s)


def compute_seconds(sim: SimWorkers, steps: list[int]) -> float:
    cfg = sim.cfg
    return max(s * cfg.step_time_s * cfg.compute_factor(i) for i, s in enumerate(steps))
