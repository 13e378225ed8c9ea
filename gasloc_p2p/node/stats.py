"""Counters of one node, written from the event loop (exchanges) or the trainer thread (steps).

Plain attributes: each is written by one thread only and read for logs and ``Info``; reads may
be a moment stale, which is all a progress line needs.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ExchangeStats:
    """Gossip outcomes; bytes count payload bytes (Chunk data) only."""

    ok_initiator: int = 0
    ok_responder: int = 0
    failed: int = 0
    busy: int = 0  # our attempts answered BUSY (not failures)
    rejected_inbound: int = 0  # inbound exchanges we refused (BUSY or incompatible)
    bytes_sent: int = 0
    bytes_received: int = 0
    staleness: Counter[int] = field(default_factory=Counter)  # round ends spanned -> count
    failures: Counter[str] = field(default_factory=Counter)  # reason -> count
    last_correction_norm: float = 0.0

    @property
    def ok(self) -> int:
        return self.ok_initiator + self.ok_responder


@dataclass
class TrainStats:
    """Trainer progress; ``tokens_per_s`` is an exponential moving average."""

    step: int = 0
    rounds: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0  # EMA of one inner step's wall time
    train_loss: float = math.nan
    val_loss: float = math.nan
    first_val_loss: float = math.nan
    running: bool = False
    error: str = ""

    def round_duration_s(self, inner_steps: int) -> float:
        """Estimated wall time of one round (H inner steps); 0 before the first step."""
        return self.step_time_s * inner_steps
