"""The node's outer algorithms as modes: the registry, what each mode builds, the seams."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from gasloc_p2p.node.averaging.base import InMemoryAveragingHub
from gasloc_p2p.node.config import AlgorithmConfig, NodeConfig, TrainConfig
from gasloc_p2p.node.discovery.base import InMemoryDiscovery, InMemoryRegistry, PeerInfo
from gasloc_p2p.node.modes.base import Mode, ModeContext
from gasloc_p2p.node.modes.diloco import DilocoMode
from gasloc_p2p.node.modes.gossip import GossipMode
from gasloc_p2p.node.modes.registry import MODES, make_mode
from gasloc_p2p.node.runtime.clock import ManualClock
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.trainer import Trainer
from gasloc_p2p.node.stats import ExchangeStats, TrainStats
from gasloc_p2p.node.transport.service import PeerChannels
from gasloc_p2p.protocol.messages import Identity
from tests.daemon_helpers import spy_on_gossip_machinery
from tests.node_helpers import run


def context(mode: Mode, discovery: InMemoryDiscovery | None = None) -> ModeContext:
    """A mode context around a tiny model (no data, no server)."""
    cfg = NodeConfig(outer=AlgorithmConfig(eta=0.7))  # an outer step that reads the anchor
    lock, stats = TrainingLock(), TrainStats()
    trainer = Trainer(TrainConfig(n_layer=1, n_embd=16, n_head=2, seq_len=16),
                      mode.outer_config(cfg), 1, lock, stats, mode.round_end, mode.keeps_anchor)
    discovery = discovery or InMemoryDiscovery(InMemoryRegistry(), "run", "me")
    peers = [PeerInfo("a", "h:1", 1, "f"), PeerInfo("nat", "h:2", 1, "f", reachable=False)]
    return ModeContext(cfg, trainer, lock, stats, ExchangeStats(), discovery,
                       PeerChannels(cfg.network), Identity("run", trainer.fingerprint, "me"),
                       ManualClock(), threading.Event(), lambda: peers, lambda: "h:0", 1)


def test_registry_maps_each_algorithm_to_its_mode():
    assert set(MODES) == {"gasloc", "diloco", "streaming-diloco"}
    assert isinstance(make_mode("gasloc"), GossipMode)
    assert isinstance(make_mode("diloco"), DilocoMode)
    with pytest.raises(ValueError, match="--algorithm"):
        make_mode("allreduce")


def test_gossip_mode_builds_its_machinery_and_diloco_none(monkeypatch):
    built = spy_on_gossip_machinery(monkeypatch)

    async def main() -> None:
        gossip = GossipMode()
        ctx = context(gossip)
        await gossip.start(ctx)
        assert sorted(built) == ["GossipLoop", "GossipTransport", "PeerBook"]
        assert gossip.exchanger is not None and [name for name, _ in gossip.tasks()] == ["gossip"]
        assert [p.peer_id for p in gossip.candidates(ctx.peers())] == ["a"]
        await gossip.stop()
        await gossip.stop()  # safe twice
        assert not gossip.exchanger.accepting

        built.clear()
        diloco = DilocoMode("diloco", [InMemoryAveragingHub().averager("me")])
        ctx = context(diloco)
        await diloco.start(ctx)
        assert built == [] and diloco.exchanger is None and diloco.tasks() == []
        snap = await asyncio.to_thread(diloco.snapshot)
        assert snap.outer == "local" and torch.equal(snap.params, ctx.trainer.state.anchor)
        assert snap.state.keys() == {"momentum"}  # DiLoCo's Nesterov buffers
        await diloco.stop()
        await diloco.stop()

    run(main())


def test_gossip_round_end_runs_the_outer_update_under_the_lock():
    gossip = GossipMode()
    ctx = context(gossip)
    run(gossip.start(ctx))
    state = ctx.trainer.state
    assert state.anchor is not None  # context()'s outer step has eta 0.7: the anchor is read
    with torch.no_grad():
        state.theta.add_(0.01)  # a drift, so the round end moves the anchor
    anchor = state.anchor.clone()
    ctx.trainer.round_end()  # what the trainer thread calls every H steps
    assert state.rounds == ctx.train_stats.rounds == 1
    assert not torch.equal(state.anchor, anchor)


def test_diloco_mode_needs_a_dht_or_an_injected_averager():
    discovery = InMemoryDiscovery(InMemoryRegistry(), "run", "me")
    assert discovery.averaging_backend() is None  # in-memory discovery runs no DHT
    mode = DilocoMode()
    with pytest.raises(RuntimeError, match="hivemind DHT"):
        run(mode.start(context(mode, discovery)))
    run(mode.stop())  # nothing started: stop is a no-op
