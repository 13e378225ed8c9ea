"""The asyncio/gRPC shell of the Exchange protocol, for both roles (see gasloc.proto).

:class:`GossipTransport` runs exchanges as initiator (:meth:`GossipTransport.initiate`) or
responder (:meth:`GossipTransport.respond`). The protocol itself (message order, header checks,
staleness weight) lives in the sans-I/O :class:`ExchangeSession`; this shell only
moves messages between the stream and the session, runs the actions it asks for (tensor work in
threads via ``asyncio.to_thread``, never on the event loop), applies the named timeouts from
:class:`GossipConfig`, and owns admission control (in-flight peers, inbound limit), the upload
rate limit and the stats. Any error, timeout, cancellation or ``Abort`` before the commit leaves
both sides unchanged.

The one window two parties cannot close: the initiator applies once its ``Commit`` is written;
if the responder dies before reading it, only one side applied: the pair's sum moved by one
correction, which the next exchanges average away (no per-peer state can go stale).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.node.config import GossipConfig
from gasloc_p2p.node.stats import ExchangeStats
from gasloc_p2p.node.transport.ratelimit import TokenBucket
from gasloc_p2p.node.transport.reasons import FailureReasons
from gasloc_p2p.node.transport.uplink import UplinkMeter
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.actions import (
    Action,
    Admit,
    Apply,
    Check,
    Done,
    FlushPayload,
    Outcome,
    Prepare,
    Send,
    SendPayload,
)
from gasloc_p2p.protocol.engine import ExchangeEngine
from gasloc_p2p.protocol.guard import UpdateGuard, address_block
from gasloc_p2p.protocol.messages import (
    BUSY,
    MAX_CHUNK_BYTES,
    ExchangeError,
    Identity,
    ImplausiblePayload,
    MessageStream,
    ProtocolError,
    chunks,
)
from gasloc_p2p.protocol.session import ExchangeSession, Rules, Stage, Timeouts
from gasloc_p2p.safelog import safe

log = logging.getLogger(__name__)

# Opens an Exchange call on the peer: a MessageStream that also has done_writing/cancel/code.
CallFactory = Callable[[], Any]
Write = Callable[[pb.ExchangeMsg], Awaitable[None]]
T = TypeVar("T")
_MAX_PENALIZED = 1024  # peers remembered as penalized (bounded memory)
_MAX_GOOD = 4096  # peers remembered as having committed an exchange here
_ROUND_AT_MOST_S = 30.0  # ... or per this long, when the node's rounds stop (training ended)
_ABORT_WRITE_S = 1.0  # a failed exchange's last write (the Abort, or the payload write in flight)


def remote_address(context: Any) -> str:
    """The caller's IP address (gRPC's ``ipv4:1.2.3.4:5678`` without the port)."""
    try:
        peer = str(context.peer())
    except Exception:  # noqa: BLE001 - a test double or a closed call
        return "?"
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


class GossipTransport:
    """Runs exchanges of one node; owns admission (in-flight peers, inbound limit) and stats."""

    def __init__(self, me: Identity, engine: ExchangeEngine, gossip: GossipConfig,
                 outer: AsyncConfig, bucket: TokenBucket | None = None,
                 stats: ExchangeStats | None = None) -> None:
        self.me = me
        self.engine = engine
        self.outer = outer
        self.cfg = gossip  # also builds self.rules
        self.bucket = bucket or TokenBucket.from_mbps(gossip.max_upload_mbps, MAX_CHUNK_BYTES)
        self.stats = stats or ExchangeStats()
        self.reasons = FailureReasons()  # why exchanges fail, logged once per reason
        self.inflight: set[str] = set()  # peers with an exchange in flight, either role
        self.initiating: set[str] = set()  # ... of those, the ones this node started
        self.uplink = UplinkMeter()  # this node's own payloads' rate: exchanges at once
        self.inbound = 0
        self.accepting = True
        self._guards: dict[int, RateGuard] = {}  # minimum-rate state of the running sessions
        engine.guard = (UpdateGuard(gossip.guard_rule(), outer.w) if gossip.guard_factor > 0
                        else None)
        self._penalized: dict[str, float] = {}  # peer -> monotonic time its penalty ends
        # address block -> end of its penalty for keys without full trust here (a refused
        # peer's next fresh identity from the same block is not a stranger)
        self._penalized_blocks: dict[str, float] = {}
        # peers with a committed exchange here, newest last (bounded): they get the reserved
        # inbound slots
        self._good: OrderedDict[str, None] = OrderedDict()  # at most _MAX_GOOD
        self.reserved_inbound = max(1, gossip.max_inbound // 2)
        # key -> (round, its start, exchanges started in it)
        self._this_round: OrderedDict[str, tuple[int, float, int]] = OrderedDict()
        # called with every committed exchange and its wall time, either role
        self.on_commit: Callable[[Outcome, float], None] | None = None

    def _admit_this_round(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may start another exchange here this round: at most
        ``key_exchanges_per_round`` a round of this node (an honest peer starts about
        exchanges_per_round / peers with it; a member's keys took seven a second each, and
        serving them halved the node's own training: issue 39)."""
        if self.cfg.key_exchanges_per_round <= 0:
            return True
        now, clock = self.engine.state.rounds, time.monotonic()
        at, since, count = self._this_round.get(peer_id, (now, clock, 0))
        if at != now or clock - since > _ROUND_AT_MOST_S:  # a node that stopped training
            at, since, count = now, clock, 0
        if count >= self.cfg.key_exchanges_per_round:
            return False
        self._this_round[peer_id] = (at, since, count + 1)
        self._this_round.move_to_end(peer_id)
        while len(self._this_round) > _MAX_GOOD:
            self._this_round.popitem(last=False)
        return True

    def inbound_limit(self, peer_id: str) -> int:
        """How many inbound exchanges may run when ``peer_id``'s would start: the base limit,
        the reserved slots too for a peer that committed here before (unless blamed), a
        quarter of the base for a blamed key."""
        guard = self.engine.guard
        if guard is not None and guard.demerits(peer_id):
            return max(1, self.cfg.max_inbound // 4)
        return self.cfg.max_inbound + (self.reserved_inbound if peer_id in self._good else 0)

    def uplink_slots(self) -> int | None:
        """Exchanges this node's uplink carries at once within the peers' deadlines (its own
        measured rate, see uplink.py), or None before a measurement."""
        return self.uplink.slots(self.payload_bytes, self.cfg.chunk_bytes,
                                 self.rules.timeouts.chunk_s, self.deadline_s)

    def uplink_sampled(self, nbytes: int, seconds: float) -> None:
        """One of this node's payloads reached a peer: the uplink's new sample, its slots in
        the stats, and a line when the limit binds or stops binding (more than the inbound
        limits allow never does): not every few seconds as a fast link's rate wobbles."""
        self.uplink.sample(nbytes, seconds)
        slots = self.uplink_slots()
        if slots is None or slots == self.stats.uplink_slots:
            return
        cap = self.cfg.max_inbound + self.reserved_inbound + 1
        if min(slots, cap) != min(self.stats.uplink_slots or cap, cap):
            log.info("uplink: %.3g Mbit/s measured, %d exchange(s) at once fit the peers' "
                     "deadlines", (self.uplink.rate() or 0.0) * 8 / 1e6, slots)
        self.stats.uplink_slots = slots

    def uplink_free(self, peer_id: str | None) -> bool:
        """Whether another exchange fits the uplink now: one this node starts (``peer_id``
        None) or answers for a peer that committed here before counts only this node's own
        and such peers' exchanges in flight (newcomers cannot take the uplink from them);
        a newcomer's counts every exchange in flight."""
        slots = self.uplink_slots()
        if slots is None:
            return True
        if peer_id is None or peer_id in self._good:
            mine = len(self.initiating) + sum(1 for p in self.inflight - self.initiating
                                              if p in self._good)
            return mine < slots
        return len(self.inflight) < slots

    def known_good(self, peer_id: str) -> bool:
        """Whether ``peer_id`` committed an exchange with this node (lately; bounded)."""
        return peer_id in self._good

    def block_penalized(self, peer_id: str, block: str) -> bool:
        """Whether ``peer_id`` from ``block`` is refused: a key without full trust here from
        a block whose peer sent an implausible update lately."""
        until = self._penalized_blocks.get(block)
        if until is None:
            return False
        if until <= time.monotonic():
            del self._penalized_blocks[block]
            return False
        guard = self.engine.guard
        return guard is None or not guard.trusted(peer_id)

    def penalized(self) -> list[str]:
        """Peers left alone (both directions) after an implausible update."""
        now = time.monotonic()
        for peer in [p for p, until in self._penalized.items() if until <= now]:
            del self._penalized[peer]
        return list(self._penalized)

    def _implausible(self, peer_id: str, block: str, exc: BaseException) -> None:
        """Our guard rejected ``peer_id``'s update: back it off in both directions, and its
        address block's keys that have not earned full trust here."""
        self.stats.implausible += 1
        until = time.monotonic() + self.cfg.guard_backoff_s
        for table, who in ((self._penalized, peer_id), (self._penalized_blocks, block)):
            if len(table) >= _MAX_PENALIZED:  # bounded: forget the oldest
                table.pop(next(iter(table)))
            table[who] = until
        log.warning("peer %s sent an implausible update (%s); leaving it alone for %g s",
                    safe(peer_id), exc, self.cfg.guard_backoff_s)

    @property
    def cfg(self) -> GossipConfig:
        return self._cfg

    @cfg.setter
    def cfg(self, gossip: GossipConfig) -> None:
        """Replacing the config (codec, timeouts) rebuilds the sessions' rules to match."""
        self._cfg = gossip
        # this node's largest payload on the slowest link it plans for (a 1 GB payload takes
        # 800 s at 10 Mbit/s): the whole exchange's deadline and the wait for our own upload
        # to finish grow by it
        largest = max((f.numel for f in self.engine.fragments), default=0)
        self.payload_bytes = gossip.codec_spec.codec().wire_bytes(largest)
        send_s = gossip.transfer_s(self.payload_bytes)
        self.deadline_s = gossip.exchange_timeout_s + send_s
        # one message of the peer's payload: the largest chunk twice over on that link, if
        # that is longer than the setting (1 MiB at 0.5 Mbit/s takes 17 s)
        chunk_s = max(gossip.chunk_timeout_s, 2 * gossip.transfer_s(MAX_CHUNK_BYTES))
        self.rules = Rules.build(self.me, gossip.codec_spec, self.outer.w, Timeouts(
            gossip.header_timeout_s, chunk_s, gossip.commit_timeout_s, send_s))

    # ----------------------------------------------------------------- initiator
    async def initiate(self, open_call: CallFactory, peer_id: str, fragment_index: int,
                       host: str = "", peer_links: bool = False) -> Outcome:
        """One exchange with ``peer_id`` (at ``host``; ``peer_links``: its record says it
        keeps links, see core/links.py) as initiator; raises
        :class:`ExchangeError` (or ``TimeoutError``/``grpc.RpcError``) on failure, with
        nothing applied."""
        if peer_id in self.inflight:
            raise ExchangeError(BUSY, f"already exchanging with {peer_id}")
        block = address_block(host)
        if self.block_penalized(peer_id, block):
            raise ExchangeError(BUSY, f"{block} is backed off")
        self.inflight.add(peer_id)
        self.initiating.add(peer_id)
        try:
            return await self._initiate(open_call, peer_id, fragment_index, block, peer_links)
        finally:
            self.inflight.discard(peer_id)
            self.initiating.discard(peer_id)

    async def _initiate(self, open_call: CallFactory, peer_id: str, fragment: int,
                        block: str, peer_links: bool = False) -> Outcome:
        started = time.monotonic()
        session = ExchangeSession.initiator(self.rules, self.engine, peer_id, fragment,
                                            peer_links)
        (prepare,) = session.start()
        assert isinstance(prepare, Prepare)
        first = session.prepared(await self._prepare(prepare, block))
        call = open_call()
        try:
            async with asyncio.timeout(self.deadline_s):
                apply = await self._pump(call, session, first, block)
        except BaseException as exc:
            self._release(session)
            if isinstance(exc, ImplausiblePayload):
                self._implausible(peer_id, block, exc)
            lost = isinstance(exc, grpc.RpcError | asyncio.CancelledError)
            for act in session.fail(exc, transport_lost=lost):
                await self._try_write(call, _message(act))
            call.cancel()
            raise
        outcome = await self._apply(session, apply)
        await self._finish_call(call)
        return self._record(True, outcome, started)

    async def _finish_call(self, call: Any) -> None:
        """After our commit: wait for the responder to close the stream (its commit)."""
        try:
            await call.done_writing()
            code = await asyncio.wait_for(call.code(), self.cfg.commit_timeout_s)
            if code != grpc.StatusCode.OK:
                log.warning("peer ended a committed exchange with %s: it may not have applied",
                            code)
        except Exception as exc:
            log.warning("no confirmation from the peer after commit (%s): it may not have "
                        "applied", exc)

    # ----------------------------------------------------------------- responder
    async def respond(self, stream: MessageStream,
                      authenticated: Callable[[], None] | None = None,
                      header_s: float | None = None, address: str | None = None) -> None:
        """Serve one inbound exchange on ``stream``; never raises for peer errors.

        ``authenticated`` is called once the initiator's Header passed its checks (signature
        included), ``header_s`` bounds the wait for that Header (the pre-authentication
        deadline); ``address``: the caller's (default: the stream's peer)."""
        session = ExchangeSession.responder(self.rules, self.engine)
        block = address_block(address or remote_address(stream))
        try:
            actions = session.receive(await self._read(stream, session, header_s))
        except (ExchangeError, TimeoutError) as exc:
            self._fail("inbound-no-header", exc)
            return
        if actions and isinstance(actions[0], Admit):
            peer = actions[0].peer_id
            if authenticated is not None:
                authenticated()
            # peers that exchanged with us before have slots of their own: newcomers holding
            # every slot (an open swarm's free keys) cannot shut them out; keys blamed for a
            # rise of our loss share a quarter of the base slots (issue 39: a member's trusted
            # keys held every slot, and honest exchanges fell to a tenth)
            limit = self.inbound_limit(peer)
            if (not self.accepting or self.inbound >= limit
                    or peer in self.inflight or peer in self.penalized()
                    or self.block_penalized(peer, block)):
                actions = session.refused()
            elif not self.uplink_free(peer):  # our uplink carries all it can in time
                self.stats.uplink_busy += 1
                actions = session.refused()
            elif not self._admit_this_round(peer):
                actions = session.refused()
        if session.stage is Stage.REJECTED:
            self.stats.rejected_inbound += 1
            log.debug("rejecting %s: %s", safe(session.peer_id or "?"), session.problem)
            await self._try_write(stream, _message(actions[0]))
            return
        self.inflight.add(session.peer_id)
        self.inbound += 1
        try:
            await self._respond(stream, session, block)
        except asyncio.CancelledError as exc:  # the initiator vanished, or we are stopping
            self._release(session)
            session.fail(exc, transport_lost=True)
            self._fail("inbound-cancelled", exc)
            raise
        except Exception as exc:  # peer errors, timeouts, our own failures: nothing applied
            self._release(session)
            self._fail("inbound", exc)
            if isinstance(exc, ImplausiblePayload):
                self._implausible(session.peer_id, block, exc)
            if not isinstance(exc, ExchangeError | TimeoutError | grpc.RpcError):
                log.warning("inbound exchange from %s failed on this side: %r",
                            safe(session.peer_id), exc)
            for act in session.fail(exc):
                await self._try_write(stream, _message(act))
        finally:
            self.inbound -= 1
            self.inflight.discard(session.peer_id)

    def _release(self, session: ExchangeSession) -> None:
        """A failed exchange: the guard's reservation for it returns to the budget."""
        if session.prep is not None:
            self.engine.release(session.prep)

    async def _respond(self, stream: MessageStream, session: ExchangeSession,
                       block: str) -> None:
        started = time.monotonic()
        async with asyncio.timeout(self.deadline_s):
            apply = await self._pump(stream, session, session.admitted(), block)
        outcome = await self._apply(session, apply)
        self._record(False, outcome, started)

    # ----------------------------------------------------------------- the pump
    async def _pump(self, stream: MessageStream, session: ExchangeSession,
                    actions: list[Action], block: str) -> Apply:
        """Run the session's actions and feed it the stream's messages until it decides to
        apply; our payload goes out concurrently, one writer at a time."""
        write_lock = asyncio.Lock()
        tasks: list[asyncio.Task[None]] = []

        async def write(msg: pb.ExchangeMsg) -> None:
            async with write_lock:
                await stream.write(msg)

        todo: deque[Action] = deque(actions)
        try:
            return await self._pump_loop(stream, session, todo, write,
                                         lambda t: tasks.append(t), block)
        finally:
            self._guards.pop(id(session), None)
            for sender in tasks:
                await self._stop_sender(sender, write_lock)

    @staticmethod
    async def _stop_sender(sender: asyncio.Task[None], write_lock: asyncio.Lock) -> None:
        """Cancel our payload's sender between two writes, not inside one: a write cancelled
        while gRPC still carries it leaves the stream unable to take the Abort that follows
        (the peer then saw the stream end with no reason, once in a loaded test run). The
        wait for the write in flight is bounded: a peer that stopped reading gets no Abort."""
        locked = False
        if not sender.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(write_lock.acquire(), _ABORT_WRITE_S)
                locked = True
            sender.cancel()
        try:
            await asyncio.gather(sender, return_exceptions=True)
        finally:
            if locked:
                write_lock.release()

    async def _pump_loop(self, stream: MessageStream, session: ExchangeSession,
                         todo: deque[Action], write: Write,
                         started: Callable[[asyncio.Task[None]], None], block: str) -> Apply:
        """The body of :meth:`_pump`; ``started`` learns the payload sender task."""
        sender: asyncio.Task[None] | None = None
        sending: tuple[int, float] | None = None  # our payload's size and its start
        while True:
            while todo:
                act = todo.popleft()
                if isinstance(act, Apply):
                    return act
                if isinstance(act, SendPayload):
                    sender = asyncio.create_task(self._send_payload(write, act),
                                                 name=f"send-payload-{session.peer_id[:8]}")
                    started(sender)
                    sending = (len(act.payload), time.monotonic())
                elif isinstance(act, FlushPayload):
                    assert sender is not None
                    await asyncio.wait_for(sender, act.timeout_s)
                    todo.extend(session.payload_sent())
                else:
                    todo.extend(await self._run(act, session, write, block))
            msg = await self._read(stream, session)
            todo.extend(session.receive(msg))
            kind = msg.WhichOneof("kind")
            if kind == "chunk":
                self.stats.add_received(session.peer_codec, len(msg.chunk.data))
            elif kind == "ready" and sending is not None:  # the peer has all of ours
                self.uplink_sampled(sending[0], time.monotonic() - sending[1])
                sending = None

    async def _run(self, act: Action, session: ExchangeSession, write: Write,
                   block: str) -> list[Action]:
        """One action that yields the session's next actions (never Apply/payload ones)."""
        if isinstance(act, Send):
            await write(act.msg)
            return []
        if isinstance(act, Prepare):
            return session.prepared(await self._prepare(act, block))
        if isinstance(act, Check):
            try:
                received = await self._work(self.engine.check, act.codec, act.numel,
                                            act.payload, act.digest, act.prep, act.seen_digest)
            except ValueError as exc:
                return session.check_failed(exc)
            return session.checked(received)
        raise AssertionError(f"unexpected action {act!r}")

    async def _prepare(self, act: Prepare, block: str) -> Any:
        return await self._work(self.engine.prepare, act.peer_id, act.fragment, act.codec,
                                block, act.link)

    async def _work(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, marked as exchange work for the trainer's timing
        (steps that overlap no exchange work are its "quiet" steps: the utilization)."""
        st = self.stats
        st.work_active += 1
        st.work_started += 1
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            st.work_active -= 1

    async def _send_payload(self, write: Write, act: SendPayload) -> None:
        for piece in chunks(act.payload, self.cfg.chunk_bytes):
            await self.bucket.take(len(piece))
            await write(pb.ExchangeMsg(chunk=pb.Chunk(data=piece)))
            self.stats.add_sent(act.codec.name, len(piece))

    async def _apply(self, session: ExchangeSession, act: Apply) -> Outcome:
        """Apply in a thread; shielded so a cancellation cannot split a commit."""
        job = asyncio.ensure_future(self._work(self.engine.commit, act.prep, act.received,
                                               act.weight))
        norm = await asyncio.shield(job)
        (done,) = session.applied(norm)
        assert isinstance(done, Done)
        return done.outcome

    async def _read(self, stream: MessageStream, session: ExchangeSession,
                    cap_s: float | None = None) -> Any:
        expected = session.expecting()
        assert expected is not None, f"nothing to read in stage {session.stage}"
        timeout_s, rate_bound = min(expected[1], cap_s or float("inf")), False
        guard = self._guards.get(id(session))
        if session.stage is Stage.TRANSFER and session.receiving_payload:
            if guard is None:
                guard = self._guards[id(session)] = RateGuard(
                    time.monotonic(), self.cfg.min_transfer_bps, self.cfg.transfer_grace_s)
            left = guard.seconds_left(time.monotonic(), session.payload_received)
            if left < timeout_s:
                timeout_s, rate_bound = max(left, 0.0), True
        try:
            msg = await asyncio.wait_for(stream.read(), timeout_s)
        except TimeoutError:
            if rate_bound:
                self.stats.failures["slow-transfer"] += 1
                raise ProtocolError(f"payload slower than {self.cfg.min_transfer_bps:g} B/s "
                                    "after the grace") from None
            return session.timed_out()
        if is_eof(msg):
            return session.closed()
        return msg

    @staticmethod
    async def _try_write(stream: MessageStream, msg: pb.ExchangeMsg) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(stream.write(msg), _ABORT_WRITE_S)

    def _record(self, initiator: bool, outcome: Outcome, started: float) -> Outcome:
        st, took = self.stats, time.monotonic() - started
        self._good[outcome.peer_id] = None
        self._good.move_to_end(outcome.peer_id)
        if len(self._good) > _MAX_GOOD:
            self._good.popitem(last=False)
        st.record_commit(took, outcome.weight, outcome.correction_norm, outcome.numel)
        st.add_partner(outcome.peer_id)
        if self.on_commit is not None:
            self.on_commit(outcome, took)
        if initiator:
            st.ok_initiator += 1
        else:
            st.ok_responder += 1
        st.staleness[outcome.staleness] += 1
        st.last_correction_norm = outcome.correction_norm
        if outcome.clipped:
            st.clipped += 1
            log.info("exchange %s %s clipped: its distance exceeds this node's soft limit, "
                     "weight x%.3g", "to" if initiator else "from", safe(outcome.peer_id[:12]),
                     outcome.clip)
        log.debug("exchange %s %s frag %d staleness %d w %.3g |c| %.3g",
                  "to" if initiator else "from", safe(outcome.peer_id[:12]), outcome.fragment,
                  outcome.staleness, outcome.weight, outcome.correction_norm)
        return outcome

    def _fail(self, where: str, exc: BaseException) -> None:
        self.stats.failed += 1
        self.stats.failures[f"{where}:{type(exc).__name__}"] += 1
        self.reasons(where, f"{where} exchange", exc)


class RateGuard:
    """A minimum transfer rate: after ``grace_s``, the peer's payload must have arrived at
    ``min_bps`` bytes/s on average since the transfer started (0: no minimum), counting the
    message in flight as the size of the peer's last one (the first: a whole chunk). A peer
    that trickles bytes just inside the per-message timeout is cut after about grace + its
    payload size / min_bps, not after payload-size per-message timeouts; an honest peer whose
    1 MiB chunks arrive at the minimum rate is not cut (counting the message in flight as one
    byte demanded the first chunk within the grace: about 1.7 Mbit/s for the exchange)."""

    def __init__(self, started: float, min_bps: float, grace_s: float,
                 first_message: int = MAX_CHUNK_BYTES) -> None:
        self.started, self.min_bps, self.grace_s = started, min_bps, grace_s
        self.in_flight = first_message  # bytes the next message is counted as
        self._seen = 0

    def seconds_left(self, now: float, received: int) -> float:
        """How long the next message may take before the stream is below the rate."""
        if received > self._seen:
            self.in_flight, self._seen = received - self._seen, received
        if self.min_bps <= 0:
            return float("inf")
        return self.started + self.grace_s + (received + self.in_flight) / self.min_bps - now


def _message(act: Action) -> pb.ExchangeMsg:
    assert isinstance(act, Send)
    return act.msg


def is_eof(msg: Any) -> bool:
    return msg is grpc.aio.EOF or msg is None
