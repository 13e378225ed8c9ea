"""Hostile peers against real gRPC servers: forged headers, outsiders without the swarm key,
forged DHT records, fake records at a closed port, slow and idle streams; and reachability
that heals (on a manual clock)."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import random
import signal
import socket
import time

import grpc
import pytest

from gasloc_p2p.node.config import NetworkConfig
from gasloc_p2p.node.discovery.base import InMemoryDiscovery, InMemoryRegistry, PeerInfo
from gasloc_p2p.node.discovery.records import make_validator, signed_value
from gasloc_p2p.node.modes.gossip import GossipLoop, PeerBook
from gasloc_p2p.node.runtime.clock import ManualClock, every
from gasloc_p2p.node.runtime.reachability import Reachability
from gasloc_p2p.node.stats import TrainStats
from gasloc_p2p.node.transport.service import download_state, fetch_info
from gasloc_p2p.node.transport.tls import secure_channel
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer, new_nonce
from gasloc_p2p.protocol.messages import (
    UNAUTHENTICATED,
    ExchangeError,
    Identity,
    Rejected,
    make_header,
    sign_header,
)
from gasloc_p2p.protocol.session import ProtocolError
from tests.node_helpers import (
    RUN,
    assert_same_state,
    cert_for,
    full_state,
    gossip_config,
    make_peer,
    plain_dht,
    relay_from,
    run,
    scaled,
    settle,
    wait_until,
)

SWARM_KEY = b"0123456789abcdef-the-swarm-secret"


async def _send_header(a, b, forge):
    """A raw stream from ``a`` to ``b`` whose first Header ``forge`` tampers with; returns the
    first message ``b`` answers."""
    prep = a.engine.prepare(b.me.peer_id, 0, a.exchanger.rules.codec)
    msg = sign_header(make_header(a.me, prep, 2), a.me.signer, new_nonce(), b"")
    forge(msg.header)
    call = a.open_call(b)
    try:
        await call.write(msg)
        return await call.read()
    finally:
        call.cancel()


def _claim_other_id(h):  # impersonate another peer, signed with our own key
    h.peer_id = Signer().peer_id


def _other_key(h):  # the right id but someone else's key and signature
    other = Signer()
    h.public_key = other.public_key
    h.signature = other.sign("gasloc/header", [])


def _tampered(h):  # a field changed after signing
    h.rounds += 1


def _unsigned(h):
    h.signature = b""


@pytest.mark.parametrize("forge", [_claim_other_id, _other_key, _tampered, _unsigned])
def test_forged_header_is_rejected_unauthenticated(forge):
    async def main():
        a, b = await make_peer("A", 1), await make_peer("B", 2)
        try:
            before = full_state(b)
            reply = await _send_header(a, b, forge)
            assert reply.WhichOneof("kind") == "reject", reply
            assert reply.reject.code == UNAUTHENTICATED, reply.reject
            assert b.exchanger.stats.rejected_inbound == 1
            assert_same_state(before, full_state(b))
            await a.exchange(b)  # an honest, signed exchange still works
        finally:
            await a.close()
            await b.close()

    run(main())


def test_responder_must_own_the_dialed_id():
    """An initiator that dials peer X's endpoint but reaches a node with another key aborts
    (a stale or forged record cannot make it exchange with an impostor)."""
    async def main():
        a, b = await make_peer("A", 1), await make_peer("B", 2)
        try:
            x = Signer().peer_id  # the record said X lives at b's endpoint
            result = await settle(a.exchanger.initiate(lambda: a.open_call(b), x, 0))
            assert isinstance(result, ProtocolError), result
            assert "answered by" in str(result)
            assert b.exchanger.stats.ok == a.exchanger.stats.ok == 0
        finally:
            await a.close()
            await b.close()

    run(main())


def test_outsider_without_swarm_key_gets_health_only():
    async def main():
        a = await make_peer("A", 1, swarm_key=SWARM_KEY)
        b = await make_peer("B", 2, swarm_key=SWARM_KEY)
        outsider = await make_peer("O", 3)  # a valid key of its own, but no swarm secret
        wrong = await make_peer("W", 4, swarm_key=b"another-secret-of-16-bytes")
        try:
            before = full_state(a)
            for stranger in (outsider, wrong):
                result = await settle(stranger.exchange(a))
                assert isinstance(result, Rejected) and result.code == UNAUTHENTICATED, result
                state = await settle(download_state(stranger.stub(a), stranger.me, scaled(5),
                                                    outer=stranger.state.outer))
                assert isinstance(state, ExchangeError) and state.code == UNAUTHENTICATED
                info = await fetch_info(stranger.stub(a), scaled(5),
                                        stranger.me.signer)
                assert info.ok and not info.authenticated
                assert info.step == 0 and not info.peers and info.run_id == RUN
            unsigned = await fetch_info(b.stub(a), scaled(5))
            assert unsigned.ok and not unsigned.authenticated and unsigned.step == 0
            assert_same_state(before, full_state(a))
            # members: exchanges, state and the full Info
            await b.exchange(a)
            meta, params, _ = await download_state(b.stub(a), b.me, scaled(5),
                                                   outer=b.state.outer)
            assert params.numel() == meta.numel > 0
            info = await fetch_info(b.stub(a), scaled(5), b.me.signer)
            assert info.authenticated and info.step == 7 and list(info.peers) == ["x"]
        finally:
            for p in (a, b, outsider, wrong):
                await p.close()

    run(main())


def test_forged_and_overwritten_dht_records_are_ignored():
    async def main():
        reg = InMemoryRegistry()
        honest, reader = Signer(), Signer()
        d = InMemoryDiscovery(reg, RUN, "h")
        d.use_identity(honest, 10.0)
        r = InMemoryDiscovery(reg, RUN, "r")
        r.use_identity(reader, 10.0)
        await d.start()
        x = PeerInfo(honest.peer_id, "127.0.0.1:1111", 2, "f" * 64, step=5,
                     cert=cert_for(honest.peer_id))
        await d.announce(x, 5.0)
        assert await r.peers() == [x]
        entries = reg.entries[d.key]
        value, exp = entries[x.peer_id]
        attacker = Signer()
        fake = PeerInfo(honest.peer_id, "6.6.6.6:1", 2, "f" * 64, step=10**9,
                        cert=cert_for(honest.peer_id))
        forged = [
            # X's id, signed by the attacker's key
            ({**signed_value(d.key, PeerInfo(attacker.peer_id, "6.6.6.6:1", 2, "f" * 64,
                                             cert=cert_for(attacker.peer_id)),
                             attacker, exp), "endpoint": "6.6.6.6:1"}, exp),
            ({**value, "endpoint": "6.6.6.6:1", "step": 10**9}, exp),  # X's signature, edited
            ({**fake.to_value()}, exp),  # unsigned
            (value, exp + 1000.0),  # X's own record stored with a longer life
        ]
        for v, e in forged:
            entries[x.peer_id] = (v, e)
            assert await r.peers() == [], v
        # a record signed by its owner with an expiry too far ahead is refused too
        far = time.monotonic() + 1000.0
        entries[attacker.peer_id] = (signed_value(d.key, PeerInfo(
            attacker.peer_id, "6.6.6.6:1", 2, "f" * 64, cert=cert_for(attacker.peer_id)),
            attacker, far), far)
        entries[x.peer_id] = (value, exp)
        assert await r.peers() == [x]

    run(main())


def test_dht_validator_refuses_records_not_signed_by_their_owner():
    """The same checks inside hivemind's DHT (store and find): honest DHT nodes neither keep
    nor pass on a forged or overwriting record."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time

    key = f"gasloc/{RUN}/peers"
    owner, attacker = Signer(), Signer()
    validator = make_validator(key, owner, 40.0)
    exp = get_dht_time() + 20.0
    info = PeerInfo(owner.peer_id, "127.0.0.1:1", 2, "f" * 64, cert=cert_for(owner.peer_id))

    def record(value, subkey=owner.peer_id, expiration=exp, k=key):
        return DHTRecord(DHTID.generate(source=k).to_bytes(), MSGPackSerializer.dumps(subkey),
                         MSGPackSerializer.dumps(value), expiration)

    good = signed_value(key, info, owner, exp)
    assert validator.validate(record(good))
    assert not validator.validate(record({**good, "endpoint": "6.6.6.6:1"}))
    assert not validator.validate(record(good, expiration=exp + 500))  # overwrite, longer life
    stolen = signed_value(key, PeerInfo(attacker.peer_id, "6.6.6.6:1", 2, "f" * 64,
                                        cert=cert_for(attacker.peer_id)),
                          attacker, exp)
    assert not validator.validate(record(stolen))  # the attacker's record under X's id
    assert validator.validate(record(stolen, subkey=attacker.peer_id))  # its own id is fine
    assert validator.validate(record({"any": 1}, k="another/key"))  # other keys untouched
    far = get_dht_time() + 500  # signed by its owner, but living far longer than allowed
    assert not validator.validate(record(signed_value(key, info, owner, far), expiration=far))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tarpit() -> socket.socket:
    """A port that completes TCP handshakes (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1024)
    return s


async def _gossip_events(a, b, ports: list[int], events: int) -> list[tuple[bool, float]]:
    """Run ``events`` gossip events of ``a``'s, back to back, with ``b`` (which exchanged
    with ``a`` before) and one fake record at each of ``ports`` in its book: whether each
    committed an exchange, and how long it took (s)."""
    book = PeerBook(a.me.peer_id)
    fake_peers = [PeerInfo(pid, f"127.0.0.1:{port}", 2, "f" * 64, cert=cert_for(pid))
                  for pid, port in ((Signer().peer_id, port) for port in ports)]
    book.update([PeerInfo(b.me.peer_id, b.endpoint, 2, "f" * 64, cert=b.cert), *fake_peers])
    net = NetworkConfig(connect_timeout_s=scaled(5))
    loop = GossipLoop(a.exchanger, book, a.channels, a.exchanger.cfg, net, TrainStats(),
                      inner_steps=10, seed=1)
    out = []
    for _ in range(events):
        t0 = time.monotonic()
        outcome = await loop.gossip_once()
        out.append((outcome is not None, time.monotonic() - t0))
    return out


@pytest.mark.parametrize("kind,fakes", [("closed", 20), ("tarpit", 150)])
def test_fake_records_at_dead_ports_do_not_stall_gossip(kind, fakes):
    """Records at closed ports, or at tarpits (ports that accept TCP and never answer: the
    TLS handshake hangs), cost a gossip event little: a peer that exchanged before is dialed
    beside the random picks, the dead ones are backed off once their (shorter) connect timeout
    ends, and no event waits for them. Before, 150 tarpit records cut gossip to 1% of its
    rate: an event found a live peer among its 3 random picks 6% of the time, and waited the
    5 s connect timeout otherwise."""
    async def main():
        cfg = gossip_config(busy_retries=3, backoff_s=5.0)
        a, b = await make_peer("A", 1, cfg), await make_peer("B", 2)
        pits = [_tarpit() for _ in range(fakes)] if kind == "tarpit" else []
        ports = [p.getsockname()[1] for p in pits] or [_closed_port() for _ in range(fakes)]
        try:
            await a.exchange(b)
            clean = await _gossip_events(a, b, [], 10)
            attacked = await _gossip_events(a, b, ports, 40)
            slowest = max(t for _, t in attacked)
            print(f"gossip events: {sum(ok for ok, _ in clean)} of 10 committed without fakes, "
                  f"{sum(ok for ok, _ in attacked)} of 40 with {fakes} at {kind} ports "
                  f"(slowest {slowest:.3f} s, median "
                  f"{sorted(t for _, t in attacked)[20]:.3f} s)")
            assert all(ok for ok, _ in clean)
            assert all(ok for ok, _ in attacked)
            assert slowest < scaled(5) / 4  # no event waits for a dead port's timeout
        finally:
            for pit in pits:
                pit.close()
            await a.close()
            await b.close()

    run(main(), timeout_s=60)


def test_slow_trickle_stream_is_cut_and_honest_peers_still_exchange():
    async def main():
        slow_cfg = gossip_config(min_transfer_bps=2000.0, transfer_grace_s=scaled(1.0),
                                 chunk_timeout_s=scaled(3), exchange_timeout_s=scaled(60))
        b = await make_peer("B", 2, slow_cfg)
        a, c = await make_peer("A", 1), await make_peer("C", 3)
        try:
            prep = a.engine.prepare(b.me.peer_id, 0, a.exchanger.rules.codec)
            nonce = new_nonce()
            msg = sign_header(make_header(a.me, prep, 2), a.me.signer, nonce, b"")
            call = a.open_call(b)
            await call.write(msg)
            reply = await call.read()
            assert reply.WhichOneof("kind") == "header"
            # the proof of key over B's nonce, then a payload far too slow
            await call.write(sign_header(make_header(a.me, prep, 2), a.me.signer, nonce,
                                         reply.header.nonce))
            started = time.monotonic()

            async def trickle():  # one byte every 0.5 s: inside the 3 s per-message timeout
                for i in range(60):
                    await call.write(pb.ExchangeMsg(chunk=pb.Chunk(data=bytes(prep.payload[i:i + 1]))))
                    await asyncio.sleep(0.5)

            writer = asyncio.create_task(trickle())
            await wait_until(lambda: b.exchanger.stats.failures["slow-transfer"] == 1,
                             timeout_s=10, what="B cuts the slow stream")
            cut_after = time.monotonic() - started
            writer.cancel()
            await settle(writer)
            call.cancel()
            print(f"slow stream cut after {cut_after:.2f} s")
            assert cut_after < scaled(5)
            # the failure is counted before the stream's slot is released: wait for both
            await wait_until(lambda: not b.exchanger.inflight, what="B frees the slot")
            assert b.exchanger.stats.ok == 0
            await c.exchange(b)  # honest peers still exchange
        finally:
            for p in (a, b, c):
                await p.close()

    run(main())


def test_idle_streams_cannot_make_info_fail_nor_hold_the_exchange_slots():
    """Streams that never send a Header: Info still answers at once, at most the pre-auth
    pool's 8 stay open (each newcomer displaces the oldest), and while an attacker from another
    address block keeps 15 of them open (re-opening each one the node drops, until its block
    has spent its budget: tests/test_node_preauth.py) every honest exchange commits. Before
    protocol 7, 15 idle streams from 5 addresses held the node's stream cap and no honest
    exchange was answered for 40 s."""
    async def main():
        b = await make_peer("B", 2, gossip_config(exchange_timeout_s=scaled(20)))
        a = await make_peer("A", 1)
        idle: list = []
        try:
            stub = a.stub(b)
            for _ in range(30):  # open streams that never send a Header
                call = stub.Exchange(timeout=scaled(30))
                await call.wait_for_connection()
                idle.append(call)
            t0 = time.monotonic()
            for _ in range(5):
                info = await fetch_info(stub, scaled(2), a.me.signer)
                assert info.ok and info.authenticated
            print(f"5 Info calls under 30 idle streams in {time.monotonic() - t0:.3f} s")
            # one connection carries 16 calls at once (the rest wait in the client): 16 reached
            # B, which keeps 8 of them
            await wait_until(lambda: b.preauth.displaced >= 8, what="B drops the oldest")
            assert len(b.preauth) <= 8
            for call in idle:
                call.cancel()

            async def keep_idle(stop: asyncio.Event) -> int:
                """15 idle streams from another block, each re-opened as soon as it ends;
                the streams opened."""
                opened = 0
                async with relay_from("127.1.0.1", b.endpoint) as via:
                    channel = secure_channel(via, b.cert)
                    other = pb_grpc.GossipStub(channel)

                    async def one() -> None:
                        nonlocal opened
                        while not stop.is_set():
                            call = other.Exchange(timeout=scaled(30))
                            opened += 1
                            await settle(call.read())  # ends when the node drops it
                            if await call.code() == grpc.StatusCode.UNAVAILABLE:
                                await asyncio.sleep(0.1)  # cut off: the block cools down
                    await asyncio.gather(*(one() for _ in range(15)))
                    await channel.close()
                return opened

            async def exchanges(n: int) -> float:
                t = time.monotonic()
                for _ in range(n):
                    await a.exchange(b)  # raises if one fails
                return n / (time.monotonic() - t)

            clean = await exchanges(5)
            stop = asyncio.Event()
            attacker = asyncio.create_task(keep_idle(stop))
            await wait_until(lambda: len(b.preauth) >= 8, what="the idle streams fill the pool")
            attacked = await exchanges(10)
            stop.set()
            print(f"exchanges per second: {clean:.1f} clean, {attacked:.1f} under 15 idle "
                  f"streams ({b.preauth.displaced} displaced)")
            await asyncio.wait_for(attacker, scaled(10))  # each ends within the deadline
        finally:
            for call in idle:
                call.cancel()
            await a.close()
            await b.close()

    run(main())


def test_one_failed_dial_back_does_not_make_a_node_unreachable_and_it_heals():
    async def main():
        clock = ManualClock()
        reach = Reachability(probes_needed=3, rng=random.Random(0))
        answers = iter([False, None, False, False, True])  # a transient failure, then healed
        asked: list[str] = []

        async def ask(peer_id):
            asked.append(peer_id)
            return next(answers, True)

        async def check():
            await reach.check(["p1"], ask)  # one helper: successive checks accumulate

        task = asyncio.create_task(every(clock, 60.0, check, "reachability"))
        try:
            await clock.advance(60)
            assert reach.reachable  # one failed dial-back proves little
            await clock.advance(120)
            assert reach.reachable  # no answer teaches nothing: 1 failure in a row, then 2
            await clock.advance(60)
            assert not reach.reachable  # the third failure in a row
            await clock.advance(60)
            assert reach.reachable  # re-checked while unreachable: healed
            assert len(asked) == 5
        finally:
            task.cancel()
            await settle(task)

    run(main())


def test_reachability_asks_distinct_peers_within_one_check():
    async def main():
        reach = Reachability(probes_needed=3)
        asked: list[str] = []

        async def no(peer_id):
            asked.append(peer_id)
            return False

        assert not await reach.check(["a", "b", "c", "d"], no)
        assert len(set(asked)) == 3 == len(asked)

    run(main())


def test_identity_is_bound_to_the_key():
    signer = Signer()
    me = Identity.keyed(RUN, "f" * 64, signer)
    assert me.peer_id == signer.peer_id and me.peer_id.startswith("g1")
    assert Signer().peer_id != signer.peer_id


@pytest.mark.parametrize("signature", [b"", bytes(64), "replayed"])
def test_commit_not_signed_for_this_stream_is_not_applied(signature):
    async def main():
        a, b = await make_peer("A", 1), await make_peer("B", 2)
        try:
            before = full_state(b)
            prep = a.engine.prepare(b.me.peer_id, 0, a.exchanger.rules.codec)
            msg = sign_header(make_header(a.me, prep, 2), a.me.signer, new_nonce(), b"")
            call = a.open_call(b)
            await call.write(msg)
            reply = await call.read()
            assert reply.WhichOneof("kind") == "header"
            await call.write(pb.ExchangeMsg(chunk=pb.Chunk(data=bytes(prep.payload))))
            await call.write(pb.ExchangeMsg(ready=pb.Ready()))
            sig = signature
            if sig == "replayed":  # a valid commit signature, but from another stream's nonces
                from gasloc_p2p.protocol.messages import COMMIT_DOMAIN, commit_fields

                old = pb.Header(nonce=new_nonce(), peer_id=a.me.peer_id)
                sig = a.me.signer.sign(COMMIT_DOMAIN, commit_fields(msg.header, old))
            # B may read the commit and end the stream before our write completes
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call.write(pb.ExchangeMsg(commit=pb.Commit(signature=sig)))
            await wait_until(lambda: b.exchanger.stats.failed == 1, what="B refuses the commit")
            call.cancel()
            assert b.exchanger.stats.ok == 0
            assert b.exchanger.stats.failures["inbound:ProtocolError"] == 1
            assert_same_state(before, full_state(b))
        finally:
            await a.close()
            await b.close()

    run(main())


def test_nodes_with_swarm_key_ignore_a_node_without_it(corpus, tmp_path):
    """Three real nodes (in-memory discovery): two share --swarm-key and gossip; the third has
    none. Neither side accepts the other's records, so they never meet."""
    from gasloc_p2p.node.daemon import Node
    from tests.daemon_helpers import tiny_config

    key_file = tmp_path / "swarm.key"
    key_file.write_bytes(SWARM_KEY + b"\n")

    async def main():
        reg = InMemoryRegistry()
        keyed = tiny_config(corpus, swarm_key=str(key_file))
        a = Node(keyed, InMemoryDiscovery(reg, keyed.discovery.run_id, "a"))
        b = Node(tiny_config(corpus, swarm_key=str(key_file), peers=("/memory/a",)),
                 InMemoryDiscovery(reg, keyed.discovery.run_id, "b"))
        c = Node(tiny_config(corpus), InMemoryDiscovery(reg, keyed.discovery.run_id, "c"))
        async with a, b, c:
            await wait_until(lambda: min(a.stats.ok_initiator, b.stats.ok_initiator) >= 2,
                             timeout_s=60, what="the keyed nodes gossip")
            assert len(reg.entries[f"gasloc/{keyed.discovery.run_id}/peers"]) == 3
            assert [p.peer_id for p in a.peers] == [b.me.peer_id]
            assert [p.peer_id for p in b.peers] == [a.me.peer_id]
            assert c.peers == [] and c.stats.ok == 0
            info = await fetch_info(c.channels.stub(a.endpoint, a.tls.cert_der), scaled(5), c.signer)
            assert info.ok and not info.authenticated and not info.peers

    run(main(), timeout_s=120)


def test_identity_file_keeps_the_peer_id(tmp_path):
    from gasloc_p2p.protocol.auth import load_or_create_identity

    path = tmp_path / "node.key"
    first = load_or_create_identity(str(path))
    assert path.stat().st_mode & 0o777 == 0o600
    again = load_or_create_identity(str(path), SWARM_KEY)
    assert again.peer_id == first.peer_id and again.swarm_key == SWARM_KEY
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="32-byte"):
        load_or_create_identity(str(path))


def test_health_reply_carries_the_dht_peer_id_for_bootstrap_multiaddrs():
    """``gasloc-container join-via`` builds /p2p/<DHT id> from an unsigned Info call."""
    from gasloc_p2p.node.transport.service import GossipServicer

    me = Identity.keyed(RUN, "f" * 64, Signer())
    servicer = GossipServicer(me, None, lambda: pb.InfoReply(step=3), lambda: None)
    servicer.dht_peer_id = "12D3KooWexample"

    async def main():
        health = await servicer.Info(pb.InfoRequest(), None)
        assert health.dht_peer_id == "12D3KooWexample" and health.peer_id == me.peer_id
        assert health.ok and not health.authenticated and health.step == 0

    run(main())


def test_real_dht_keeps_the_owners_record_against_an_overwrite():
    """Three hivemind DHT processes: X announces itself; an attacker's DHT (without the
    validator) stores X's record with another endpoint and a long expiration. The honest DHT
    nodes refuse to store it and drop it from the attacker's answers, so a reader still sees X's
    own record (with a read-side check only, X would vanish for the attacker's expiration)."""
    from hivemind.utils import get_dht_time

    from gasloc_p2p.node.discovery.dht import HivemindDiscovery

    async def main():
        owner, reader_key = Signer(), Signer()
        x = HivemindDiscovery(RUN, "127.0.0.1", 0, [], scaled(10), scaled(60))
        x.use_identity(owner, 40.0)
        started: list = [x]
        attacker = None
        try:
            await x.start()
            addrs = await x.visible_addrs()
            reader = HivemindDiscovery(RUN, "127.0.0.1", 0, addrs, scaled(10), scaled(60))
            reader.use_identity(reader_key, 40.0)
            started.append(reader)
            await reader.start()
            info = PeerInfo(owner.peer_id, "127.0.0.1:1111", 2, "f" * 64,
                            cert=cert_for(owner.peer_id))
            await x.announce(info, 20.0)
            assert await reader.peers() == [info]
            attacker = await asyncio.to_thread(plain_dht, addrs)
            far = get_dht_time() + 1000.0
            forged = {**signed_value(x.key, info, owner, far - 980.0), "expires": far,
                      "endpoint": "6.6.6.6:1"}
            stored = attacker.store(x.key, forged, far, subkey=owner.peer_id, return_future=True)
            await asyncio.to_thread(stored.result, scaled(30))
            for _ in range(3):
                assert await reader.peers() == [info]
                assert await x.peers() == [info]
                await asyncio.sleep(0.2)
        finally:
            if attacker is not None:
                await asyncio.to_thread(attacker.shutdown)
            for d in started:
                await d.stop()

    run(main(), timeout_s=120)


def test_a_dht_process_that_dies_while_starting_is_started_again(tmp_path, monkeypatch, caplog):
    """The first forked DHT process dies of SIGSEGV before it is ready (as one did once in a
    loaded CI run): the node sees it at once, starts a fresh one, and the second works."""
    import hivemind

    from gasloc_p2p.node.discovery.dht import HivemindDiscovery

    marker = tmp_path / "crashed"
    serve = hivemind.DHT.run

    def crash_once(self):
        if not marker.exists():
            marker.touch()
            faulthandler.disable()  # pytest's: no stack dump of this intended crash in the log
            os.kill(os.getpid(), signal.SIGSEGV)
        serve(self)

    monkeypatch.setattr(hivemind.DHT, "run", crash_once)
    monkeypatch.setenv("GASLOC_DHT_START", "fork")  # the patch reaches a forked child only

    async def main():
        d = HivemindDiscovery(RUN, "127.0.0.1", 0, [], scaled(10), scaled(60))
        d.use_identity(Signer(), 40.0)
        t0 = time.monotonic()
        try:
            await d.start()
            took = time.monotonic() - t0
            assert await d.visible_addrs()
        finally:
            await d.stop()
        return took

    took = run(main(), timeout_s=120)
    assert marker.exists()
    assert "the DHT process exited while starting (signal SIGSEGV); starting it again" in \
        caplog.text
    assert took < scaled(60) / 2  # not the half-timeout a hung start waits
