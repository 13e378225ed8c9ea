"""Simulated gossip exchanges with modulo payloads (:mod:`gasloc_p2p.core.modulo`, issue 40),
with the same begin/commit/staleness rules as the other exchangers.

Both sides snapshot their public iterates at :meth:`ModuloExchanger.begin`. At
:meth:`~ModuloExchanger.commit` each side sizes its steps by the distances it measured at its own
last exchange, encodes its snapshot (its own stochastic rounding), lifts the partner's codes next
to its own snapshot and applies ``w (Q(p_j) - Q(p_i))`` at the sent positions; then each measures
its distance to what it decoded. A side with no measurement yet (its first exchange) makes the
pair exchange int8 plain (the daemon's default) instead. Wrapped coordinates (a decoded value
``2^b`` steps off) are counted: the simulator knows both codes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gasloc_p2p.core import modulo
from gasloc_p2p.core.async_state import AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.compress import exchange_seed
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.modulo import Distances, ModuloSpec
from gasloc_p2p.sim.exchange import ExactExchanger, Pending


class ModuloExchanger(ExactExchanger):
    """Modulo exchanges among ``states``; ``seed``: the run's (positions and roundings). The
    snapshots are the exact exchanger's (:meth:`ExactExchanger.begin`)."""

    def __init__(self, states: Sequence[AsyncGaslocState], fragments: Sequence[Fragment],
                 spec: ModuloSpec, w: float, seed: int = 0) -> None:
        super().__init__(states, fragments, w)
        self.spec, self.seed = spec, seed
        self.distances = [Distances() for _ in states]
        self.generators = [torch.Generator().manual_seed(exchange_seed(seed, i, 1))
                           for i in range(len(states))]
        self.int8 = CodecSpec.of("int8").codec()
        self.counter = 0
        self.stats = {"wrapped": 0, "sent": 0, "int8_exchanges": 0}

    def commit(self, pend: Pending) -> tuple[int, float]:
        assert pend.p_i is not None and pend.p_j is not None
        si, sj = self.states[pend.i], self.states[pend.j]
        staleness = (si.rounds - pend.rounds_i) + (sj.rounds - pend.rounds_j)
        w = self.weight(self.w, staleness)
        key = pend.fragment.index
        di, dj = self.distances[pend.i].get(key), self.distances[pend.j].get(key)
        seed = exchange_seed(self.seed, self.counter)
        self.counter += 1
        dtype = si.theta.dtype
        if di is None or dj is None:
            c_i = self._int8(pend.p_j).sub_(self._int8(pend.p_i)).mul_(w)
            self.stats["int8_exchanges"] += 1
            pos = modulo.positions(self.spec, pend.fragment.numel, seed)
            self.distances[pend.i].measure(key, self.spec, pend.fragment.numel, pos,
                                           pend.p_j.float()[pos], pend.p_i)
            self.distances[pend.j].measure(key, self.spec, pend.fragment.numel, pos,
                                           pend.p_i.float()[pos], pend.p_j)
            si.apply_correction(c_i.to(dtype), pend.fragment)
            sj.apply_correction(c_i.neg().to(dtype), pend.fragment)
            return staleness, w
        spec = self.spec
        m_i, q_i = modulo.encode(spec, pend.p_i, modulo.steps_for(spec, pend.p_i.float(), di),
                                 seed, self.generators[pend.i])
        m_j, q_j = modulo.encode(spec, pend.p_j, modulo.steps_for(spec, pend.p_j.float(), dj),
                                 seed, self.generators[pend.j])
        j_at_i, i_at_j = modulo.lift(m_j, pend.p_i), modulo.lift(m_i, pend.p_j)
        self.stats["wrapped"] += int((j_at_i != q_j).sum()) + int((i_at_j != q_i).sum())
        self.stats["sent"] += 2 * q_i.numel()
        pos = modulo.positions(spec, pend.fragment.numel, seed)
        n = pend.fragment.numel
        c_i = torch.zeros(n).index_put_((pos,), (j_at_i - q_i) * w)
        c_j = torch.zeros(n).index_put_((pos,), (i_at_j - q_j) * w)
        self.distances[pend.i].measure(key, spec, n, pos, j_at_i, pend.p_i)
        self.distances[pend.j].measure(key, spec, n, pos, i_at_j, pend.p_j)
        si.apply_correction(c_i.to(dtype), pend.fragment)
        sj.apply_correction(c_j.to(dtype), pend.fragment)
        return staleness, w

    def _int8(self, p: torch.Tensor) -> torch.Tensor:
        return self.int8.decode(self.int8.encode(p.float()))

    def payload_bytes(self, fragment: Fragment) -> int:
        return self.spec.wire_bytes(fragment.numel)

    def pending_bytes(self, pend: Pending) -> int:
        """int8's size for a pair's first exchange (a side without a measured distance)."""
        key = pend.fragment.index
        if any(self.distances[x].get(key) is None for x in (pend.i, pend.j)):
            return self.int8.wire_bytes(pend.fragment.numel)
        return self.payload_bytes(pend.fragment)
