"""A node keeps its identity across restarts by default, and two nodes of one run on one
machine never share one."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time

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


def test_a_node_that_keeps_its_key_in_the_state_folder_keeps_its_checkpoint_beside_it(
        tmp_path, monkeypatch):
    """One folder per kept key and model (fingerprint): another model of the run ``gasloc``
    never meets a checkpoint it cannot load; a node whose key is its own business (a file
    elsewhere, or new at each start), --checkpoint-dir and auto_checkpoint false: none."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gasloc_p2p.protocol.membership import (
        Invitation,
        expires_in,
        public_bytes,
        write_invitation,
    )

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(state_dir, "_held", [])
    folder = tmp_path / "gasloc_p2p" / "nodes" / "gasloc"
    kept = cfg(identity_file=state_dir.default_identity(cfg()))
    assert state_dir.default_checkpoint(kept, "ab" * 32) == str(
        folder / "checkpoint-identity-abababababab")
    assert state_dir.default_checkpoint(kept, "cd" * 32) != state_dir.default_checkpoint(
        kept, "ab" * 32)
    assert state_dir.default_checkpoint(cfg(identity_file=str(tmp_path / "mine.key")),
                                        "ab" * 32) == ""
    assert state_dir.default_checkpoint(cfg(), "ab" * 32) == ""
    net = kept.network.identity_file
    assert state_dir.default_checkpoint(cfg(identity_file=net, checkpoint_dir="ck"), "ab") == ""
    assert state_dir.default_checkpoint(cfg(identity_file=net, auto_checkpoint=False),
                                        "ab") == ""
    owner, key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    invitation = Invitation.issue(owner, public_bytes(key), expires_in(1))
    write_invitation(str(tmp_path / "b.invite"), invitation, key.private_bytes_raw())
    member = build_config(argparse.Namespace(invitation=str(tmp_path / "b.invite")), environ={})
    assert state_dir.default_checkpoint(member, "ab" * 32) == str(
        folder / f"checkpoint-member-{invitation.member_id[:16]}-abababababab")


def test_a_member_finds_the_owner_again_after_the_owners_dht_restarts(tmp_path, monkeypatch):
    """A client-mode member bootstraps from one peer, the owner's node. The owner's DHT
    restarts (same key, same port): the member, alone in the DHT, pings its ``--peers`` again
    and both see each other's records; before, it stayed alone for good (peers 0 both sides).
    Alone means no DHT peer known too: the owner's record cached at the member (120 s here)
    must not hide that."""
    import asyncio
    import socket

    from gasloc_p2p.node.discovery import dht as dht_module
    from gasloc_p2p.node.discovery.base import PeerInfo
    from gasloc_p2p.node.discovery.dht import HivemindDiscovery
    from gasloc_p2p.protocol.auth import Signer
    from tests.node_helpers import cert_for, run, scaled

    monkeypatch.setattr(dht_module, "REJOIN_S", 1.0)  # 15 s in a node: the test's wait
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = str(tmp_path / "identity.dht.key")
    owner_key, member_key = Signer(), Signer()
    owner_info = PeerInfo(owner_key.peer_id, "127.0.0.1:1111", 2, "f" * 64,
                          cert=cert_for(owner_key.peer_id))
    member_info = PeerInfo(member_key.peer_id, "127.0.0.1:2222", 2, "f" * 64,
                           cert=cert_for(member_key.peer_id))

    def owner_dht() -> HivemindDiscovery:
        d = HivemindDiscovery("gasloc", "127.0.0.1", port, [], scaled(10), scaled(60),
                              identity_path=key)
        d.use_identity(owner_key, 300.0)
        return d

    async def both_see_each_other(owner: HivemindDiscovery, member: HivemindDiscovery) -> bool:
        deadline = time.monotonic() + scaled(60)
        while time.monotonic() < deadline:
            await owner.announce(owner_info, 120.0)
            await member.announce(member_info, 120.0)
            with contextlib.suppress(Exception):  # a lookup that times out while alone
                seen = ({p.peer_id for p in await member.peers()},
                        {p.peer_id for p in await owner.peers()})
                if all(s == {owner_key.peer_id, member_key.peer_id} for s in seen):
                    return True
            await asyncio.sleep(0.5)
        return False

    async def main() -> None:
        owner = owner_dht()
        await owner.start()
        addrs = await owner.visible_addrs()
        member = HivemindDiscovery("gasloc", "127.0.0.1", 0, addrs, scaled(10), scaled(60),
                                   client_mode=True)
        member.use_identity(member_key, 300.0)
        await member.start()
        try:
            assert await both_see_each_other(owner, member)
            await owner.stop()
            print("T stop", time.monotonic())
            for _ in range(1):  # the member's lookups while the owner is down (a node's restart
                with contextlib.suppress(Exception):  # takes seconds): it forgets the owner
                    await member.announce(member_info, 120.0)
                    await member.peers()
            print("T down", time.monotonic())
            owner = owner_dht()  # restarted: the same multiaddr, a DHT that knows nobody
            await owner.start()
            assert await owner.visible_addrs() == addrs
            print("T up", time.monotonic())
            assert await both_see_each_other(owner, member), "the member stayed alone"
        finally:
            await member.stop()
            await owner.stop()

    run(main(), timeout_s=scaled(240))
