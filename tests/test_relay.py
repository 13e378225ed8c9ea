"""Relayed connections for nodes behind routers: the relay's hub (joins, bounds, refusals) and
the signed record field that names a node's relays. The real path, through routers doing NAT
in network namespaces, is tests/test_nat.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hivemind.utils import get_dht_time

from gasloc_p2p.node.discovery.base import PeerInfo
from gasloc_p2p.node.discovery.records import signed_value, verify_record
from gasloc_p2p.node.transport.circuits.hub import RelayHub, RelayLimits, RelayRefused
from gasloc_p2p.protocol.auth import Signer
from tests.node_helpers import cert_for


class Side:
    """One end of a relayed connection: what it sends (then its end) and what it got."""

    def __init__(self, chunks: list[bytes], hold: asyncio.Event | None = None) -> None:
        self.chunks, self.got, self.hold = list(chunks), bytearray(), hold

    async def read(self) -> bytes:
        if self.chunks:
            return self.chunks.pop(0)
        if self.hold is not None:  # keep the connection open until told
            await self.hold.wait()
        return b""

    async def write(self, data: bytes) -> None:
        self.got += data


async def _join(hub: RelayHub, caller: Side, listener: Side, target: str = "B") -> None:
    async with hub.listening(target) as tokens:
        call = asyncio.ensure_future(hub.call(target, caller.read, caller.write))
        token = await asyncio.wait_for(tokens.get(), 5)
        await hub.accept(token, listener.read, listener.write)
        await asyncio.wait_for(call, 5)


def test_a_caller_and_its_listener_are_joined_both_ways() -> None:
    hub = RelayHub(RelayLimits())
    caller, listener = Side([b"hello ", b"B"]), Side([b"hi ", b"A"])
    asyncio.run(_join(hub, caller, listener))
    assert bytes(listener.got) == b"hello B" and bytes(caller.got) == b"hi A"
    assert hub.stats.relayed == 1 and hub.stats.bytes == len(b"hello Bhi A")


def test_a_target_that_is_not_listening_is_refused() -> None:
    async def run() -> None:
        hub = RelayHub(RelayLimits())
        with pytest.raises(RelayRefused, match="not listening"):
            await hub.call("B", Side([]).read, Side([]).write)
        async with hub.listening("B"):
            pass
        with pytest.raises(RelayRefused, match="not listening"):  # it left
            await hub.call("B", Side([]).read, Side([]).write)
        assert (hub.stats.refused, hub.stats.relayed, hub.open, hub.listeners) == (2, 0, 0, 0)

    asyncio.run(run())


def test_a_relayed_connection_ends_at_its_byte_limit() -> None:
    hub = RelayHub(RelayLimits(bytes_per_connection=100))
    hold = asyncio.Event()
    caller = Side([b"x" * 64, b"y" * 64, b"z" * 64], hold)
    listener = Side([], hold)
    asyncio.run(_join(hub, caller, listener))
    assert bytes(listener.got) == b"x" * 64  # the chunk that would pass 100 bytes ends it


def test_a_relayed_connection_ends_at_its_time_limit() -> None:
    async def run() -> None:
        hub = RelayHub(RelayLimits(seconds_per_connection=0.3))
        hold = asyncio.Event()  # neither side ever ends
        await asyncio.wait_for(_join(hub, Side([b"a"], hold), Side([], hold)), 5)

    asyncio.run(run())


def test_connections_are_capped_counting_those_waiting_for_their_listener() -> None:
    async def run() -> None:
        hub = RelayHub(RelayLimits(connections=1, accept_s=5))
        async with hub.listening("B") as tokens:
            waiting = asyncio.ensure_future(hub.call("B", Side([]).read, Side([]).write))
            await asyncio.wait_for(tokens.get(), 5)  # B has not taken it yet
            with pytest.raises(RelayRefused, match="relaying 1 connections already"):
                await hub.call("B", Side([]).read, Side([]).write)
            waiting.cancel()

    asyncio.run(run())


def test_a_caller_whose_listener_never_takes_it_is_refused_in_time() -> None:
    async def run() -> None:
        hub = RelayHub(RelayLimits(accept_s=0.2))
        async with hub.listening("B"):
            with pytest.raises(RelayRefused, match="did not take"):
                await hub.call("B", Side([]).read, Side([]).write)
            # and its slot is free again: the next caller waits its own turn
            assert (hub.open, hub.listeners) == (0, 1)
            with pytest.raises(RelayRefused, match="did not take"):
                await hub.call("B", Side([]).read, Side([]).write)
        assert (hub.stats.refused, hub.listeners) == (2, 0)

    asyncio.run(run())


def test_a_token_is_taken_once_and_an_unknown_one_never() -> None:
    async def run() -> None:
        hub = RelayHub(RelayLimits())
        with pytest.raises(RelayRefused, match="no caller"):
            await hub.accept(b"\0" * 16, Side([]).read, Side([]).write)
        async with hub.listening("B") as tokens:
            call = asyncio.ensure_future(hub.call("B", Side([b"a"]).read, Side([]).write))
            token = await asyncio.wait_for(tokens.get(), 5)
            first = asyncio.ensure_future(hub.accept(token, Side([]).read, Side([]).write))
            await asyncio.sleep(0)
            with pytest.raises(RelayRefused, match="no caller"):
                await hub.accept(token, Side([]).read, Side([]).write)
            await asyncio.wait_for(asyncio.gather(call, first), 5)

    asyncio.run(run())


def test_listeners_are_capped_per_address_block_and_in_all() -> None:
    async def run() -> None:
        hub = RelayHub(RelayLimits(max_listeners=16))  # 2 per block
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(hub.listening("A", "6.6.6.0/24"))
            await stack.enter_async_context(hub.listening("B", "6.6.6.0/24"))
            # a third from the same block displaces that block's oldest, never another's
            await stack.enter_async_context(hub.listening("C", "6.6.6.0/24"))
            assert await asyncio.wait_for(a.get(), 5) == b""
            honest = [await stack.enter_async_context(hub.listening(f"h{i}", f"10.0.{i}.0/24"))
                      for i in range(13)]
            assert all(hub.listening_to(f"h{i}") for i in range(13)) and hub.listening_to("B")
            # all 16 taken (2 + 13 + ... ): a newcomer displaces the busiest block's oldest
            await stack.enter_async_context(hub.listening("D", "10.9.9.0/24"))
            await stack.enter_async_context(hub.listening("E", "10.9.8.0/24"))
            assert not hub.listening_to("B") and hub.listening_to("C")
            assert all(q.empty() for q in honest)
            # a listener that comes back replaces its own call
            again = await stack.enter_async_context(hub.listening("h0", "10.0.0.0/24"))
            assert await asyncio.wait_for(honest[0].get(), 5) == b"" and again.empty()

    asyncio.run(run())


def test_relayed_connections_are_capped_per_callers_address_block() -> None:
    async def run() -> None:
        hub = RelayHub(RelayLimits(connections=4, accept_s=5))  # 1 per block
        async with hub.listening("B") as tokens:
            first = asyncio.ensure_future(hub.call("B", Side([]).read, Side([]).write,
                                                   "6.6.6.0/24"))
            await asyncio.wait_for(tokens.get(), 5)
            with pytest.raises(RelayRefused, match="for 6.6.6.0/24 already"):
                await hub.call("B", Side([]).read, Side([]).write, "6.6.6.0/24")
            other = asyncio.ensure_future(hub.call("B", Side([]).read, Side([]).write,
                                                   "10.0.0.0/24"))
            await asyncio.wait_for(tokens.get(), 5)  # another block still gets through
            first.cancel()
            other.cancel()

    asyncio.run(run())


def test_a_records_relays_are_signed_and_checked() -> None:
    owner, relay = Signer(), Signer()
    key, exp = "gasloc/r/peers", get_dht_time() + 20
    info = PeerInfo(owner.peer_id, "127.0.0.1:1", 2, "f" * 64, reachable=False,
                    cert=cert_for(owner.peer_id), relays=(relay.peer_id,))
    value = signed_value(key, info, owner, exp)
    read = verify_record(key, owner.peer_id, value, exp, owner, get_dht_time(), 40)
    assert read is not None and read.relays == (relay.peer_id,) and read.relayed
    # a relay swapped in by someone else (to send the node's callers elsewhere) breaks it
    forged = {**value, "relays": [Signer().peer_id]}
    assert verify_record(key, owner.peer_id, forged, exp, owner, get_dht_time(), 40) is None
    for bad in (["not an id"], [relay.peer_id] * 5, "g1x"):
        assert PeerInfo.from_value(owner.peer_id, {**value, "relays": bad}) is None
    # a record without relays is signed as before (older nodes' records still verify)
    plain = PeerInfo(owner.peer_id, "127.0.0.1:1", 2, "f" * 64, cert=cert_for(owner.peer_id))
    assert verify_record(key, owner.peer_id, signed_value(key, plain, owner, exp), exp, owner,
                         get_dht_time(), 40) is not None


def test_calls_to_a_relay_take_a_connection_of_their_own() -> None:
    """The relay's calls (challenge, Relay, Listen) never share the TCP connection this node
    exchanges with the relay itself over: on a slow uplink they waited behind its payloads
    (bench_nat at 1 Mbit/s: a third of relayed connects failed after 10 s)."""
    import socket

    from gasloc_p2p.node.config_network import NetworkConfig
    from gasloc_p2p.node.transport.service import PeerChannels

    async def main() -> int:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            listener.setblocking(False)
            endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
            channels = PeerChannels(NetworkConfig())
            cert = cert_for("relay")
            try:
                stub_channel = channels.stub_and_channel(endpoint, cert)[1]
                assert channels.stub_and_channel(endpoint, cert)[1] is stub_channel  # cached
                relay_channel = channels.stub_and_channel(endpoint, cert, "relay")[1]
                assert relay_channel is not stub_channel
                accepted = []
                loop = asyncio.get_running_loop()
                for channel in (stub_channel, relay_channel):
                    channel.get_state(try_to_connect=True)
                    conn, _ = await asyncio.wait_for(loop.sock_accept(listener), 10)
                    accepted.append(conn)
                with contextlib.suppress(TimeoutError):  # no third connection
                    accepted.append((await asyncio.wait_for(loop.sock_accept(listener),
                                                            0.5))[0])
                for conn in accepted:
                    conn.close()
                return len(accepted)
            finally:
                await channels.close()

    assert asyncio.run(main()) == 2
