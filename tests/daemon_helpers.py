"""Shared helpers for the tests that run a node: a small real-text corpus and a tiny config."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from gasloc_p2p.node.config import NodeConfig
from gasloc_p2p.node.modes import gossip
from gasloc_p2p.node.settings import build_config
from gasloc_p2p.node.transport.exchange import GossipTransport
from tests.node_helpers import scaled

STDLIB_TEXTS = ("argparse", "ast", "typing", "inspect", "textwrap")


def write_corpus(directory: Path) -> Path:
    """A small real-text corpus: a few standard-library modules' source (about 400 kB)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in STDLIB_TEXTS:
        src = Path(importlib.import_module(name).__file__ or "")
        (directory / f"{name}.txt").write_text(src.read_text())
    return directory


def tiny_config(corpus: Path, **flags: object) -> NodeConfig:
    """A small fast node: 2 layers, width 64, loopback, short intervals."""
    base = {"data": str(corpus), "n_layer": 2, "n_embd": 64, "seq_len": 64, "batch_size": 8,
            "inner_steps": 10, "eval_interval_steps": 50, "eval_batches": 2, "host": "127.0.0.1",
            "announce_interval_s": 0.5, "announce_ttl_s": 3.0, "refresh_interval_s": 0.3,
            "log_interval_s": 1.0, "header_timeout_s": scaled(5), "chunk_timeout_s": scaled(5),
            "commit_timeout_s": scaled(5), "exchange_timeout_s": scaled(20),
            "warmup_steps": 10}
    base.update(flags)
    if not any(base.get(k) for k in ("swarm_key", "invitation", "owner_key")):
        base.setdefault("open_swarm", True)  # tests of other things: an open swarm
    return build_config(argparse.Namespace(**base), environ={})


def spy_on_gossip_machinery(monkeypatch) -> list[str]:
    """Record every construction of a GossipTransport, PeerBook or GossipLoop (by class name)."""
    built: list[str] = []
    for cls in (GossipTransport, gossip.PeerBook, gossip.GossipLoop):
        init = cls.__init__

        def spy(self, *args, _init=init, _name=cls.__name__, **kw):
            built.append(_name)
            _init(self, *args, **kw)

        monkeypatch.setattr(cls, "__init__", spy)
    return built
