"""The node's front door: a TCP gate in front of the gRPC server, bounding connections by source.

gRPC bounds what a connection may do (streams per connection, a handshake deadline) but not
how many connections one source holds: 19,800 silent TCP connections from one process held
19,832 of a node's 20,000 file descriptors. The gate listens on the node's port, counts
connections per address block (/24, /48: :func:`address_block`) and in all, closes those that
send nothing within ``first_byte_s``, and relays the rest, still TLS (it sees ciphertext only),
to the gRPC server on a loopback port. The bytes move in a thread of their own with
``splice(2)`` through a pipe per direction: the kernel moves them, Python never copies them.

Rules (:class:`ConnectionTable`, no I/O):

- a block holding ``per_block`` connections gets no more: its new ones are closed at once;
- when ``max_connections`` are open, a newcomer from a block holding at least two fewer than
  the busiest block takes the place of one of that block's (one still silent if any, else its
  newest); otherwise it is closed. So no source, and no number of sources holding more than
  the newcomer's block, can keep a block out; only one holding as many connections as the
  newcomer's does;
- nothing depends on what a connection claims: the address is the TCP peer's.

gRPC sees every connection from 127.0.0.1; :meth:`Gate.address_of` maps the loopback port of a
relayed connection back to the caller's address (the servicer's address blocks use it).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import select
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gasloc_p2p.protocol.guard import address_block

log = logging.getLogger(__name__)

FDS_PER_CONNECTION = 7  # the caller's socket, both ends of the loopback hop, two pipes
_PIPE_BYTES = 256 * 1024  # per direction; the kernel's default (64 KiB) if refused
_SPLICE = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
_BURST = 16  # splices per direction per wake-up, so one fast connection cannot hog the thread


@dataclass(frozen=True)
class GateLimits:
    """Connections the gate admits: in all, per address block, and how long one may stay
    silent before it is closed (seconds)."""

    max_connections: int = 256
    per_block: int = 32
    first_byte_s: float = 3.0


@dataclass
class _Entry:
    block: str
    relaying: bool = False


@dataclass
class ConnectionTable:
    """Which connections are open, by id and address block; decides admissions (no I/O)."""

    limits: GateLimits
    _entries: dict[int, _Entry] = field(default_factory=dict)  # oldest first
    _blocks: Counter[str] = field(default_factory=Counter)
    _next: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, block: str) -> int:
        return self._blocks[block]

    def admit(self, block: str) -> tuple[int | None, int | None]:
        """A new connection from ``block``: its id (None: close it) and the id of the
        connection it displaces (None: none)."""
        if self._blocks[block] >= self.limits.per_block:
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


class _Pump:
    """One direction of a relayed connection: ``src`` -> a pipe -> ``dst``."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # over the user's pipe quota: the default size
            fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        self.fill = 0  # bytes in the pipe
        self.eof = False

    def step(self) -> bool:
        """Move what can move without blocking; False once this direction has ended."""
        for _ in range(_BURST):
            try:
                if self.fill:
                    self.fill -= os.splice(self.r, self.dst.fileno(), self.fill,
                                           flags=_SPLICE)
                    continue
                if self.eof:
                    return False
                moved = os.splice(self.src.fileno(), self.w, _PIPE_BYTES, flags=_SPLICE)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if moved == 0:
                self.eof = True
            self.fill += moved
        return True

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class _Relay:
    """The thread that moves the bytes of every relayed connection (epoll + splice).

    ``add``, ``drop`` and ``stop`` may be called from any thread; ``on_closed(cid)`` is
    called from this thread when a connection has ended and its sockets are closed."""

    def __init__(self, on_closed: Callable[[int], None]) -> None:
        self._on_closed = on_closed
        self._poll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll.register(self._wake_r, select.EPOLLIN)
        self._lock = threading.Lock()
        self._todo: list[tuple[str, int, tuple[socket.socket, socket.socket] | None]] = []
        self._pairs: dict[int, tuple[_Pump, _Pump]] = {}
        self._by_fd: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, name="gasloc-gate", daemon=True)
        self._thread.start()

    def _send(self, what: str, cid: int,
              socks: tuple[socket.socket, socket.socket] | None = None) -> None:
        with self._lock:
            self._todo.append((what, cid, socks))
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def add(self, cid: int, caller: socket.socket, upstream: socket.socket) -> None:
        self._send("add", cid, (caller, upstream))

    def drop(self, cid: int) -> None:
        self._send("drop", cid)

    def stop(self) -> None:
        self._send("stop", 0)
        self._thread.join()
        self._poll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        while True:
            for fd, _ in self._poll.poll():
                if fd == self._wake_r:
                    if not self._commands():
                        for cid in list(self._pairs):
                            self._end(cid)
                        return
                elif (pair := self._by_fd.get(fd)) is not None:
                    try:
                        self._step(pair)
                    except OSError as exc:  # never let one connection stop the thread
                        log.debug("gate: relayed connection failed: %s", exc)
                        self._end(pair)

    def _commands(self) -> bool:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        with self._lock:
            todo, self._todo = self._todo, []
        for what, cid, socks in todo:
            if what == "stop":
                return False
            if what == "drop" and cid in self._pairs:
                self._end(cid)
            elif what == "add" and socks is not None:
                try:
                    self._open(cid, *socks)
                except OSError as exc:  # out of descriptors for the pipes
                    log.warning("gate: cannot relay a connection: %s", exc)
                    if cid in self._pairs:
                        self._end(cid)
                    else:
                        for sock in socks:
                            sock.close()
                        self._on_closed(cid)
        return True

    def _open(self, cid: int, a: socket.socket, b: socket.socket) -> None:
        there = _Pump(a, b)
        try:
            back = _Pump(b, a)
        except OSError:
            there.close()
            raise
        self._pairs[cid] = (there, back)
        for sock in (a, b):
            self._by_fd[sock.fileno()] = cid
            self._poll.register(sock.fileno(), select.EPOLLIN)
        self._step(cid)

    def _step(self, cid: int) -> None:
        pumps = self._pairs[cid]
        if not all(p.step() for p in pumps):  # either side ended (or failed): close both
            self._end(cid)
            return
        for sock in (pumps[0].src, pumps[1].src):
            events = 0
            for p in pumps:
                if p.src is sock and not p.fill and not p.eof:
                    events |= select.EPOLLIN
                if p.dst is sock and p.fill:
                    events |= select.EPOLLOUT
            self._poll.modify(sock.fileno(), events)

    def _end(self, cid: int) -> None:
        pumps = self._pairs.pop(cid, None)
        if pumps is None:
            return
        for sock in (pumps[0].src, pumps[1].src):
            self._by_fd.pop(sock.fileno(), None)
            with contextlib.suppress(OSError):
                self._poll.unregister(sock.fileno())
            sock.close()
        for p in pumps:
            p.close()
        self._on_closed(cid)


class Gate:
    """Accepts on ``host:port``, admits by :class:`ConnectionTable`, relays to ``upstream``
    (the gRPC server's loopback port). An event-loop object; ``close`` is safe twice."""

    def __init__(self, limits: GateLimits, upstream: tuple[str, int]) -> None:
        self.limits = limits
        self.upstream = upstream
        self.table = ConnectionTable(limits)
        self.port = 0
        self.refused = 0  # closed at once: their block full, or the gate full
        self.displaced = 0  # closed to make room for a less busy block
        self.silent = 0  # closed after sending nothing for first_byte_s
        self._sources: dict[int, str] = {}  # loopback port -> the caller's address
        self._ports: dict[int, int] = {}  # connection id -> its loopback port
        self._waiting: dict[int, asyncio.Task[None]] = {}  # connections before their 1st byte
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._relay: _Relay | None = None
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
        self._relay = _Relay(self._closed_from_thread)
        self._accepting = asyncio.create_task(self._accept_loop())
        return self.port

    def address_of(self, peer: str) -> str:
        """The caller's address for gRPC's ``peer`` string (``ipv4:127.0.0.1:PORT``) of a
        relayed connection; ``peer`` itself for anything else."""
        host, _, port = peer.rpartition(":")
        if port.isdigit() and (source := self._sources.get(int(port))) is not None:
            return source
        return host or peer

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
            self._admit(sock, str(addr[0]))

    def _admit(self, sock: socket.socket, host: str) -> None:
        cid, victim = self.table.admit(address_block(host))
        if victim is not None:
            self.displaced += 1
            self._drop(victim)
        if cid is None:
            self.refused += 1
            _reset(sock)
            return
        sock.setblocking(False)
        self._waiting[cid] = asyncio.create_task(self._first_byte(cid, sock, host))

    async def _first_byte(self, cid: int, sock: socket.socket, host: str) -> None:
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
        self._sources[port], self._ports[cid] = host, port
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
        if port is not None:
            self._sources.pop(port, None)


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
