"""In-memory pairwise exchanges for the simulator.

- :class:`ProtocolExchanger` (asynchronous driver, quantized codecs): the daemon's protocol
  itself, one :class:`~gasloc_p2p.protocol.session.ExchangeSession` per side and one
  :class:`~gasloc_p2p.protocol.engine.ExchangeEngine` per worker, wired by
  :class:`~gasloc_p2p.protocol.memory.MemoryExchange`; a simulated exchange and a daemon
  exchange on the same inputs give bit-identical references and corrections.
- :class:`SimExchanger` (synchronous driver, which mixes proposals ``y`` that are no node's
  state, and the exact codec "none" for float64 equivalence checks): the same reference math
  (core ``PeerLink`` encode/commit) on bare tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec, Encoded
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.references import ReferenceTable
from gasloc_p2p.protocol.engine import DEFAULT_SCHEME, ExchangeEngine, NoLock
from gasloc_p2p.protocol.memory import MemoryExchange
from gasloc_p2p.protocol.messages import Identity
from gasloc_p2p.protocol.session import Rules, Timeouts

SIM_RUN = "sim"
SIM_FINGERPRINT = "sim"


@dataclass
class Pending:
    """An exchange between snapshot and commit (``link``: the protocol path's exchange)."""

    i: int
    j: int
    fragment: Fragment
    sent_i: Encoded | torch.Tensor | None = None
    sent_j: Encoded | torch.Tensor | None = None
    rounds_i: int = 0  # round counters at snapshot, for staleness
    rounds_j: int = 0
    link: MemoryExchange | None = None


class ProtocolExchanger:
    """Exchanges among the workers' :class:`AsyncGaslocState`s through the daemon's protocol.

    ``fragments`` must be indexed by position (``fragments[k].index == k``), as the daemon's.
    Worker ``i`` is peer ``peer_ids[i]`` (default ``str(i)``); simulated time has no timeouts.
    """

    def __init__(self, states: Sequence[AsyncGaslocState], theta0: torch.Tensor,
                 fragments: Sequence[Fragment], spec: CodecSpec, outer: AsyncConfig,
                 capacity: int = 8, references: str = DEFAULT_SCHEME,
                 peer_ids: Sequence[str] | None = None) -> None:
        never = Timeouts(math.inf, math.inf, math.inf)
        ids = list(peer_ids) if peer_ids is not None else [str(i) for i in range(len(states))]
        self.spec = spec
        self.fragments = list(fragments)
        self.engines = [ExchangeEngine(s, theta0, fragments, NoLock(), capacity, references)
                        for s in states]
        self.rules = [Rules.build(Identity(SIM_RUN, SIM_FINGERPRINT, ids[i]), spec, outer, never)
                      for i in range(len(states))]

    def begin(self, i: int, j: int, fragment: int) -> Pending:
        """``i`` starts an exchange with ``j``: headers and both snapshots, payloads in flight."""
        link = MemoryExchange((self.rules[i], self.engines[i]), (self.rules[j], self.engines[j]),
                              fragment)
        link.open()
        return Pending(i, j, self.fragments[fragment], link=link)

    def commit(self, pend: Pending) -> tuple[int, float]:
        """Deliver the payloads and commit on both sides; returns (staleness, weight)."""
        assert pend.link is not None
        mine, theirs = pend.link.finish()
        assert (mine.staleness, mine.weight) == (theirs.staleness, theirs.weight)
        return mine.staleness, mine.weight

    def payload_bytes(self, fragment: Fragment) -> int:
        """Bytes one side sends for this fragment, exactly as the wire payload carries them."""
        return self.spec.codec().wire_bytes(fragment.numel)


class SimExchanger:
    """Computes both sides' corrections of pairwise exchanges among ``n`` workers.

    ``spec`` None: exact exchange of the iterates (no codec, no references).
    """

    def __init__(self, theta0: torch.Tensor, n: int, spec: CodecSpec | None,
                 capacity: int = 8) -> None:
        self.codec = spec.codec() if spec is not None else None
        self.theta0 = theta0
        self.tables = [ReferenceTable(theta0, capacity=capacity) for _ in range(n)]
        self.elem_bytes = theta0.element_size()

    def begin(self, i: int, j: int, p_i: torch.Tensor, p_j: torch.Tensor,
              fragment: Fragment) -> Pending:
        """Snapshot (and encode) both public iterates ``p: [fragment.numel]``."""
        if self.codec is None:
            return Pending(i, j, fragment, p_i.clone(), p_j.clone())
        li, lj = self.tables[i].get(str(j)), self.tables[j].get(str(i))
        if li.version != lj.version:  # one side evicted the link: both restart from theta_0
            li.reset(self.theta0)
            lj.reset(self.theta0)
        return Pending(i, j, fragment, li.encode(p_i, fragment, self.codec),
                       lj.encode(p_j, fragment, self.codec))

    def payload_bytes(self, fragment: Fragment) -> int:
        """Bytes one side sends for this fragment, exactly as the wire payload carries them."""
        if self.codec is None:
            return fragment.numel * self.elem_bytes
        return self.codec.wire_bytes(fragment.numel)

    def commit(self, pend: Pending, w: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sides' corrections ``(c_i, c_j)``, with ``c_j = -c_i`` exactly."""
        if isinstance(pend.sent_i, torch.Tensor) and isinstance(pend.sent_j, torch.Tensor):
            c_i = (pend.sent_j - pend.sent_i).mul_(w)
            return c_i, -c_i
        assert isinstance(pend.sent_i, Encoded) and isinstance(pend.sent_j, Encoded)
        li = self.tables[pend.i].get(str(pend.j))
        lj = self.tables[pend.j].get(str(pend.i))
        c_i = li.commit(pend.sent_i, pend.sent_j, pend.fragment, w)
        c_j = lj.commit(pend.sent_j, pend.sent_i, pend.fragment, w)
        return c_i, c_j
