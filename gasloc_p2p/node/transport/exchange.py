"""The Exchange protocol over one bidirectional stream, for both roles (see gasloc.proto).

:class:`Exchanger` runs an exchange as initiator (:meth:`Exchanger.initiate`) or responder
(:meth:`Exchanger.respond`). Both roles share :meth:`Exchanger._transfer`: send our payload and
receive the peer's concurrently on the one stream, then trade ``Ready``. The initiator then
sends ``Commit`` and both apply. Every wait has a named timeout from :class:`GossipConfig`; any
error, timeout, cancellation or ``Abort`` before the commit leaves both sides unchanged. Tensor
work runs in threads (``asyncio.to_thread``), never on the event loop.

The one window two parties cannot close: the initiator applies once its ``Commit`` is written;
if the responder dies before reading it, only one side applied. The link versions then differ,
and the next exchange of the pair restarts the link from ``theta_0`` (self-healing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from gasloc_p2p.core.async_state import AsyncConfig, exchange_weight
from gasloc_p2p.core.codecs import Encoded
from gasloc_p2p.node.config import GossipConfig
from gasloc_p2p.node.runtime.stats import ExchangeStats
from gasloc_p2p.node.transport.ratelimit import TokenBucket
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.engine import ExchangeEngine, Prepared
from gasloc_p2p.protocol.messages import (
    BAD_REQUEST,
    BUSY,
    INTERNAL,
    MAX_CHUNK_BYTES,
    ExchangeError,
    Identity,
    MessageStream,
    PeerAborted,
    ProtocolError,
    Rejected,
    abort,
    check_header,
    check_reply_header,
    chunks,
    make_header,
    reject,
)

log = logging.getLogger(__name__)

# Opens an Exchange call on the peer: a MessageStream that also has done_writing/cancel/code.
CallFactory = Callable[[], Any]


@dataclass(frozen=True)
class Outcome:
    """A committed exchange, as seen by one side."""

    peer_id: str
    fragment: int
    staleness: int  # round ends on both sides between snapshot and Ready
    weight: float
    correction_norm: float
    bytes_sent: int
    bytes_received: int


class Exchanger:
    """Runs exchanges of one node; owns admission (in-flight peers, inbound limit) and stats."""

    def __init__(self, me: Identity, engine: ExchangeEngine, gossip: GossipConfig,
                 outer: AsyncConfig, bucket: TokenBucket | None = None,
                 stats: ExchangeStats | None = None) -> None:
        self.me = me
        self.engine = engine
        self.cfg = gossip
        self.outer = outer
        self.bucket = bucket or TokenBucket.from_mbps(gossip.max_upload_mbps, MAX_CHUNK_BYTES)
        self.stats = stats or ExchangeStats()
        self.inflight: set[str] = set()  # peers with an exchange in flight, either role
        self.inbound = 0
        self.accepting = True

    # ----------------------------------------------------------------- initiator
    async def initiate(self, open_call: CallFactory, peer_id: str, fragment_index: int) -> Outcome:
        """One exchange with ``peer_id`` as initiator; raises :class:`ExchangeError` (or
        ``TimeoutError``/``grpc.RpcError``) on failure, with nothing applied."""
        if peer_id in self.inflight:
            raise ExchangeError(BUSY, f"already exchanging with {peer_id}")
        self.inflight.add(peer_id)
        try:
            return await self._initiate(open_call, peer_id, fragment_index)
        finally:
            self.inflight.discard(peer_id)

    async def _initiate(self, open_call: CallFactory, peer_id: str, fragment: int) -> Outcome:
        cfg = self.cfg
        started = time.monotonic()
        codec = self.engine.codec(cfg.codec, 0 if cfg.codec in ("fp32", "fp16") else cfg.block_size)
        version = self.engine.link_version(peer_id)
        prep = await asyncio.to_thread(self.engine.prepare, peer_id, fragment, codec, False)
        call = open_call()
        committed = False
        try:
            async with asyncio.timeout(cfg.exchange_timeout_s):
                mine = make_header(self.me, prep, len(self.engine.fragments))
                await call.write(mine)
                msg = await self._read(call, cfg.header_timeout_s, "the responder's Header")
                kind = msg.WhichOneof("kind")
                if kind == "reject":
                    raise Rejected(msg.reject.code, msg.reject.message)
                if kind != "header":
                    raise ProtocolError(f"expected Header or Reject, got {kind}")
                problem = check_reply_header(msg.header, mine.header, self.me, self.engine)
                if problem is not None:
                    raise problem
                if msg.header.peer_id != peer_id:
                    raise ProtocolError(f"dialed {peer_id}, answered by {msg.header.peer_id}")
                if msg.header.link_version != version:  # both restart the link from theta_0
                    prep = await asyncio.to_thread(self.engine.prepare, peer_id, fragment, codec,
                                                   True)
                    await call.write(make_header(self.me, prep, len(self.engine.fragments)))
                received, staleness = await self._transfer(call, prep, msg.header)
                weight = exchange_weight(self.outer, staleness)
                await call.write(pb.ExchangeMsg(commit=pb.Commit()))
                committed = True
        except BaseException as exc:
            if not committed:
                await self._abort_call(call, exc)
            raise
        norm = await self._commit(prep, received, weight)
        await self._finish_call(call)
        return self._record(True, prep, staleness, weight, norm, received, started)

    async def _abort_call(self, call: Any, exc: BaseException) -> None:
        """Tell the peer why (best effort; it times out otherwise), then cancel the call."""
        code = exc.code if isinstance(exc, ExchangeError) else INTERNAL
        if not isinstance(exc, PeerAborted | Rejected | grpc.RpcError | asyncio.CancelledError):
            await self._try_write(call, abort(code, str(exc)))
        call.cancel()

    async def _finish_call(self, call: Any) -> None:
        """After our commit: wait for the responder to close the stream (its commit)."""
        try:
            await call.done_writing()
            code = await asyncio.wait_for(call.code(), self.cfg.commit_timeout_s)
            if code != grpc.StatusCode.OK:
                log.warning("peer ended a committed exchange with %s; the link will reset", code)
        except Exception as exc:
            log.warning("no confirmation from the peer after commit (%s); the link will reset "
                        "if it did not apply", exc)

    # ----------------------------------------------------------------- responder
    async def respond(self, stream: MessageStream) -> None:
        """Serve one inbound exchange on ``stream``; never raises for peer errors."""
        cfg = self.cfg
        try:
            msg = await self._read(stream, cfg.header_timeout_s, "the initiator's Header")
        except (ExchangeError, TimeoutError) as exc:
            self._fail("inbound-no-header", exc)
            return
        if msg.WhichOneof("kind") != "header":
            await self._try_write(stream, reject(BAD_REQUEST, "the first message must be a Header"))
            self.stats.rejected_inbound += 1
            return
        h = msg.header
        problem = check_header(h, self.me, self.engine)
        if problem is None and (not self.accepting or self.inbound >= cfg.max_inbound
                                or h.peer_id in self.inflight):
            problem = ExchangeError(BUSY, "at the inbound limit or already exchanging with you")
        if problem is not None:
            self.stats.rejected_inbound += 1
            log.debug("rejecting %s: %s", h.peer_id, problem)
            await self._try_write(stream, reject(problem.code, problem.message))
            return
        self.inflight.add(h.peer_id)
        self.inbound += 1
        try:
            await self._respond(stream, h)
        except asyncio.CancelledError as exc:  # the initiator vanished, or we are stopping
            self._fail("inbound-cancelled", exc)
            raise
        except Exception as exc:  # peer errors, timeouts, our own failures: nothing applied
            self._fail("inbound", exc)
            if not isinstance(exc, ExchangeError | TimeoutError | grpc.RpcError):
                log.warning("inbound exchange from %s failed on this side: %r", h.peer_id, exc)
            if not isinstance(exc, PeerAborted):
                code = exc.code if isinstance(exc, ExchangeError) else INTERNAL
                await self._try_write(stream, abort(code, str(exc)))
        finally:
            self.inbound -= 1
            self.inflight.discard(h.peer_id)

    async def _respond(self, stream: MessageStream, h: pb.Header) -> None:
        cfg = self.cfg
        started = time.monotonic()
        async with asyncio.timeout(cfg.exchange_timeout_s):
            codec = self.engine.codec(h.codec, h.block_size)
            reset = h.link_version != self.engine.link_version(h.peer_id)
            prep = await asyncio.to_thread(self.engine.prepare, h.peer_id, h.fragment_index,
                                           codec, reset)
            # The header carries our version before any reset, so the initiator resets too.
            await stream.write(make_header(self.me, prep, len(self.engine.fragments)))
            received, staleness = await self._transfer(stream, prep, h, expect_header=reset)
            msg = await self._read(stream, cfg.commit_timeout_s, "Commit")
            kind = msg.WhichOneof("kind")
            if kind == "abort":
                raise PeerAborted(msg.abort.code, msg.abort.message)
            if kind != "commit":
                raise ProtocolError(f"expected Commit, got {kind}")
        weight = exchange_weight(self.outer, staleness)
        norm = await self._commit(prep, received, weight)
        self._record(False, prep, staleness, weight, norm, received, started)

    # ----------------------------------------------------------------- shared
    async def _transfer(self, stream: MessageStream, prep: Prepared, peer: pb.Header,
                        expect_header: bool = False) -> tuple[Encoded, int]:
        """Send our payload while receiving the peer's, then trade Ready.

        ``expect_header`` (responder, link reset): the initiator re-encodes against ``theta_0``
        and re-sends its Header, which must come before any Chunk. Returns the peer's message
        and the staleness (both sides' round ends since their snapshots).
        """
        write_lock = asyncio.Lock()

        async def send(msg: pb.ExchangeMsg) -> None:
            async with write_lock:
                await stream.write(msg)

        async def send_payload() -> None:
            for piece in chunks(prep.payload, self.cfg.chunk_bytes):
                await self.bucket.take(len(piece))
                await send(pb.ExchangeMsg(chunk=pb.Chunk(data=piece)))
                self.stats.add_sent(prep.encoded.codec, len(piece))

        sender = asyncio.create_task(send_payload(), name=f"send-payload-{prep.peer_id[:8]}")
        try:
            buf = bytearray()
            received: Encoded | None = None
            my_rounds: int | None = None
            peer_rounds: int | None = None
            while received is None or peer_rounds is None:
                msg = await self._read(stream, self.cfg.chunk_timeout_s, "payload")
                kind = msg.WhichOneof("kind")
                if kind == "header" and expect_header:
                    peer = self._replacement_header(msg.header, peer)
                    expect_header = False
                elif kind == "chunk" and received is None and not expect_header:
                    data = msg.chunk.data
                    if not data or len(data) > MAX_CHUNK_BYTES:
                        raise ProtocolError(f"chunk of {len(data)} B (limit {MAX_CHUNK_BYTES})")
                    if len(buf) + len(data) > peer.payload_bytes:
                        raise ProtocolError(f"payload exceeds the announced {peer.payload_bytes} B")
                    buf += data
                    self.stats.add_received(peer.codec, len(data))
                    if len(buf) == peer.payload_bytes:
                        received = await self._check(peer, buf)
                        my_rounds = self.engine.rounds_since(prep)
                        await send(pb.ExchangeMsg(ready=pb.Ready(rounds_since_snapshot=my_rounds)))
                elif kind == "ready" and peer_rounds is None:
                    peer_rounds = msg.ready.rounds_since_snapshot
                elif kind == "abort":
                    raise PeerAborted(msg.abort.code, msg.abort.message)
                else:
                    raise ProtocolError(f"unexpected {kind} during the transfer")
            await asyncio.wait_for(sender, self.cfg.chunk_timeout_s)
        finally:
            if not sender.done():
                sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        assert my_rounds is not None
        return received, my_rounds + peer_rounds

    def _replacement_header(self, new: pb.Header, old: pb.Header) -> pb.Header:
        problem = check_header(new, self.me, self.engine)
        if problem is None and (new.peer_id, new.fragment_index, new.codec, new.block_size) != (
                old.peer_id, old.fragment_index, old.codec, old.block_size):
            problem = ProtocolError("the re-sent Header changed peer, fragment or codec")
        if problem is not None:
            raise problem
        return new

    async def _check(self, peer: pb.Header, payload: bytearray) -> Encoded:
        codec = self.engine.codec(peer.codec, peer.block_size)
        try:
            return await asyncio.to_thread(self.engine.check, codec, peer.fragment_numel,
                                           payload, peer.payload_crc32)
        except ValueError as exc:
            raise ProtocolError(f"bad payload: {exc}") from None

    async def _commit(self, prep: Prepared, received: Encoded, weight: float) -> float:
        """Apply in a thread; shielded so a cancellation cannot split a commit."""
        pinned = tuple(self.inflight)
        job = asyncio.ensure_future(asyncio.to_thread(self.engine.commit, prep, received,
                                                      weight, pinned))
        return await asyncio.shield(job)

    async def _read(self, stream: MessageStream, timeout_s: float, what: str) -> Any:
        try:
            msg = await asyncio.wait_for(stream.read(), timeout_s)
        except TimeoutError:
            raise ProtocolError(f"no {what} within {timeout_s:g} s") from None
        if is_eof(msg):
            raise ProtocolError(f"stream closed while waiting for {what}")
        return msg

    @staticmethod
    async def _try_write(stream: MessageStream, msg: pb.ExchangeMsg) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(stream.write(msg), 1.0)

    def _record(self, initiator: bool, prep: Prepared, staleness: int, weight: float,
                norm: float, received: Encoded, started: float) -> Outcome:
        st = self.stats
        st.record_commit(time.monotonic() - started, weight, norm, prep.fragment.numel)
        if initiator:
            st.ok_initiator += 1
        else:
            st.ok_responder += 1
        st.staleness[staleness] += 1
        st.last_correction_norm = norm
        log.debug("exchange %s %s frag %d staleness %d w %.3g |c| %.3g",
                  "to" if initiator else "from", prep.peer_id[:12], prep.fragment.index,
                  staleness, weight, norm)
        return Outcome(prep.peer_id, prep.fragment.index, staleness, weight, norm,
                       len(prep.payload), received.nbytes)

    def _fail(self, where: str, exc: BaseException) -> None:
        self.stats.failed += 1
        self.stats.failures[f"{where}:{type(exc).__name__}"] += 1
        log.debug("%s exchange failed: %s", where, exc)


def is_eof(msg: Any) -> bool:
    return msg is grpc.aio.EOF or msg is None
