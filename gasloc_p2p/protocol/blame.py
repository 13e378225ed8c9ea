"""Who pushed a node uphill: a ledger of what each key's committed exchanges moved it by.

A push that stays under every per-exchange and per-round limit still adds up over rounds, and
the node's loss shows it before its parameters say who did it. So the node keeps, for the
exchanges of its recent rounds, what each one moved it by on a private random sample of
coordinates (drawn from the OS's randomness: no peer knows where it is looked at; a few
thousand floats an exchange). When the node rolls back because its loss rose and stayed up
(:class:`gasloc_p2p.protocol.guard.LossWatch`), the *rise* is what moved it since the state it
returns to; the keys whose exchanges since then moved it along the rise are blamed:

- a key's summed moves must be significantly aligned with the rise: cosine at least ``min_z
  / sqrt(samples)`` (for a direction independent of the rise the cosine is about ``N(0, 1 /
  samples)``: honest corrections, which pull towards the swarm's mean, rarely pass), and
- its projection on the rise must be at least ``min_share`` of the rise (a key that moved the
  node by a negligible amount is not the cause).

Identities are free, so blame is not the defence on its own: the rollback undoes the push,
and a blamed key loses its trust and, for good, most of its weight
(:meth:`gasloc_p2p.protocol.guard.UpdateGuard.demerit`); keys it mints start as newcomers,
whose movement is budgeted apart.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass

import torch

SAMPLES = 2048  # coordinates of the ledger's sample
KEEP = 4096  # committed exchanges remembered (the oldest dropped first)


@dataclass(frozen=True)
class Entry:
    """One committed exchange: the node's round, the key and block, its move on the sample."""

    round: int
    key: str
    block: str
    moved: torch.Tensor  # float32 [samples], host


class Ledger:
    """The recent committed exchanges of one node, sampled (thread-safe appends)."""

    def __init__(self, numel: int, samples: int = SAMPLES, keep: int = KEEP) -> None:
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        k = min(samples, numel)
        self.positions = (torch.randperm(numel, generator=gen)[:k] if numel <= 4 * k
                          else torch.randint(numel, (k,), generator=gen)).sort().values
        self._entries: deque[Entry] = deque(maxlen=keep)

    def record(self, round_: int, key: str, block: str, moved: torch.Tensor) -> None:
        """Exchange with ``key`` committed in round ``round_``, moving the sample by ``moved``."""
        self._entries.append(Entry(round_, key, block, moved.detach().float().cpu()))

    def culprits(self, since_round: int, rise: torch.Tensor, min_z: float = 4.0,
                 min_share: float = 0.02) -> list[tuple[str, str]]:
        """``(key, block)`` of every key blamed for ``rise`` (the node's move on the sample
        since round ``since_round``'s state; see the module docstring)."""
        rise = rise.detach().double().cpu()
        norm2 = float(rise @ rise)
        if not norm2 > 0:
            return []
        moved: dict[tuple[str, str], torch.Tensor] = {}
        for e in list(self._entries):
            if e.round >= since_round:
                key = (e.key, e.block)
                moved[key] = moved.get(key, torch.zeros_like(rise)) + e.moved.double()
        least = min_z / math.sqrt(max(rise.numel(), 1))
        out = []
        for who, m in moved.items():
            along = float(m @ rise)
            size = math.sqrt(float(m @ m))
            if size > 0 and along / (size * math.sqrt(norm2)) >= least \
                    and along / norm2 >= min_share:
                out.append(who)
        return out
