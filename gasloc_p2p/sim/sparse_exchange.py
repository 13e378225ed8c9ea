"""Simulated gossip exchanges with sparse payloads (issue 24): :mod:`gasloc_p2p.core.compress`
driven in memory, with the same begin/commit/staleness rules as the other exchangers.

Both sides snapshot their public iterates at :meth:`SparseExchanger.begin`; at
:meth:`~SparseExchanger.commit` each encodes its snapshot against the pair's reference (theta_0,
or the pair's :class:`~gasloc_p2p.core.compress.LinkReference`), and each applies the
correction it computes itself from the two messages: ``w (D(m_j) - D(m_i))`` on side ``i`` and
``w (D(m_i) - D(m_j))`` on side ``j``, exact negatives of each other. randk positions come from a
seed both sides share (the run seed and an exchange counter here; a daemon would take them from
the exchange's header).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gasloc_p2p.core.async_state import AsyncGaslocState
from gasloc_p2p.core.compress import (
    LinkReference,
    exchange_seed,
    gossip_message,
    pair_correction,
)
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.sparse import SparseSpec
from gasloc_p2p.sim.exchange import Exchanger, Pending


class SparseExchanger(Exchanger):
    """Sparse exchanges against ``reference`` ("theta0" or "link") among ``states``."""

    def __init__(self, states: Sequence[AsyncGaslocState], theta0: torch.Tensor,
                 fragments: Sequence[Fragment], spec: SparseSpec, w: float,
                 reference: str = "theta0", seed: int = 0) -> None:
        super().__init__(states, fragments)
        if reference not in ("theta0", "link"):
            raise ValueError(f"unknown reference {reference!r}")
        self.spec, self.w, self.reference, self.seed = spec, w, reference, seed
        self.theta0 = theta0.detach().float()
        self.links: dict[tuple[int, int, int], LinkReference] = {}  # (low, high, fragment)
        self.counter = 0  # exchanges committed: with the run seed, the randk seed

    def begin(self, i: int, j: int, fragment: int) -> Pending:
        frag = self.fragments[fragment]
        si, sj = self.states[i], self.states[j]
        return Pending(i, j, frag, si.public_iterate(frag), sj.public_iterate(frag),
                       si.rounds, sj.rounds)

    def reference_of(self, i: int, j: int, frag: Fragment) -> LinkReference | torch.Tensor:
        """The pair's reference on ``frag``: theta_0's compact slice, or its LinkReference."""
        theta0 = frag.gather(self.theta0)
        if self.reference == "theta0":
            return theta0
        key = (min(i, j), max(i, j), frag.index)
        if key not in self.links:
            self.links[key] = LinkReference(theta0)
        return self.links[key]

    def commit(self, pend: Pending) -> tuple[int, float]:
        assert pend.p_i is not None and pend.p_j is not None
        si, sj = self.states[pend.i], self.states[pend.j]
        staleness = (si.rounds - pend.rounds_i) + (sj.rounds - pend.rounds_j)
        w = self.weight(self.w, staleness)
        seed = exchange_seed(self.seed, self.counter)
        self.counter += 1
        ref = self.reference_of(pend.i, pend.j, pend.fragment)
        r = ref.ref if isinstance(ref, LinkReference) else ref
        m_i = gossip_message(self.spec, pend.p_i, r, seed)
        m_j = gossip_message(self.spec, pend.p_j, r, seed)
        dtype = si.theta.dtype
        si.apply_correction(pair_correction(m_i, m_j, w).to(dtype), pend.fragment)
        sj.apply_correction(pair_correction(m_j, m_i, w).to(dtype), pend.fragment)
        if isinstance(ref, LinkReference):
            ref.update(m_i, m_j)
        return staleness, w

    def payload_bytes(self, fragment: Fragment) -> int:
        return self.spec.wire_bytes(fragment.numel)
