"""In-memory pairwise exchanges between simulated workers' node states.

Both exchangers work on the workers' :class:`~gasloc_p2p.core.async_state.AsyncGaslocState`
and follow the same two steps: :meth:`begin` snapshots both public iterates (the exchange's
start), :meth:`commit` adds the correction to both sides (its end), with the weight the
staleness between the two implies. A round of the synchronous driver begins every exchange of
its matching before committing any, so each correction is computed from the round's
proposals ``y``, as in the synchronous algorithm (docs/algorithm.md, section 1).

- :class:`ProtocolExchanger` (quantized codecs): the daemon's protocol itself, one
  :class:`~gasloc_p2p.protocol.session.ExchangeSession` per side and one
  :class:`~gasloc_p2p.protocol.engine.ExchangeEngine` per worker, wired by
  :class:`~gasloc_p2p.protocol.memory.MemoryExchange`; a simulated exchange and a daemon
  exchange on the same inputs give bit-identical corrections.
- :class:`ExactExchanger` (codec "none"): the same correction ``w (p_j - p_i)`` on unquantized
  snapshots, in the parameters' dtype (float64 for the equivalence checks).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gasloc_p2p.core.async_state import MAX_STALENESS, AsyncGaslocState, exchange_weight
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.protocol.engine import ExchangeEngine, NoLock
from gasloc_p2p.protocol.memory import MemoryExchange
from gasloc_p2p.protocol.messages import Identity
from gasloc_p2p.protocol.session import Rules, Timeouts

SIM_RUN = "sim"
SIM_FINGERPRINT = "sim"


@dataclass
class Pending:
    """An exchange between snapshot and commit."""

    i: int
    j: int
    fragment: Fragment
    p_i: torch.Tensor | None = None  # exact snapshots (ExactExchanger)
    p_j: torch.Tensor | None = None
    rounds_i: int = 0  # round counters at snapshot, for staleness
    rounds_j: int = 0
    link: MemoryExchange | None = None  # the protocol's exchange (ProtocolExchanger)


class Exchanger(abc.ABC):
    """Pairwise exchanges among ``states``; ``fragments`` indexed by position;
    ``max_staleness``: round ends an exchange may span at full weight."""

    def __init__(self, states: Sequence[AsyncGaslocState],
                 fragments: Sequence[Fragment]) -> None:
        self.states = list(states)
        self.fragments = list(fragments)
        self.max_staleness = MAX_STALENESS

    def weight(self, w: float, staleness: int) -> float:
        return exchange_weight(w, staleness, self.max_staleness)

    @abc.abstractmethod
    def begin(self, i: int, j: int, fragment: int) -> Pending:
        """``i`` starts an exchange of ``fragments[fragment]`` with ``j``: both snapshots."""

    @abc.abstractmethod
    def commit(self, pend: Pending) -> tuple[int, float]:
        """Apply the exchange on both sides; returns (staleness, weight)."""

    @abc.abstractmethod
    def payload_bytes(self, fragment: Fragment) -> int:
        """Bytes one side sends for this fragment."""

    def pending_bytes(self, pend: Pending) -> int:
        """Bytes one side sends for this exchange (the fragment's, unless the exchanger picks
        a payload per pair)."""
        return self.payload_bytes(pend.fragment)


class ProtocolExchanger(Exchanger):
    """Exchanges through the daemon's protocol and engine, in memory (no timeouts: simulated
    time). Worker ``i`` is peer ``peer_ids[i]`` (default ``str(i)``)."""

    def __init__(self, states: Sequence[AsyncGaslocState], theta0: torch.Tensor,
                 fragments: Sequence[Fragment], spec: CodecSpec, w: float,
                 peer_ids: Sequence[str] | None = None,
                 max_staleness: int = MAX_STALENESS) -> None:
        super().__init__(states, fragments)
        never = Timeouts(math.inf, math.inf, math.inf)
        ids = list(peer_ids) if peer_ids is not None else [str(i) for i in range(len(states))]
        self.spec, self.max_staleness = spec, max_staleness
        self.engines = [ExchangeEngine(s, theta0, fragments, NoLock()) for s in states]
        self.rules = [Rules.build(Identity(SIM_RUN, SIM_FINGERPRINT, ids[i]), spec, w, never,
                                  max_staleness) for i in range(len(states))]

    def begin(self, i: int, j: int, fragment: int) -> Pending:
        link = MemoryExchange((self.rules[i], self.engines[i]), (self.rules[j], self.engines[j]),
                              fragment)
        link.open()
        return Pending(i, j, self.fragments[fragment], link=link)

    def commit(self, pend: Pending) -> tuple[int, float]:
        assert pend.link is not None
        mine, theirs = pend.link.finish()
        assert (mine.staleness, mine.weight) == (theirs.staleness, theirs.weight)
        return mine.staleness, mine.weight

    def payload_bytes(self, fragment: Fragment) -> int:
        return self.spec.codec().wire_bytes(fragment.numel)


class ExactExchanger(Exchanger):
    """Unquantized exchanges: ``c_i = w (p_j - p_i) = -c_j`` from the snapshots."""

    def __init__(self, states: Sequence[AsyncGaslocState], fragments: Sequence[Fragment],
                 w: float) -> None:
        super().__init__(states, fragments)
        self.w = w

    def begin(self, i: int, j: int, fragment: int) -> Pending:
        frag = self.fragments[fragment]
        si, sj = self.states[i], self.states[j]
        return Pending(i, j, frag, si.public_iterate(frag), sj.public_iterate(frag),
                       si.rounds, sj.rounds)

    def commit(self, pend: Pending) -> tuple[int, float]:
        assert pend.p_i is not None and pend.p_j is not None
        si, sj = self.states[pend.i], self.states[pend.j]
        staleness = (si.rounds - pend.rounds_i) + (sj.rounds - pend.rounds_j)
        w = self.weight(self.w, staleness)
        c = (pend.p_j - pend.p_i).mul_(w)
        si.apply_correction(c, pend.fragment)
        sj.apply_correction(c.neg_(), pend.fragment)
        return staleness, w

    def payload_bytes(self, fragment: Fragment) -> int:
        return fragment.numel * self.states[0].theta.element_size()
