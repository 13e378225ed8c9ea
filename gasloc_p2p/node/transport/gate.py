"""The node's front door: a TCP gate in front of the gRPC server, bounding what each source
holds and what it may spend before it proves anything.

gRPC bounds what a connection may do (calls per connection, a handshake deadline) but not how
many connections one source holds: 19,800 silent TCP connections from one process held 19,832
of a node's 20,000 file descriptors. The gate listens on the node's port, counts connections
per address block (/24, /48: :func:`address_block`) and in all, closes those that send nothing
within ``first_byte_s``, and relays the rest, still TLS (it sees ciphertext only), to the
gRPC server on a loopback port (:mod:`gasloc_p2p.node.transport.relay`).

Rules (:class:`ConnectionTable`, no I/O):

- a block holding ``per_block`` connections gets no more: its new ones are closed at once;
- when ``max_connections`` are open, a newcomer from a block holding at least two fewer than
  the busiest block takes the place of one of that block's (one still silent if any, else its
  newest); otherwise it is closed. So no source, and no number of sources holding more than
  the newcomer's block, can keep a block out; only one holding as many connections as the
  newcomer's does;
- every call that has proved nothing yet (an Exchange before its valid Header, an Info or
  DownloadState before its signed request checks out) spends a token of its block's bucket
  (``unproven_per_s``, ``unproven_burst``); a call that proves itself gives it back. A call
  that finds the bucket empty has its connection closed, and the block's new connections are
  refused for ``cooldown_s``: calls re-opened as fast as the node ends them (630 a second
  from one process cut a node's training to 36% of its steps) cost the node at most the
  bucket's rate, and refusing a connection costs it an accept;
- nothing depends on what a connection claims: the address is the TCP peer's.

gRPC sees every connection from 127.0.0.1; :meth:`Gate.address_of` maps the loopback port of a
relayed connection back to the caller's address (the servicer's address blocks use it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import struct
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TypeVar

from gasloc_p2p.node.transport.relay import FDS_PER_CONNECTION, Relay
from gasloc_p2p.protocol.guard import address_block

log = logging.getLogger(__name__)

__all__ = ["FDS_PER_CONNECTION", "ConnectionTable", "Gate", "GateLimits"]
V = TypeVar("V")
_MAX_BLOCKS = 4096  # address blocks whose bucket or cool-down is remembered (bounded memory)


@dataclass(frozen=True)
class GateLimits:
    """Connections the gate admits (in all, per address block), how long one may stay silent
    (seconds), and what a block's calls may spend before they prove anything: tokens per
    second, the bucket's size, and the cool-down once it is empty (seconds)."""

    max_connections: int = 256
    per_block: int = 32
    first_byte_s: float = 3.0
    unproven_per_s: float = 20.0
    unproven_burst: int = 100
    cooldown_s: float = 10.0


@dataclass
class _Entry:
    block: str
    relaying: bool = False


@dataclass
class ConnectionTable:
    """Which connections are open, by id and address block, and each block's bucket of
    unproven calls; decides admissions (no I/O; ``now`` in monotonic seconds)."""

    limits: GateLimits
    _entries: dict[int, _Entry] = field(default_factory=dict)  # oldest first
    _blocks: Counter[str] = field(default_factory=Counter)
    _tokens: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)
    _cooling: OrderedDict[str, float] = field(default_factory=OrderedDict)  # block -> until
    _next: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, block: str) -> int:
        return self._blocks[block]

    def admit(self, block: str, now: float = 0.0) -> tuple[int | None, int | None]:
        """A new connection from ``block``: its id (None: close it) and the id of the
        connection it displaces (None: none)."""
        if self._blocks[block] >= self.limits.per_block or self.cooling(block, now):
            return None, None
        victim = None
        if len(self._entries) >= self.limits.max_connections:
            busiest, most = self._blocks.most_common(1)[0]
            if most < self._blocks[block] + 2:
                return None, None
            victim = self._victim(busiest)
            self.release(victim)
        self._next += 1
        self._entries[self._next] = _Entry(block)
        self._blocks[block] += 1
        return self._next, victim

    def _victim(self, block: str) -> int:
        """``block``'s oldest connection still silent, else its newest."""
        ids = [i for i, e in self._entries.items() if e.block == block]
        return next((i for i in ids if not self._entries[i].relaying), ids[-1])

    def relaying(self, cid: int) -> None:
        """``cid`` sent its first bytes and is relayed now."""
        if cid in self._entries:
            self._entries[cid].relaying = True

    def release(self, cid: int) -> None:
        entry = self._entries.pop(cid, None)
        if entry is not None:
            self._blocks[entry.block] -= 1
            if not self._blocks[entry.block]:
                del self._blocks[entry.block]

    def charge(self, block: str, now: float) -> bool:
        """A call from ``block`` that has proved nothing starts: take a token. False if the
        bucket is empty: the block then cools down."""
        tokens = self._refill(block, now)
        if tokens >= 1:
            self._put(self._tokens, block, (tokens - 1, now))
            return True
        self._put(self._tokens, block, (tokens, now))
        self._put(self._cooling, block, now + self.limits.cooldown_s)
        return False

    def refund(self, block: str, now: float) -> None:
        """A call from ``block`` proved itself: its token comes back."""
        self._put(self._tokens, block, (min(self._refill(block, now) + 1,
                                            float(self.limits.unproven_burst)), now))

    def cooling(self, block: str, now: float) -> bool:
        """Whether ``block``'s new connections are refused (its bucket ran dry lately)."""
        until = self._cooling.get(block)
        if until is None:
            return False
        if until > now:
            return True
        del self._cooling[block]
        return False

    def _refill(self, block: str, now: float) -> float:
        tokens, at = self._tokens.get(block, (float(self.limits.unproven_burst), now))
        return min(float(self.limits.unproven_burst),
                   tokens + (now - at) * self.limits.unproven_per_s)

    @staticmethod
    def _put(table: OrderedDict[str, V], block: str, value: V) -> None:
        table.pop(block, None)
        table[block] = value
        if len(table) > _MAX_BLOCKS:  # bounded: forget the least recently seen block
            table.popitem(last=False)


class Gate:
    """Accepts on ``host:port``, admits by :class:`ConnectionTable`, relays to ``upstream``
    (the gRPC server's loopback port). An event-loop object; ``close`` is safe twice.

    The servicer reports each call by gRPC's ``peer`` string (``ipv4:127.0.0.1:PORT``, the
    loopback end of a relayed connection): :meth:`unproven` when it starts, :meth:`proved`
    once it has proved itself."""

    def __init__(self, limits: GateLimits, upstream: tuple[str, int]) -> None:
        self.limits = limits
        self.upstream = upstream
        self.table = ConnectionTable(limits)
        self.port = 0
        self.refused = 0  # closed at once: their block full or cooling down, or the gate full
        self.displaced = 0  # closed to make room for a less busy block
        self.silent = 0  # closed after sending nothing for first_byte_s
        self.cut = 0  # closed when a call found its block's bucket empty
        self._relayed: dict[int, tuple[int, str, int]] = {}  # loopback port -> (id, caller,
        # the caller's port)
        self._ports: dict[int, int] = {}  # connection id -> its loopback port
        self._waiting: dict[int, asyncio.Task[None]] = {}  # connections before their 1st byte
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._relay: Relay | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port. OSError if taken."""
        self._loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=4096,
                                              dualstack_ipv6=host == "::")
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        ensure_fd_limit(self.limits.max_connections * FDS_PER_CONNECTION)
        self._relay = Relay(self._closed_from_thread)
        self._accepting = asyncio.create_task(self._accept_loop())
        return self.port

    def _connection(self, peer: str) -> tuple[int, str, int] | None:
        """(id, caller's address, caller's port) of the relayed connection gRPC names
        ``peer``."""
        port = peer.rpartition(":")[2]
        return self._relayed.get(int(port)) if port.isdigit() else None

    def address_of(self, peer: str) -> str:
        """The caller's address for gRPC's ``peer`` string of a relayed connection; the
        address in ``peer`` itself for anything else."""
        found = self._connection(peer)
        return found[1] if found is not None else peer.rpartition(":")[0] or peer

    def observed_of(self, peer: str) -> str:
        """The caller's ``host:port`` as this gate sees it (what its router maps to), for
        gRPC's ``peer`` string; the address in ``peer`` itself for anything else."""
        found = self._connection(peer)
        if found is None:
            return peer.partition(":")[2] or peer
        host = found[1]
        return f"[{host}]:{found[2]}" if ":" in host else f"{host}:{found[2]}"

    def unproven(self, peer: str) -> bool:
        """A call that has proved nothing starts on ``peer``'s connection: False if its
        block's bucket is empty (the connection is being closed and the block cools down)."""
        found = self._connection(peer)
        if found is None:
            return True
        cid, host, _ = found
        if self.table.charge(address_block(host), time.monotonic()):
            return True
        self.cut += 1
        self.table.release(cid)
        self._drop(cid)
        return False

    def proved(self, peer: str) -> None:
        """A call on ``peer``'s connection proved itself: its block gets the token back."""
        found = self._connection(peer)
        if found is not None:
            self.table.refund(address_block(found[1]), time.monotonic())

    def stop_accepting(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self._listener is not None:
            self._listener.close()

    async def close(self) -> None:
        """Stop accepting and close every connection."""
        self.stop_accepting()
        if self._accepting is not None:
            await asyncio.gather(self._accepting, return_exceptions=True)
        for task in list(self._waiting.values()):
            task.cancel()
        await asyncio.gather(*self._waiting.values(), return_exceptions=True)
        relay, self._relay = self._relay, None
        if relay is not None:
            await asyncio.to_thread(relay.stop)

    async def _accept_loop(self) -> None:
        assert self._loop is not None and self._listener is not None
        while True:
            try:
                sock, addr = await self._loop.sock_accept(self._listener)
            except OSError as exc:  # out of descriptors: let some close first
                log.warning("gate: accept failed (%s)", exc)
                await asyncio.sleep(0.1)
                continue
            self.take(sock, str(addr[0]), int(addr[1]))

    def take(self, sock: socket.socket, host: str, port: int) -> None:
        """Admit a connection from ``host:port`` as one accepted on the node's port (a
        hole-punched one comes in here: the same limits, deadline and relay)."""
        cid, victim = self.table.admit(address_block(host), time.monotonic())
        if victim is not None:
            self.displaced += 1
            self._drop(victim)
        if cid is None:
            self.refused += 1
            _reset(sock)
            return
        sock.setblocking(False)
        self._waiting[cid] = asyncio.create_task(self._first_byte(cid, sock, host, port))

    async def _first_byte(self, cid: int, sock: socket.socket, host: str, caller_port: int
                          ) -> None:
        """Relay ``sock`` once it has sent a byte; close it if it sends none in time."""
        assert self._loop is not None
        upstream = None
        try:
            async with asyncio.timeout(self.limits.first_byte_s):
                await _readable(self._loop, sock)
                if not sock.recv(1, socket.MSG_PEEK):
                    raise ConnectionError("closed before its first byte")
                upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                upstream.setblocking(False)
                await self._loop.sock_connect(upstream, self.upstream)
        except BaseException as exc:
            if isinstance(exc, TimeoutError):
                self.silent += 1
            _reset(sock)
            if upstream is not None:
                upstream.close()
            self._waiting.pop(cid, None)
            self.table.release(cid)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self._waiting.pop(cid, None)
        for s in (sock, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        port = int(upstream.getsockname()[1])
        self._relayed[port], self._ports[cid] = (cid, host, caller_port), port
        self.table.relaying(cid)
        assert self._relay is not None
        self._relay.add(cid, sock, upstream)

    def _drop(self, cid: int) -> None:
        """Close connection ``cid`` (already released from the table)."""
        task = self._waiting.pop(cid, None)
        if task is not None:
            task.cancel()
        elif self._relay is not None:
            self._relay.drop(cid)

    def _closed_from_thread(self, cid: int) -> None:
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is stopping
                self._loop.call_soon_threadsafe(self._closed, cid)

    def _closed(self, cid: int) -> None:
        self.table.release(cid)
        port = self._ports.pop(cid, None)
        if port is not None and self._relayed.get(port, (None,))[0] == cid:  # not reused yet
            del self._relayed[port]


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


def _reset(sock: socket.socket) -> None:
    """Close at once, with a reset (no TIME_WAIT kept for a connection we refused)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def ensure_fd_limit(needed: int, margin: int = 1024) -> None:
    """Raise this process's soft limit on open files to ``needed + margin`` if it is lower
    (up to the hard limit; a warning if that is not enough)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + margin
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            new = soft
        if new < want:
            log.warning("open-file limit %d is below the %d the gate may need "
                        "(--max-connections); raise `ulimit -n`", new, want)
