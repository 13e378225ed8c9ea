"""``--algorithm gasloc``: the gossip mode of the node, and its outbound gossip loop.

:class:`GossipMode` builds the gossip machinery (an :class:`GossipTransport` over the protocol
engine, a :class:`PeerBook` and a :class:`GossipLoop`), serves inbound Exchange streams, and
runs the GASLoC outer update at each round end.

The loop decides when to exchange, with whom, and which fragment.

Waiting times are exponential with rate ``exchanges_per_round / round duration`` (the round
duration is estimated from the trainer's recent step time), so each node starts on average
``exchanges_per_round`` exchanges per round of its own. The partner is a compatible peer drawn
uniformly: not this node, not one it is already exchanging with, not one in backoff after a
failure, and never an unreachable (``--client-mode``) peer: nobody can dial it, it gossips by
dialing out, so two unreachable nodes are never paired. A BUSY answer is not a failure: the
loop tries another peer, up to ``busy_retries`` times. About once a round the loop also updates
the node's compute-utilization estimate (:class:`~gasloc_p2p.node.stats.Utilization`, a
metric and a progress field).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence

import grpc
import torch

from gasloc_p2p.core.async_state import MAX_STALENESS, AsyncConfig
from gasloc_p2p.core.drift import DriftProbe
from gasloc_p2p.core.links import LinkCache
from gasloc_p2p.core.wire import RESIDUAL_CODECS
from gasloc_p2p.node.config import GossipConfig, NetworkConfig, NodeConfig
from gasloc_p2p.node.discovery.base import PeerInfo
from gasloc_p2p.node.modes.base import Mode, ModeContext, ModeTask
from gasloc_p2p.node.runtime.clock import Clock, WallClock
from gasloc_p2p.node.stats import TrainStats, Utilization
from gasloc_p2p.node.transport.exchange import GossipTransport
from gasloc_p2p.node.transport.service import PeerChannels, StateSnapshot
from gasloc_p2p.protocol.actions import Outcome
from gasloc_p2p.protocol.blame import Ledger, LossGate, PushMeter
from gasloc_p2p.protocol.engine import ExchangeEngine
from gasloc_p2p.protocol.guard import LossWatch, UpdateGuard
from gasloc_p2p.protocol.messages import BUSY, INTERNAL, ExchangeError
from gasloc_p2p.safelog import safe
from gasloc_p2p.train.schedule import LRSchedule

log = logging.getLogger(__name__)
_IDLE_S = 0.5  # re-check interval while there is no rate (no step yet, or no peers)
_WINDOW_MIN_S = 2.0  # shortest utilization window (a round, at least this)
_CONNECT_GRACE_S = 0.1  # after the first connection, others this close count as a tie
_RELAYED_GRACE_S = 1.0  # ... and this close for a relayed one (its relay's calls first)
_NEW_PEER_CONNECT_S = 2.0
_RELAYED_CONNECT_S = 10.0


class PeerBook:
    """Compatible peers from discovery, with backoff after failures, per peer and per
    endpoint (many fake ids can share one dead address)."""

    MAX_TRACKED = 4096  # bound on remembered failures (peer ids and endpoints are cheap to mint)

    def __init__(self, self_id: str, clock: Clock | None = None,
                 dialable: Callable[[PeerInfo], bool] | None = None) -> None:
        self.self_id = self_id
        self.clock = clock or WallClock()
        self.dialable = dialable or (lambda p: p.reachable)
        self.peers: dict[str, PeerInfo] = {}
        self._backoff_until: dict[str, float] = {}  # peer id or "@endpoint" -> until
        self._failures: dict[str, int] = {}  # failures in a row, same keys

    def update(self, peers: Iterable[PeerInfo]) -> None:
        self.peers = {p.peer_id: p for p in peers if p.peer_id != self.self_id}

    def backoff(self, peer_id: str, seconds: float) -> None:
        self._backoff_until[peer_id] = self.clock.monotonic() + seconds

    def failed(self, peer: PeerInfo, base_s: float, max_s: float) -> float:
        """Back ``peer`` and its endpoint off for ``base_s`` doubled per failure in a row
        (at most ``max_s``); returns the backoff in seconds."""
        if len(self._failures) > self.MAX_TRACKED:
            self._forget_expired()
        seconds = 0.0
        for key in (peer.peer_id, "@" + peer.endpoint):
            n = self._failures[key] = self._failures.get(key, 0) + 1
            seconds = min(max_s, base_s * 2 ** min(n - 1, 30))
            self.backoff(key, seconds)
        return seconds

    def succeeded(self, peer: PeerInfo) -> None:
        for key in (peer.peer_id, "@" + peer.endpoint):
            self._failures.pop(key, None)
            self._backoff_until.pop(key, None)

    def _forget_expired(self) -> None:
        now = self.clock.monotonic()
        for key in [k for k, t in self._backoff_until.items() if t <= now]:
            self._backoff_until.pop(key, None)
            self._failures.pop(key, None)

    def candidates(self, exclude: Iterable[str] = ()) -> list[PeerInfo]:
        now, skip, until = self.clock.monotonic(), set(exclude), self._backoff_until
        return [p for p in self.peers.values()
                if p.peer_id not in skip and until.get(p.peer_id, 0.0) <= now
                and until.get("@" + p.endpoint, 0.0) <= now
                and self.dialable(p)]  # a NAT'ed node: only through a relay (libp2p)


class FragmentChooser:
    """Round-robin or random fragment indices."""

    def __init__(self, count: int, order: str, rng: random.Random) -> None:
        self.count, self.order, self.rng = count, order, rng
        self._next = rng.randrange(count)  # nodes start at different fragments

    def __call__(self) -> int:
        if self.order == "random":
            return self.rng.randrange(self.count)
        index, self._next = self._next, (self._next + 1) % self.count
        return index


class GossipLoop:
    """Starts exchanges at exponential waiting times; run :meth:`run` as one task."""

    def __init__(self, exchanger: GossipTransport, book: PeerBook, channels: PeerChannels,
                 gossip: GossipConfig, net: NetworkConfig, train_stats: TrainStats,
                 inner_steps: int, seed: int, active: Callable[[], bool] = lambda: True,
                 clock: Clock | None = None) -> None:
        """``active``: whether to gossip now (the trainer runs); ``clock``: for the waits."""
        self.exchanger = exchanger
        self.book = book
        self.channels = channels
        self.cfg = gossip
        self.net = net
        self.train_stats = train_stats
        self.inner_steps = inner_steps
        self.rng = random.Random(seed)
        self.choose_fragment = FragmentChooser(len(exchanger.engine.fragments),
                                               gossip.fragment_order, self.rng)
        self.active = active
        self.clock = clock or WallClock()
        self.utilization = Utilization()
        self._window_at = -float("inf")
        # connection attempts that no gossip event waits for any more (bounded: each ends
        # within its connect timeout)
        self._settling: dict[asyncio.Future[None], str] = {}  # -> the peer dialed

    def rate_per_s(self) -> float:
        """Exchanges per second this node starts now (0 before the first timed step)."""
        round_s = self.train_stats.round_duration_s(self.inner_steps)
        if self.cfg.exchanges_per_round <= 0 or round_s <= 0:
            return 0.0
        return self.cfg.exchanges_per_round / round_s

    def window(self) -> float:
        """One round, at least ``_WINDOW_MIN_S``: the utilization's window and the longest
        single wait (the waits are memoryless: sleeping one window and drawing again is the
        same law)."""
        return max(self.train_stats.round_duration_s(self.inner_steps), _WINDOW_MIN_S)

    def measure(self) -> None:
        """Update the utilization estimate when a window has passed."""
        now = self.clock.monotonic()
        if now - self._window_at < self.window():
            return
        self._window_at = now
        self.exchanger.stats.utilization = self.utilization.update(self.train_stats)

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            for task in list(self._settling):
                task.cancel()
            await asyncio.gather(*self._settling, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            self.measure()
            rate = self.rate_per_s()
            if rate <= 0 or not self.active():
                await self.clock.sleep(_IDLE_S)
                continue
            wait = self.rng.expovariate(rate)
            if wait > self.window():
                await self.clock.sleep(self.window())
                continue
            await self.clock.sleep(wait)
            try:
                await self.gossip_once()
            except Exception:  # a bug must not end gossip: log it, keep training and serving
                log.exception("gossip event failed unexpectedly")

    async def gossip_once(self) -> Outcome | None:
        """One gossip event: connect to ``connect_fanout`` random candidates at once and
        exchange with the first that answers; after BUSY (or when none connects) try others,
        until one exchange commits, fails, or no candidate is left. None at once when this
        node's uplink carries all the exchanges it can in time (see transport/uplink.py)."""
        if not self.exchanger.uplink_free(None):
            self.exchanger.stats.uplink_waits += 1
            return None
        tried: list[str] = []
        for _ in range(self.cfg.busy_retries + 1):
            exclude = [*tried, *self.exchanger.inflight, *self.exchanger.penalized(),
                       *self._settling.values()]
            options = self.book.candidates(exclude)
            if not options:
                return None
            picks = self.rng.sample(options, min(self.cfg.connect_fanout, len(options)))
            good = [p for p in options if self.exchanger.known_good(p.peer_id)]
            if good and not any(self.exchanger.known_good(p.peer_id) for p in picks):
                # one peer that exchanged before, dialed beside the random picks: records
                # at ports that never answer (tarpits) cannot make a whole event wait
                picks.append(self.rng.choice(good))
            tried += [p.peer_id for p in picks]
            peer = await self._first_connected(picks)
            if peer is None:
                continue
            try:
                outcome = await self.exchange_with(peer, self.choose_fragment())
            except ExchangeError as exc:
                if exc.code == BUSY:
                    self.exchanger.stats.busy += 1
                    continue
                self._failed(peer, exc)
                return None
            except (grpc.RpcError, TimeoutError, OSError) as exc:
                self._failed(peer, exc)
                return None
            self.book.succeeded(peer)
            return outcome
        return None

    def connect_timeout_s(self, peer: PeerInfo) -> float:
        """How long a connection (TCP and the TLS handshake) to ``peer`` may take: for a
        peer that never exchanged with this node a quarter of ``connect_timeout_s``, but at
        least ``_NEW_PEER_CONNECT_S`` (about 3 round trips on a slow intercontinental path)."""
        full = self.net.connect_timeout_s
        if not peer.reachable:  # through a relay: a libp2p connection and stream first
            return max(full, _RELAYED_CONNECT_S)
        if self.exchanger.known_good(peer.peer_id):
            return full
        return max(full / 4, min(full, _NEW_PEER_CONNECT_S))

    async def _first_connected(self, picks: Sequence[PeerInfo]) -> PeerInfo | None:
        """A random one of ``picks`` whose endpoint connects first or within
        ``_CONNECT_GRACE_S`` of the first (attempts run concurrently, so a peer whose channel
        is already open is not favoured over a new one on a fast link), ``_RELAYED_GRACE_S``
        while a relayed attempt runs (a relayed connection takes the relay's calls first: with
        the short grace a reachable peer whose channel is open wins every event it is picked
        for); the
        ones that fail (dead or fake records) are backed off, the slower ones abandoned."""
        attempts = {asyncio.ensure_future(connect(
            self.channels.stub_and_channel(self.channels.endpoint_for(p), p.cert)[1],
            p.endpoint, self.connect_timeout_s(p))): p for p in picks}
        pending, connected = set(attempts), list[PeerInfo]()
        try:
            while pending:
                relayed = any(not attempts[task].reachable for task in pending)
                grace = (_RELAYED_GRACE_S if relayed else _CONNECT_GRACE_S) if connected else None
                done, pending = await asyncio.wait(pending, timeout=grace,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    peer, exc = attempts[task], task.exception()
                    if exc is None:
                        connected.append(peer)
                    else:
                        self.channels.discard(self.channels.endpoint_for(peer), peer.cert)
                        self._failed(peer, exc)
                if connected and not done:  # the grace is over
                    break
            return self.rng.choice(connected) if connected else None
        finally:  # the slower attempts go on until their own timeout: a dead one is then
            for task in pending:  # backed off, so the next events do not dial it again
                self._settling[task] = attempts[task].peer_id
                task.add_done_callback(functools.partial(self._settled, attempts[task]))

    def _settled(self, peer: PeerInfo, task: asyncio.Future[None]) -> None:
        """A connection attempt no event waited for has ended: back its peer off if it
        failed."""
        self._settling.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self.channels.discard(self.channels.endpoint_for(peer), peer.cert)
            self._failed(peer, task.exception() or RuntimeError())

    async def exchange_with(self, peer: PeerInfo, fragment: int) -> Outcome:
        stub, channel = self.channels.stub_and_channel(self.channels.endpoint_for(peer),
                                                       peer.cert)
        await connect(channel, peer.endpoint,
                      max(self.net.connect_timeout_s, self.connect_timeout_s(peer)))
        deadline = self.exchanger.deadline_s + self.cfg.commit_timeout_s
        started = time.monotonic()
        outcome = await self.exchanger.initiate(lambda: stub.Exchange(timeout=deadline),
                                                peer.peer_id, fragment,
                                                peer.endpoint.rsplit(":", 1)[0],
                                                self.cfg.codec in RESIDUAL_CODECS
                                                and self.cfg.codec in peer.codecs)
        self.exchanger.stats.record_path(self.channels.path_of(peer), peer.peer_id,
                                         time.monotonic() - started)
        return outcome

    def _failed(self, peer: PeerInfo, exc: BaseException) -> None:
        """Back ``peer`` off: 4 times longer if it never exchanged with this node, so
        records that never answer are tried rarely."""
        self.exchanger.stats.failed += 1
        self.exchanger.stats.failures[f"outbound:{type(exc).__name__}"] += 1
        base = self.cfg.backoff_s * (1 if self.exchanger.known_good(peer.peer_id) else 4)
        seconds = self.book.failed(peer, base, self.cfg.max_backoff_s)
        self.exchanger.reasons("outbound", f"exchange with {safe(peer.peer_id)}", exc)
        log.debug("backing %s off for %.0f s", safe(peer.peer_id), seconds)


class ConnectFailed(ExchangeError):
    """No connection to the peer's endpoint: nothing was sent."""

    def __init__(self, message: str) -> None:
        super().__init__(INTERNAL, message)


async def connect(channel: grpc.aio.Channel, endpoint: str, timeout_s: float) -> None:
    """Wait until ``channel`` is connected; :class:`ConnectFailed` as soon as gRPC reports a
    transient failure (e.g. connection refused) or after ``timeout_s``."""
    ready, failure = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE
    try:
        async with asyncio.timeout(timeout_s):
            state = channel.get_state(try_to_connect=True)
            while state != ready:
                if state == failure:
                    raise ConnectFailed(f"cannot connect to {endpoint!r}")
                await channel.wait_for_state_change(state)
                state = channel.get_state(try_to_connect=True)
    except TimeoutError:
        raise ConnectFailed(f"cannot connect to {endpoint!r} within {timeout_s:g} s") from None


def _drift_reporter(guard: UpdateGuard, schedule: LRSchedule, inner_steps: int,
                    stats: TrainStats) -> Callable[[dict[int, float]], None]:
    """The trainer's round-end callback: the round's drifts and its step bound (the sum of its
    inner learning rates, from this node's own schedule and step count) to the guard."""
    def report(drifts: dict[int, float]) -> None:
        end = stats.step  # steps done; the round took the last inner_steps of them
        bound = sum(schedule.at(s) for s in range(max(0, end - inner_steps), end))
        guard.round_end(drifts, bound)

    return report


def _blamer(guard: UpdateGuard, ledger: Ledger
            ) -> Callable[[torch.Tensor, torch.Tensor, int], None]:
    """The trainer's callback before a rollback for a rise of its loss: the keys whose
    exchanges since the good copy moved the node along the rise get a demerit."""
    def blame(theta: torch.Tensor, good: torch.Tensor, since: int) -> None:
        at = ledger.positions
        rise = (theta.detach().index_select(0, at.to(theta.device)).cpu()
                - good.index_select(0, at.to(good.device)).cpu())
        culprits = ledger.culprits(since, rise)
        for key, block in culprits:
            guard.demerit(key, block)
        log.warning("the loss rose since round %d: %d peer key(s) blamed (%s)", since,
                    len(culprits), ", ".join(safe(k)[:12] for k, _ in culprits[:4]))

    return blame


def compatible_codecs(peers: Sequence[PeerInfo], codec: str) -> list[PeerInfo]:
    """Peers that announced they can decode ``codec`` (or announced no list at all)."""
    return [p for p in peers if not p.codecs or codec in p.codecs]


class GossipMode(Mode):
    """GASLoC: pairwise gossip exchanges between round ends (docs/algorithm.md section 2)."""

    name = "gasloc"

    def __init__(self) -> None:
        self.ctx: ModeContext | None = None
        self._exchanger: GossipTransport | None = None
        self.book: PeerBook | None = None
        self.loop: GossipLoop | None = None

    @staticmethod
    def outer_config(cfg: NodeConfig) -> AsyncConfig:
        return cfg.outer.async_config()

    async def start(self, ctx: ModeContext) -> None:
        cfg, trainer = ctx.cfg, ctx.trainer
        self.ctx = ctx
        engine = ExchangeEngine(trainer.state, trainer.theta0, trainer.fragments, ctx.lock)
        if cfg.gossip.codec in RESIDUAL_CODECS:  # links in host memory (pinned beside a GPU)
            engine.links = LinkCache(cfg.gossip.links, pin=engine.stream is not None)
        failed = await asyncio.to_thread(engine.warm_up, cfg.gossip.codec_spec)  # before any exchange
        if failed:
            log.warning("the fused exchange kernels did not build (%s); exchanges run the eager "
                        "passes (the same bytes, about 10x the device time)", failed)
        elif engine.kernels and engine.streams(cfg.gossip.codec_spec):
            log.info("exchanges run fused Triton kernels on %s", engine.device)
        self._exchanger = GossipTransport(ctx.me, engine, cfg.gossip, cfg.outer.async_config(),
                                    stats=ctx.exchange_stats)
        trainer.exchange_work = ctx.exchange_stats  # quiet steps, for the utilization
        if engine.guard is not None:  # the guard's unit: this node's own drift per round
            trainer.probe = DriftProbe(trainer.state.theta, trainer.fragments)
            trainer.on_drift = _drift_reporter(engine.guard, trainer.inner.schedule,
                                               cfg.train.inner_steps, ctx.train_stats)
            if cfg.gossip.guard_push_limit > 0:  # a push in one direction, summed over rounds
                engine.meter = PushMeter()
                engine.meter_limit = cfg.gossip.guard_push_limit
                engine.meter.back_share = cfg.gossip.guard_push_back
                engine.meter.back_rounds = cfg.gossip.guard_back_rounds
            loss = trainer.private_loss() if cfg.gossip.guard_loss_gate > 0 else None
            if loss is not None:  # the loss itself, measured around each commit
                engine.gate = LossGate(loss, cfg.gossip.guard_loss_gate)
            if cfg.gossip.guard_loss_rise > 0:  # a rise of the loss: roll back, blame
                engine.ledger = Ledger(trainer.state.theta.numel())
                trainer.losses = LossWatch(rise=cfg.gossip.guard_loss_rise)
                trainer.on_rollback = _blamer(engine.guard, engine.ledger)
                trainer.moved_since = engine.ledger.moved_since
        self.book = PeerBook(ctx.me.peer_id, ctx.clock, ctx.channels.dialable)
        self.book.update(ctx.peers())
        self.loop = GossipLoop(self._exchanger, self.book, ctx.channels, cfg.gossip, cfg.network,
                               ctx.train_stats, cfg.train.inner_steps, ctx.seed,
                               active=lambda: ctx.train_stats.running, clock=ctx.clock)

    def tasks(self) -> list[ModeTask]:
        assert self.loop is not None, "start the mode first"
        return [("gossip", self.loop.run)]

    @property
    def exchanger(self) -> GossipTransport | None:
        return self._exchanger

    def trainer_round_end(self) -> None:
        """None: the trainer runs the GASLoC update in the H-th step's own lock hold."""
        return None

    def round_end(self) -> None:
        """The GASLoC outer update (``AsyncGaslocState.round_end``) under the training lock
        (what the trainer does itself, atomically with the round's last step)."""
        assert self.ctx is not None
        state = self.ctx.trainer.state
        with self.ctx.lock.step():
            state.round_end()
            self.ctx.train_stats.rounds = state.rounds

    def peers_changed(self, peers: Sequence[PeerInfo]) -> None:
        if self.book is not None:
            self.book.update(peers)

    def candidates(self, peers: Sequence[PeerInfo]) -> list[PeerInfo]:
        """Reachable peers not in backoff after a failed exchange."""
        return self.book.candidates() if self.book is not None else super().candidates(peers)

    def snapshot(self) -> StateSnapshot:
        """The public iterate and the outer optimizer's state, copied to the host under the
        lock (chunk by chunk: no device-side copy of the model)."""
        assert self.ctx is not None
        state = self.ctx.trainer.state
        with self.ctx.lock.urgent(writes=False):
            outer = {name: t.to("cpu", copy=True) for name, t in state.outer.state_dict().items()}
            public = state.public_iterate(out=torch.empty(state.theta.numel()))
            return StateSnapshot(self.ctx.train_stats.step, state.rounds, state.outer.name,
                                 public, outer)

    def progress(self) -> str:
        assert self.ctx is not None
        x = self.ctx.exchange_stats
        stale = sum(n for k, n in x.staleness.items() if k > MAX_STALENESS)
        return (f"exchanges ok {x.ok} (init {x.ok_initiator} resp {x.ok_responder}) failed "
                f"{x.failed} busy {x.busy} stale {stale} | sent {x.bytes_sent / 1e6:.2f} MB "
                f"recv {x.bytes_received / 1e6:.2f} MB | util {x.utilization:.3f}{self._guard()}")

    def _guard(self) -> str:
        """The guard's unit (this node's own drift per round) and the share of this round's
        movement budget spent, on fragment 0."""
        guard = self._exchanger.engine.guard if self._exchanger is not None else None
        if guard is None:
            return ""
        meter = self._exchanger.engine.meter if self._exchanger is not None else None
        drift = guard.drift(0)
        pushed = (f" pushed {meter.level(0) / drift:.2f}" if meter is not None and drift > 0
                  else "")
        gate = self._exchanger.engine.gate if self._exchanger is not None else None
        gated = f" gated {gate.taken_back} (bad {gate.bad})" if gate is not None else ""
        return (f" | guard drift {drift:.4g} (measured {guard.measured(0):.4g}) spent "
                f"{guard.spent(0):.2f}{pushed}{gated}")

    async def stop(self) -> None:
        if self._exchanger is not None:
            self._exchanger.accepting = False
