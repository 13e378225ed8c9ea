"""The relay's side: listeners waiting for callers, and each relayed connection's two calls
joined with bounded buffers, bytes and time (no gRPC here: the servicer hands its calls in).

A node behind a router (the listener) holds a ``Listen`` call open at a reachable node that
relays. A caller opens a ``Relay`` call naming the listener; the hub gives it a random token,
sends the token down the listener's ``Listen`` call, and waits (``accept_s``) for the listener
to open its own ``Relay`` call with it. Then each side's reads go to the other side's writes
through a queue of ``QUEUE_CHUNKS`` chunks, so a slow side holds back the fast one and the
relay buffers at most that much per direction. What it carries is the caller's TLS connection
to the listener: the relay reads ciphertext, and the listener's certificate is pinned by the
caller from the listener's signed record.

Bounds, against an attacker who knows them (identities are free: nothing here is per peer
id): at most ``max_listeners`` listeners, an eighth of them per address block (/24, /48); a
new listener displaces the oldest of its own block when that block is full, else, when all
are taken, the oldest of the block holding the most (a listener that comes back replaces its
own); at most ``connections`` relayed connections at once counting those waiting for their
listener, a quarter of them per caller's address block, each at most
``bytes_per_connection`` each way and ``seconds_per_connection`` long. So one address block
can neither take every slot nor keep other blocks' listeners out. Callers and listeners have proved membership (signed
requests) before they reach the hub; a listener's accept proves itself with the token, sent
only down its own authenticated call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from gasloc_p2p.node.transport.circuits import cancel_all

log = logging.getLogger(__name__)

QUEUE_CHUNKS = 8  # chunks buffered per direction of a relayed connection
TOKEN_BYTES = 16
_END = b""
_ABORT = b"\0abort"  # (compared by identity: no relayed chunk is this object)


@dataclass(frozen=True)
class RelayLimits:
    """What a node spends relaying for nodes behind routers."""

    enabled: bool = True
    connections: int = 32  # relayed connections at once (waiting ones included)
    max_listeners: int = 64
    bytes_per_connection: int = 1 << 30  # each way
    seconds_per_connection: float = 1800.0
    accept_s: float = 10.0  # a caller waits this long for its listener's call


class RelayRefused(Exception):
    """A caller's relayed connection cannot be made (the reason is for the caller)."""


@dataclass
class RelayStats:
    relayed: int = 0  # relayed connections made
    refused: int = 0
    bytes: int = 0  # relayed, both ways


# A side of a relayed connection: its next chunk (b"" at its end) and a write.
Read = Callable[[], Awaitable[bytes]]
Write = Callable[[bytes], Awaitable[None]]


class _Circuit:
    def __init__(self) -> None:
        self.to_listener: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_CHUNKS)
        self.to_caller: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_CHUNKS)
        self.accepted = asyncio.get_running_loop().create_future()


class RelayHub:
    def __init__(self, limits: RelayLimits) -> None:
        self.limits = limits
        self.stats = RelayStats()
        self._listeners: OrderedDict[str, tuple[str, asyncio.Queue[bytes]]] = OrderedDict()
        self._pending: dict[bytes, tuple[str, _Circuit]] = {}
        self._open = 0  # relayed connections held (waiting or joined)
        self._calls: Counter[str] = Counter()  # ... by the caller's address block

    @property
    def open(self) -> int:
        """Relayed connections held now (waiting for their listener or joined)."""
        return self._open

    @property
    def listeners(self) -> int:
        """Peers behind routers holding a Listen call here now."""
        return len(self._listeners)

    @property
    def listeners_per_block(self) -> int:
        return max(1, self.limits.max_listeners // 8)

    @property
    def calls_per_block(self) -> int:
        return max(1, self.limits.connections // 4)

    # ------------------------------------------------------------ the listener's Listen call
    @contextlib.asynccontextmanager
    async def listening(self, peer_id: str, block: str = ""
                        ) -> AsyncIterator[asyncio.Queue[bytes]]:
        """Tokens of the callers waiting for ``peer_id`` (calling from address ``block``);
        b"": displaced, end the call."""
        old = self._listeners.pop(peer_id, None)
        if old is not None:
            _offer(old[1], _END)
        blocks = Counter(b for b, _ in self._listeners.values())
        if blocks[block] >= self.listeners_per_block:
            self._evict(block)
        elif len(self._listeners) >= self.limits.max_listeners:
            self._evict(blocks.most_common(1)[0][0])
        queue: asyncio.Queue[bytes] = asyncio.Queue(self.limits.connections)
        self._listeners[peer_id] = (block, queue)
        try:
            yield queue
        finally:
            if self._listeners.get(peer_id, ("", None))[1] is queue:
                del self._listeners[peer_id]

    def _evict(self, block: str) -> None:
        """End the oldest listener of ``block``."""
        oldest = next(p for p, (b, _) in self._listeners.items() if b == block)
        _offer(self._listeners.pop(oldest)[1], _END)

    def listening_to(self, peer_id: str) -> bool:
        return peer_id in self._listeners

    # ------------------------------------------------------------ the two Relay calls
    async def call(self, target: str, read: Read, write: Write, block: str = "") -> None:
        """A caller's (from address ``block``) relayed connection to ``target``;
        RelayRefused if it cannot be made."""
        try:
            await self._call(target, read, write, block)
        except RelayRefused:
            self.stats.refused += 1
            raise

    async def _call(self, target: str, read: Read, write: Write, block: str) -> None:
        listener = self._listeners.get(target)
        if listener is None:
            raise RelayRefused(f"{target} is not listening here")
        queue = listener[1]
        if self._open >= self.limits.connections:
            raise RelayRefused(f"relaying {self._open} connections already")
        if self._calls[block] >= self.calls_per_block:
            raise RelayRefused(f"relaying {self._calls[block]} connections for {block} already")
        token, circuit = os.urandom(TOKEN_BYTES), _Circuit()
        if not _offer(queue, token):
            raise RelayRefused(f"{target} has callers waiting already")
        self._open += 1
        self._calls[block] += 1
        self._pending[token] = (target, circuit)
        try:
            try:
                await asyncio.wait_for(asyncio.shield(circuit.accepted), self.limits.accept_s)
            except TimeoutError:
                raise RelayRefused(f"{target} did not take the connection") from None
            finally:
                self._pending.pop(token, None)
            self.stats.relayed += 1
            await self._carry(read, write, circuit.to_caller, circuit.to_listener)
        finally:
            self._open -= 1
            self._calls[block] -= 1
            if not self._calls[block]:
                del self._calls[block]

    async def accept(self, token: bytes, read: Read, write: Write) -> None:
        """The listener's side, with a token from its Listen call; RelayRefused if no caller
        waits with it."""
        pending = self._pending.pop(token, None)
        if pending is None or pending[1].accepted.done():
            raise RelayRefused("no caller waits with this token")
        circuit = pending[1]
        circuit.accepted.set_result(None)
        await self._carry(read, write, circuit.to_listener, circuit.to_caller)

    async def _carry(self, read: Read, write: Write, inbox: asyncio.Queue[bytes],
                     outbox: asyncio.Queue[bytes]) -> None:
        """This side's reads into ``outbox`` (the other side's writes), ``inbox`` into this
        side's writes, until both directions ended (each side's end is passed on after what
        it sent); the limit, the time or a failure ends both at once."""
        limit = self.limits.bytes_per_connection

        async def reads() -> None:
            sent = 0
            while data := await read():
                sent += len(data)
                if sent > limit:
                    raise _Spent(f"a relayed connection reached its {limit >> 20} MiB")
                self.stats.bytes += len(data)
                await outbox.put(data)
            await outbox.put(_END)  # after what is queued: the other side writes it all

        async def writes() -> None:
            while data := await inbox.get():
                if data is _ABORT:
                    raise _OtherSideFailed
                await write(data)

        tasks = [asyncio.ensure_future(reads()), asyncio.ensure_future(writes())]
        clean = False
        try:
            done, pending = await asyncio.wait(tasks, timeout=self.limits.seconds_per_connection,
                                               return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                exc = task.exception()
                if isinstance(exc, _Spent):
                    log.info("%s; closing it", exc)
            clean = not pending and all(t.exception() is None for t in done)
        finally:
            await cancel_all(tasks)
            if not clean:  # the other side must not wait for more
                _offer(outbox, _ABORT)


class _Spent(Exception):
    """A relayed connection used up its bytes."""


class _OtherSideFailed(Exception):
    """The other side of a relayed connection ended it abnormally."""


def _offer(queue: asyncio.Queue[bytes], item: bytes) -> bool:
    try:
        queue.put_nowait(item)
        return True
    except asyncio.QueueFull:
        if item is _ABORT or item == _END:  # an end must get through: make room
            _drain(queue)
            queue.put_nowait(item)
            return True
        return False


def _drain(queue: asyncio.Queue[bytes]) -> None:
    while not queue.empty():
        queue.get_nowait()
