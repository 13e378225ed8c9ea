"""A node keeps its identity across restarts by default, and two nodes of one run on one
machine never share one."""

from __future__ import annotations

import argparse
import subprocess
import sys

from gasloc_p2p.node import state_dir
from gasloc_p2p.node.settings import build_config
from gasloc_p2p.protocol.auth import load_or_create_identity


def cfg(**flags: object):
    return build_config(argparse.Namespace(open_swarm=True, **flags), environ={})


def test_the_default_identity_is_kept_per_run_and_never_shared(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(state_dir, "_held", [])
    first = state_dir.default_identity(cfg())
    assert first == str(tmp_path / "gasloc_p2p" / "nodes" / "gasloc" / "identity.key")
    second = state_dir.default_identity(cfg())  # a second node of the run while the first runs
    assert second.endswith("identity-1.key")
    other_run = state_dir.default_identity(cfg(run_id="other"))
    assert "/nodes/other/identity.key" in other_run
    assert state_dir.default_identity(cfg(checkpoint_dir=str(tmp_path / "ck"))) == str(
        tmp_path / "ck" / "identity.key")
    assert state_dir.default_identity(cfg(identity_file=str(tmp_path / "mine.key"))) == str(
        tmp_path / "mine.key")
    for lock in state_dir._held:  # the first node stops: its file is free again...
        lock.close()
    state_dir._held.clear()
    assert state_dir.default_identity(cfg()) == first  # ...and a restart takes it back
    code = ("import sys, argparse; from gasloc_p2p.node import state_dir; from "
            "gasloc_p2p.node.settings import build_config; print(state_dir.default_identity("
            "build_config(argparse.Namespace(open_swarm=True), environ={})))")
    held = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          timeout=60)
    assert held.stdout.strip().endswith("identity-1.key"), held.stderr  # another process
    key = load_or_create_identity(first)
    assert load_or_create_identity(first).peer_id == key.peer_id  # the same peer id again


def test_the_dht_keeps_its_peer_id_across_restarts(tmp_path, monkeypatch, corpus):
    """The DHT's libp2p key lives beside the node's key: two starts with the same state
    folder have the same DHT peer id, so a join line (its multiaddr) survives a restart."""
    from gasloc_p2p.node.daemon import Node
    from gasloc_p2p.node.discovery.dht import HivemindDiscovery
    from gasloc_p2p.protocol.auth import Signer
    from tests.daemon_helpers import tiny_config
    from tests.node_helpers import run, scaled

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(state_dir, "_held", [])
    mine = tiny_config(corpus, identity_file=state_dir.default_identity(cfg()))
    path = state_dir.dht_identity(mine)
    assert path == str(tmp_path / "gasloc_p2p" / "nodes" / "gasloc" / "identity.dht.key")
    assert Node(mine).discovery.identity_path == path  # what the node's DHT is started with

    async def dht_peer_id(identity: str) -> str:
        dht = HivemindDiscovery("gasloc", "127.0.0.1", 0, [], scaled(10), scaled(60),
                                identity_path=identity)
        dht.use_identity(Signer(), 60.0)
        await dht.start()
        await dht.stop()
        return dht.dht_peer_id

    first = run(dht_peer_id(path), timeout_s=120)
    assert run(dht_peer_id(path), timeout_s=120) == first
    assert run(dht_peer_id(""), timeout_s=120) != first  # no kept key: a new id


def test_a_member_whose_invitation_holds_its_key_keeps_its_dht_key_in_the_state_folder(
        tmp_path, monkeypatch):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gasloc_p2p.protocol.membership import (
        Invitation,
        expires_in,
        public_bytes,
        write_invitation,
    )

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    owner, key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    invitation = Invitation.issue(owner, public_bytes(key), expires_in(1))
    write_invitation(str(tmp_path / "b.invite"), invitation, key.private_bytes_raw())
    member = build_config(argparse.Namespace(invitation=str(tmp_path / "b.invite")), environ={})
    assert state_dir.dht_identity(member) == str(
        tmp_path / "gasloc_p2p" / "nodes" / "gasloc" / f"dht-{invitation.member_id}.key")
    assert state_dir.dht_identity(cfg()) == ""  # a key new at each start: its DHT's too
