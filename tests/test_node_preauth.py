"""What a caller that has proved nothing can hold (issue 39): silent connections are closed,
half-open calls cannot starve members' Info nor exchanges, one address cannot grow the node's
open files beyond its share; and the gate's admission rules, without sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator

import grpc

from gasloc_p2p.node.config import NetworkConfig
from gasloc_p2p.node.transport.gate import ConnectionTable, GateLimits
from gasloc_p2p.node.transport.service import fetch_info
from gasloc_p2p.node.transport.tls import secure_channel
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from tests.node_helpers import make_peer, relay_from, run, scaled, wait_until

ATTACKER = "127.1.0.1"  # loopback, but another /24 than the members' 127.0.0.1


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def silent(endpoint: str, n: int, source: str = ATTACKER) -> list[socket.socket]:
    """``n`` TCP connections from ``source`` that never send a byte."""
    host, port = endpoint.rsplit(":", 1)
    socks = []
    for _ in range(n):
        sock = socket.create_connection((host, int(port)), source_address=(source, 0))
        sock.setblocking(False)
        socks.append(sock)
    return socks


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def test_silent_connections_are_closed_within_the_deadline():
    """TCP connections that never send a byte, or stop inside the TLS handshake, are closed
    after ``preauth_timeout_s``; before, they stayed for gRPC's 120 s default and 19,800 of
    them held a node's file descriptors."""
    async def main():
        deadline = scaled(1.0)
        b = await make_peer("B", 2, net=NetworkConfig(preauth_timeout_s=deadline))
        try:
            socks = silent(b.endpoint, 20)
            started = time.monotonic()
            stalled = silent(b.endpoint, 1)[0]  # one TLS record header, then nothing
            stalled.send(b"\x16\x03\x01")
            everything = [*socks, stalled]
            await wait_until(lambda: all(map(closed_by_peer, everything)), timeout_s=5,
                             what="the node closes the silent connections")
            took = time.monotonic() - started
            print(f"21 silent connections closed after {took:.2f} s (deadline {deadline:g} s)")
            assert deadline * 0.9 <= took <= deadline + scaled(2)
            assert b.server.gate.silent == 20
            await wait_until(lambda: len(b.server.gate.table) == 0, what="the gate forgets them")
            for sock in everything:
                sock.close()
        finally:
            await b.close()

    run(main())


async def _never() -> AsyncIterator[pb.InfoRequest]:
    await asyncio.Event().wait()
    yield pb.InfoRequest()  # never reached: headers only, no message


def test_half_open_calls_cannot_starve_a_members_info_nor_an_exchange():
    """100 Info calls from one address that send their headers and no message, over 7
    connections, with a deadline of their own of 60 s: a member's Info and an exchange still
    succeed at once, and the node ends every half-open call within its pre-authentication
    deadline. Before, the calls held 100 of the 88 places of a server-wide cap and both got
    RESOURCE_EXHAUSTED until the callers' deadline."""
    async def main():
        deadline = scaled(2.0)
        b = await make_peer("B", 2, net=NetworkConfig(preauth_timeout_s=deadline))
        a = await make_peer("A", 1)
        calls, channels = [], []
        try:
            async with relay_from(ATTACKER, b.endpoint) as via:
                channels = [secure_channel(via, b.cert, [("grpc.use_local_subchannel_pool", 1)])
                            for _ in range(7)]
                for channel in channels:
                    half_open = channel.stream_unary(
                        "/gasloc.v1.Gossip/Info",
                        request_serializer=pb.InfoRequest.SerializeToString,
                        response_deserializer=pb.InfoReply.FromString)
                    calls += [half_open(_never(), timeout=60)
                              for _ in range(min(15, 100 - len(calls)))]
                await asyncio.gather(*(c.wait_for_connection() for c in calls))  # headers sent
                started = time.monotonic()
                info = await fetch_info(a.stub(b), scaled(2), a.me.signer)
                assert info.ok and info.authenticated
                await a.exchange(b)
                print(f"a member's signed Info and an exchange under 100 half-open calls: "
                      f"{time.monotonic() - started:.3f} s")
                codes = await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls)),
                                               deadline + scaled(5))
            ended = set(codes)
            print(f"half-open calls ended with {sorted(c.name for c in ended)}; "
                  f"{b.preauth.displaced} displaced")
            assert ended <= {grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert b.preauth.displaced >= 100 - b.preauth.size  # all of them reached B
        finally:
            for call in calls:
                call.cancel()
            for channel in channels:
                await channel.close()
            await a.close()
            await b.close()

    run(main())


def test_calls_reopened_as_fast_as_they_end_are_cut_off_by_address_block():
    """An address that opens Exchange streams without a Header as fast as the node ends them
    (displaced by the next): once its block has spent its budget of unproven calls, the gate
    closes the connection and refuses the block's new ones for the cool-down, so the node
    handles a bounded number of such calls; a member from another block still exchanges.
    Before, the pool displaced them for ever: 630 calls a second from one process cut a
    node's training to 36% of its steps."""
    async def main():
        b = await make_peer("B", 2)
        a = await make_peer("A", 1)
        handled = 0
        try:
            async with relay_from(ATTACKER, b.endpoint) as via:
                channel = secure_channel(via, b.cert)
                stub = pb_grpc.GossipStub(channel)
                stop = asyncio.Event()

                async def churn() -> None:
                    nonlocal handled
                    while not stop.is_set():
                        call = stub.Exchange(timeout=scaled(10))
                        with contextlib.suppress(grpc.RpcError):
                            await call.read()  # BUSY when displaced
                        handled += 1
                        if call.done() and await call.code() == grpc.StatusCode.UNAVAILABLE:
                            await asyncio.sleep(0.05)  # cut off: try again

                churners = [asyncio.create_task(churn()) for _ in range(12)]
                await wait_until(lambda: b.server.gate.cut >= 1, timeout_s=20,
                                 what="the gate cuts the churning connection")
                limits = b.server.gate.limits
                at_cut = b.preauth.displaced
                await asyncio.sleep(scaled(1.0))  # the block is cooling down: refused
                after = b.preauth.displaced - at_cut
                await a.exchange(b)
                stop.set()
                await asyncio.gather(*churners, return_exceptions=True)
                await channel.close()
            print(f"churned calls displaced before the cut: {at_cut}, in the next second: "
                  f"{after}; connections refused {b.server.gate.refused}")
            assert at_cut <= limits.unproven_burst + 2 * limits.unproven_per_s * scaled(20)
            assert after <= 12  # at most the calls in flight when the connection was cut
            assert b.server.gate.refused >= 1
        finally:
            await a.close()
            await b.close()

    run(main())


def test_one_address_holds_at_most_its_share_of_connections_and_files():
    """300 connections from one address: the node keeps ``connections_per_block`` (8 here),
    closes the rest at once, and its open files grow by at most those; a member from another
    block still exchanges. Before, every connection was kept (19,800 held 19,832 of a
    node's 20,000 file descriptors)."""
    async def main():
        net = NetworkConfig(connections_per_block=8, max_connections=16,
                            preauth_timeout_s=scaled(30))
        b = await make_peer("B", 2, net=net)
        a = await make_peer("A", 1)
        socks: list[socket.socket] = []
        try:
            await a.exchange(b)  # the member's connection is open
            before = open_files()
            socks = silent(b.endpoint, 300)
            await wait_until(lambda: b.server.gate.refused >= 292, what="the rest are refused")
            await wait_until(lambda: sum(map(closed_by_peer, socks)) == 292,
                             what="the refused ones closed")
            grown = open_files() - before - len(socks)  # the node's side only
            print(f"300 connections from one address: {len(b.server.gate.table)} held, "
                  f"{b.server.gate.refused} refused, the node's open files +{grown}")
            assert b.server.gate.table.count("127.1.0.0/24") == 8
            assert grown <= 8
            await a.exchange(b)
            fresh = await make_peer("C", 3)  # a new member's connection from another block
            try:
                await fresh.exchange(b)
            finally:
                await fresh.close()
        finally:
            for sock in socks:
                sock.close()
            await a.close()
            await b.close()

    run(main())


def test_the_gate_admits_by_address_block_and_displaces_only_the_busiest():
    table = ConnectionTable(GateLimits(max_connections=6, per_block=4))
    ids = [table.admit("a")[0] for _ in range(5)]
    assert ids[-1] is None and len(table) == 4  # a block at its limit gets no more
    assert table.admit("b") == (5, None) and table.admit("b") == (6, None)
    table.relaying(1)
    # full: a block with 0 displaces one of the busiest (a, 4): its oldest still silent
    cid, victim = table.admit("c")
    assert cid is not None and victim == 2 and table.count("a") == 3
    # b (2) against a (3): not two fewer, so b is refused rather than a block displaced
    assert table.admit("b") == (None, None)
    for cid in (1, 3, 4):
        table.relaying(cid)
    # every one of a's relayed: the newest goes
    assert table.admit("d")[1] == 4
    table.release(99)  # unknown ids are ignored
    table.release(1)
    assert table.count("a") == 1 and len(table) == 5


def test_a_blocks_unproven_calls_spend_a_bucket_and_an_empty_one_cools_the_block():
    table = ConnectionTable(GateLimits(unproven_per_s=2.0, unproven_burst=3, cooldown_s=10.0))
    assert all(table.charge("a", 0.0) for _ in range(3))
    table.refund("a", 0.0)  # a call that proved itself gives its token back
    assert table.charge("a", 0.0)
    assert not table.charge("a", 0.0)  # empty: the block cools down
    assert table.admit("a", 5.0) == (None, None) and table.admit("b", 5.0)[0] is not None
    assert table.admit("a", 10.5)[0] is not None  # cooled down
    assert table.charge("a", 10.5)  # refilled at 2 a second meanwhile (at most 3)


def test_without_splice_grpc_serves_the_port_itself(monkeypatch):
    """The gate's relay is Linux's splice(2); elsewhere the node serves as before, and says
    that inbound connections are not bounded per address block."""
    monkeypatch.delattr(os, "splice", raising=False)

    async def main():
        a, b = await make_peer("A", 1), await make_peer("B", 2)
        try:
            assert b.server.gate is None
            info = await fetch_info(a.stub(b), scaled(5), a.me.signer)
            assert info.ok and info.authenticated
            await a.exchange(b)
        finally:
            await a.close()
            await b.close()

    run(main(), timeout_s=scaled(60))
