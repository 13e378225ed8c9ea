"""The DiLoCo drivers (diloco, streaming-diloco) and the no-communication control (local).

DiLoCo is Streaming DiLoCo with one fragment (the whole model) and no overlap (tau 0): both
run the core's :class:`~gasloc_p2p.core.streaming.StreamingDiloco`, as the daemon's one DiLoCo
mode does. With one fragment the driver goes round by round, so each worker may take its own
``H_i`` steps per round (``--H-per-worker``) and the all-reduce waits for the slowest; with
several fragments it goes step by step on the staggered schedule, each sync overlapping
``tau`` steps of compute.
"""

from __future__ import annotations

from gasloc_p2p.core.flat import layer_fragments, whole
from gasloc_p2p.core.streaming import StreamingConfig, StreamingDiloco
from gasloc_p2p.model import layer_index
from gasloc_p2p.sim.clock import (
    Clock,
    Record,
    allgather_seconds,
    allreduce_seconds,
    compute_seconds,
)
from gasloc_p2p.sim.workers import SimWorkers


def run_diloco(sim: SimWorkers, clock: Clock, record: Record) -> None:
    cfg, n = sim.cfg, sim.cfg.workers
    one = cfg.algorithm == "diloco"
    frags = ([whole(sim.theta0.numel())] if one
             else layer_fragments(sim.spans, layer_index, cfg.fragments, "strided"))
    scfg = StreamingConfig(H=cfg.H, tau=0 if one else min(cfg.tau, cfg.H - 1), alpha=cfg.alpha,
                           eta=cfg.outer_eta, gamma=cfg.outer_gamma, codec=cfg.codec,
                           ef_beta=cfg.ef_beta)
    sd = StreamingDiloco(sim.theta0, frags, scfg)
    if one:
        _rounds(sim, sd, clock, record)
        return
    in_flight = 0.0  # seconds of communication still to hide behind compute
    for step in range(1, cfg.steps + 1):
        for i in range(n):
            sim.inner_step(i)
        step_s = compute_seconds(sim, [1] * n)
        in_flight = max(0.0, in_flight - step_s)
        for f in sd.due(step):
            in_flight += _sync(sim, sd, f, step, clock)
        landed = sd.land(step, sim.thetas)
        stall = in_flight if landed or scfg.tau == 0 else 0.0  # merging waits for the data
        in_flight -= stall
        clock.now += step_s + stall
        if step % cfg.H == 0 or step == cfg.steps:
            record(clock.now)


def _rounds(sim: SimWorkers, sd: StreamingDiloco, clock: Clock, record: Record) -> None:
    """One fragment, no overlap: every round each worker takes its ``H_i`` steps, then all
    sync (the blocking all-reduce waits for the slowest worker and link)."""
    rounds = 0
    while not sim.finished():
        steps = sim.round_steps()
        for i, k in enumerate(steps):
            for _ in range(k):
                sim.inner_step(i)
        rounds += 1
        comm = _sync(sim, sd, 0, rounds, clock)
        sd.land(rounds, sim.thetas)
        clock.now += compute_seconds(sim, steps) + comm
        record(clock.now)


def _sync(sim: SimWorkers, sd: StreamingDiloco, f: int, step: int, clock: Clock) -> float:
    """Start fragment ``f``'s sync; count its bytes; returns the all-reduce's (or, for sparse
    codecs, the ring all-gather's: each worker sends its message and forwards the n - 2 others)
    seconds."""
    n = sim.cfg.workers
    nbytes = sd.begin(f, step, sim.thetas)
    for i in range(n):
        clock.bytes_sent[i] += (n - 1) * nbytes if sd.allgather else int(2 * (n - 1) / n * nbytes)
    return allgather_seconds(sim, nbytes) if sd.allgather else allreduce_seconds(sim, nbytes)


def run_local(sim: SimWorkers, clock: Clock, record: Record) -> None:
    """No communication: every worker trains alone (the control)."""
    while not sim.finished():
        steps = sim.round_steps()
        for i, k in enumerate(steps):
            for _ in range(k):
                sim.inner_step(i)
        clock.now += compute_seconds(sim, steps)
        record(clock.now)
