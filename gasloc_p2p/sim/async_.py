"""Event-driven asynchronous driver (ALGORITHM.md section 2): what the daemon does, in memory.

Each worker steps at its own speed (``step_time_s * compute_factor``) and ends a round after its
own ``H_i`` steps. Gossip events arrive at exponential waiting times (``start_rate`` = half of
``participations_per_round`` per own round on average: every exchange has two participants)
with a random graph neighbour that is not exchanging; the exchange is
snapshotted at start and committed ``bytes / min(bw) + latency`` seconds later, while both keep
training. Nothing waits for the slowest worker. The run ends at the equal-token budget
(``workers * steps`` inner steps in total).
"""

from __future__ import annotations

import heapq
import itertools
import random

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState, exchange_weight
from gasloc_p2p.core.flat import Fragment, layer_fragments, whole
from gasloc_p2p.core.topology import default_weight, graph_edges, random_matching
from gasloc_p2p.model import layer_index
from gasloc_p2p.sim.exchange import Pending, ProtocolExchanger, SimExchanger
from gasloc_p2p.sim.sync import Clock, Record
from gasloc_p2p.sim.workers import SimWorkers


class AsyncSim:
    def __init__(self, sim: SimWorkers, clock: Clock, record: Record) -> None:
        cfg = sim.cfg
        self.sim, self.cfg, self.clock, self.record = sim, cfg, clock, record
        n = cfg.workers
        gossip = cfg.algorithm == "gossip-sgd"
        w = cfg.w if cfg.w is not None else default_weight(cfg.graph, n, "1-peer")
        rate, beta = cfg.acid() if cfg.momentum == "acid" else (0.0, 0.5)
        self.acfg = AsyncConfig(eta=1.0 if gossip else cfg.outer_eta, gamma=cfg.outer_gamma, w=w,
                                momentum=cfg.momentum, staleness_policy=cfg.staleness_policy,
                                max_staleness=cfg.max_staleness, acid_rate=rate, acid_beta=beta)
        self.states = [AsyncGaslocState(sim.thetas[i], sim.theta0, self.acfg)
                       for i in range(n)]
        if cfg.task == "consensus" and cfg.momentum != "local":
            for st in self.states:  # the toy's workers start apart: memory at the own point
                st.memory.copy_(st.theta)
        numel = sim.theta0.numel()
        self.fragments: list[Fragment] = (
            [whole(numel)] if cfg.fragments == 1
            else layer_fragments(sim.spans, layer_index, cfg.fragments, "strided"))
        # the aligned driver exchanges the whole vector: the last fragment the engines know
        self.whole = len(self.fragments) - 1 if cfg.fragments == 1 else len(self.fragments)
        known = self.fragments + ([] if cfg.fragments == 1
                                  else [Fragment(self.whole, whole(numel).ranges)])
        spec = cfg.codec_spec
        # quantized: the daemon's protocol and engine, in memory; "none": exact, no references
        self.exchanger: ProtocolExchanger | SimExchanger = (
            SimExchanger(sim.theta0, n, None) if spec is None
            else ProtocolExchanger(self.states, sim.theta0, known, spec, self.acfg,
                                   capacity=cfg.reference_capacity,
                                   references=cfg.reference_scheme))
        self.neighbours: list[list[int]] = [[] for _ in range(n)]
        for i, j in graph_edges(cfg.graph, n):
            self.neighbours[i].append(j)
            self.neighbours[j].append(i)
        self.rng = random.Random(cfg.seed)
        self.busy: set[int] = set()
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.stats = {"exchanges": 0, "dropped": 0, "busy": 0, "stale": 0, "staleness_sum": 0}

    def step_seconds(self, i: int) -> float:
        return self.cfg.step_time_s * self.cfg.compute_factor(i)

    def push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def gossip_gap(self, i: int) -> float:
        rate = self.cfg.start_rate / (self.cfg.h_of(i) * self.step_seconds(i))
        return self.rng.expovariate(rate)

    def run(self) -> dict[str, float]:
        cfg, n = self.cfg, self.cfg.workers
        if cfg.aligned:
            return self.run_aligned()
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
        self.record(self.clock.now)
        return self.summary()

    def summary(self) -> dict[str, float]:
        """Counters, plus the participation actually measured: committed exchanges a worker
        took part in per own round (``2 * exchanges / sum of rounds``)."""
        rounds = sum(w.steps / self.cfg.h_of(w.index) for w in self.sim.workers)
        out: dict[str, float] = dict(self.stats)
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
        index = self.rng.randrange(len(self.fragments))
        pend = self.begin(i, j, index)
        frag = pend.fragment
        self.busy.update((i, j))
        nbytes = self.exchanger.payload_bytes(frag)
        self.clock.bytes_sent[i] += nbytes
        self.clock.bytes_sent[j] += nbytes
        link = min(self.cfg.bandwidth_bytes_s(i), self.cfg.bandwidth_bytes_s(j))
        self.push(t + nbytes / link + self.cfg.latency_s, "commit", pend)

    def begin(self, i: int, j: int, index: int) -> Pending:
        """Snapshot both sides of an exchange of fragment ``index`` (``self.whole``: all)."""
        if isinstance(self.exchanger, ProtocolExchanger):
            return self.exchanger.begin(i, j, index)
        frag = self.fragments[index] if index < len(self.fragments) else whole(
            self.sim.theta0.numel())
        si, sj = self.states[i], self.states[j]
        pend = self.exchanger.begin(i, j, si.public_iterate(frag), sj.public_iterate(frag), frag)
        pend.rounds_i, pend.rounds_j = si.rounds, sj.rounds
        return pend

    def commit(self, pend: Pending) -> None:
        if isinstance(self.exchanger, ProtocolExchanger):
            staleness, w = self.exchanger.commit(pend)
        else:
            si, sj = self.states[pend.i], self.states[pend.j]
            staleness = (si.rounds - pend.rounds_i) + (sj.rounds - pend.rounds_j)
            w = exchange_weight(self.acfg, staleness)
            c_i, c_j = self.exchanger.commit(pend, w)
            si.apply_correction(c_i, pend.fragment)
            sj.apply_correction(c_j, pend.fragment)
        self.busy.difference_update((pend.i, pend.j))
        self.stats["exchanges"] += 1
        self.stats["staleness_sum"] += staleness
        self.stats["stale"] += staleness > self.acfg.max_staleness
        self.stats["dropped"] += w == 0.0

    def run_aligned(self) -> dict[str, float]:
        """Lock-step rounds; instantaneous exchanges on a random matching right before each
        synchronized round end. Worker ``i`` takes its own ``H_i`` steps per round (a faster
        one waits). With momentum "mixed" this is the synchronous algorithm."""
        cfg, n = self.cfg, self.cfg.workers
        edges = graph_edges(cfg.graph, n)
        rng = random.Random(cfg.seed)  # the same matching stream as the synchronous driver
        while min(wk.steps for wk in self.sim.workers) < cfg.steps:
            steps = [min(cfg.h_of(i), cfg.steps - self.sim.workers[i].steps) for i in range(n)]
            for i in range(n):
                for _ in range(steps[i]):
                    self.sim.inner_step(i)
            for i, j in random_matching(edges, rng) if cfg.matching == "1-peer" else []:
                self.commit(self.begin(i, j, self.whole))
            for s in self.states:
                s.round_end()
            self.clock.now += max(k * self.step_seconds(i) for i, k in enumerate(steps))
            self.record(self.clock.now)
        return self.summary()


def run_async(sim: SimWorkers, clock: Clock, record: Record) -> dict[str, float]:
    return AsyncSim(sim, clock, record).run()
