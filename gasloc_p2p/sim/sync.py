"""Synchronous-round drivers: gasloc (mixed/unmixed), gossip-sgd, diloco, streaming-diloco,
noloco, local.

Simulated time per round = the slowest worker's compute + the round's communication: a pairwise
exchange takes ``bytes / min(bw_i, bw_j) + latency``; a ring all-reduce takes
``2 (n-1)/n * bytes / min(bw) + 2 (n-1) * latency`` (it waits for the slowest link).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from gasloc_p2p.core.diloco import NesterovOuter
from gasloc_p2p.core.flat import layer_fragments, whole
from gasloc_p2p.core.gasloc import OuterConfig, SyncGasloc, propose
from gasloc_p2p.core.noloco import NolocoConfig, NolocoOuter, exact_round_
from gasloc_p2p.core.streaming import StreamingConfig, StreamingDiloco
from gasloc_p2p.core.topology import default_weight, graph_edges, round_edges
from gasloc_p2p.model import layer_index
from gasloc_p2p.sim.exchange import SimExchanger
from gasloc_p2p.sim.workers import SimWorkers

Record = Callable[[float], None]  # called with the simulated time after each round


class Clock:
    """Simulated seconds and bytes sent per worker."""

    def __init__(self, n: int) -> None:
        self.now = 0.0
        self.bytes_sent = [0] * n


def allreduce_seconds(sim: SimWorkers, nbytes: int) -> float:
    cfg, n = sim.cfg, sim.cfg.workers
    if n == 1:
        return 0.0
    slowest = min(cfg.bandwidth_bytes_s(i) for i in range(n))
    return 2 * (n - 1) / n * nbytes / slowest + 2 * (n - 1) * cfg.latency_s


def compute_seconds(sim: SimWorkers, steps: list[int]) -> float:
    cfg = sim.cfg
    return max(s * cfg.step_time_s * cfg.compute_factor(i) for i, s in enumerate(steps))


def run_gasloc_sync(sim: SimWorkers, clock: Clock, record: Record) -> None:
    cfg, n = sim.cfg, sim.cfg.workers
    gossip = cfg.algorithm == "gossip-sgd"
    outer = OuterConfig(eta=1.0 if gossip else cfg.outer_eta, gamma=cfg.outer_gamma,
                        variant=cfg.variant, warmup_rounds=cfg.outer_warmup)
    state = SyncGasloc(sim.thetas, n, outer)  # every row is theta_0 when training
    edges = graph_edges(cfg.graph, n)
    w = cfg.w if cfg.w is not None else default_weight(cfg.graph, n, cfg.matching)
    exchanger = SimExchanger(sim.theta0, n, cfg.codec_spec)
    frag = whole(sim.theta0.numel())
    rng = random.Random(cfg.seed)
    while not sim.finished():
        anchors = sim.thetas.clone()
        steps = sim.round_steps()
        for i in range(n):
            for _ in range(steps[i]):
                sim.inner_step(i)
        y = propose(anchors, sim.thetas, outer.eta)
        z = y.clone()
        comm = 0.0
        for i, j in round_edges(edges, cfg.matching, rng):
            c_i, c_j = exchanger.commit(exchanger.begin(i, j, y[i], y[j], frag), w)
            z[i] += c_i
            z[j] += c_j
            nbytes = exchanger.payload_bytes(frag)
            clock.bytes_sent[i] += nbytes
            clock.bytes_sent[j] += nbytes
            link = min(cfg.bandwidth_bytes_s(i), cfg.bandwidth_bytes_s(j))
            comm = max(comm, nbytes / link + cfg.latency_s)
        state.accelerate(y, z, sim.thetas)
        clock.now += compute_seconds(sim, steps) + comm
        record(clock.now)


def run_diloco(sim: SimWorkers, clock: Clock, record: Record) -> None:
    cfg, n = sim.cfg, sim.cfg.workers
    anchor = sim.theta0.clone()
    outer = NesterovOuter(anchor.numel(), cfg.outer_eta, cfg.outer_gamma, anchor.dtype)
    spec = cfg.codec_spec
    codec = spec.codec() if spec is not None else None
    while not sim.finished():
        steps = sim.round_steps()
        for i in range(n):
            for _ in range(steps[i]):
                sim.inner_step(i)
        grad = torch.zeros_like(anchor)
        for row in sim.thetas:  # each worker's outer gradient, as it would go on the wire
            delta = anchor - row
            grad += delta if codec is None else codec.decode(codec.encode(delta)).to(grad.dtype)
        outer.step_(anchor, grad.div_(n))
        sim.thetas.copy_(anchor.expand_as(sim.thetas))
        nbytes = (anchor.numel() * anchor.element_size() if codec is None
                  else codec.wire_bytes(anchor.numel()))
        for i in range(n):
            clock.bytes_sent[i] += int(2 * (n - 1) / n * nbytes)
        clock.now += compute_seconds(sim, steps) + allreduce_seconds(sim, nbytes)
        record(clock.now)


def run_noloco(sim: SimWorkers, clock: Clock, record: Record) -> None:
    """NoLoCo: per round, a random matching; each pair shares its outer gradients (quantized
    directly, as DiLoCo's) and its outer parameters ``phi`` (through references, as GASLoC's
    iterates), so a side sends two payloads per exchange."""
    cfg, n = sim.cfg, sim.cfg.workers
    outer = NolocoOuter(sim.theta0, n, NolocoConfig(alpha=cfg.outer_gamma, beta=cfg.outer_eta,
                                                    gamma=cfg.consensus))
    edges = graph_edges(cfg.graph, n)
    exchanger = SimExchanger(sim.theta0, n, cfg.codec_spec)
    spec = cfg.codec_spec
    codec = spec.codec() if spec is not None else None
    frag = whole(sim.theta0.numel())
    rng = random.Random(cfg.seed)
    while not sim.finished():
        steps = sim.round_steps()
        for i in range(n):
            for _ in range(steps[i]):
                sim.inner_step(i)
        pairs = round_edges(edges, cfg.matching, rng)
        comm = 0.0
        if codec is None:
            exact_round_(outer, sim.thetas, [tuple(p) for p in pairs])
        else:
            grads = outer.phi - sim.thetas
            sent = torch.stack([codec.decode(codec.encode(g)).to(g.dtype) for g in grads])
            paired = {k for p in pairs for k in p}
            todo = [(k, sent[k], torch.zeros_like(sent[k])) for k in range(n) if k not in paired]
            for i, j in pairs:
                c_i, c_j = exchanger.commit(
                    exchanger.begin(i, j, outer.phi[i], outer.phi[j], frag), 0.5)
                g_mean = (sent[i] + sent[j]) / 2
                todo += [(i, g_mean, -c_i), (j, g_mean, -c_j)]
            for k, g_mean, gap in todo:
                outer.step_(k, g_mean, gap)
            sim.thetas.copy_(outer.phi)
        # per side: phi (through references) and the outer gradient
        nbytes = exchanger.payload_bytes(frag) + (
            codec.wire_bytes(frag.numel) if codec is not None
            else frag.numel * sim.theta0.element_size())
        for i, j in pairs:
            clock.bytes_sent[i] += nbytes
            clock.bytes_sent[j] += nbytes
            link = min(cfg.bandwidth_bytes_s(i), cfg.bandwidth_bytes_s(j))
            comm = max(comm, nbytes / link + cfg.latency_s)
        clock.now += compute_seconds(sim, steps) + comm
        record(clock.now)


def run_streaming(sim: SimWorkers, clock: Clock, record: Record) -> None:
    cfg, n = sim.cfg, sim.cfg.workers
    frags = layer_fragments(sim.spans, layer_index, cfg.fragments, "strided")
    scfg = StreamingConfig(H=cfg.H, tau=min(cfg.tau, cfg.H - 1), alpha=cfg.alpha, eta=cfg.outer_eta,
                           gamma=cfg.outer_gamma, codec=cfg.codec)
    sd = StreamingDiloco(sim.theta0, frags, scfg)
    in_flight = 0.0  # seconds of communication still to hide behind compute
    for step in range(1, cfg.steps + 1):
        for i in range(n):
            sim.inner_step(i)
        step_s = compute_seconds(sim, [1] * n)
        in_flight = max(0.0, in_flight - step_s)
        for f in sd.due(step):
            nbytes = sd.begin(f, step, sim.thetas)
            for i in range(n):
                clock.bytes_sent[i] += int(2 * (n - 1) / n * nbytes)
            in_flight += allreduce_seconds(sim, nbytes)
        landed = sd.land(step, sim.thetas)
        stall = in_flight if landed or scfg.tau == 0 else 0.0  # merging waits for the data
        in_flight -= stall
        clock.now += step_s + stall
        if step % cfg.H == 0 or step == cfg.steps:
            record(clock.now)


def run_local(sim: SimWorkers, clock: Clock, record: Record) -> None:
    n = sim.cfg.workers
    while not sim.finished():
        steps = sim.round_steps()
        for i in range(n):
            for _ in range(steps[i]):
                sim.inner_step(i)
        clock.now += compute_seconds(sim, steps)
        record(clock.now)


SYNC_DRIVERS: dict[str, Callable[[SimWorkers, Clock, Record], None]] = {
    "gasloc": run_gasloc_sync, "gossip-sgd": run_gasloc_sync, "diloco": run_diloco,
    "streaming-diloco": run_streaming, "noloco": run_noloco, "local": run_local,
}
