"""The two ends of a relayed connection, as gRPC calls to the relay.

:class:`RelayDialer` (any node): a loopback endpoint per peer behind a router; each gRPC
connection to it travels in a ``Relay`` call to one of the relays the peer's record names,
so the node's own channel, TLS pinned to the peer's certificate, runs end to end through it.

:class:`RelayListener` (a node behind a router): holds a ``Listen`` call open at up to
``MAX_RELAYS`` reachable peers, and for each caller the relay announces opens a ``Relay``
call and carries it to the node's own gRPC server (its gate, on loopback). The relays it holds
are what its record announces.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from gasloc_p2p.node.transport.circuits import cancel_all
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.messages import sign_relay_request
from gasloc_p2p.safelog import safe

if TYPE_CHECKING:
    from gasloc_p2p.node.transport.circuits import Peer as PeerInfo

log = logging.getLogger(__name__)

MAX_RELAYS = 2  # relays a node behind a router listens at
CHUNK = 64 * 1024  # bytes per relayed message
_RETRY_S = 5.0  # a lost Listen call is replaced after this long (at most)

Stub = Callable[["PeerInfo"], pb_grpc.GossipStub]


async def _challenge(stub: pb_grpc.GossipStub, timeout_s: float) -> tuple[str, bytes]:
    health: pb.InfoReply = await stub.Info(pb.InfoRequest(), timeout=timeout_s)
    return health.peer_id, health.challenge


async def carry(call: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A socket's bytes into a ``Relay`` call and the call's into the socket, until either
    ends; then both are closed."""

    async def up() -> None:
        while data := await reader.read(CHUNK):
            await call.write(pb.RelayMsg(data=data))
        await call.done_writing()

    async def down() -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF or not msg.data:
                return
            writer.write(msg.data)
            await writer.drain()

    tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_all(tasks)
        call.cancel()
        with contextlib.suppress(Exception):
            writer.close()


class RelayDialer:
    """Loopback endpoints for peers behind routers (at most ``max_peers``, least recently
    used closed first)."""

    def __init__(self, signer: Signer, stub: Stub, relays_of: Callable[[PeerInfo],
                 Sequence[PeerInfo]], timeout_s: float) -> None:
        self.signer, self.stub, self.relays_of, self.timeout_s = signer, stub, relays_of, timeout_s
        self.max_peers = 32
        self._ends: OrderedDict[str, tuple[socket.socket, asyncio.Future[Any], int]] = OrderedDict()
        self._peers: dict[str, PeerInfo] = {}

    def endpoint(self, peer: PeerInfo) -> str:
        """``127.0.0.1:port`` whose connections reach ``peer`` through one of its relays (the
        socket listens at once; its accept loop starts at the event loop's next turn)."""
        self._peers[peer.peer_id] = peer
        end = self._ends.get(peer.peer_id)
        if end is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen(16)
            sock.setblocking(False)
            server = asyncio.ensure_future(asyncio.start_server(
                functools.partial(self._carry, peer.peer_id), sock=sock))
            end = self._ends[peer.peer_id] = (sock, server, sock.getsockname()[1])
            while len(self._ends) > self.max_peers:
                old, old_end = self._ends.popitem(last=False)
                self._peers.pop(old, None)
                _close(old_end)
        self._ends.move_to_end(peer.peer_id)
        return f"127.0.0.1:{end[2]}"

    def owns(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is one of this dialer's loopback endpoints."""
        return any(endpoint == f"127.0.0.1:{end[2]}" for end in self._ends.values())

    async def _carry(self, peer_id: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        peer = self._peers.get(peer_id)
        relays = list(self.relays_of(peer)) if peer is not None else []
        random.shuffle(relays)
        for relay in relays:
            stub = self.stub(relay)
            call = None
            try:
                target, challenge = await _challenge(stub, self.timeout_s)
                call = stub.Relay()
                await asyncio.wait_for(call.write(pb.RelayMsg(open=sign_relay_request(
                    pb.RelayRequest(target_peer=peer_id), self.signer, time.time(), target,
                    challenge))), self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - the next relay, if any
                log.debug("relay %s for %s: %s", safe(relay.peer_id[:12]), safe(peer_id[:12]),
                          exc)
                if call is not None:
                    call.cancel()
                continue
            await carry(call, reader, writer)
            return
        log.debug("no relay reached %s", safe(peer_id[:12]))
        writer.close()

    async def close(self) -> None:
        ends, self._ends = list(self._ends.values()), OrderedDict()
        for end in ends:
            _close(end)
        await asyncio.gather(*(end[1] for end in ends), return_exceptions=True)


def _close(end: tuple[socket.socket, asyncio.Future[Any], int]) -> None:
    sock, server, _ = end

    def closed(task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and task.exception() is None:
            task.result().close()

    server.add_done_callback(closed)
    with contextlib.suppress(OSError):
        sock.close()


class RelayListener:
    """Listen calls at up to :data:`MAX_RELAYS` reachable peers, each caller carried to
    ``upstream`` (this node's gate). :attr:`relays`: the peer ids listened at now."""

    def __init__(self, signer: Signer, stub: Stub, upstream: tuple[str, int],
                 timeout_s: float, on_change: Callable[[], None]) -> None:
        self.signer, self.stub, self.upstream, self.timeout_s = signer, stub, upstream, timeout_s
        self.on_change = on_change
        self._held: dict[str, asyncio.Task[None]] = {}  # relay peer id -> its Listen task
        self._ready: set[str] = set()
        self._carrying: set[asyncio.Task[None]] = set()

    @property
    def relays(self) -> tuple[str, ...]:
        return tuple(sorted(self._ready))

    def update(self, peers: Sequence[PeerInfo]) -> None:
        """Keep Listen calls at :data:`MAX_RELAYS` of the reachable ``peers``."""
        known = {p.peer_id: p for p in peers if p.reachable}
        for pid in [p for p, task in self._held.items() if task.done() or p not in known]:
            self._held.pop(pid).cancel()
            self._ready.discard(pid)
        fresh = [p for p in known.values() if p.peer_id not in self._held]
        random.shuffle(fresh)
        for peer in fresh[:MAX_RELAYS - len(self._held)]:
            self._held[peer.peer_id] = asyncio.ensure_future(self._listen(peer))

    async def _listen(self, relay: PeerInfo) -> None:
        stub = self.stub(relay)
        call = None
        try:
            target, challenge = await _challenge(stub, self.timeout_s)
            call = stub.Listen()
            await asyncio.wait_for(call.write(sign_relay_request(
                pb.RelayRequest(), self.signer, time.time(), target, challenge)), self.timeout_s)
            self._ready.add(relay.peer_id)
            self.on_change()
            log.info("listening for callers at relay %s", safe(relay.peer_id[:12]))
            while True:
                event = await call.read()
                if event is grpc.aio.EOF:
                    break
                task = asyncio.ensure_future(self._accept(stub, event.token))
                self._carrying.add(task)
                task.add_done_callback(self._carrying.discard)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - replaced at the next update
            log.debug("Listen at %s ended: %s", safe(relay.peer_id[:12]), exc)
        finally:
            if call is not None:
                call.cancel()
            if relay.peer_id in self._ready:
                self._ready.discard(relay.peer_id)
                self.on_change()
        await asyncio.sleep(random.uniform(0, _RETRY_S))  # (a done task is replaced)

    async def _accept(self, stub: pb_grpc.GossipStub, token: bytes) -> None:
        call = stub.Relay()
        try:
            await asyncio.wait_for(call.write(pb.RelayMsg(open=pb.RelayRequest(token=token))),
                                   self.timeout_s)
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the caller sees its connection closed
            log.debug("relayed caller not taken: %s", exc)
            call.cancel()
            return
        await carry(call, reader, writer)

    async def close(self) -> None:
        tasks = [*self._held.values(), *self._carrying]
        self._held.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
