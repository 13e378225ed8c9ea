"""Momentum acid on two real daemon nodes (loopback gRPC): every committed exchange reaches
x~ through the daemon's engine. With A2CiD2's gossip step equal to the pair weight (1/2),
x~ takes exactly what the anchor takes, so between round ends ``x~ == anchor`` must hold at
every moment; an engine that skipped x~ breaks it at the first exchange."""

from __future__ import annotations

import torch

from gasloc_p2p.node.daemon import Node
from gasloc_p2p.node.discovery.base import InMemoryDiscovery, InMemoryRegistry
from tests.daemon_helpers import tiny_config
from tests.node_helpers import run, wait_until


def test_two_acid_nodes_feed_x_tilde_with_every_exchange(corpus):
    async def main():
        reg = InMemoryRegistry()
        acid = {"momentum": "acid", "acid_rate": 0.3, "acid_beta": 0.5,
                "exchanges_per_round": 4.0}
        a = Node(tiny_config(corpus, **acid), InMemoryDiscovery(reg, "gasloc", "a"))
        b = Node(tiny_config(corpus, peers=("/memory/a",), **acid),
                 InMemoryDiscovery(reg, "gasloc", "b"))
        async with a, b:
            await wait_until(lambda: a.stats.ok >= 4 and a.trainer.state.rounds >= 2,
                             timeout_s=90, what="exchanges and round ends on node a")
            gaps = []
            for node in (a, b):
                with node.trainer.lock.urgent():
                    st = node.trainer.state
                    gaps.append(float((st.memory - st.anchor).abs().max()))
                    assert torch.isfinite(st.theta).all()
        assert a.trainer.state.cfg.momentum == "acid"
        assert max(gaps) < 1e-4, gaps  # x~ == anchor: corrections reached x~ too

    run(main(), timeout_s=150)
