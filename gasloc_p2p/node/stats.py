"""Counters of one node, written from the event loop (exchanges) or the trainer thread (steps).

Plain attributes: each is written by one thread only and read for logs and ``Info``; reads may
be a moment stale, which is all a progress line needs. The shared types of the node's rooms:
runtime, transport, modes and observability all read them, none of them is imported here.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field

# Bucket upper bounds of the exchange-duration histogram, seconds (loopback int8 exchanges of
# a small model take tens of milliseconds; a 100 MB model over a slow link takes minutes).
log = logging.getLogger(__name__)
MAX_PARTNERS = 4096  # distinct exchange partners remembered (bounded memory)
DURATION_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_CONSENSUS_EMA = 0.8  # weight of the previous estimate in gasloc_consensus_estimate


@dataclass
class Buckets:
    """A plain histogram (no Prometheus dependency): per-bucket counts plus the sum.

    ``counts[i]`` counts observations in ``(bounds[i-1], bounds[i]]``; the last entry counts
    those above every bound (the +Inf bucket). Written by one thread, read at scrape time.
    """

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[index] += 1
        self.total += value


@dataclass
class ExchangeStats:
    """Gossip outcomes; bytes count payload bytes (Chunk data) only."""

    ok_initiator: int = 0
    ok_responder: int = 0
    failed: int = 0
    busy: int = 0  # our attempts answered BUSY (not failures)
    rejected_inbound: int = 0  # inbound exchanges we refused (BUSY or incompatible)
    uplink_busy: int = 0  # ... of those, BUSY because our uplink carried all it could in time
    uplink_waits: int = 0  # our gossip events skipped for the same reason
    uplink_slots: int = 0  # exchanges at once the measured uplink allows (0: not measured)
    implausible: int = 0  # exchanges aborted by the bounded-update guard (either side)
    clipped: int = 0  # exchanges this node committed with a clipped weight (its guard)
    bytes_sent: int = 0
    bytes_received: int = 0
    staleness: Counter[int] = field(default_factory=Counter)  # round ends spanned -> count
    failures: Counter[str] = field(default_factory=Counter)  # reason -> count
    last_correction_norm: float = 0.0
    applied: int = 0  # committed with weight > 0 (either role)
    sent_by_codec: Counter[str] = field(default_factory=Counter)  # codec -> payload bytes
    received_by_codec: Counter[str] = field(default_factory=Counter)
    duration_s: Buckets = field(default_factory=lambda: Buckets(DURATION_BUCKETS_S))
    # EMA over commits of ||p_i - p_j||^2 / fragment numel (see record_commit); NaN before one
    consensus: float = math.nan
    work_active: int = 0  # exchange work sections (check/prepare/commit) running now
    work_started: int = 0  # ... started so far (the trainer reads both: quiet steps)
    utilization: float = math.nan  # quiet step time / mean step time (see Utilization)
    by_path: Counter[str] = field(default_factory=Counter)  # initiated commits: direct/...
    path_seconds: dict[str, float] = field(default_factory=dict)  # ... their wall time, summed
    partners: dict[str, None] = field(default_factory=dict)  # committed with (either role)

    def add_partner(self, peer_id: str) -> None:
        """Remember a peer this node committed an exchange with (at most MAX_PARTNERS)."""
        if peer_id not in self.partners and len(self.partners) < MAX_PARTNERS:
            self.partners[peer_id] = None

    def record_path(self, path: str, peer_id: str, seconds: float) -> None:
        """An initiated exchange committed over ``path`` (direct, holepunched, relayed)."""
        self.by_path[path] += 1
        self.path_seconds[path] = self.path_seconds.get(path, 0.0) + seconds
        log.debug("exchange to %s via %s in %.2f s", peer_id[:12], path, seconds)

    @property
    def ok(self) -> int:
        return self.ok_initiator + self.ok_responder

    def add_sent(self, codec: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.sent_by_codec[codec] += nbytes

    def add_received(self, codec: str, nbytes: int) -> None:
        self.bytes_received += nbytes
        self.received_by_codec[codec] += nbytes

    def record_commit(self, duration_s: float, weight: float, correction_norm: float,
                      numel: int) -> None:
        """Duration and consensus estimate of one committed exchange.

        The correction is ``c = w (D(m_j) - D(m_i))`` over the fragment, and the messages are
        both public iterates, quantized, so ``(||c|| / w)^2 / numel`` estimates the mean squared
        per-parameter distance between the two nodes.
        """
        self.duration_s.observe(duration_s)
        if weight <= 0:
            return
        self.applied += 1
        if numel > 0:
            sample = (correction_norm / weight) ** 2 / numel
            self.consensus = sample if math.isnan(self.consensus) else (
                _CONSENSUS_EMA * self.consensus + (1 - _CONSENSUS_EMA) * sample)


@dataclass
class TrainStats:
    """Trainer progress; ``tokens_per_s`` is an exponential moving average."""

    step: int = 0
    rounds: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0  # EMA of one inner step's wall time
    timed_steps: int = 0  # inner steps timed since start, and their wall time
    train_s: float = 0.0
    quiet_steps: int = 0  # steps that overlapped no exchange work, and their wall time
    quiet_s: float = 0.0
    train_loss: float = math.nan
    val_loss: float = math.nan
    first_val_loss: float = math.nan
    rollbacks: int = 0  # non-finite losses rolled back to the last good round end
    checkpoints_written: int = 0
    checkpoint_failures: int = 0  # checkpoints that could not be written
    running: bool = False
    error: str = ""

    def round_duration_s(self, inner_steps: int) -> float:
        """Estimated wall time of one round (H inner steps); 0 before the first step."""
        return self.step_time_s * inner_steps


class Utilization:
    """How much of its compute throughput the node keeps while exchanges run: ``quiet step time
    / mean step time`` over windows of about a round (EMA), at most 1, from the trainer's
    counters (a "quiet" step overlapped no exchange work; waiting on the network is not work).
    docs/results/pacing.md: 0.97 on a core per node; the controller that once acted on it was
    retired (no loss gain measured)."""

    EMA = 0.5  # weight of the newest window
    MIN_QUIET = 2  # quiet steps a window needs to re-estimate the quiet step time

    def __init__(self) -> None:
        self.value = math.nan
        self.quiet_step_s = math.nan
        self._last: tuple[int, float, int, float] | None = None

    def update(self, t: TrainStats) -> float:
        """Take the trainer's cumulative counters at the end of a window; returns the estimate."""
        now = (t.timed_steps, t.train_s, t.quiet_steps, t.quiet_s)
        last, self._last = self._last, now
        if last is None or now[0] <= last[0]:  # first window, or not training
            return self.value
        mean_s = (now[1] - last[1]) / (now[0] - last[0])
        quiet = now[2] - last[2]
        quiet_s = self.quiet_step_s  # the window's own quiet steps if it has enough
        if quiet >= self.MIN_QUIET:
            quiet_s = self.quiet_step_s = self._ema(self.quiet_step_s, (now[3] - last[3]) / quiet)
        if not math.isnan(quiet_s) and mean_s > 0:
            self.value = self._ema(self.value, min(1.0, quiet_s / mean_s))
        return self.value

    def _ema(self, old: float, new: float) -> float:
        return new if math.isnan(old) else (1 - self.EMA) * old + self.EMA * new


@dataclass(frozen=True)
class RelayCounts:
    """A node's relaying, read at scrape time: as a relay (``connections``, ``refused`` and
    ``bytes`` since start; ``open`` and ``listeners`` now) and behind a router (``held``: relays
    it listens at now)."""

    connections: int = 0
    refused: int = 0
    bytes: int = 0
    open: int = 0
    listeners: int = 0
    held: int = 0


@dataclass
class FragmentStats:
    """One DiLoCo fragment's syncs (``gasloc_fragment_*`` metrics, Info, logs).

    Written by the trainer thread (counts, times) and the fragment's averaging thread (bytes);
    read at scrape time. ``last_start_step`` is the schedule step (inner step plus the phase
    shift the group agreed on) at which the last sync started: ``(step - offset) % H == 0``.
    """

    offset: int
    numel: int
    ok: int = 0
    failed: int = 0
    solo: int = 0
    last_start_step: int = 0
    wait_s: float = 0.0  # training stalled waiting for results (the overlap did not hide)
    averaging_s: float = 0.0  # wall time of the syncs (start to result)
    last_group_size: int = 0
    resyncs: int = 0
    resync_failures: int = 0
    bytes_sent: int = 0  # encoded payload bytes of this fragment's all-reduces
    bytes_received: int = 0
    failures: dict[str, int] = field(default_factory=dict)
