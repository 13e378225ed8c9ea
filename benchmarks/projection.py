"""Timing projection past one machine: compute utilization and gossip rate at n = 64 or 256
(no tensors, no training; the timing rules of the simulator and the daemon).

A :class:`Profile` says how long an inner step takes, how many bytes one exchange or sync moves,
each node's link rate, the one-way latency, and how much node time one exchange's work takes
(encode, decode, guard, apply: measured on the daemon, see ``benchmarks/bench_projection.py``).
Three methods:

- **GASLoC** (:func:`gasloc`, event-driven): every node starts exchanges at exponential waiting
  times (``starts_per_round`` per own round) with a uniformly random peer; like the daemon it
  tries up to ``1 + busy_retries`` peers when one is busy. A node's link carries one exchange at
  a time (concurrent exchanges would share its rate: no more bytes per second either way); an
  exchange takes ``payload / min(link_i, link_j) + 2 latency`` and overlaps training, so the
  link never stalls compute; each participation costs ``work_s`` of the node's compute time.
  Reported: utilization (compute time / wall time) and participations per node per round
  (what consensus gets).
- **GASLoC paced** (:func:`gasloc_paced`): what ``--pacing compute`` converges to, the most
  starts per round (from ``starts_per_round`` down to ``min_starts_per_round``) that keep
  utilization at ``pacing_target``.
- **DiLoCo** (:func:`diloco`): every ``H`` steps all nodes stop at a barrier and all-reduce
  ``allreduce_payload`` bytes: hivemind's butterfly all-reduce sends and receives
  ``2 (n - 1) / n`` payloads per node, bound by the slowest link, plus two latencies; each
  sync also costs one ``work_s`` (encode, reduce, apply one payload).
- **Streaming DiLoCo** (:func:`streaming`): ``fragments`` fragments, each all-reduced once per
  ``H`` steps, overlapped with ``tau`` steps of compute; training stalls for what the overlap
  does not hide (lock-step, so the slowest link sets it); the fragments' work adds to one
  ``work_s`` per round.

Utilization is the share of wall time spent computing. These are models of the timing only:
loss is not projected.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    """Timing of one setting; rates in bytes/s, times in seconds."""

    nodes: int
    step_s: float  # one inner step
    inner_steps: int  # H
    payload_bytes: float  # one gossip exchange, each way
    allreduce_bytes: float  # the vector a DiLoCo sync all-reduces
    link_bps: tuple[float, ...]  # per node (bytes/s), both directions
    latency_s: float = 0.02
    work_s: float = 0.0  # node time one exchange's work takes from training
    starts_per_round: float = 2.0  # exchanges a node starts per round (the daemon's default)
    busy_retries: int = 3
    fragments: int = 4  # Streaming DiLoCo
    tau: int = 5  # Streaming DiLoCo's overlap, steps
    pacing_target: float = 0.95  # GASLoC paced (the daemon's --pacing-target)
    min_starts_per_round: float = 0.5  # GASLoC paced (the daemon's --pacing-min-rate)

    def __post_init__(self) -> None:
        if len(self.link_bps) != self.nodes or self.nodes < 2:
            raise ValueError("need one link rate per node and at least 2 nodes")
        if min(self.link_bps) <= 0 or self.step_s <= 0 or self.inner_steps < 1:
            raise ValueError("link rates, step time and H must be positive")

    @property
    def round_s(self) -> float:
        return self.step_s * self.inner_steps

    def with_links(self, link_bps: tuple[float, ...]) -> Profile:
        return replace(self, link_bps=link_bps)


@dataclass(frozen=True)
class Projection:
    method: str
    utilization: float  # mean over nodes of compute time / wall time
    participations_per_round: float  # gossip: mean exchanges per node per own round
    exchange_s: float  # mean wall time of one exchange or sync


def diloco(p: Profile) -> Projection:
    sync = _allreduce_s(p, p.allreduce_bytes)
    return Projection("diloco", p.round_s / (p.round_s + sync + p.work_s), 0.0, sync)


def streaming(p: Profile) -> Projection:
    sync = _allreduce_s(p, p.allreduce_bytes / p.fragments)
    stall = max(0.0, sync - p.tau * p.step_s)
    return Projection("streaming-diloco",
                      p.round_s / (p.round_s + p.fragments * stall + p.work_s), 0.0, sync)


def _allreduce_s(p: Profile, nbytes: float) -> float:
    n = p.nodes
    return 2 * (n - 1) / n * nbytes / min(p.link_bps) + 2 * p.latency_s


def gasloc(p: Profile, rounds: int = 40, seed: int = 0) -> Projection:
    """Event-driven: ``rounds`` rounds of every node (after 5 rounds of warm-up)."""
    rng = random.Random(seed)
    n, warm = p.nodes, 5
    horizon = (rounds + warm) * p.round_s
    start_rate = p.starts_per_round / p.round_s  # per second of wall time, while computing
    busy_until = [0.0] * n
    work = [0.0] * n  # exchange work each node did (time taken from training)
    joined = [0] * n
    durations: list[float] = []
    events = [(rng.expovariate(start_rate), i) for i in range(n)] if start_rate > 0 else []
    heapq.heapify(events)
    while events:
        t, i = heapq.heappop(events)
        if t > horizon:
            break
        heapq.heappush(events, (t + rng.expovariate(start_rate), i))
        if busy_until[i] > t:
            continue  # its link is still carrying an exchange
        for _ in range(p.busy_retries + 1):
            j = rng.randrange(n - 1)
            j += j >= i
            if busy_until[j] <= t:
                break
        else:
            continue
        took = p.payload_bytes / min(p.link_bps[i], p.link_bps[j]) + 2 * p.latency_s
        busy_until[i] = busy_until[j] = t + took
        if t >= warm * p.round_s:
            durations.append(took)
            for k in (i, j):
                joined[k] += 1
                work[k] += p.work_s
    span = rounds * p.round_s
    util = sum(span / (span + w) for w in work) / n
    # a node with exchange work does fewer rounds in the span: participations per own round
    per_round = sum(c / (rounds * (span / (span + w))) for c, w in zip(joined, work,
                                                                       strict=True)) / n
    return Projection("gasloc", util, per_round,
                      sum(durations) / len(durations) if durations else float("nan"))


def gasloc_paced(p: Profile, step: float = 0.1) -> Projection:
    """The most starts per round, in ``step`` decrements from ``starts_per_round`` down to
    ``min_starts_per_round``, whose utilization reaches ``pacing_target`` (the floor if none
    does: the daemon never paces below it)."""
    rate = p.starts_per_round
    while True:
        q = gasloc(replace(p, starts_per_round=rate))
        if q.utilization >= p.pacing_target or rate <= p.min_starts_per_round + 1e-9:
            return replace(q, method="gasloc-paced")
        rate = max(p.min_starts_per_round, rate - step)


def min_link_for(method: str, p: Profile, utilization: float, min_participations: float = 1.0,
                 lo: float = 1e3, hi: float = 1e12) -> float | None:
    """The smallest uniform link rate (bytes/s) at which ``method`` reaches ``utilization``
    (GASLoC: and at least ``min_participations`` per node per round); None if none does."""
    def ok(bps: float) -> bool:
        q = project(method, p.with_links((bps,) * p.nodes))
        return q.utilization >= utilization and (
            not method.startswith("gasloc") or q.participations_per_round >= min_participations)

    if not ok(hi):
        return None
    for _ in range(60):  # bisection in log space
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        if hi / lo < 1.01:
            break
    return hi


def project(method: str, p: Profile) -> Projection:
    if method == "gasloc":
        return gasloc(p)
    if method == "gasloc-paced":
        return gasloc_paced(p)
    if method == "diloco":
        return diloco(p)
    if method == "streaming-diloco":
        return streaming(p)
    raise ValueError(f"unknown method {method!r}: gasloc | gasloc-paced | diloco | streaming-diloco")
