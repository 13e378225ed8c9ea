"""Small pieces of the node: peer choice, fragment order, lr schedule, lock fairness, rate cap."""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time

from gasloc_p2p.model import build_model
from gasloc_p2p.node.config import TrainConfig
from gasloc_p2p.node.discovery.base import PeerInfo
from gasloc_p2p.node.modes.gossip import FragmentChooser, PeerBook
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.trainer import inner_settings
from gasloc_p2p.node.settings import add_config_flags, build_config
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


def test_decay_vectors_flag_reaches_the_optimizer():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    model = build_model(TrainConfig(n_layer=1, n_embd=16, n_head=2, seq_len=8).gpt(), 0)
    for argv, decays in (([], [0.1, 0.0]), (["--decay-vectors"], [0.1])):
        cfg = build_config(parser.parse_args(argv), environ={}).train
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
