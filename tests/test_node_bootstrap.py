"""Start-up state downloads: two donors must agree; a fake with a huge announced step or a
poisoned state is never adopted."""

from __future__ import annotations

import torch

from gasloc_p2p.node.daemon import Node
from gasloc_p2p.node.discovery.base import InMemoryDiscovery, InMemoryRegistry
from gasloc_p2p.node.runtime import bootstrap
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.guard import LossWatch
from tests.daemon_helpers import tiny_config
from tests.node_helpers import run, wait_until

N = 1000


def cand(name: str, params: torch.Tensor, step: int = 0) -> bootstrap.Candidate:
    return bootstrap.Candidate(name, step, params, torch.zeros(N), pb.StateMeta(step=step))


def test_two_agreeing_donors_are_needed_and_the_step_does_not_decide():
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(N, generator=g)
    progress = torch.randn(N, generator=g)
    honest = [cand(f"h{i}", theta0 + progress + 0.1 * torch.randn(N, generator=g), step=100 + i)
              for i in range(2)]
    fake = cand("fake", theta0 + 50 * torch.randn(N, generator=g), step=10**9)
    assert bootstrap.choose([fake], theta0) is None
    assert bootstrap.choose([fake, honest[0]], theta0) is None
    assert bootstrap.choose([fake, honest[0], honest[1]], theta0) is honest[1]
    assert bootstrap.problem(cand("nan", torch.full((N,), float("nan"))), N)
    assert bootstrap.problem(cand("big", torch.full((N,), 1e30)), N)
    assert bootstrap.problem(cand("short", torch.zeros(7)), N)
    assert not bootstrap.problem(honest[0], N)


def test_a_joining_node_ignores_a_poisoned_donor_with_a_huge_step(corpus):
    async def main():
        reg = InMemoryRegistry()
        fast = {"exchanges_per_round": 4.0, "inner_steps": 5}
        a = Node(tiny_config(corpus, **fast), InMemoryDiscovery(reg, "gasloc", "a"))
        b = Node(tiny_config(corpus, peers=("/memory/a",), **fast),
                 InMemoryDiscovery(reg, "gasloc", "b"))
        evil = Node(tiny_config(corpus, peers=("/memory/a",), exchanges_per_round=0.0),
                    InMemoryDiscovery(reg, "gasloc", "evil"))
        async with a, b, evil:
            await wait_until(lambda: min(a.stats.ok, b.stats.ok) >= 6 and evil.peers,
                             timeout_s=90, what="a and b in consensus")
            st, t0 = evil.trainer.state, evil.trainer.theta0
            evil.trainer.losses = LossWatch(jump=0)  # it would roll its own poison back
            with evil.lock.urgent():
                st.theta.copy_(t0 + 50 * torch.randn(t0.shape))  # eta 1: p is theta
            evil.train_stats.step = 10**9  # announced at its next announcement
            await wait_until(lambda: any(p.step >= 10**9 for p in a.peers), timeout_s=30,
                             what="the fake step announced")
            joiner = Node(tiny_config(corpus, peers=("/memory/a",)),
                          InMemoryDiscovery(reg, "gasloc", "joiner"))
            async with joiner:
                mine = joiner.trainer.state.theta
                poison = bootstrap.rms(st.theta - t0)
                assert bootstrap.rms(mine - t0) < poison / 10

    run(main(), timeout_s=180)
