"""Adaptive gossip pacing (``--pacing compute``): the controller alone, then real nodes."""

from __future__ import annotations

import asyncio
import math
import urllib.request

import pytest

from gasloc_p2p.node.config import ConfigError
from gasloc_p2p.node.discovery.base import InMemoryDiscovery, InMemoryRegistry
from gasloc_p2p.node.modes.pacing import Counters, Pacer
from gasloc_p2p.node.runtime.daemon import Node
from tests.daemon_helpers import tiny_config
from tests.node_helpers import run, wait_until


def feed(pacer: Pacer, windows: int, step_s: float, quiet_s: float, steps: int = 20,
         quiet: int = 10) -> float:
    """``windows`` windows of ``steps`` steps of mean ``step_s``, ``quiet`` of them quiet steps
    of ``quiet_s``."""
    c = Counters(0, 0.0, 0, 0.0)
    rate = pacer.update(c)
    for i in range(1, windows + 1):
        c = Counters(i * steps, i * steps * step_s, i * quiet, i * quiet * quiet_s)
        rate = pacer.update(c)
    return rate


def test_unhurried_steps_keep_the_configured_rate():
    pacer = Pacer(0.95, max_per_round=2.0, min_per_round=0.5)
    assert feed(pacer, 5, step_s=0.101, quiet_s=0.1) == 2.0
    assert pacer.utilization == pytest.approx(0.1 / 0.101)


def test_slowed_steps_cut_the_rate_then_it_recovers():
    pacer = Pacer(0.95, max_per_round=4.0, min_per_round=0.5)
    assert feed(pacer, 1, step_s=0.125, quiet_s=0.1) == pytest.approx(4.0 * 0.7)
    assert pacer.utilization == pytest.approx(0.8)
    assert feed(pacer, 20, step_s=0.125, quiet_s=0.1) == 0.5  # floored, never below
    rates = [feed(pacer, 1, step_s=0.1, quiet_s=0.1) for _ in range(12)]
    assert rates[-1] == 4.0 and rates == sorted(rates)  # additive increase back to the cap
    assert rates[4] - rates[3] == pytest.approx(0.4)  # a tenth of the maximum per window


def test_off_only_measures_and_the_floor_is_capped():
    off = Pacer(0.95, max_per_round=4.0, min_per_round=0.5, enabled=False)
    assert feed(off, 6, step_s=0.2, quiet_s=0.1) == 4.0
    assert off.utilization == pytest.approx(0.5)  # measured all the same
    assert Pacer(0.95, max_per_round=0.25, min_per_round=0.5).min_per_round == 0.25


def test_nothing_measured_changes_nothing():
    pacer = Pacer(0.9, max_per_round=2.0, min_per_round=0.5)
    assert feed(pacer, 3, step_s=0.5, quiet_s=0.1, quiet=1) == 2.0  # < 2 quiet steps a window
    assert math.isnan(pacer.utilization)
    assert feed(pacer, 2, step_s=0.5, quiet_s=0.1, steps=0, quiet=0) == 2.0  # not training
    assert feed(pacer, 1, step_s=0.15, quiet_s=0.1, quiet=5) == 2.0 * 0.7  # now it can tell
    with pytest.raises(ValueError, match="target"):
        Pacer(1.0, 2.0, 0.5)


@pytest.mark.parametrize("flags, match", [
    ({"pacing": "fast"}, "--pacing='fast': choose one of"),
    ({"pacing_target": 1.0}, "--pacing-target=1.0: must be in"),
    ({"pacing_min_rate": -1.0}, "--pacing-min-rate=-1.0: must be >= 0"),
])
def test_bad_pacing_flags_name_the_flag(corpus, flags, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(corpus, **flags)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_a_paced_node_starts_fewer_exchanges_and_still_answers(corpus):
    """Two real nodes on loopback: with an unreachable target (99.9% compute) the paced node
    drops to its floor; the unpaced one keeps its rate, and exchanges go on both ways."""
    async def main():
        reg = InMemoryRegistry()
        common = {"exchanges_per_round": 6.0, "pacing_min_rate": 0.5}
        paced = Node(tiny_config(corpus, pacing="compute", pacing_target=0.999, **common),
                     InMemoryDiscovery(reg, "gasloc", "paced"))
        plain = Node(tiny_config(corpus, peers=("/memory/paced",), **common),
                     InMemoryDiscovery(reg, "gasloc", "plain"))
        async with paced, plain:
            def settled() -> bool:
                return (paced.stats.starts_per_round == 0.5 and paced.stats.ok_responder >= 3
                        and math.isfinite(plain.stats.utilization))

            await wait_until(settled, timeout_s=90, what="the paced node at its floor")
            text = await asyncio.to_thread(_scrape, paced.metrics.url)
        assert "gasloc_gossip_starts_per_round 0.5" in text
        assert "gasloc_compute_utilization " in text
        assert 0 < paced.stats.utilization < 0.999
        assert plain.stats.starts_per_round == 6.0
        assert paced.trainer.stats.quiet_steps < paced.trainer.stats.timed_steps

    run(main(), timeout_s=150)
