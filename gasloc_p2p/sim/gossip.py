"""The GASLoC driver (gasloc, gossip-sgd): the daemon's node state and exchanges, in memory.

Every worker keeps the daemon's :class:`~gasloc_p2p.core.async_state.AsyncGaslocState` (or the
simulator's A2CiD2 form, :mod:`gasloc_p2p.sim.acid`) and exchanges through one
:class:`~gasloc_p2p.sim.exchange.Exchanger` (the daemon's protocol for quantized codecs). Two
schedules:

- ``--mode sync`` (docs/algorithm.md, section 1): lock-step rounds; each worker takes its own
  ``H_i`` steps (a faster one waits), then every exchange of the round's matching is begun
  (snapshots of the proposals ``y``) before any is committed, then every worker ends its
  round. Simulated round time: the slowest worker's compute plus the slowest exchange,
  ``bytes / min(bw_i, bw_j) + latency``.
- ``--mode async`` (section 2): each worker steps at its own speed (``step_time_s *
  compute_factor``) and ends a round after its own ``H_i`` steps. Gossip events arrive at
  exponential waiting times (``start_rate`` per own round on average) with a random graph
  neighbour that is not exchanging; the exchange is snapshotted at its start and committed
  ``bytes / min(bw) + latency`` seconds later, while both keep training. Nothing waits for the
  slowest worker. The run ends at the equal-token budget (``workers * steps`` steps in all).
"""

from __future__ import annotations

import heapq
import itertools
import random

from gasloc_p2p.core.async_state import MAX_STALENESS, AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.flat import Fragment, layer_fragments, whole
from gasloc_p2p.core.modulo import ModuloSpec
from gasloc_p2p.core.sparse import SparseSpec
from gasloc_p2p.core.topology import default_weight, graph_edges, round_edges
from gasloc_p2p.model import layer_index
from gasloc_p2p.sim.acid import AcidState
from gasloc_p2p.sim.clock import Clock, Record, compute_seconds
from gasloc_p2p.sim.exchange import ExactExchanger, Exchanger, Pending, ProtocolExchanger
from gasloc_p2p.sim.modulo_exchange import ModuloExchanger
from gasloc_p2p.sim.sparse_exchange import SparseExchanger
from gasloc_p2p.sim.workers import SimWorkers


class GossipSim:
    def __init__(self, sim: SimWorkers, clock: Clock, record: Record) -> None:
        cfg = sim.cfg
        self.sim, self.cfg, self.clock, self.record = sim, cfg, clock, record
        n = cfg.workers
        gossip = cfg.algorithm == "gossip-sgd"
        matching = cfg.matching if cfg.mode == "sync" else "1-peer"
        w = cfg.w if cfg.w is not None else default_weight(cfg.graph, n, matching)
        acid = cfg.momentum == "acid"
        self.acfg = AsyncConfig(eta=1.0 if gossip else cfg.outer_eta, gamma=cfg.outer_gamma, w=w,
                                momentum="mixed" if acid else cfg.momentum)
        rate, beta = cfg.acid() if acid else (0.0, 0.5)
        self.states = [AcidState(sim.thetas[i], sim.theta0, self.acfg, rate, beta) if acid
                       else AsyncGaslocState(sim.thetas[i], sim.theta0, self.acfg)
                       for i in range(n)]
        if cfg.task == "consensus":  # the toy's workers start apart: outer state at the own
            for st in self.states:  # point (p = theta at the start)
                st.reset_outer()
        numel = sim.theta0.numel()
        self.fragments: list[Fragment] = (
            [whole(numel)] if cfg.fragments == 1
            else layer_fragments(sim.spans, layer_index, cfg.fragments, "strided"))
        # rounds exchange the whole vector: the last fragment the engines know
        self.whole = len(self.fragments) - 1 if cfg.fragments == 1 else len(self.fragments)
        known = self.fragments + ([] if cfg.fragments == 1
                                  else [Fragment(self.whole, whole(numel).ranges)])
        spec = cfg.payload_spec
        self.exchanger: Exchanger = (
            ExactExchanger(self.states, known, w) if spec is None
            else ModuloExchanger(self.states, known, spec, w, cfg.seed)
            if isinstance(spec, ModuloSpec)
            else SparseExchanger(self.states, sim.theta0, known, spec, w, cfg.reference,
                                 cfg.seed) if isinstance(spec, SparseSpec)
            else ProtocolExchanger(self.states, sim.theta0, known, spec, w,
                                   max_staleness=cfg.max_staleness))
        self.exchanger.max_staleness = cfg.max_staleness  # the others read it at each commit
        self.edges = graph_edges(cfg.graph, n)
        self.neighbours: list[list[int]] = [[] for _ in range(n)]
        for i, j in self.edges:
            self.neighbours[i].append(j)
            self.neighbours[j].append(i)
        self.rng = random.Random(cfg.seed)
        self.busy: set[int] = set()
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.stats = {"exchanges": 0, "busy": 0, "stale": 0, "staleness_sum": 0}

    def step_seconds(self, i: int) -> float:
        return self.cfg.step_time_s * self.cfg.compute_factor(i)

    def push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def gossip_gap(self, i: int) -> float:
        rate = self.cfg.start_rate / (self.cfg.h_of(i) * self.step_seconds(i))
        return self.rng.expovariate(rate)

    def run(self) -> dict[str, float]:
        return self.run_rounds() if self.cfg.mode == "sync" else self.run_events()

    def run_rounds(self) -> dict[str, float]:
        """Lock-step rounds, exchanges on the round's matching at the synchronized round ends."""
        cfg, sim = self.cfg, self.sim
        while not sim.finished():
            steps = sim.round_steps()
            for i, k in enumerate(steps):
                for _ in range(k):
                    sim.inner_step(i)
            pending = [self.exchanger.begin(i, j, self.whole)
                       for i, j in round_edges(self.edges, cfg.matching, self.rng)]
            comm = max((self.account(p) for p in pending), default=0.0)
            for pend in pending:  # every snapshot taken first: corrections from the proposals
                self.commit(pend)
            for s in self.states:
                s.round_end()
            self.clock.now += compute_seconds(sim, steps) + comm
            self.record(self.clock.now)
        return self.summary()

    def run_events(self) -> dict[str, float]:
        cfg, n = self.cfg, self.cfg.workers
        budget, done, next_eval = n * cfg.steps, 0, n * cfg.H
        for i in range(n):
            self.push(self.step_seconds(i), "step", i)
            if cfg.algorithm != "local" and n > 1:
                self.push(self.gossip_gap(i), "gossip", i)
        while done < budget:
            t, _, kind, payload = heapq.heappop(self.events)
            self.clock.now = t
            if kind == "step":
                i = int(payload)  # type: ignore[call-overload]
                self.sim.inner_step(i)
                done += 1
                if self.sim.workers[i].steps % cfg.h_of(i) == 0:
                    self.states[i].round_end()
                self.push(t + self.step_seconds(i), "step", i)
                if done >= next_eval:  # a "round end" of the mean worker: log the loss
                    next_eval += n * cfg.H
                    self.record(t)
            elif kind == "gossip":
                i = int(payload)  # type: ignore[call-overload]
                self.start_exchange(i, t)
                self.push(t + self.gossip_gap(i), "gossip", i)
            else:
                assert isinstance(payload, Pending)
                self.commit(payload)
                self.busy.difference_update((payload.i, payload.j))
        self.record(self.clock.now)
        return self.summary()

    def summary(self) -> dict[str, float]:
        """Counters, plus the participation actually measured: committed exchanges a worker
        took part in per own round (``2 * exchanges / sum of rounds``)."""
        rounds = sum(w.steps / self.cfg.h_of(w.index) for w in self.sim.workers)
        out: dict[str, float] = dict(self.stats)
        out.update(getattr(self.exchanger, "stats", {}))  # the exchanger's own (modulo: wraps)
        out["rounds"] = rounds
        out["participations_per_round"] = 2 * self.stats["exchanges"] / rounds if rounds else 0.0
        return out

    def start_exchange(self, i: int, t: float) -> None:
        if i in self.busy:
            self.stats["busy"] += 1
            return
        free = [j for j in self.neighbours[i] if j not in self.busy]
        if not free:
            self.stats["busy"] += 1
            return
        j = self.rng.choice(free)
        pend = self.exchanger.begin(i, j, self.rng.randrange(len(self.fragments)))
        self.busy.update((i, j))
        self.push(t + self.account(pend), "commit", pend)

    def account(self, pend: Pending) -> float:
        """Count the exchange's bytes on both sides; returns its simulated duration."""
        nbytes = self.exchanger.pending_bytes(pend)
        self.clock.bytes_sent[pend.i] += nbytes
        self.clock.bytes_sent[pend.j] += nbytes
        link = min(self.cfg.bandwidth_bytes_s(pend.i), self.cfg.bandwidth_bytes_s(pend.j))
        return nbytes / link + self.cfg.latency_s

    def commit(self, pend: Pending) -> None:
        staleness, _ = self.exchanger.commit(pend)
        self.stats["exchanges"] += 1
        self.stats["staleness_sum"] += staleness
        self.stats["stale"] += staleness > MAX_STALENESS


def run_gossip(sim: SimWorkers, clock: Clock, record: Record) -> dict[str, float]:
    return GossipSim(sim, clock, record).run()
