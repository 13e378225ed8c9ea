"""The gRPC side of a node: the Gossip servicer, the server, and client helpers.

Message sizes are bounded on both sides (``max_message_bytes``: one 1 MiB chunk plus headroom)
and HTTP/2 keepalive pings detect dead peers. :class:`PeerChannels` keeps a bounded LRU of
channels so repeated exchanges with a peer reuse one connection.

What a caller that has proved nothing can hold (see docs/security.md): a connection, through
the gate in front of the server (:mod:`gasloc_p2p.node.transport.gate`: per address block and
in all, closed if silent for ``preauth_timeout_s``); on it at most
``max_streams_per_connection`` calls (HTTP/2 SETTINGS; gRPC refuses more with RST_STREAM);
and a place in the servicer's small pool of calls that have not sent their first message (or,
for Exchange, a valid Header) within ``preauth_timeout_s``, where a newcomer displaces the
oldest call of the busiest block. There is no server-wide cap on calls: one that half-open
calls filled shut out members' Info and every exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import torch

from gasloc_p2p import __version__
from gasloc_p2p.core.outer import OuterOptimizer
from gasloc_p2p.node.config import NetworkConfig
from gasloc_p2p.node.transport.circuits.hub import RelayHub, RelayRefused
from gasloc_p2p.node.transport.exchange import GossipTransport
from gasloc_p2p.node.transport.gate import Gate, GateLimits
from gasloc_p2p.node.transport.tls import secure_channel, server_credentials
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer, Verifier, peer_id_of
from gasloc_p2p.protocol.certs import TlsIdentity
from gasloc_p2p.protocol.guard import address_block
from gasloc_p2p.protocol.messages import (
    BAD_REQUEST,
    BUSY,
    FINGERPRINT_MISMATCH,
    INFO_DOMAIN,
    MAX_CHUNK_BYTES,
    PROTOCOL_VERSION,
    REFUSED,
    RELAY_DOMAIN,
    RUN_MISMATCH,
    STATE_DOMAIN,
    UNAUTHENTICATED,
    VERSION_MISMATCH,
    Challenges,
    ExchangeError,
    Identity,
    check_request_auth,
    info_fields,
    reject,
    relay_fields,
    sign_info_request,
    sign_state_request,
    state_fields,
)
from gasloc_p2p.safelog import safe

if TYPE_CHECKING:
    from gasloc_p2p.node.transport.circuits import Peer as PeerInfo
    from gasloc_p2p.node.transport.circuits.client import RelayDialer
    from gasloc_p2p.node.transport.circuits.punch import Puncher

log = logging.getLogger(__name__)


def grpc_options(net: NetworkConfig, server: bool) -> list[tuple[str, int]]:
    """Message-size limits and keepalive for a server or a client channel; a server's
    connections also carry at most ``max_streams_per_connection`` calls at once and must
    finish their TLS and HTTP/2 handshake within ``preauth_timeout_s``."""
    opts = [
        ("grpc.max_send_message_length", net.max_message_bytes),
        ("grpc.max_receive_message_length", net.max_message_bytes),
        ("grpc.keepalive_time_ms", int(net.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(net.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if server:  # accept the clients' pings at our own keepalive rate (without it, gRPC's
        # default of 5 minutes answers the third idle ping with GOAWAY "too_many_pings": every
        # long-lived connection that went quiet, a relay's Listen or a hole-punched path,
        # ended after about 80 s)
        opts += [("grpc.http2.min_ping_interval_without_data_ms",
                  int(net.keepalive_time_s * 500)),
                 ("grpc.max_concurrent_streams", net.max_streams_per_connection),
                 ("grpc.server_handshake_timeout_ms", int(net.preauth_timeout_s * 1000))]
    return opts


@dataclass(frozen=True, eq=False)
class StateSnapshot:
    """What DownloadState sends: ``params`` (the public iterate; a DiLoCo mode's anchor) and
    ``state``, the outer optimizer ``outer``'s buffers by name in the order its class declares
    (none at gamma 0), float32 [numel] each."""

    step: int
    rounds: int
    outer: str
    params: torch.Tensor
    state: Mapping[str, torch.Tensor]

    def views(self) -> tuple[memoryview, ...]:
        """The body's parts as bytes views of the tensors' memory (no copy on CPU): the
        parameters, then each buffer."""
        return tuple(_bytes_view(t) for t in (self.params, *self.state.values()))

    def body(self) -> bytes:
        """The whole body as one bytes object (a copy; tests and small tools only)."""
        return b"".join(bytes(v) for v in self.views())


def _bytes_view(t: torch.Tensor) -> memoryview:
    array: Any = t.detach().float().cpu().contiguous().numpy()
    return memoryview(array).cast("B")


class SharedSnapshot:
    """One snapshot (and its CRC) shared by all downloads in progress, at most ``limit`` of them.

    The first download takes it (the node's ``take``: a copy of the public iterate and outer
    state,
    under the training lock); later ones reuse it while any download still streams it, and it is
    dropped when the last ends. So concurrent downloads cost one copy of the state, not one
    serialized copy each, and the body is streamed chunk by chunk from the snapshot's memory.
    """

    def __init__(self, take: Callable[[], StateSnapshot], limit: int) -> None:
        self.take = take  # blocking; runs in a thread
        self.limit = limit
        self.active = 0
        self.taken = 0  # snapshots taken so far (tests, metrics)
        self._current: tuple[StateSnapshot, tuple[memoryview, ...], int] | None = None
        self._lock = asyncio.Lock()

    def admit(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active -= 1
        if not self.active:
            self._current = None

    async def get(self) -> tuple[StateSnapshot, tuple[memoryview, ...], int]:
        """(snapshot, its body views, body CRC32); only between ``admit`` and ``release``."""
        async with self._lock:
            if self._current is None:
                self._current = await asyncio.to_thread(self._take)
                self.taken += 1
            return self._current

    def _take(self) -> tuple[StateSnapshot, tuple[memoryview, ...], int]:
        snap = self.take()
        if snap.params.device.type != "cpu":  # hold host copies only, not device ones too
            snap = replace(snap, params=snap.params.cpu(),
                           state={k: t.cpu() for k, t in snap.state.items()})
        views = snap.views()
        crc = 0
        for view in views:
            crc = zlib.crc32(view, crc)
        return snap, views, crc


@dataclass(frozen=True)
class ServeLimits:
    """Bounds on what callers can hold open: calls that have not sent their first message (an
    Exchange stream: a valid Header) yet and how long they may take to, concurrent state
    downloads, and the clock skew accepted in a signed request."""

    preauth_streams: int = 8
    preauth_timeout_s: float = 3.0
    max_downloads: int = 2
    auth_skew_s: float = 120.0
    download_s: float = 600.0  # a download served longer is cut: a reader that stops reading
    # would hold its slot for good (the node sets the state's time on the slowest link)


class Displaced(Exception):
    """A call waiting in the :class:`PreauthPool` was displaced by a newer one."""


class PreauthPool:
    """Calls that have proved nothing yet: at most ``size``. An Exchange stream stays until it
    shows a valid Header; an Info or DownloadState call until its request arrives.

    When the pool is full a new call displaces the oldest call of the address block
    (/24, /48) that holds the most, instead of being refused: idle calls hold a place only
    until the next call arrives, and an honest caller, whose message follows its call at
    once, is through in milliseconds. A pool that refused newcomers was held shut by 15
    idle streams (no honest exchange was answered for 40 s).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._streams: dict[object, tuple[str, asyncio.Task[Any]]] = {}  # oldest first
        self._gone: set[object] = set()  # displaced, until their handler has noticed
        self.displaced = 0

    def __len__(self) -> int:
        return len(self._streams)

    def enter(self, key: object, block: str, task: asyncio.Task[Any]) -> None:
        """Admit the stream ``key`` from ``block`` served by ``task`` (its handler); when
        full, cancel the handler of the oldest stream of the busiest block."""
        if len(self._streams) >= self.size:
            counts = Counter(b for b, _ in self._streams.values())
            busiest = max(counts, key=lambda b: counts[b])
            victim = next(k for k, (b, _) in self._streams.items() if b == busiest)
            self._streams.pop(victim)[1].cancel()
            self._gone.add(victim)
            self.displaced += 1
        self._streams[key] = (block, task)

    def leave(self, key: object) -> None:
        self._streams.pop(key, None)

    def was_displaced(self, key: object) -> bool:
        """Whether ``key``'s handler was cancelled to make room (once: then forgotten)."""
        if key in self._gone:
            self._gone.discard(key)
            return True
        return False

    @contextlib.asynccontextmanager
    async def waiting(self, block: str) -> AsyncIterator[Callable[[], None]]:
        """Hold a place for the current task's call from ``block`` until the body calls the
        function it gets (the call proved itself) or ends; :class:`Displaced` if a newer
        call took the place first."""
        key, task = object(), asyncio.current_task()
        assert task is not None
        self.enter(key, block, task)
        try:
            yield lambda: self.leave(key)
        except asyncio.CancelledError:
            if not self.was_displaced(key):
                raise  # the server stops
            task.uncancel()
            raise Displaced from None
        finally:
            self.leave(key)
            self._gone.discard(key)


class Door(Protocol):
    """What the servicer asks of the connection a call came on (the :class:`Gate`), by gRPC's
    ``context.peer()`` string."""

    def address_of(self, peer: str) -> str:
        """The caller's address."""

    def observed_of(self, peer: str) -> str:
        """The caller's ``host:port`` as this node sees the connection."""

    def unproven(self, peer: str) -> bool:
        """A call that has proved nothing starts; False: its connection is being closed."""

    def proved(self, peer: str) -> None:
        """The call proved itself (a valid Header, a signed request that checks out)."""


class OpenDoor:
    """A servicer served without a gate (tests, benchmarks): no per-source limits."""

    def address_of(self, peer: str) -> str:
        return host_of(peer)

    def observed_of(self, peer: str) -> str:
        return peer.partition(":")[2] or peer

    def unproven(self, peer: str) -> bool:
        return True

    def proved(self, peer: str) -> None:
        pass


def _peer(context: Any) -> str:
    try:
        return str(context.peer())
    except Exception:  # noqa: BLE001 - a test double or a closed call
        return "?"


class GossipServicer(pb_grpc.GossipServicer):
    """Serves Exchange (via the node's :class:`GossipTransport`), Info and DownloadState.

    ``exchanger`` None (a mode that does not gossip, e.g. DiLoCo): every Exchange stream is
    answered BUSY after its first message, as a gossiping node at its inbound limit answers.

    Callers are authenticated by signatures (``me.signer``, with the swarm key if any): an
    Exchange needs a signed Header (the session checks it), DownloadState a signed request;
    Info to an unauthenticated caller answers health only. Every call waits for its first
    message (an Exchange: a valid Header) in the :class:`PreauthPool`, at most
    ``limits.preauth_timeout_s``, so half-open or idle calls cannot hold the server's capacity
    or starve Info. :func:`add_to_server` serves Info and DownloadState as request streams
    (the same bytes on the wire) so that the wait for their request has that deadline.

    ``door``: the connection's side of every call (:class:`Door`; the :class:`Gate` behind
    :func:`start_server`): the caller's address, and each call that has not proved itself yet
    spends from its address block's budget.
    """

    def __init__(self, me: Identity, exchanger: GossipTransport | None,
                 info: Callable[[], pb.InfoReply], snapshot: Callable[[], StateSnapshot],
                 limits: ServeLimits | None = None) -> None:
        self.me = me
        self.exchanger = exchanger
        self.info = info
        self.limits = limits or ServeLimits()
        self.downloads = SharedSnapshot(snapshot, self.limits.max_downloads)
        self.verifier: Verifier = me.signer or Verifier()
        # the nonces signed requests must carry: issued in Info replies, each accepted once
        self.challenges = Challenges()
        # probe(endpoint, cert, peer_id): does the node at endpoint, holding cert, answer as
        # peer_id (set by the node)
        self.probe: Callable[[str, bytes, str], Awaitable[bool]] | None = None
        # punch(caller's endpoint, its local one): where this node dials from to meet the
        # caller's hole punch, public and local ("" if it does not; set by the node)
        self.punch: Callable[[str, str], Awaitable[tuple[str, str]]] | None = None
        self.dht_peer_id = ""  # for bootstrap multiaddrs, in every Info reply (set by the node)
        self._probing = asyncio.Lock()
        self.preauth = PreauthPool(self.limits.preauth_streams)
        self.door: Door = OpenDoor()
        self.relay: RelayHub | None = None  # relaying for nodes behind routers (set by the node)

    async def Exchange(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        peer = _peer(context)
        if not self.door.unproven(peer):
            return  # its address block is over budget: the gate closes the connection
        address = self.door.address_of(peer)
        try:
            async with self.preauth.waiting(address_block(address)) as arrived:
                def authenticated() -> None:
                    arrived()
                    self.door.proved(peer)

                await self._exchange(context, authenticated, address)
        except Displaced:  # by a newer stream: end the call properly
            await _try_write(context, reject(BUSY, "too many streams waiting"))

    async def _exchange(self, context: grpc.aio.ServicerContext,
                        authenticated: Callable[[], None], address: str) -> None:
        if self.exchanger is not None:
            await self.exchanger.respond(context, authenticated, self.limits.preauth_timeout_s,
                                         address)
            return
        try:  # read the header first, as the exchanger does, so the initiator sees the reject
            await asyncio.wait_for(context.read(), self.limits.preauth_timeout_s)
            await context.write(reject(BUSY, "this node does not gossip (--algorithm)"))
        except (TimeoutError, grpc.RpcError, asyncio.InvalidStateError) as exc:
            log.debug("stray Exchange stream dropped: %s", exc)

    def drain(self) -> None:
        """New exchanges get BUSY from now on (the server's stop grace)."""
        if self.exchanger is not None:
            self.exchanger.accepting = False

    async def _first(self, context: grpc.aio.ServicerContext) -> Any:
        """A call's request, within the pre-authentication pool and deadline; aborts the call
        (a status, no reply) if it does not come."""
        peer, request = _peer(context), None
        if not self.door.unproven(peer):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "too many calls from this address block")
        try:
            async with self.preauth.waiting(address_block(self.door.address_of(peer))):
                request = await asyncio.wait_for(context.read(), self.limits.preauth_timeout_s)
        except Displaced:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls waiting")
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no request in time")
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request")
        return request

    async def info_call(self, requests: Any, context: grpc.aio.ServicerContext
                        ) -> pb.InfoReply:
        """Info served as a request stream: its request within the pool's deadline."""
        return await self.Info(await self._first(context), context)

    async def download_call(self, requests: Any, context: grpc.aio.ServicerContext
                            ) -> AsyncGenerator[pb.StateChunk, None]:
        """DownloadState served as a request stream: its request within the pool's
        deadline."""
        request = await self._first(context)
        async for chunk in self.DownloadState(request, context):
            yield chunk

    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.InfoReply:
        now = time.time()
        why = check_request_auth(request.auth, self.verifier, INFO_DOMAIN,
                                 info_fields(request), now, self.limits.auth_skew_s,
                                 self.me.peer_id, self.challenges)
        observed = self.door.observed_of(_peer(context))
        if why is not None:  # health only; never a dial-back for a stranger
            return pb.InfoReply(protocol_version=PROTOCOL_VERSION, run_id=self.me.run_id,
                                peer_id=self.me.peer_id, software_version=__version__, ok=True,
                                dht_peer_id=self.dht_peer_id,
                                challenge=self.challenges.issue(now), observed=observed)
        self.door.proved(_peer(context))
        reply = self.info()
        reply.ok = reply.authenticated = True
        reply.dht_peer_id = self.dht_peer_id
        reply.challenge = self.challenges.issue(now)
        reply.observed = observed
        if request.probe_endpoint:
            reply.probe_ok = await self._probe(request.probe_endpoint, request.probe_cert,
                                               peer_id_of(request.auth.public_key))
        if request.punch_endpoint and self.punch is not None:
            reply.punch_endpoint, reply.punch_local = await self.punch(request.punch_endpoint,
                                                                       request.punch_local)
        return reply

    # ------------------------------------------------------------ relaying (circuits.hub)
    def _relay_caller(self, r: pb.RelayRequest) -> str | None:
        """The peer id that signed ``r`` for this node (None: refused, logged)."""
        why = check_request_auth(r.auth, self.verifier, RELAY_DOMAIN, relay_fields(r),
                                 time.time(), self.limits.auth_skew_s, self.me.peer_id,
                                 self.challenges)
        if why is not None:
            log.debug("refusing a relay request: %s", why)
            return None
        return peer_id_of(r.auth.public_key)

    async def listen_call(self, requests: Any, context: grpc.aio.ServicerContext
                          ) -> AsyncGenerator[pb.RelayEvent, None]:
        """A node behind a router waits here for its callers (this node relays)."""
        request = await self._first(context)
        if self.relay is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node does not relay")
        listener = self._relay_caller(request)
        if listener is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
        self.door.proved(_peer(context))
        assert self.relay is not None and listener is not None
        block = address_block(self.door.address_of(_peer(context)))
        async with self.relay.listening(listener, block) as tokens:
            while token := await tokens.get():
                yield pb.RelayEvent(token=token)

    async def relay_call(self, requests: Any, context: grpc.aio.ServicerContext
                         ) -> AsyncGenerator[pb.RelayMsg, None]:
        """One relayed connection: a caller's (naming its target) or its listener's (with
        the token of the Listen event)."""
        first = await self._first(context)
        if self.relay is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node does not relay")
        assert self.relay is not None
        if first.WhichOneof("kind") != "open":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Relay call opens first")
        opened = first.open
        outgoing: asyncio.Queue[bytes] = asyncio.Queue(1)

        async def read() -> bytes:
            msg = await context.read()
            return b"" if msg is grpc.aio.EOF or msg.WhichOneof("kind") != "data" else msg.data

        async def write(data: bytes) -> None:
            await outgoing.put(data)

        if opened.token:
            side = self.relay.accept(opened.token, read, write)
        else:
            caller = self._relay_caller(opened)
            if caller is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
            side = self.relay.call(opened.target_peer, read, write,
                                   address_block(self.door.address_of(_peer(context))))
        self.door.proved(_peer(context))
        task = asyncio.ensure_future(side)
        try:
            while True:
                getter = asyncio.ensure_future(outgoing.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                yield pb.RelayMsg(data=getter.result())
            exc = task.exception()
            if isinstance(exc, RelayRefused):
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            task.cancel()

    async def _probe(self, endpoint: str, cert: bytes, caller: str) -> bool:
        """Dial ``endpoint`` back with one Info call (a caller's reachability check).

        Uses the node's cached client channels (``self.probe``), never a channel owned by this
        handler, so a probe cannot hold up the server's stop. One probe at a time per server,
        so the service cannot be used to fan out connections. Only authenticated callers get a
        probe, and it succeeds only if the endpoint answers as the caller (``caller``'s id).
        """
        if self.probe is None or self._probing.locked():
            return False
        async with self._probing:
            return await self.probe(endpoint, cert, caller)

    async def DownloadState(self, request: pb.StateRequest,
                            context: Any) -> AsyncIterator[pb.StateChunk]:
        problem = self._check_state_request(request)
        if problem is not None:
            yield pb.StateChunk(reject=reject(problem.code, problem.message).reject)
            return
        self.door.proved(_peer(context))
        if not self.downloads.admit():
            yield pb.StateChunk(reject=reject(BUSY, f"serving {self.downloads.limit} state "
                                                    "downloads already; retry later").reject)
            return
        task = asyncio.current_task()
        timer = (asyncio.get_running_loop().call_later(self.limits.download_s, task.cancel)
                 if task is not None else None)
        try:
            snap, views, crc = await self.downloads.get()
            yield pb.StateChunk(meta=pb.StateMeta(
                protocol_version=PROTOCOL_VERSION, model_fingerprint=self.me.fingerprint,
                numel=snap.params.numel(), step=snap.step, rounds=snap.rounds,
                momentum=snap.outer, total_bytes=sum(v.nbytes for v in views),
                body_crc32=crc))
            for view in views:  # one 1 MiB copy at a time, as gRPC pulls the stream
                for start in range(0, view.nbytes, MAX_CHUNK_BYTES):
                    yield pb.StateChunk(data=bytes(view[start : start + MAX_CHUNK_BYTES]))
        finally:
            if timer is not None:
                timer.cancel()
            self.downloads.release()

    def _check_state_request(self, r: pb.StateRequest) -> ExchangeError | None:
        """Why ``r`` is refused (None: serve it). A caller that is not a member reads only
        that it is refused; the reason is logged here."""
        if r.protocol_version != PROTOCOL_VERSION:
            return ExchangeError(VERSION_MISMATCH, f"protocol {r.protocol_version}")
        why = check_request_auth(r.auth, self.verifier, STATE_DOMAIN, state_fields(r),
                                 time.time(), self.limits.auth_skew_s, self.me.peer_id,
                                 self.challenges)
        if why is not None:
            log.debug("refusing a state request: %s", why)
            return ExchangeError(UNAUTHENTICATED, REFUSED)
        if r.run_id != self.me.run_id:
            return ExchangeError(RUN_MISMATCH, f"run {r.run_id!r}")
        if r.model_fingerprint != self.me.fingerprint:
            return ExchangeError(FINGERPRINT_MISMATCH, "another model")
        return None


async def _try_write(context: Any, msg: pb.ExchangeMsg) -> None:
    try:
        await asyncio.wait_for(context.write(msg), 1.0)
    except Exception as exc:  # noqa: BLE001 - the caller is gone: nothing to tell it
        log.debug("could not write to a refused stream: %s", exc)


def host_of(peer: str) -> str:
    """The address in gRPC's ``ipv4:1.2.3.4:5678`` (``ipv4:1.2.3.4``; the port dropped)."""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def add_to_server(servicer: GossipServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer``: as the generated code does, but Info and DownloadState with
    request streams (the wire is the same), so that the wait for their request is bounded."""
    handlers = {
        "Exchange": grpc.stream_stream_rpc_method_handler(
            servicer.Exchange, request_deserializer=pb.ExchangeMsg.FromString,
            response_serializer=pb.ExchangeMsg.SerializeToString),
        "Info": grpc.stream_unary_rpc_method_handler(
            servicer.info_call, request_deserializer=pb.InfoRequest.FromString,
            response_serializer=pb.InfoReply.SerializeToString),
        "DownloadState": grpc.stream_stream_rpc_method_handler(
            servicer.download_call, request_deserializer=pb.StateRequest.FromString,
            response_serializer=pb.StateChunk.SerializeToString),
        "Listen": grpc.stream_stream_rpc_method_handler(
            servicer.listen_call, request_deserializer=pb.RelayRequest.FromString,
            response_serializer=pb.RelayEvent.SerializeToString),
        "Relay": grpc.stream_stream_rpc_method_handler(
            servicer.relay_call, request_deserializer=pb.RelayMsg.FromString,
            response_serializer=pb.RelayMsg.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


SERVICE = "gasloc.v1.Gossip"


class NodeServer:
    """The gRPC server (on a loopback port) behind its :class:`Gate` (on the node's port)."""

    def __init__(self, server: grpc.aio.Server, gate: Gate | None) -> None:
        self.grpc = server
        self.gate = gate  # None: gRPC serves the node's port itself (no splice(2) here)

    async def stop(self, grace: float | None) -> None:
        """No new connections; running calls get ``grace`` seconds; then everything closes."""
        if self.gate is not None:
            self.gate.stop_accepting()
        try:
            await self.grpc.stop(grace)
        finally:
            if self.gate is not None:
                await self.gate.close()


async def start_server(servicer: GossipServicer, host: str, port: int, net: NetworkConfig,
                       tls: TlsIdentity) -> tuple[NodeServer, int]:
    """Start serving on ``host:port`` (0: any free port) over TLS with ``tls``; returns the
    server and its port.

    The gRPC server listens on a loopback port; the node's port is the gate's, which admits
    connections by source and relays them (TLS end to end). No cap on calls is shared by all
    callers: what a caller can hold is bounded per connection, per address block and in the
    servicer's pre-authentication pool.

    OSError naming ``--port`` if the address cannot be bound (checked with a plain socket
    first, so no half-started server is left behind).
    """
    if port:
        check_bindable(host, port, "--port", "the gRPC port")
    server = grpc.aio.server(options=grpc_options(net, server=True))
    add_to_server(servicer, server)
    if not hasattr(os, "splice"):  # the gate's relay is Linux's splice(2)
        log.warning("no connection gate on this system (it needs Linux's splice(2)): "
                    "inbound connections are not bounded per address block")
        bound = server.add_secure_port(f"{host}:{port}", server_credentials(tls))
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} for gRPC: choose another --port "
                          "(0: any free port) or --host")
        await server.start()
        return NodeServer(server, None), bound
    inner = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    if inner == 0:
        raise OSError("cannot listen on a loopback port for gRPC")
    await server.start()
    gate = Gate(GateLimits(net.max_connections, net.connections_per_block,
                           net.preauth_timeout_s), ("127.0.0.1", inner))
    try:
        bound = await gate.start(host, port)
    except OSError as exc:
        await server.stop(0)
        raise OSError(f"cannot listen on {host}:{port} for gRPC ({exc.strerror}): choose "
                      "another --port (0: any free port) or --host") from None
    servicer.door = gate
    return NodeServer(server, gate), bound


def check_bindable(host: str, port: int, flag: str, what: str) -> None:
    """OSError with ``flag`` in its message if ``host:port`` cannot be bound right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is ok
        try:
            sock.bind((host, port))
        except OSError as exc:
            error = OSError(f"cannot listen on {host}:{port} for {what} ({exc.strerror}): "
                            f"choose another {flag} (0: any free port)")
            error.errno = exc.errno
            raise error from None


RELAYED_IDLE_MS = 5000  # a relayed channel without calls closes its connection after this


class PeerChannels:
    """A bounded LRU of TLS client channels by ``host:port`` and pinned certificate;
    ``close`` is safe to call twice."""

    def __init__(self, net: NetworkConfig) -> None:
        self.net = net
        self._channels: OrderedDict[tuple[str, bytes, str], grpc.aio.Channel] = OrderedDict()
        self._closing: list[asyncio.Task[None]] = []
        self.relayed: RelayDialer | None = None  # paths to peers behind routers (the node's)
        self.punched: Puncher | None = None  # ... hole-punched ones, where they form

    def dialable(self, peer: PeerInfo) -> bool:
        """Whether this node has a path to ``peer``: its gRPC endpoint, or a relay it
        listens at (with :attr:`relayed` set)."""
        return peer.reachable or (peer.relayed and self.relayed is not None)

    def endpoint_for(self, peer: PeerInfo) -> str:
        """Where gRPC dials ``peer``: its endpoint, or for a peer behind a router a loopback
        endpoint whose connection is a hole-punched one to it (:attr:`punched`, tried in the
        background), else whose connections travel through one of its relays."""
        if not peer.reachable and peer.relayed and self.relayed is not None:
            punched = self.punched.endpoint(peer) if self.punched is not None else None
            return punched or self.relayed.endpoint(peer)
        return peer.endpoint

    def path_of(self, peer: PeerInfo) -> str:
        """direct, holepunched or relayed: how connections to ``peer`` travel."""
        if peer.reachable:
            return "direct"
        if self.punched is not None and self.punched.holds(peer.peer_id):
            return "holepunched"
        return "relayed"

    def stub(self, endpoint: str, cert: bytes) -> pb_grpc.GossipStub:
        return self.stub_and_channel(endpoint, cert)[0]

    def relay_stub(self, endpoint: str, cert: bytes) -> pb_grpc.GossipStub:
        """A stub for the calls to a relay (its challenge, ``Relay``, ``Listen``) on a
        connection of their own: on the channel this node exchanges with the relay itself
        over, they waited behind its payloads on a slow uplink (bench_nat at 1 Mbit/s: 48
        relayed connects in 10 minutes failed after 10 s against 97 relayed exchanges)."""
        return self.stub_and_channel(endpoint, cert, "relay")[0]

    def stub_and_channel(self, endpoint: str, cert: bytes, purpose: str = ""
                         ) -> tuple[pb_grpc.GossipStub, grpc.aio.Channel]:
        """A stub on the cached channel to ``endpoint`` (``host:port``) that trusts only
        ``cert`` (DER, from the peer's signed record), and the channel; a ``purpose`` has a
        channel, and a connection, of its own. ValueError if ``cert`` is not a certificate
        with a name."""
        key = (endpoint, cert, purpose)
        channel = self._channels.get(key)
        if channel is None:
            options: list[tuple[str, int | str]] = [*grpc_options(self.net, False)]
            if self.relayed is not None and self.relayed.owns(endpoint):  # holds a slot of
                options.append(("grpc.client_idle_timeout_ms", RELAYED_IDLE_MS))  # the relay
            if purpose:  # not gRPC's shared connection of equal channels
                options += [("grpc.use_local_subchannel_pool", 1), ("gasloc.purpose", purpose)]
            channel = secure_channel(endpoint, cert, options)
            self._channels[key] = channel
            if len(self._channels) > self.net.max_channels:
                _, old = self._channels.popitem(last=False)
                self._closing = [f for f in self._closing if not f.done()]
                self._closing.append(asyncio.ensure_future(old.close(grace=1.0)))
        self._channels.move_to_end(key)
        return pb_grpc.GossipStub(channel), channel

    def discard(self, endpoint: str, cert: bytes) -> None:
        """Close the channel to ``endpoint`` (after a failed connect: the next attempt starts
        afresh instead of inheriting gRPC's growing reconnect backoff)."""
        channel = self._channels.pop((endpoint, cert, ""), None)
        if channel is not None:
            self._closing = [f for f in self._closing if not f.done()]  # bounded: a dead peer
            self._closing.append(asyncio.ensure_future(channel.close(grace=0)))  # is retried

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), OrderedDict()
        await asyncio.gather(*(c.close() for c in channels), *self._closing,
                             return_exceptions=True)
        self._closing = []


def info_request(signer: Signer, target: str, challenge: bytes, probe_endpoint: str = "",
                 probe_cert: bytes = b"", punch_endpoint: str = "", punch_local: str = ""
                 ) -> pb.InfoRequest:
    """An Info request signed for ``target`` with the ``challenge`` it issued; with
    ``probe_endpoint``, a dial-back to it trusting ``probe_cert``; with ``punch_endpoint``
    (and ``punch_local``), a hole punch to meet there (circuits/punch.py)."""
    request = pb.InfoRequest(probe_endpoint=probe_endpoint, probe_cert=probe_cert,
                             punch_endpoint=punch_endpoint, punch_local=punch_local)
    return sign_info_request(request, signer, time.time(), target, challenge)


async def target_of(stub: pb_grpc.GossipStub, timeout_s: float) -> tuple[str, bytes]:
    """The peer id a node answers with to an unsigned Info and the challenge it issued
    (what a signed request is bound to; a node that lies about its id refuses the request it
    gets)."""
    health: pb.InfoReply = await stub.Info(pb.InfoRequest(), timeout=timeout_s)
    return health.peer_id, health.challenge


async def fetch_info(stub: pb_grpc.GossipStub, timeout_s: float,
                     signer: Signer | None = None) -> pb.InfoReply:
    """A node's Info: health only without ``signer``; signed, one round trip more (the
    node's peer id and challenge, which the request is bound to)."""
    if signer is None:
        health: pb.InfoReply = await stub.Info(pb.InfoRequest(), timeout=timeout_s)
        return health
    target, challenge = await target_of(stub, timeout_s)
    reply: pb.InfoReply = await stub.Info(info_request(signer, target, challenge),
                                          timeout=timeout_s)
    return reply


def state_request(run_id: str, fingerprint: str, signer: Signer, target: str,
                  challenge: bytes) -> pb.StateRequest:
    request = pb.StateRequest(protocol_version=PROTOCOL_VERSION, run_id=run_id,
                              model_fingerprint=fingerprint)
    return sign_state_request(request, signer, time.time(), target, challenge)


async def download_state(stub: pb_grpc.GossipStub, me: Identity, timeout_s: float,
                         numel: int | None = None, info_timeout_s: float | None = None, *,
                         outer: OuterOptimizer,
                         ) -> tuple[pb.StateMeta, torch.Tensor, dict[str, torch.Tensor]]:
    """A peer's public iterate and outer state (float32 ``[numel]`` each), and its meta,
    within ``timeout_s`` (its challenge first, within ``info_timeout_s``, default the same).

    ``outer`` is this node's own outer optimizer (its settings suffice): a state announced for
    another one is refused in one line, and the body is sized from it alone, the parameters
    then each of its buffers in the order its class declares (returned by name). With
    ``numel`` (this node's model), a state announced for another size is refused before any
    byte of it is buffered."""
    assert me.signer is not None, "state requests are signed"
    request = state_request(me.run_id, me.fingerprint, me.signer, *await target_of(
        stub, timeout_s if info_timeout_s is None else min(timeout_s, info_timeout_s)))
    meta: pb.StateMeta | None = None
    body = bytearray()
    async with asyncio.timeout(timeout_s):
        async for msg in stub.DownloadState(request, timeout=timeout_s):
            kind = msg.WhichOneof("kind")
            if kind == "reject":
                raise ExchangeError(msg.reject.code, msg.reject.message)
            if kind == "meta" and meta is None:
                meta = msg.meta
                _check_state_meta(meta, numel, outer)
            elif kind == "data" and meta is not None:
                body += msg.data
                if len(body) > meta.total_bytes:
                    raise ExchangeError(BAD_REQUEST, "state larger than announced")
            else:
                raise ExchangeError(BAD_REQUEST, f"unexpected {kind} in the state stream")
    if meta is None or len(body) != meta.total_bytes or zlib.crc32(body) != meta.body_crc32:
        raise ExchangeError(BAD_REQUEST, "state stream incomplete or corrupt")
    parts = torch.frombuffer(body, dtype=torch.float32).view(1 + len(outer.buffers), -1)
    return meta, parts[0].clone(), {name: parts[1 + i].clone()
                                    for i, name in enumerate(outer.buffers)}


def _check_state_meta(meta: pb.StateMeta, numel: int | None, outer: OuterOptimizer) -> None:
    """ExchangeError unless the announced state is ``outer``'s (by name) and of the size this
    node expects: ``numel`` (if given) parameters, that many for each of ``outer``'s buffers."""
    if meta.momentum != outer.name:
        raise ExchangeError(BAD_REQUEST, f"state of the outer optimizer "
                                         f"'{safe(meta.momentum, 40)}', this node runs "
                                         f"'{outer.name}'")
    if (numel is not None and meta.numel != numel) or not meta.numel or (
            meta.total_bytes != 4 * meta.numel * (1 + len(outer.buffers))):
        raise ExchangeError(BAD_REQUEST, f"state of {meta.total_bytes} B for {meta.numel} "
                                         "params announced")
