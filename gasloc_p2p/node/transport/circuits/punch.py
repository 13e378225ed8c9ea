"""Hole-punched connections: a direct TCP connection between a node and a peer behind a
router, both opening it at once, so that their exchanges stop costing a relay its uplink.

How (TCP simultaneous open, RFC 5128; libp2p's DCUtR does the same over its relays):

1. The caller binds a port (``SO_REUSEADDR``, ``SO_REUSEPORT``), connects from it to a
   reachable peer and asks it in an Info call over that very connection which ``host:port``
   it sees (``InfoReply.observed``): the address the caller's router maps the port to. A
   reachable node that knows no other reachable peer takes its announced host and the port.
2. It sends that address to the target in a signed Info call over the relayed path
   (``InfoRequest.punch_endpoint``). The target does step 1 for itself, answers with its own
   mapped address (``InfoReply.punch_endpoint``) and starts dialing the caller.
3. Both dial each other from their bound ports, again every :data:`RETRY_S` for at most
   ``punch_s``, and listen on them: each one's SYN opens its own router for the other's, and
   the connection forms as a simultaneous open or as an accept (only from the address agreed).
4. The caller runs its gRPC channel to the target over the connection (:class:`SocketEnd`: a
   loopback endpoint whose one connection is piped into it), TLS pinned to the certificate in
   the target's signed record end to end; the target hands it to its gate like any connection
   accepted on its port (the same limits and deadlines).

Two nodes behind the same router see the same host observed: they dial each other's address on
their own network instead (sent beside the public one), since few routers carry a connection
from inside back inside (hairpinning).

A router that maps every connection to a new port (a symmetric NAT) makes step 1's address
wrong for the target: nothing connects, and the pair keeps its relayed path; the caller tries
again after a back-off (:data:`BACKOFF_S`, doubling to :data:`MAX_BACKOFF_S`). IPv4 only (the
address translation of home routers).

Bounds (the target dials an address a member chose; identities are free, so nothing here is
per peer id): each request is signed and bound to a challenge used once; a node answers at most
:data:`MAX_ANSWERING` at once and :data:`ANSWERS_PER_S` on average; each answer dials one
address from one port for at most ``punch_s``, one SYN per :data:`RETRY_S` at most. Addresses
are IPv4 literals with a port, at most :data:`MAX_ENDPOINT_CHARS` characters. A caller runs at
most :data:`MAX_ATTEMPTS` attempts at once and keeps at most ``max_peers`` punched paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import random
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gasloc_p2p.node.transport.circuits import cancel_all
from gasloc_p2p.node.transport.relay import Relay
from gasloc_p2p.node.transport.service import info_request, target_of
from gasloc_p2p.node.transport.tls import secure_channel
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.safelog import safe

if TYPE_CHECKING:
    from gasloc_p2p.node.transport.circuits import Peer

log = logging.getLogger(__name__)

MAX_ENDPOINT_CHARS = 64
RETRY_S = 0.1  # between one failed dial and the next
PUNCH_S = 10.0  # how long both ends dial (the answer may wait behind a payload on the relay)
MAX_ANSWERING = 2
ANSWERS_PER_S = 1.0
ANSWER_BURST = 4
MAX_ATTEMPTS = 2
BACKOFF_S = 30.0
MAX_BACKOFF_S = 600.0

Stub = Callable[["Peer"], pb_grpc.GossipStub]


def parse_endpoint(text: str) -> tuple[str, int] | None:
    """``(host, port)`` of an IPv4 ``host:port``, None for anything else."""
    if not text or len(text) > MAX_ENDPOINT_CHARS:
        return None
    host, _, port = text.rpartition(":")
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        return None
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return str(address), int(port)


def bound_socket(port: int = 0) -> socket.socket:
    """A non-blocking TCP socket bound to ``port`` (0: a free one), shareable with the other
    sockets of the punch on that port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("0.0.0.0", port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def meet(port: int, remote: tuple[str, int], within_s: float) -> socket.socket:
    """A TCP connection between ``port`` and ``remote``: dialed from the port again and again,
    and accepted on it (from ``remote`` only), whichever forms first; TimeoutError after
    ``within_s``."""
    loop = asyncio.get_running_loop()
    listener = bound_socket(port)
    listener.listen(4)

    async def accept() -> socket.socket:
        while True:
            sock, addr = await loop.sock_accept(listener)
            if (addr[0], addr[1]) == remote:
                return sock
            sock.close()

    async def dial() -> socket.socket:
        # One dial waits for its answer as long as the punch lasts (the kernel repeats its SYN):
        # a router that drops the first SYN keeps its own mapping open, and the other end's
        # SYN then meets this one (a simultaneous open). Closing a dial half-way through that
        # handshake would leave the address pair taken. A dial refused (a router that answers
        # with a reset) is repeated after RETRY_S.
        while True:
            sock = bound_socket(port)
            try:
                await loop.sock_connect(sock, remote)
                return sock
            except OSError:
                sock.close()
            await asyncio.sleep(RETRY_S)

    tasks = [asyncio.ensure_future(accept()), asyncio.ensure_future(dial())]
    try:
        done, _ = await asyncio.wait(tasks, timeout=within_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        formed = [t.result() for t in done if t.exception() is None]
        if not formed:
            raise TimeoutError(f"no connection with {remote[0]}:{remote[1]} in {within_s:g} s")
        for extra in formed[1:]:
            extra.close()
        # gRPC's own sockets send small frames at once; so must this one (Nagle's wait
        # behind a delayed ACK would hold each of an exchange's small messages back)
        formed[0].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return formed[0]
    finally:
        await cancel_all(tasks)
        listener.close()


class SocketEnd:
    """A loopback endpoint whose first connection is joined to ``sock`` (a connected TCP
    socket) both ways by the process's splice thread (:class:`_Splicer`: the kernel moves the
    bytes, off the event loop, which a node's exchanges keep busy) until either side ends; then
    both are closed and ``on_closed`` runs on the event loop. Later connections are refused."""

    def __init__(self, sock: socket.socket, on_closed: Callable[[], None] = lambda: None
                 ) -> None:
        self.sock, self.on_closed = sock, on_closed
        self.endpoint = ""
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._cid: int | None = None  # the splice thread's, while it joins the two
        self._closed = False

    async def start(self) -> str:
        """Listen on a loopback port; returns ``127.0.0.1:port``."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        self._listener = listener
        self.endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
        self._accepting = asyncio.ensure_future(self._accept(listener))
        return self.endpoint

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn, _ = await loop.sock_accept(listener)
        except OSError:
            self._end()
            return
        finally:
            listener.close()  # one connection: the next is refused
        if self._closed:
            conn.close()
            return
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self._cid = SPLICER.join(conn, self.sock, loop, self._spliced_end)

    def _spliced_end(self) -> None:
        """The splice thread has closed both sockets (on the event loop)."""
        self._cid = None
        self._report()

    def _end(self) -> None:
        if self._cid is not None:  # the splice thread closes both, then reports
            SPLICER.drop(self._cid)
            return
        for sock in (self.sock, self._listener):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._report()

    def _report(self) -> None:
        if not self._closed:
            self._closed = True
            self.on_closed()

    async def close(self) -> None:
        if self._accepting is not None and not self._accepting.done():
            await cancel_all([self._accepting])
        self._end()


class _Splicer:
    """The one thread of this process that joins the sockets of its punched paths (a
    :class:`~gasloc_p2p.node.transport.relay.Relay`, started on first use); each pair's end is
    reported on the event loop that joined it."""

    def __init__(self) -> None:
        self._relay: Relay | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = {}

    def join(self, a: socket.socket, b: socket.socket, loop: asyncio.AbstractEventLoop,
             on_closed: Callable[[], None]) -> int:
        with self._lock:
            if self._relay is None:
                self._relay = Relay(self._ended)
            cid = next(self._ids)
            self._waiting[cid] = (loop, on_closed)
            relay = self._relay
        relay.add(cid, a, b)
        return cid

    def drop(self, cid: int) -> None:
        if self._relay is not None:
            self._relay.drop(cid)

    def _ended(self, cid: int) -> None:  # on the splice thread
        with self._lock:
            got = self._waiting.pop(cid, None)
        if got is not None:
            with contextlib.suppress(RuntimeError):  # that loop has closed
                got[0].call_soon_threadsafe(got[1])


SPLICER = _Splicer()


def pick(mine: str, theirs: str, their_local: str) -> tuple[str, int] | None:
    """Where to dial a peer whose observed address is ``theirs``: its address on its own
    network when both were observed at the same host (behind one router), else ``theirs``."""
    remote = parse_endpoint(theirs)
    local = parse_endpoint(their_local)
    own = parse_endpoint(mine)
    if remote is not None and local is not None and own is not None and own[0] == remote[0]:
        return local
    return remote


class Observation:
    """This node's address as a reachable peer sees a connection from ``port``, and its own
    end of it (:attr:`local`); the connection stays open until :meth:`close` (it holds the
    router's mapping)."""

    def __init__(self) -> None:
        self.address = ""
        self.local = ""
        self.by = ""  # who observed it
        self._channel: Any = None
        self._end: SocketEnd | None = None

    @classmethod
    async def at(cls, observer: Peer, port: int, timeout_s: float) -> Observation:
        """OSError or gRPC's error if ``observer`` does not answer with an address."""
        where = parse_endpoint(observer.endpoint)
        if where is None:
            raise OSError(f"cannot observe through {safe(observer.endpoint)}")
        obs, sock = cls(), bound_socket(port)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, where),
                                   timeout_s)
            obs._end = SocketEnd(sock)
            obs._channel = secure_channel(await obs._end.start(), observer.cert)
            reply = await pb_grpc.GossipStub(obs._channel).Info(pb.InfoRequest(),
                                                                timeout=timeout_s)
            if parse_endpoint(reply.observed) is None:
                raise OSError(f"no address observed by {safe(observer.peer_id[:12])}")
            obs.address, obs.by = reply.observed, observer.peer_id[:12]
            obs.local = f"{sock.getsockname()[0]}:{port}"
        except BaseException:
            sock.close()
            await obs.close()
            raise
        return obs

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
        if self._end is not None:
            await self._end.close()


class Puncher:
    """Hole-punched paths to peers behind routers (the caller's side: :meth:`endpoint`), and
    answers to the peers that punch to this node (:meth:`answer`).

    ``relayed_stub(peer)``: a stub on the path this node has to ``peer`` now (its relay);
    ``observers()``: reachable peers that can tell this node its address; ``public_host()``:
    this node's own IPv4 host when it is reachable (no observer needed), else "";
    ``take(sock, host, port)``: hands a connection formed with a caller to the node's gate
    (None: this node does not answer); ``on_up(endpoint, cert)``: a punched path is up, open
    the channel over it now (the target's gate closes a connection silent for a few seconds);
    ``on_lost(endpoint, cert)``: a punched path ended."""

    def __init__(self, signer: Signer, relayed_stub: Stub,
                 observers: Callable[[], Sequence[Peer]], public_host: Callable[[], str],
                 take: Callable[[socket.socket, str, int], None] | None,
                 on_up: Callable[[str, bytes], None], on_lost: Callable[[str, bytes], None],
                 timeout_s: float, punch_s: float = PUNCH_S, max_peers: int = 32) -> None:
        self.signer, self.relayed_stub, self.observers = signer, relayed_stub, observers
        self.public_host, self.take = public_host, take
        self.on_up, self.on_lost = on_up, on_lost
        self.timeout_s, self.punch_s, self.max_peers = timeout_s, punch_s, max_peers
        self.punched = 0  # paths made (as caller)
        self.failed = 0  # attempts that made none
        self.answered = 0  # connections formed as the target
        self._ends: dict[str, SocketEnd] = {}  # peer id -> its path
        self._next: OrderedDict[str, tuple[float, float]] = OrderedDict()  # id -> (at, back-off)
        self._attempts: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._answering = 0
        self._tokens, self._last = float(ANSWER_BURST), time.monotonic()
        self._closed = False

    # ------------------------------------------------------------ the caller's side
    def holds(self, peer_id: str) -> bool:
        """Whether a punched path to ``peer_id`` is up."""
        return peer_id in self._ends

    def endpoint(self, peer: Peer) -> str | None:
        """The loopback endpoint of a punched path to ``peer``; None while there is none (an
        attempt starts in the background when its back-off allows)."""
        end = self._ends.get(peer.peer_id)
        if end is not None:
            return end.endpoint
        now = time.monotonic()
        at = self._next.get(peer.peer_id, (0.0, 0.0))[0]
        if (not self._closed and now >= at and peer.peer_id not in self._attempts
                and len(self._attempts) < MAX_ATTEMPTS and len(self._ends) < self.max_peers):
            task = asyncio.ensure_future(self._attempt(peer))
            self._attempts[peer.peer_id] = task
            task.add_done_callback(lambda _: self._attempts.pop(peer.peer_id, None))
        return None

    async def _attempt(self, peer: Peer) -> None:
        sock: socket.socket | None = None
        try:
            port_holder = bound_socket()  # keeps the port ours for the attempt
            port = port_holder.getsockname()[1]
            try:
                obs = await self._observe(port, exclude=peer.peer_id)
                try:
                    stub = self.relayed_stub(peer)
                    target, challenge = await target_of(stub, self.timeout_s)
                    reply = await stub.Info(info_request(
                        self.signer, target, challenge, punch_endpoint=obs.address,
                        punch_local=obs.local), timeout=self.timeout_s)
                    remote = pick(obs.address, reply.punch_endpoint, reply.punch_local)
                    if not reply.authenticated or remote is None:
                        raise OSError("the peer does not answer hole punches")
                    log.debug("punching to %s: %s (port %d here, %s) -> %s:%d",
                              safe(peer.peer_id[:12]), obs.address, port, obs.by, *remote)
                    sock = await meet(port, remote, self.punch_s)
                finally:
                    await obs.close()
            finally:
                port_holder.close()
            await self._keep(peer, sock)
        except asyncio.CancelledError:
            if sock is not None:
                sock.close()
            raise
        except Exception as exc:  # noqa: BLE001 - the relayed path stays
            self.failed += 1
            _, backoff = self._next.get(peer.peer_id, (0.0, 0.0))
            backoff = min(MAX_BACKOFF_S, max(BACKOFF_S, 2 * backoff))
            self._remember(peer.peer_id, time.monotonic() + backoff, backoff)
            log.debug("no hole punched to %s (next try in %.0f s): %s",
                      safe(peer.peer_id[:12]), backoff, exc)

    async def _keep(self, peer: Peer, sock: socket.socket) -> None:
        pid, cert, since = peer.peer_id, peer.cert, time.monotonic()
        end = SocketEnd(sock)

        def lost() -> None:
            if self._ends.get(pid) is end:
                del self._ends[pid]
                log.debug("hole-punched path to %s ended after %.0f s", safe(pid[:12]),
                          time.monotonic() - since)
                self._remember(pid, time.monotonic() + BACKOFF_S, 0.0)  # relayed meanwhile
                self.on_lost(end.endpoint, cert)

        end.on_closed = lost
        await end.start()
        if self._closed:
            await end.close()
            return
        self._ends[pid] = end
        self._remember(pid, 0.0, 0.0)
        self.punched += 1
        log.info("hole punched to %s", safe(pid[:12]))
        self.on_up(end.endpoint, cert)

    def _remember(self, peer_id: str, at: float, backoff: float) -> None:
        self._next[peer_id] = (at, backoff)
        self._next.move_to_end(peer_id)
        while len(self._next) > 4 * self.max_peers:
            self._next.popitem(last=False)

    async def _observe(self, port: int, exclude: str = "") -> Observation:
        """The address ``port`` is seen at: observed by a reachable peer (a reachable node
        may sit behind a router that forwards its announced port only), else this node's own
        host when it is reachable."""
        observers = [p for p in self.observers()
                     if p.peer_id != exclude and parse_endpoint(p.endpoint) is not None]
        if observers:
            return await Observation.at(random.choice(observers), port, self.timeout_s)
        host = self.public_host()
        if host and parse_endpoint(f"{host}:{port}") is not None:
            obs = Observation()
            obs.address = obs.local = f"{host}:{port}"
            return obs
        raise OSError("no reachable peer to observe this node's address")

    # ------------------------------------------------------------ the target's side
    async def answer(self, caller_endpoint: str, caller_local: str = "") -> tuple[str, str]:
        """This node's addresses, public and local, for a caller's punch (it dials the caller
        from there for ``punch_s`` from now, in the background); ("", "") when it does not
        answer."""
        if (parse_endpoint(caller_endpoint) is None or self.take is None or self._closed
                or not self._spend()):
            return "", ""
        self._answering += 1
        port_holder = None
        try:
            port_holder = bound_socket()
            obs = await self._observe(port_holder.getsockname()[1])
        except Exception as exc:  # noqa: BLE001 - the caller keeps its relayed path
            self._answering -= 1
            log.debug("not answering a hole punch: %s", exc)
            if port_holder is not None:
                port_holder.close()
            return "", ""
        remote = pick(obs.address, caller_endpoint, caller_local)
        assert remote is not None
        task = asyncio.ensure_future(self._dial_caller(port_holder, obs, remote))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return obs.address, obs.local

    def _spend(self) -> bool:
        """One answer from the bucket, if it is not empty and fewer than MAX_ANSWERING run."""
        now = time.monotonic()
        self._tokens = min(float(ANSWER_BURST), self._tokens + (now - self._last) * ANSWERS_PER_S)
        self._last = now
        if self._answering >= MAX_ANSWERING or self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    async def _dial_caller(self, port_holder: socket.socket, obs: Observation,
                           remote: tuple[str, int]) -> None:
        try:
            sock = await meet(port_holder.getsockname()[1], remote, self.punch_s)
        except (OSError, TimeoutError) as exc:
            log.debug("hole punch from %s:%d not met: %s", remote[0], remote[1], exc)
            return
        finally:
            self._answering -= 1
            port_holder.close()
            await obs.close()
        assert self.take is not None
        self.answered += 1
        self.take(sock, *remote)

    async def close(self) -> None:
        self._closed = True
        await cancel_all([*self._attempts.values(), *self._tasks])
        ends, self._ends = list(self._ends.values()), {}
        for end in ends:
            await end.close()
