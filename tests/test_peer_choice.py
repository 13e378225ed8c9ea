"""Partner choice: uniform, or by the throughput this node measured (node/modes/peer_choice.py).

Unit tests of the chooser (deterministic rng), then three in-process nodes with real gRPC and
``--peer-choice bandwidth``: every node still exchanges with every other one, and the metrics
show what it measured.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
from collections import Counter

import pytest

from gasloc_p2p.node.discovery.base import InMemoryDiscovery, InMemoryRegistry
from gasloc_p2p.node.modes.peer_choice import MAX_PEERS, PeerChooser
from gasloc_p2p.node.runtime.daemon import Node
from tests.daemon_helpers import tiny_config
from tests.node_helpers import run, wait_until


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.read().decode()


def same(x: str) -> str:
    return x


def draws(chooser: PeerChooser, options: list[str], n: int = 4000) -> Counter[str]:
    return Counter(chooser.pick(options, 1, same)[0] for _ in range(n))


def test_uniform_is_a_plain_random_sample():
    a, b = PeerChooser("uniform", 0.25, random.Random(3)), random.Random(3)
    options = ["p", "q", "r", "s"]
    assert a.pick(options, 3, same) == b.sample(options, 3)
    a.observe("p", 10**6, 0.1)  # measurements change nothing in uniform mode
    counts = draws(a, options)
    assert min(counts.values()) > 0.2 * 4000


def test_bandwidth_prefers_the_faster_peer_and_still_explores():
    chooser = PeerChooser("bandwidth", 0.25, random.Random(1))
    for _ in range(3):
        chooser.observe("fast", 2_000_000, 0.1)  # 20 MB/s
        chooser.observe("slow", 2_000_000, 10.0)  # 0.2 MB/s
    counts = draws(chooser, ["fast", "slow"])
    # exploit: 0.75 x (20 / 20.2); explore: 0.25 x 1/2 each
    assert counts["slow"] == pytest.approx(4000 * (0.125 + 0.75 * 0.2 / 20.2), rel=0.15)
    assert counts["fast"] > 5 * counts["slow"]
    assert chooser.explored + chooser.exploited == 4000
    assert chooser.explored == pytest.approx(1000, rel=0.1)


def test_unknown_peers_are_optimistic_and_failures_halve_the_estimate():
    chooser = PeerChooser("bandwidth", 0.0, random.Random(2))
    chooser.observe("known", 1000, 1.0)
    counts = draws(chooser, ["known", "new"])
    assert counts["new"] == pytest.approx(2000, rel=0.1)  # as fast as the fastest known
    chooser.observe("new", 1000, 1.0)
    chooser.failed("new")
    assert chooser.throughput("new") == 500
    chooser.failed("never-seen")  # nothing to halve
    assert chooser.throughput("never-seen") is None
    counts = draws(chooser, ["known", "new"])
    assert counts["known"] == pytest.approx(4000 * 2 / 3, rel=0.1)


def test_the_estimate_is_a_moving_average_and_the_table_is_bounded():
    chooser = PeerChooser("bandwidth", 0.25, random.Random(0))
    chooser.observe("p", 100, 1.0)
    chooser.observe("p", 200, 1.0)
    assert chooser.throughput("p") == pytest.approx(0.7 * 100 + 0.3 * 200)
    chooser.observe("p", 0, 1.0)  # nothing measured: ignored
    chooser.observe("p", 100, 0.0)
    assert chooser.throughput("p") == pytest.approx(130)
    for i in range(MAX_PEERS + 10):
        chooser.observe(f"x{i}", 100, 1.0)
    assert len(chooser.rates()) == MAX_PEERS
    assert chooser.throughput("p") is None  # the least recently measured went first


def test_picks_are_distinct_preferences_and_bad_settings_fail():
    chooser = PeerChooser("bandwidth", 0.5, random.Random(5))
    options = [f"p{i}" for i in range(6)]
    for _ in range(50):
        picks = chooser.pick(options, 3, same)
        assert len(picks) == len(set(picks)) == 3 and set(picks) <= set(options)
    assert chooser.pick(options[:2], 5, same) in (options[:2], options[1::-1])
    assert chooser.pick([], 3, same) == []
    with pytest.raises(ValueError, match="peer choice"):
        PeerChooser("fastest", 0.2, random.Random(0))
    with pytest.raises(ValueError, match="explore"):
        PeerChooser("bandwidth", 1.5, random.Random(0))


def test_nodes_choosing_by_bandwidth_exchange_with_every_peer(corpus):
    async def main():
        reg = InMemoryRegistry()
        flags = {"peer_choice": "bandwidth", "exchanges_per_round": 4.0}
        nodes = [Node(tiny_config(corpus, **flags),
                      InMemoryDiscovery(reg, "gasloc", "n0"))]
        nodes += [Node(tiny_config(corpus, peers=("/memory/n0",), **flags),
                       InMemoryDiscovery(reg, "gasloc", f"n{i}")) for i in (1, 2)]
        async with nodes[0], nodes[1], nodes[2]:
            loops = [n.mode.loop for n in nodes]

            def everyone_measured() -> bool:
                return all(len(loop.chooser.rates()) == 2 for loop in loops)

            await wait_until(everyone_measured, timeout_s=90, what="every pair measured")
            text = await asyncio.to_thread(_scrape, nodes[0].metrics.url)
        assert "gasloc_peer_throughput_bytes_per_second{peer=" in text
        assert 'gasloc_peer_choice_draws_total{kind="exploit"}' in text
        assert nodes[0].stats.draws_explore + nodes[0].stats.draws_exploit > 0
        for node in nodes:
            assert all(rate > 0 for rate in node.mode.loop.chooser.rates().values())

    run(main(), timeout_s=150)
