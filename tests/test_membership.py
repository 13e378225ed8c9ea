"""Closed swarms: invitations signed by the owner, revocations, and what a non-member gets.

The rules without I/O (protocol/membership.py), then real gRPC peers: an invited member
exchanges and downloads state; a key without an invitation, a member of another owner, an
expired invitation and a revoked member are all refused, and read only "refused".
"""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gasloc_p2p.node.transport.service import download_state, fetch_info
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.membership import (
    Admission,
    Invitation,
    RevocationList,
    Revocations,
    public_bytes,
    read_invitation,
    write_invitation,
)
from gasloc_p2p.protocol.messages import UNAUTHENTICATED, ExchangeError, Rejected
from tests.node_helpers import (
    assert_same_state,
    full_state,
    make_peer,
    member_signer,
    run,
    scaled,
    settle,
)

OWNER = Ed25519PrivateKey.generate()
OWNER_PUB = public_bytes(OWNER)


def _member() -> tuple[Ed25519PrivateKey, bytes]:
    key = Ed25519PrivateKey.generate()
    return key, public_bytes(key)


def test_an_invitation_admits_exactly_its_key_until_it_expires():
    now = time.time()
    _, member = _member()
    inv = Invitation.issue(OWNER, member, now + 60)
    raw = inv.to_bytes()
    assert Invitation.from_bytes(raw) == inv and len(raw) == 137
    admission = Admission(OWNER_PUB)
    assert admission.admits(member, raw, now) is None
    _, other = _member()
    assert admission.admits(other, raw, now) == "the invitation is for another key"
    assert admission.admits(member, raw, now + 61) == "the invitation has expired"
    assert admission.admits(member, b"", now) == "no invitation"
    assert "not an invitation" in admission.admits(member, raw[:-1], now)
    forged = raw[:-64] + bytes(64)  # the member's own signature cannot stand in
    assert admission.admits(member, forged, now) == "the invitation's signature is not the owner's"
    stranger_owner = Ed25519PrivateKey.generate()  # anyone can be an owner of its own swarm
    theirs = Invitation.issue(stranger_owner, member, now + 60).to_bytes()
    assert admission.admits(member, theirs, now) == "invited by another owner"
    longer = bytearray(raw)
    longer[65:73] = Invitation.issue(OWNER, member, now + 10**6).to_bytes()[65:73]
    assert admission.admits(member, bytes(longer), now) is not None  # expiry is signed


def test_revocations_apply_the_newest_list_the_owner_signed():
    now = time.time()
    _, member = _member()
    inv = Invitation.issue(OWNER, member, now + 600).to_bytes()
    revocations = Revocations()
    admission = Admission(OWNER_PUB, revocations)
    first = RevocationList.issue(OWNER, {Invitation.from_bytes(inv).member_id: now + 300}, now)
    value = first.to_value()
    assert RevocationList.from_value(value, OWNER_PUB, first.expires) == first
    assert RevocationList.from_value(value, OWNER_PUB, first.expires + 1) is None  # replayed
    assert RevocationList.from_value(value, public_bytes(Ed25519PrivateKey.generate())) is None
    tampered = {**value, "entries": []}
    assert RevocationList.from_value(tampered, OWNER_PUB) is None
    assert revocations.update(first)
    assert admission.admits(member, inv, now) == "revoked by the owner"
    assert admission.admits(member, inv, now + 301) is None  # the entry lapsed
    assert not revocations.update(first)  # the same list again: nothing new
    cleared = RevocationList.issue(OWNER, {}, now + 1)
    assert revocations.update(cleared) and admission.admits(member, inv, now) is None
    assert not revocations.update(first)  # an older list never comes back


def test_invitation_files_round_trip_and_refuse_a_foreign_key(tmp_path):
    key, member = _member()
    inv = Invitation.issue(OWNER, member, time.time() + 60)
    path = tmp_path / "a.invite"
    write_invitation(str(path), inv, key.private_bytes_raw())
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_invitation(str(path)) == (inv, key.private_bytes_raw())
    other = tmp_path / "b.invite"
    write_invitation(str(other), inv, Ed25519PrivateKey.generate().private_bytes_raw())
    with pytest.raises(ValueError, match="not the invited key"):
        read_invitation(str(other))
    junk = tmp_path / "junk"
    junk.write_text("hello\n")
    with pytest.raises(ValueError, match="not an invitation file"):
        read_invitation(str(junk))


def test_members_exchange_and_everyone_else_reads_only_refused():
    """Over real gRPC: two invited members exchange and download state. A key without an
    invitation (a member minting a fresh identity), a member of another owner's swarm, an
    expired invitation and a revoked member are refused before any payload, and read
    "refused" (not the run, the model or a limit); Info gives them health only."""
    async def main():
        shared = Admission(OWNER_PUB)  # a's rule, with its revocations
        a = await make_peer("A", 1, signer=member_signer(OWNER, admission=shared))
        b = await make_peer("B", 2, signer=member_signer(OWNER))
        strangers = {
            "no invitation": await make_peer("S", 3, signer=Signer(
                admission=Admission(OWNER_PUB))),
            "another owner": await make_peer("O", 4, signer=member_signer(
                Ed25519PrivateKey.generate())),
            "expired": await make_peer("E", 5, signer=member_signer(OWNER, days=-1 / 86400)),
        }
        revoked = await make_peer("R", 6, signer=member_signer(OWNER))
        try:
            await b.exchange(a)
            await revoked.exchange(a)  # a member until revoked
            meta, params, _ = await download_state(b.stub(a), b.me, scaled(5),
                                                   outer=b.state.outer)
            assert params.numel() == meta.numel > 0
            assert (await fetch_info(b.stub(a), scaled(5), b.me.signer)).authenticated
            shared.revocations.update(RevocationList.issue(
                OWNER, {revoked.me.peer_id: time.time() + 60}, time.time()))
            strangers["revoked"] = revoked
            before = full_state(a)
            for why, s in strangers.items():
                result = await settle(s.exchange(a))
                assert isinstance(result, Rejected), (why, result)
                assert result.code == UNAUTHENTICATED and result.message == "refused", why
                state = await settle(download_state(s.stub(a), s.me, scaled(5),
                                                    outer=s.state.outer))
                assert isinstance(state, ExchangeError) and state.message == "refused", why
                info = await fetch_info(s.stub(a), scaled(5), s.me.signer)
                assert info.ok and not info.authenticated and info.step == 0, why
            assert_same_state(before, full_state(a))
            await b.exchange(a)  # members still exchange
        finally:
            for p in (a, b, revoked, *strangers.values()):
                await p.close()

    run(main())


def test_a_closed_swarm_of_nodes_keeps_strangers_out_and_applies_a_revocation(
        corpus, tmp_path, monkeypatch):
    """Three in-process nodes: the owner (its key made on first use), a member with an
    invitation file that holds its key, and a stranger in an open swarm of its own. The
    members gossip and list only each other (the stranger's record has no invitation); the
    stranger commits nothing. Then the owner revokes the member through the DHT: the owner
    drops its record and refuses its exchanges within a refresh."""
    from gasloc_p2p.node import daemon
    from gasloc_p2p.node.daemon import Node
    from gasloc_p2p.node.discovery.base import InMemoryDiscovery, InMemoryRegistry
    from gasloc_p2p.protocol.membership import load_or_create_owner_key
    from tests.daemon_helpers import tiny_config
    from tests.node_helpers import wait_until

    monkeypatch.setattr(daemon, "REVOCATION_REFRESH_S", 0.5)
    owner_path = tmp_path / "keys" / "owner.key"
    key = Ed25519PrivateKey.generate()
    invite = tmp_path / "b.invite"

    async def main():
        reg = InMemoryRegistry()
        cfg_a = tiny_config(corpus, owner_key=str(owner_path))
        a = Node(cfg_a, InMemoryDiscovery(reg, cfg_a.discovery.run_id, "a"))
        owner = load_or_create_owner_key(str(owner_path))  # the node made it
        write_invitation(str(invite), Invitation.issue(owner, public_bytes(key),
                                                       time.time() + 3600),
                         key.private_bytes_raw())
        b = Node(tiny_config(corpus, invitation=str(invite), peers=("/memory/a",)),
                 InMemoryDiscovery(reg, cfg_a.discovery.run_id, "b"))
        c = Node(tiny_config(corpus, peers=("/memory/a",)),
                 InMemoryDiscovery(reg, cfg_a.discovery.run_id, "c"))
        assert (a.membership.role, b.membership.role, c.membership.role) == (
            "owner", "member", "open")
        assert b.signer.public_key == public_bytes(key)  # the key from the invitation file
        async with a, b, c:
            await wait_until(lambda: min(a.stats.ok_initiator, b.stats.ok_initiator) >= 2,
                             timeout_s=60, what="the members gossip")
            assert [p.peer_id for p in a.peers] == [b.me.peer_id]
            assert [p.peer_id for p in b.peers] == [a.me.peer_id]
            assert c.stats.ok == 0
            await a.discovery.publish_revocations(RevocationList.issue(
                owner, {b.me.peer_id: time.time() + 600}, time.time()))
            await wait_until(lambda: not a.peers, timeout_s=scaled(10),
                             what="the owner drops the revoked member's record")
            failed = b.stats.failed
            await wait_until(lambda: b.stats.failed > failed, timeout_s=scaled(20),
                             what="the revoked member's next exchange fails")
            # an exchange already under way when the revocation arrived may still commit
            # (seen once under load); none that starts after it does
            ok, failed = a.stats.ok, b.stats.failed
            await wait_until(lambda: b.stats.failed > failed, timeout_s=scaled(45),
                             what="the revoked member's exchanges keep failing")
            assert a.stats.ok == ok
            # it stops, saying why, at its next read of the revocations (a timer: late under
            # load, once after its exchanges had failed for 45 s)
            await wait_until(lambda: "revoked this node" in b.error, timeout_s=scaled(30),
                             what="the revoked member stops, saying why")
            assert b._stop.is_set()

    run(main(), timeout_s=180)


def test_a_revoked_member_restarted_with_its_invitation_stops_in_one_line(corpus, tmp_path):
    """The owner revoked the member while it was away: restarted with its invitation, it
    stops at start (before building its model) with one line, instead of training alone."""
    from gasloc_p2p.node.config import ConfigError
    from gasloc_p2p.node.daemon import Node
    from gasloc_p2p.node.discovery.base import InMemoryDiscovery, InMemoryRegistry
    from tests.daemon_helpers import tiny_config

    key = Ed25519PrivateKey.generate()
    invitation = Invitation.issue(OWNER, public_bytes(key), time.time() + 3600)
    write_invitation(str(tmp_path / "b.invite"), invitation, key.private_bytes_raw())

    async def main():
        reg = InMemoryRegistry()
        cfg = tiny_config(corpus, invitation=str(tmp_path / "b.invite"), peers=("/memory/a",))
        owner = InMemoryDiscovery(reg, cfg.discovery.run_id, "a")
        await owner.publish_revocations(RevocationList.issue(
            OWNER, {invitation.member_id: time.time() + 600}, time.time()))
        b = Node(cfg, InMemoryDiscovery(reg, cfg.discovery.run_id, "b"))
        with pytest.raises(ConfigError, match="^the owner of this swarm revoked this node "
                                              f"\\({invitation.member_id}\\)") as err:
            await b.start()
        assert "\n" not in str(err.value) and b.trainer is None

    run(main(), timeout_s=60)
