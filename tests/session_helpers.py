"""Shared helper of the sans-I/O protocol tests: one node's rules and engine, in memory."""

from __future__ import annotations

import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.protocol.engine import ExchangeEngine, NoLock
from gasloc_p2p.protocol.messages import Identity
from gasloc_p2p.protocol.session import Rules, Timeouts
from tests.node_helpers import NUMEL, fragments, theta0

OUTER = AsyncConfig(eta=0.7, gamma=0.5, w=0.5)
TIMEOUTS = Timeouts(1.0, 2.0, 3.0)


def node(name: str, seed: int, codec: str = "int8",
         run_id: str = "run") -> tuple[Rules, ExchangeEngine]:
    """Rules and engine of a node at ``theta_0`` plus seeded noise (live != anchor)."""
    t0 = theta0()
    theta = t0 + 0.1 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    state = AsyncGaslocState(theta, t0, OUTER)
    state.theta.add_(0.05)
    engine = ExchangeEngine(state, t0, fragments(), NoLock())
    rules = Rules.build(Identity(run_id, "f" * 64, name), CodecSpec.of(codec), OUTER.w, TIMEOUTS)
    return rules, engine
