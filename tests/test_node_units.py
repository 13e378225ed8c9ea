"""Small pieces of the node: peer choice, fragment order, lr schedule, lock fairness, rate cap,
and the timers on a manual clock (virtual time: no test here sleeps for a timer)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import threading
import time
from types import SimpleNamespace

import pytest

from gasloc_p2p.model import build_model
from gasloc_p2p.node.config import GossipConfig, NetworkConfig, TrainConfig
from gasloc_p2p.node.discovery.base import PeerInfo
from gasloc_p2p.node.modes.gossip import FragmentChooser, GossipLoop, PeerBook
from gasloc_p2p.node.runtime.clock import ManualClock, every
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.trainer import inner_settings
from gasloc_p2p.node.settings import add_config_flags, build_config
from gasloc_p2p.node.stats import ExchangeStats, TrainStats
from gasloc_p2p.node.transport.ratelimit import TokenBucket
from gasloc_p2p.train import build_adamw
from tests.node_helpers import run, scaled


def test_peer_book_skips_self_busy_backoff_and_unreachable():
    book = PeerBook("me")
    book.update([PeerInfo("me", "h:0", 1, "f"), PeerInfo("a", "h:1", 1, "f"),
                 PeerInfo("b", "h:2", 1, "f"), PeerInfo("nat", "h:3", 1, "f", reachable=False)])
    assert {p.peer_id for p in book.candidates()} == {"a", "b"}
    assert [p.peer_id for p in book.candidates(exclude=["a"])] == ["b"]
    book.backoff("b", 60)
    assert [p.peer_id for p in book.candidates()] == ["a"]
    book.backoff("a", -1)  # expired
    assert [p.peer_id for p in book.candidates()] == ["a"]


def test_fragment_chooser_round_robin_covers_all_and_random_stays_in_range():
    rr = FragmentChooser(3, "round-robin", random.Random(0))
    seq = [rr() for _ in range(6)]
    assert sorted(seq[:3]) == [0, 1, 2] and seq[:3] == seq[3:]
    rnd = FragmentChooser(3, "random", random.Random(0))
    assert {rnd() for _ in range(50)} == {0, 1, 2}


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, lr_horizon_steps=110, min_lr_ratio=0.1)
    lr_at = inner_settings(cfg)[0].at
    assert lr_at(0) == 1e-4 and lr_at(9) == 1e-3
    assert abs(lr_at(60) - 0.55e-3) < 1e-12  # halfway down the cosine
    assert abs(lr_at(110) - 1e-4) < 1e-12 and lr_at(10_000) == lr_at(110)


def test_decay_vectors_setting_reaches_the_optimizer():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    model = build_model(TrainConfig(n_layer=1, n_embd=16, n_head=2, seq_len=8).gpt(), 0)
    for env, decays in (({}, [0.1, 0.0]), ({"GASLOC_DECAY_VECTORS": "true"}, [0.1])):
        cfg = build_config(parser.parse_args([]), environ=env).train
        opt = build_adamw(model, 1e-3, inner_settings(cfg)[1])
        assert [g["weight_decay"] for g in opt.param_groups] == decays


def test_training_lock_serves_urgent_work_before_the_next_step():
    lock = TrainingLock()
    order: list[str] = []
    stop = threading.Event()

    def trainer() -> None:
        while not stop.is_set():
            with lock.step():
                time.sleep(0.002)
                order.append("step")

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        time.sleep(0.02)
        waited = []
        for _ in range(20):
            t0 = time.perf_counter()
            with lock.urgent():
                order.append("urgent")
            waited.append(time.perf_counter() - t0)
        assert max(waited) < scaled(2.0)  # never starved by the back-to-back steps
    finally:
        stop.set()
        thread.join()
    assert order.count("urgent") == 20 and "step" in order


def test_token_bucket_caps_the_rate():
    async def main() -> float:
        bucket = TokenBucket(rate_bytes_s=1_000_000, burst_bytes=100_000)
        t0 = time.perf_counter()
        for _ in range(4):
            await bucket.take(100_000)  # 400 kB at 1 MB/s after a 100 kB burst
        return time.perf_counter() - t0

    elapsed = run(main())
    assert 0.25 <= elapsed < scaled(5.0)
    unlimited = TokenBucket(0, 1)
    assert run(asyncio.wait_for(unlimited.take(10**9), 1)) is None


# ------------------------------------------------------------------ timers on a manual clock
def test_peer_book_backoff_expires_on_the_clock():
    clock = ManualClock(100.0)
    book = PeerBook("me", clock)
    book.update([PeerInfo("a", "h:1", 1, "f")])
    book.backoff("a", 30)
    clock.now = 129.9
    assert book.candidates() == []
    clock.now = 130.1
    assert [p.peer_id for p in book.candidates()] == ["a"]


class CountingLoop(GossipLoop):
    """A gossip loop whose events only record when they happen (virtual seconds)."""

    def __init__(self, clock: ManualClock, stats: TrainStats, per_round: float) -> None:
        exchanger = SimpleNamespace(engine=SimpleNamespace(fragments=[0, 1]), inflight=set(),
                                    stats=ExchangeStats())
        super().__init__(exchanger, PeerBook("me", clock), None,  # type: ignore[arg-type]
                         GossipConfig(exchanges_per_round=per_round), NetworkConfig(), stats,
                         inner_steps=10, seed=7, active=lambda: stats.running, clock=clock)
        self.events: list[float] = []

    async def gossip_once(self) -> None:  # type: ignore[override]
        self.events.append(self.clock.monotonic())


@pytest.mark.parametrize("per_round", [1.0, 4.0])
def test_gossip_loop_starts_exchanges_at_the_configured_rate(per_round):
    async def main() -> CountingLoop:
        clock = ManualClock()
        stats = TrainStats(step_time_s=0.1, running=False)  # rounds of 10 steps: 1 s each
        loop = CountingLoop(clock, stats, per_round)
        task = asyncio.create_task(loop.run())
        await clock.advance(50.0)
        assert loop.events == []  # no exchange while the trainer does not run
        stats.running = True
        await clock.advance(400.0)
        task.cancel()
        return loop

    loop = run(main())
    expected = per_round * 400  # exponential waits at rate per_round / round duration
    assert abs(len(loop.events) - expected) < 4 * expected ** 0.5, len(loop.events)
    assert all(50.0 <= t <= 450.0 for t in loop.events)
    gaps = [b - a for a, b in zip(loop.events, loop.events[1:], strict=False)]
    assert abs(sum(gaps) / len(gaps) - 1 / per_round) < 0.15 / per_round


def test_periodic_job_runs_every_period_and_survives_errors():
    async def main() -> list[float]:
        clock, calls = ManualClock(), []

        async def job() -> None:
            calls.append(clock.monotonic())
            if len(calls) == 2:
                raise OSError("disk full")  # logged, retried at the next period

        task = asyncio.create_task(every(clock, 60.0, job, "checkpoint"))
        await clock.advance(59.0)
        assert calls == []  # not at start: the first run is one period in
        await clock.advance(200.0)
        task.cancel()
        first = asyncio.create_task(every(clock, 60.0, job, "announce", first_now=True))
        await clock.advance(0.0)
        first.cancel()
        return calls

    assert run(main()) == [60.0, 120.0, 180.0, 240.0, 259.0]


def test_node_stop_recancels_a_task_that_lost_its_cancellation(caplog):
    from gasloc_p2p.node.daemon import _cancel_all

    async def stubborn() -> None:
        for _ in range(2):  # the first cancellation is lost, as in a race with a gRPC call
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)
        await asyncio.sleep(3600)

    async def main() -> None:
        tasks = [asyncio.create_task(stubborn(), name="stubborn"),
                 asyncio.create_task(asyncio.sleep(3600), name="plain")]
        await asyncio.sleep(0)
        await asyncio.wait_for(_cancel_all(tasks, recheck_s=0.05), scaled(5))
        assert all(t.cancelled() for t in tasks)

    with caplog.at_level("WARNING"):
        run(main())
    assert any("stubborn still runs" in r.getMessage() for r in caplog.records)


def test_an_exchange_failure_is_said_once_per_reason(caplog):
    """A failed exchange is logged at INFO with its reason the first time that reason is seen
    (numbers such as ports do not make a new one), at DEBUG after; a peer's text is escaped."""
    import logging

    from gasloc_p2p.node.modes.gossip import ConnectFailed
    from gasloc_p2p.node.transport.reasons import FailureReasons
    from gasloc_p2p.protocol.messages import BUSY, INTERNAL, ExchangeError
    from tests.node_helpers import make_peer

    reasons = FailureReasons()
    with caplog.at_level(logging.DEBUG, logger="gasloc_p2p.node.transport.reasons"):
        reasons("outbound", "exchange with g1a", ConnectFailed("no connection to 1.2.3.4:4001"))
        reasons("outbound", "exchange with g1b", ConnectFailed("no connection to 1.2.3.4:4002"))
        reasons("outbound", "exchange with g1c", TimeoutError())
        reasons("outbound", "exchange with g1d", ExchangeError(INTERNAL, "evil\x1b[2J\nline"))

        async def inbound() -> None:  # the responder's side, as the node counts it
            peer = await make_peer("a", 0)
            try:
                for _ in range(2):
                    peer.exchanger._fail("inbound", ExchangeError(
                        BUSY, "this node has not finished a round of its own yet"))
            finally:
                await peer.close()

        run(inbound())
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO
            and r.name == "gasloc_p2p.node.transport.reasons"]
    assert [s.split(" (said once")[0] for s in said] == [
        "exchange with g1a failed: ConnectFailed: INTERNAL: no connection to 1.2.3.4:4001",
        "exchange with g1c failed: TimeoutError",
        "exchange with g1d failed: ExchangeError: INTERNAL: evil\\x1b[2J\\nline",
        "inbound exchange failed: ExchangeError: BUSY: this node has not finished a round of "
        "its own yet"], said
    assert sum("g1b" in r.getMessage() for r in caplog.records) == 1  # at DEBUG


def test_rate_guard_counts_the_message_in_flight_as_big_as_the_last_one():
    from gasloc_p2p.node.transport.exchange import RateGuard
    from gasloc_p2p.protocol.messages import MAX_CHUNK_BYTES

    # an honest 1 MiB chunk on a link at twice the minimum rate arrives in time: before, the
    # message in flight counted as one byte and the first chunk had to arrive within the grace
    guard = RateGuard(0.0, min_bps=16384, grace_s=5.0)
    assert guard.seconds_left(0.0, 0) > 2 * MAX_CHUNK_BYTES / 16384 / 2
    assert guard.seconds_left(32.0, MAX_CHUNK_BYTES) > 0  # the second chunk has its time too
    # a trickler of one-byte messages is cut soon after the grace, as before
    trickle = RateGuard(0.0, min_bps=2000, grace_s=1.0)
    lefts = [trickle.seconds_left(float(t), t) for t in range(1, 4)]  # one byte a second
    assert lefts[-1] < 0
