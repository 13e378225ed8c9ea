"""The node runtime in one process: two Nodes with in-memory discovery and real gRPC."""

from __future__ import annotations

import errno
import math
from dataclasses import replace

import pytest
import torch

from gasloc_p2p.node.daemon import Node
from gasloc_p2p.node.discovery.base import (
    CompatibilityFilter,
    InMemoryDiscovery,
    InMemoryRegistry,
    PeerInfo,
)
from gasloc_p2p.node.runtime import checkpoint as ckpt
from gasloc_p2p.node.runtime.clock import ManualClock
from gasloc_p2p.node.transport.service import download_state, fetch_info
from tests.daemon_helpers import tiny_config
from tests.node_helpers import run, scaled, wait_until


def test_two_nodes_gossip_serve_info_and_state(corpus, tmp_path):
    async def main():
        reg = InMemoryRegistry()
        cfg = tiny_config(corpus, checkpoint_dir=str(tmp_path / "a"))
        a = Node(cfg, InMemoryDiscovery(reg, cfg.discovery.run_id, "node-a"))
        b = Node(tiny_config(corpus, peers=("/memory/node-a",)),
                 InMemoryDiscovery(reg, cfg.discovery.run_id, "node-b"))
        async with a, b:
            await wait_until(lambda: min(a.stats.ok_initiator, a.stats.ok_responder,
                                         b.stats.ok_initiator, b.stats.ok_responder) >= 2,
                             timeout_s=60, what="exchanges both ways on both nodes")
            await wait_until(lambda: min(a.train_stats.step, b.train_stats.step) > 50,
                             timeout_s=60, what="a validation after training")
            info = await fetch_info(a.channels.stub(b.endpoint, b.tls.cert_der), 5, a.signer)
            assert info.peer_id == b.me.peer_id and info.peers == [a.me.peer_id]
            assert info.step > 0 and info.model_fingerprint == a.me.fingerprint
            assert info.authenticated and info.ok
            meta, params, outer = await download_state(
                a.channels.stub(b.endpoint, b.tls.cert_der), a.me, 10, outer=a.trainer.state.outer)
            assert params.shape == b.trainer.state.theta.shape
            assert outer == {} and meta.total_bytes == 4 * meta.numel  # gamma 0: no state
            assert torch.isfinite(params).all() and meta.momentum == "average"
        await a.stop()  # a second stop is harmless
        # at most a race at shutdown, or on a loaded machine one exchange in 20 (3 of 87
        # failed once, under load 6)
        ok = a.stats.ok_initiator + a.stats.ok_responder
        assert a.stats.failed <= max(2, ok // 20), (a.stats.failures, a.stats)
        assert ckpt.load(tmp_path / "a") is not None  # final checkpoint on stop
        for node in (a, b):
            t = node.train_stats
            assert not t.running and not t.error
            assert t.val_loss < t.first_val_loss

    run(main(), timeout_s=120)


def test_resume_from_checkpoint_and_full_disk_keeps_running(corpus, tmp_path, monkeypatch):
    async def main():
        reg = InMemoryRegistry()
        cfg = tiny_config(corpus, checkpoint_dir=str(tmp_path), max_steps=30)
        async with Node(cfg, InMemoryDiscovery(reg, "gasloc", "solo")) as node:
            await node.wait()  # max_steps reached
        saved = ckpt.load(tmp_path)
        assert saved is not None and saved["step"] == 30
        before = (tmp_path / ckpt.FILENAME).read_bytes()

        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(ckpt.os, "replace", full_disk)
        cfg2 = replace(cfg, train=replace(cfg.train, max_steps=60))
        async with Node(cfg2, InMemoryDiscovery(reg, "gasloc", "solo")) as node:
            assert node.train_stats.step >= 30  # resumed, not restarted
            with pytest.raises(ckpt.CheckpointError, match="disk is full"):
                ckpt.save_atomic({"x": 1}, tmp_path)
            await node._checkpoint()  # logged, not raised: the node keeps running
            await node.wait()
            assert node.train_stats.step == 60 and not node.error
        assert (tmp_path / ckpt.FILENAME).read_bytes() == before  # old checkpoint kept
        assert not list(tmp_path.glob(".node-*.tmp"))  # no temporary left behind

    run(main(), timeout_s=120)


def test_node_timers_run_on_the_injected_clock(corpus, tmp_path):
    # The checkpoint timer fires when the node's (manual) clock says so, never on wall time.
    async def main():
        slow = {"announce_interval_s": 600.0, "announce_ttl_s": 1800.0,
                "refresh_interval_s": 600.0, "log_interval_s": 600.0}
        cfg = tiny_config(corpus, checkpoint_dir=str(tmp_path), checkpoint_interval_s=3600.0,
                          **slow)
        clock = ManualClock()
        node = Node(cfg, InMemoryDiscovery(InMemoryRegistry(), "gasloc", "solo"), clock=clock)
        async with node:
            await wait_until(lambda: node.train_stats.step >= 3, what="training steps")
            await clock.advance(3599.0)
            assert not (tmp_path / ckpt.FILENAME).exists()  # not due yet, however long it ran
            await clock.advance(2.0)
            await wait_until(lambda: (tmp_path / ckpt.FILENAME).exists(),
                             what="the checkpoint timer's save")
            saved = ckpt.load(tmp_path)
            assert saved is not None and saved["step"] >= 3

    run(main(), timeout_s=60)


def test_incompatible_peers_are_skipped_and_logged_once(caplog):
    filt = CompatibilityFilter(1, "f" * 64, "me")
    good = PeerInfo("good", "h:1", 1, "f" * 64)
    old = PeerInfo("old", "h:2", 0, "f" * 64)
    other = PeerInfo("other", "h:3", 1, "0" * 64)
    me = PeerInfo("me", "h:4", 1, "f" * 64)
    with caplog.at_level("WARNING"):
        assert filt([good, old, other, me]) == [good]
        assert filt([good, old, other]) == [good]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "protocol 0" in warnings[0] and "fingerprint" in warnings[1]


def test_peer_info_round_trips_through_a_dht_value():
    info = PeerInfo("p", "1.2.3.4:5", 1, "f" * 64, 7, 123.5, False, ("int8", "fp32"))
    assert PeerInfo.from_value("p", info.to_value()) == info
    assert PeerInfo.from_value("p", {"endpoint": "x"}) is None
    assert not math.isnan(info.tokens_per_s)


def test_client_mode_node_dials_out_and_is_reached_through_a_relay(corpus):
    async def main():
        reg = InMemoryRegistry()
        open_cfg = tiny_config(corpus, fragments=2)
        # b answers no hole punch: a's attempts fail and the relay carries every exchange
        nat_cfg = tiny_config(corpus, fragments=2, client_mode=True, peers=("/memory/open",),
                              hole_punch=False)
        a = Node(open_cfg, InMemoryDiscovery(reg, "gasloc", "open"))
        b = Node(nat_cfg, InMemoryDiscovery(reg, "gasloc", "nat"))
        async with a, b:
            assert len(a.trainer.fragments) == 3  # 2 strided layer groups + the rest
            await wait_until(lambda: b.stats.by_path["direct"] >= 3, timeout_s=scaled(60),
                             what="the NAT'ed node's direct exchanges")
            info = b.peer_info()
            assert not info.reachable and b.endpoint.startswith("127.0.0.1:")
            # it listens at the open node, which relays its own calls to it too
            await wait_until(lambda: b.peer_info().relays == (a.me.peer_id,),
                             timeout_s=scaled(30), what="b listens at a")
            await wait_until(lambda: a.stats.by_path["relayed"] >= 2, timeout_s=scaled(60),
                             what="a's exchanges with b through the relay")
            assert a.stats.by_path["direct"] == 0 and b.stats.by_path["relayed"] == 0
            assert b.stats.ok_responder >= 1 and a.channels.path_of(b.peer_info()) == "relayed"
            assert a.channels.punched is not None and a.channels.punched.failed >= 1
            assert a.channels.punched.punched == 0

    run(main(), timeout_s=scaled(150))


def test_a_node_behind_a_router_is_reached_over_a_hole_punched_connection(corpus):
    # As above with b answering hole punches: a learns b's address through b's answer (b asks
    # a, a reachable peer, which address it sees), both dial each other from bound ports at
    # once (on loopback the connection forms at once), and a's channel to b runs over it, TLS
    # pinned end to end, into b's gate: a's exchanges with b leave the relay.
    async def main():
        reg = InMemoryRegistry()
        a = Node(tiny_config(corpus), InMemoryDiscovery(reg, "gasloc", "open"))
        b = Node(tiny_config(corpus, client_mode=True, peers=("/memory/open",)),
                 InMemoryDiscovery(reg, "gasloc", "nat"))
        async with a, b:
            await wait_until(lambda: a.stats.by_path["holepunched"] >= 2, timeout_s=scaled(60),
                             what="a's exchanges with b over a hole-punched connection")
            assert a.channels.path_of(b.peer_info()) == "holepunched"
            assert a.channels.punched is not None and b.channels.punched is not None
            assert a.channels.punched.punched >= 1 and b.channels.punched.answered >= 1
            relayed = a.stats.by_path["relayed"]
            await wait_until(lambda: a.stats.by_path["holepunched"] >= 4, timeout_s=scaled(60),
                             what="more exchanges over it")
            assert a.stats.by_path["relayed"] == relayed  # the relay carries none of them

    run(main(), timeout_s=scaled(150))


def test_unreachable_node_is_detected_and_taken_through_a_relay(corpus):
    # b announces an address nobody listens on (127.0.0.2; it binds 127.0.0.1): a's dial-back
    # fails, so b marks itself unreachable, keeps gossiping by dialing out, and listens at a
    # (the relay), through which a reaches it. a's own check (through b) succeeds, so a stays
    # reachable.
    async def main():
        reg = InMemoryRegistry()
        fast = {"reachability_interval_s": 0.5}
        cfg = tiny_config(corpus, **fast)
        a = Node(cfg, InMemoryDiscovery(reg, cfg.discovery.run_id, "node-a"))
        b = Node(tiny_config(corpus, peers=("/memory/node-a",), announce_host="127.0.0.2",
                             hole_punch=False, **fast),
                 InMemoryDiscovery(reg, cfg.discovery.run_id, "node-b"))
        async with a, b:
            await wait_until(lambda: not b.reachable, timeout_s=scaled(30),
                             what="b detects it cannot be dialed")
            assert a.reachable
            bid = b.me.peer_id  # derived from b's key, not the discovery's name
            await wait_until(lambda: bid in a.mode.book.peers
                             and not a.mode.book.peers[bid].reachable,
                             timeout_s=scaled(10), what="a learns b is unreachable")
            before = a.stats.ok_responder
            await wait_until(lambda: a.stats.ok_responder >= before + 2, timeout_s=scaled(60),
                             what="b still gossips by dialing out")
            await wait_until(lambda: a.stats.by_path["relayed"] >= 1, timeout_s=scaled(60),
                             what="a reaches b through its relay")
            assert b.peer_info().relays == (a.me.peer_id,) and b.listener is not None

    run(main(), timeout_s=scaled(150))


SEED = "/ip4/127.0.0.1/tcp/4001/p2p/QmXpQZ5i5WGi6pgc3yXfELRRtZmkXo8Nqkp1UG3ziodZxX"


def _pasted(hint: str):
    """The configuration a friend's node builds from a pasted join line."""
    import argparse
    import shlex

    from gasloc_p2p.cli import build_parser
    from gasloc_p2p.node.settings import build_config

    words = shlex.split(hint)
    env = dict(w.split("=", 1) for w in words if "=" in w and w.startswith("GASLOC_"))
    argv = [w for w in words if w not in {f"{k}={v}" for k, v in env.items()}]
    assert argv[:2] == ["gasloc-node", "join"], hint
    args = build_parser().parse_args(argv[1:])
    for name in ("func", "command", "check", "log_level"):
        args.__dict__.pop(name, None)
    return build_config(argparse.Namespace(**vars(args)), environ=env)


def test_a_join_line_without_a_manifest_carries_the_run_and_a_client_offers_no_address(corpus):
    """Without a manifest, the join line a node prints carries every setting of its run that
    is not a default (the data first: a friend who pastes it trains on the same corpus; tuning
    without a flag as GASLOC_*): the pasted line builds the same run. A client-mode node is
    never offered as a bootstrap peer: its line names the peers it joined through."""
    from gasloc_p2p.node.cli_node import startup_block
    from gasloc_p2p.node.manifest import RUN_FIELDS

    reg = InMemoryRegistry()
    cfg = tiny_config(corpus, run_id="demo", lr=3e-3, weight_decay=0.05, grad_accum=2)
    node = Node(cfg, InMemoryDiscovery(reg, "demo", "a"))
    block = startup_block(node, [SEED])
    hint = block.splitlines()[-1].strip()
    assert f"--data {corpus} " in hint and hint.startswith("GASLOC_")
    friend = _pasted(hint)
    for name in (*RUN_FIELDS, "batch_size", "grad_accum"):
        section = next(s for s in ("train", "outer", "gossip", "diloco")
                       if hasattr(getattr(cfg, s), name))
        assert getattr(getattr(friend, section), name) == getattr(getattr(cfg, section), name), \
            name
    assert friend.discovery.run_id == "demo" and friend.discovery.peers == (SEED,)

    mine = "/ip4/127.0.0.1/tcp/4002/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    client = Node(tiny_config(corpus, client_mode=True, peers=(SEED,)),
                  InMemoryDiscovery(reg, "gasloc", "nat"))
    block = startup_block(client, [mine])
    assert mine not in block, block
    assert "  dht      client mode: dials out only (not a bootstrap peer)" in block
    assert block.splitlines()[-1].endswith(f"--peers {SEED}")
