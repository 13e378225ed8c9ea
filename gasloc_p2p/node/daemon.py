"""The node runtime: an async context manager that owns every subsystem and task.

Start order (stop is the reverse, via one ``AsyncExitStack``): discovery (the DHT), the model
and data, the outer-algorithm mode (:mod:`gasloc_p2p.node.modes`: gossip or DiLoCo), the
checkpoint or swarm state, the gRPC server, the trainer thread, then the periodic tasks in one
``asyncio.TaskGroup``: the mode's tasks (gossip), announcer, peer refresh, progress log,
checkpoints, on the node's :class:`Clock`. ``request_stop`` (signals, limits) ends
:meth:`Node.wait`; ``stop`` is safe twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
import shlex
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import grpc

from gasloc_p2p import __version__
from gasloc_p2p.core.codecs import PLAIN_CODECS
from gasloc_p2p.core.wire import RESIDUAL_CODECS
from gasloc_p2p.node.config import ConfigError, NodeConfig
from gasloc_p2p.node.discovery.base import CompatibilityFilter, Discovery, PeerInfo
from gasloc_p2p.node.discovery.dht import HivemindDiscovery
from gasloc_p2p.node.manifest import Manifest
from gasloc_p2p.node.modes.base import Mode, ModeContext
from gasloc_p2p.node.modes.gossip import compatible_codecs
from gasloc_p2p.node.modes.registry import make_mode
from gasloc_p2p.node.observability.metrics import NodeMetrics
from gasloc_p2p.node.runtime import bootstrap
from gasloc_p2p.node.runtime import checkpoint as ckpt
from gasloc_p2p.node.runtime.clock import Clock, WallClock, every
from gasloc_p2p.node.runtime.identity import build_membership
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.ranks import RankGroup, RankLost
from gasloc_p2p.node.runtime.reachability import Reachability
from gasloc_p2p.node.runtime.trainer import Trainer, derive_seed
from gasloc_p2p.node.state_dir import default_checkpoint, dht_identity
from gasloc_p2p.node.stats import ExchangeStats, RelayCounts, TrainStats
from gasloc_p2p.node.transport.circuits import Peer
from gasloc_p2p.node.transport.circuits.client import RelayDialer, RelayListener
from gasloc_p2p.node.transport.circuits.hub import RelayHub, RelayLimits
from gasloc_p2p.node.transport.circuits.punch import Puncher
from gasloc_p2p.node.transport.gate import Gate
from gasloc_p2p.node.transport.service import (
    GossipServicer,
    PeerChannels,
    ServeLimits,
    download_state,
    fetch_info,
    info_request,
    start_server,
    target_of,
)
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.certs import TlsIdentity
from gasloc_p2p.protocol.messages import PROTOCOL_VERSION, Identity
from gasloc_p2p.safelog import safe

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
MAX_DONORS = 5  # donors asked for their state at start-up
KEEP_FULL_STATES = 2  # of their states, held in full at once (the others: a sample each)
REVOCATION_REFRESH_S = 10.0  # a revoked member is refused within about this long


class Node:
    """One gasloc node. ``async with Node(cfg) as node: await node.wait()``."""

    def __init__(self, cfg: NodeConfig, discovery: Discovery | None = None,
                 mode: Mode | None = None, clock: Clock | None = None,
                 manifest: Manifest | None = None, ranks: RankGroup | None = None) -> None:
        """``discovery``: default the hivemind DHT; ``mode``: the outer algorithm (default
        the registry's for ``cfg.outer.algorithm``); ``clock``: for the node's timers;
        ``manifest``: the run's (``cfg`` built from it), served to nodes that join.
        ``ranks``: this process is rank 0 of a multi-rank node (the others follow its
        trainer)."""
        self.ranks = ranks
        self.cfg = cfg.validate()
        self.manifest = manifest
        self.mode = mode or make_mode(cfg.outer.algorithm)
        if self.mode.name != cfg.outer.algorithm:
            raise ValueError(f"mode {self.mode.name!r} given for --algorithm "
                             f"{cfg.outer.algorithm!r}")
        self.clock = clock or WallClock()
        self.resumed_at: int | None = None  # the step of the checkpoint it resumed from
        d = cfg.discovery
        self.discovery = discovery or HivemindDiscovery(
            d.run_id, cfg.network.host, d.dht_port, d.peers, d.dht_timeout_s,
            d.dht_start_timeout_s, client_mode=cfg.network.client_mode,
            identity_path=dht_identity(cfg))
        # the node's identity: an ed25519 key (--identity-file or its invitation, else new at
        # each start; its peer id derives from it) and its membership of the swarm
        self.membership = build_membership(cfg.network, joining=bool(d.peers))
        self.signer = self.membership.signer
        self.discovery.use_identity(self.signer, 2 * d.announce_ttl_s)
        self.tls = TlsIdentity.generate(self.signer.peer_id)  # announced in the signed record
        self.lock = TrainingLock()
        self.train_stats = TrainStats()
        self.stats = ExchangeStats()
        self.reachability = Reachability(cfg.network.reachability_probes,
                                         reachable=not cfg.network.client_mode)
        self.endpoint = ""
        self.port = 0
        self.adopted_from = ""  # the donor whose state this node started from (if any)
        self.trainer: Trainer | None = None
        self.peers: list[PeerInfo] = []  # compatible peers from discovery, this node excluded
        self.channels = PeerChannels(cfg.network)
        self.listener: RelayListener | None = None  # behind a router: Listen calls at relays
        self._gate: Gate | None = None  # the node's front door (None off Linux)
        self._hub: RelayHub | None = None  # reachable: the relay it runs for others
        self._relay_listener_args: tuple[Any, ...] | None = None
        self.metrics = NodeMetrics(cfg, self.train_stats, self.stats, self._peer_counts,
                                   self.mode.fragment_stats, self._relay_counts)
        self._stop = asyncio.Event()
        self._train_stop = threading.Event()
        self._stack: contextlib.AsyncExitStack | None = None
        self.error = ""

    # ------------------------------------------------------------------ lifecycle
    @property
    def reachable(self) -> bool:
        """Whether peers can dial this node (dial-back probes; False in --client-mode)."""
        return self.reachability.reachable

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        stack = self._stack = contextlib.AsyncExitStack()
        try:
            await self._start(stack)
        except BaseException:
            await self.stop()
            raise

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        cfg = self.cfg
        await self.metrics.start()  # first: /metrics answers during the DHT and data start
        stack.push_async_callback(_timed, "metrics stop", self.metrics.stop)
        await self.discovery.start()
        if self.manifest is not None:  # a node that joins with --peers alone asks for it
            await self.discovery.serve_manifest(self.manifest.to_json())
        stack.push_async_callback(_timed, "discovery stop", self.discovery.stop)
        if self.signer.admission is not None:  # a revoked member stops before it trains alone
            with contextlib.suppress(Exception):  # unread here: the periodic refresh tries
                await self._refresh_revocations()
            if self.revoked():
                raise ConfigError(self.revoked())
        me_id = self.signer.peer_id
        trainer = self.trainer = await asyncio.to_thread(
            Trainer, cfg.train, self.mode.outer_config(cfg), cfg.gossip.fragments, self.lock,
            self.train_stats, self.mode.trainer_round_end(), self.mode.keeps_anchor,
            self.ranks, self._before_build)
        kept = default_checkpoint(cfg, trainer.fingerprint)
        if kept:  # a node that keeps its identity keeps its training too
            cfg = self.cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
                cfg.checkpoint, checkpoint_dir=kept))
        trainer.checkpoint_dir = cfg.checkpoint.checkpoint_dir
        seed = cfg.train.data_seed if cfg.train.data_seed >= 0 else derive_seed(me_id)
        await asyncio.to_thread(trainer.load_data, seed)
        await asyncio.to_thread(trainer.warm_up)  # --compile: before any exchange can arrive
        self.me = Identity.keyed(cfg.discovery.run_id, trainer.fingerprint, self.signer)
        self.filter = CompatibilityFilter(PROTOCOL_VERSION, trainer.fingerprint, me_id,
                                          cfg.outer.algorithm)
        stack.push_async_callback(_timed, "mode stop", self.mode.stop)  # safe if start fails
        # before any gRPC channel and the trainer thread exist: DiLoCo's averager forks
        await self.mode.start(ModeContext(
            cfg=cfg, trainer=trainer, lock=self.lock, train_stats=self.train_stats,
            exchange_stats=self.stats, discovery=self.discovery, channels=self.channels,
            me=self.me, clock=self.clock, stop=self._train_stop, peers=lambda: self.peers,
            endpoint=lambda: self.endpoint, seed=seed))
        await self._initial_state()
        await self._start_server(stack)
        stack.push_async_callback(_timed, "channels close", self.channels.close)
        await self._start_trainer(stack)
        tg = await stack.enter_async_context(asyncio.TaskGroup())
        tasks = [tg.create_task(every(self.clock, period, fn, name, first_now), name=name)
                 for name, fn, period, first_now in self._periodic()]
        tasks += [tg.create_task(job(), name=name) for name, job in self.mode.tasks()]
        tasks.append(tg.create_task(self._watch_trainer(), name="watch-trainer"))

        stack.push_async_callback(_cancel_all, tasks)  # runs before the TaskGroup exits
        if self.membership.role == "open":
            log.warning("this swarm is open (--open): any key can join it, exchange with this "
                        "node and download the model; drop --open for a closed swarm")
        log.info("node %s up: gRPC %s, model %d params (%s), %d fragment(s), codec %s, "
                 "metrics %s", me_id, self.endpoint, trainer.flat.numel, trainer.fingerprint[:12],
                 len(trainer.fragments), cfg.gossip.codec, self.metrics.url or "off")

    def _before_build(self, device: str, vocab: int) -> None:
        """Say what is built and how much host memory it takes; ConfigError if that is more
        than this machine has (before minutes of building: docs/running.md)."""
        from gasloc_p2p.node import plan

        t = self.cfg.train
        try:
            shape, steady, peak = plan.host_need(self.cfg, device, vocab, self.mode.keeps_anchor)
        except (ValueError, ImportError, OSError) as exc:  # a hub model: known once fetched
            log.info("building the model %s on %s (its size is known once it is fetched: %s)",
                     t.model, device, exc)
            return
        have = available_host_memory()
        log.info("building the model %s on %s: %.1fM parameters; host memory about %.2f GiB "
                 "while training, %.2f GiB at most while building it%s", t.model, device,
                 shape.numel / 1e6, steady / plan.GiB, peak / plan.GiB,
                 f" ({have / plan.GiB:.1f} GiB available)" if have is not None else "")
        if have is not None and peak > have:
            from gasloc_p2p.model_spec import BUILTIN

            smaller = ("a smaller model (--n-layer, --n-embd)" if t.model in BUILTIN else
                       f"a smaller model (`gasloc-node plan --model {t.model}"
                       f"{' --cpu' if device == 'cpu' else ''}` shows where it goes)")
            raise ConfigError(
                f"--model {t.model}: building it needs about {peak / plan.GiB:.1f} GiB of host "
                f"memory and this machine has {have / plan.GiB:.1f} GiB available (free memory "
                f"and swap): choose {smaller} or a machine with more memory")

    async def stop(self) -> None:
        """Stop everything in reverse start order; safe to call twice."""
        self._stop.set()
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    def request_stop(self) -> None:
        self._stop.set()

    async def wait(self) -> None:
        """Until a stop is requested (signal, step/time limit, trainer failure)."""
        await self._stop.wait()

    # ------------------------------------------------------------------ subsystems
    async def _initial_state(self) -> None:
        """Resume from the checkpoint; else, if peers exist, from a peer's state."""
        assert self.trainer is not None
        cp = self.cfg.checkpoint
        if cp.checkpoint_dir and cp.resume:
            saved = await asyncio.to_thread(ckpt.load, cp.checkpoint_dir)
            if saved is not None:
                await asyncio.to_thread(ckpt.validate, saved, self.trainer.fingerprint,
                                        self.trainer.flat.numel,
                                        ckpt.checkpoint_path(cp.checkpoint_dir))
                await asyncio.to_thread(self.trainer.restore, saved)
                if isinstance(saved.get("mode_state"), Mapping):  # model-sized: off the loop
                    await asyncio.to_thread(self.mode.restore_state, saved["mode_state"])
                self.resumed_at = self.train_stats.step
                log.info("resumed from %s at step %d", ckpt.checkpoint_path(cp.checkpoint_dir),
                         self.train_stats.step)
                return
        if self.cfg.gossip.init_from_swarm and self.cfg.discovery.peers:
            await self._download_from_swarm()

    async def _download_from_swarm(self) -> None:
        """Adopt the state of agreeing donors, checked here (see ``runtime/bootstrap.py``)."""
        assert self.trainer is not None
        await self._refresh_peers()
        peers = list(self.mode.candidates(self.peers))
        random.shuffle(peers)  # never chosen by their self-announced step
        good = self.mode.exchanger.known_good if self.mode.exchanger is not None else None
        if good is not None:  # peers this node exchanged with before come first
            peers.sort(key=lambda p: not good(p.peer_id))
        sampler = bootstrap.Sampler(self.trainer.theta0)
        start = self.trainer.state.theta.to("cpu", copy=True)  # theta_0: back to it after each
        cands: list[bootstrap.Candidate] = []
        for peer in peers[:MAX_DONORS]:
            cand = await self._download(peer, sampler, keep=len(cands) < KEEP_FULL_STATES,
                                        start=start)
            if cand is not None:
                cands.append(cand)
        if not cands:
            log.info("starting from theta_0 (%s)", "no peer yet" if not peers else
                     f"no live donor among {min(len(peers), MAX_DONORS)} peer record(s)")
            return
        need = bootstrap.needed(len(cands))
        chosen = await asyncio.to_thread(bootstrap.choose, cands, need)
        if chosen is None:
            log.warning("starting from theta_0: no %d of the %d donors' states agree", need,
                        len(cands))
            return
        _, group = chosen
        medoid, problem = bootstrap.pick(group, cands)  # by the loss on this node's batches
        if medoid is None:
            log.warning("starting from theta_0: %s", problem)
            return
        if medoid.params is None:  # dropped to save memory: fetch it again, check it again
            peer = next(p for p in peers if p.peer_id == medoid.peer_id)
            again = await self._download(peer, sampler, keep=True, start=start)
            if again is None or not all(bootstrap.agree(again, c) for c in group
                                        if c is not medoid) or not (
                    again.own_loss <= (1 + bootstrap.LOSS_MARGIN) * medoid.own_loss):
                log.warning("starting from theta_0: %s served another state the second "
                            "time", safe(medoid.peer_id))
                return
            again.announced_loss, medoid = medoid.announced_loss, again
        why = (f"{len(group)} of {len(cands)} donors agree" if len(group) > 1 else
               "the only donor that answered: unverified")
        await self._adopt_checked(medoid, [medoid.announced_loss], why)

    async def _download(self, peer: PeerInfo, sampler: bootstrap.Sampler, keep: bool,
                        start: torch.Tensor) -> bootstrap.Candidate | None:
        """``peer``'s state, checked and measured, its loss on this node's validation batches
        too (the node back at ``start`` after; its full vectors dropped unless ``keep``), or
        None."""
        assert self.trainer is not None
        numel, signer, own = self.trainer.flat.numel, self.signer, self.trainer.state.outer
        stub = self.channels.stub(peer.endpoint, peer.cert)
        try:
            meta, params, outer = await download_state(
                stub, self.me, self.cfg.gossip.download_deadline_s(numel, len(own.buffers)),
                numel, self.cfg.network.info_timeout_s, outer=own)
            info = await fetch_info(stub, self.cfg.network.info_timeout_s, signer)
        except Exception as exc:  # any failure: try the next donor
            log.warning("state download from %s failed: %s", safe(peer.peer_id),
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return None
        state = bootstrap.Candidate(peer.peer_id, meta.step, params, outer, meta)
        why = await asyncio.to_thread(bootstrap.problem, state, numel)
        if why:
            log.warning("state of %s rejected: %s", safe(peer.peer_id), why)
            return None
        await asyncio.to_thread(sampler.measure, state)
        assert state.params is not None  # dropped below, after this
        state.own_loss = await asyncio.to_thread(self._loss_here, state.params, start)
        if info.validation_set and info.validation_set == self.trainer.validation_set:
            state.announced_loss = info.val_loss
        if not keep:
            state.params, state.outer = None, {}
        return state

    def _loss_here(self, params: torch.Tensor, start: torch.Tensor) -> float:
        """The validation loss of ``params`` on this node's batches; theta back at ``start``
        (start-up: the trainer thread does not run yet)."""
        assert self.trainer is not None
        self.trainer.adopt(params, None)
        try:
            return self.trainer.val_loss()
        finally:
            self.trainer.adopt(start, None)

    async def _adopt_checked(self, state: bootstrap.Candidate, announced: list[float],
                             why: str) -> None:
        """Adopt ``state`` if its validation loss here is plausible, else go back to
        ``theta_0``."""
        trainer = self.trainer
        assert trainer is not None and state.params is not None
        start_loss = await asyncio.to_thread(trainer.val_loss)
        start = trainer.state.theta.to("cpu", copy=True)  # theta_0, exactly (a host copy)
        await asyncio.to_thread(trainer.adopt, state.params, state.outer)
        loss = await asyncio.to_thread(trainer.val_loss)
        problem = bootstrap.implausible_loss(loss, start_loss, announced)
        if problem:
            await asyncio.to_thread(trainer.adopt, start, None)
            log.warning("starting from theta_0: the state of %s is refused (%s)",
                        safe(state.peer_id), problem)
            return
        self.mode.adopted(state.meta)
        self.adopted_from = state.peer_id
        log.info("starting from the state of %s (its step %d; %s; validation loss here %.4f, "
                 "theta_0 %.4f)", safe(state.peer_id), state.step, why, loss, start_loss)

    async def _start_server(self, stack: contextlib.AsyncExitStack) -> None:
        net = self.cfg.network
        host = "127.0.0.1" if net.client_mode else net.host
        numel, buffers = ((self.trainer.flat.numel, len(self.trainer.state.outer.buffers))
                          if self.trainer is not None else (0, 1))
        limits = ServeLimits(net.preauth_streams, net.preauth_timeout_s, net.max_downloads,
                             net.auth_skew_s, self.cfg.gossip.download_deadline_s(numel, buffers))
        servicer = GossipServicer(self.me, self.mode.exchanger, self.info, self.mode.snapshot,
                                  limits)
        servicer.probe = self._probe_endpoint
        servicer.dht_peer_id = self.discovery.dht_peer_id
        server, self.port = await start_server(servicer, host, net.port, net, self.tls)
        self._gate = server.gate

        async def stop_server() -> None:
            servicer.drain()  # new exchanges get BUSY during the grace
            await server.stop(net.stop_grace_s)

        stack.push_async_callback(_timed, "server stop", stop_server)
        self.endpoint = f"{await self._announce_host()}:{self.port}"
        await self._start_relaying(stack, servicer)

    async def _start_relaying(self, stack: contextlib.AsyncExitStack,
                              servicer: GossipServicer) -> None:
        """Paths through relays: every node dials peers behind routers through the relays
        their records name; a reachable node relays (unless ``GASLOC_RELAY=false``); a node in
        ``--client-mode`` listens at reachable peers (:meth:`_refresh_peers` keeps them)."""
        net = self.cfg.network
        timeout = net.info_timeout_s + net.connect_timeout_s
        self.channels.relayed = RelayDialer(self.signer, self._relay_stub, self._relays_of,
                                            timeout)
        stack.push_async_callback(_timed, "relayed paths close", self.channels.relayed.close)
        if net.hole_punch:
            self.channels.punched = Puncher(
                self.signer, self._relayed_stub, self._observers, self._public_host,
                self._gate.take if self._gate is not None else None, self._punched_up,
                self.channels.discard, timeout)
            servicer.punch = self.channels.punched.answer
            stack.push_async_callback(_timed, "hole-punched paths close",
                                      self.channels.punched.close)
        gate = "127.0.0.1" if net.client_mode or net.host in ("0.0.0.0", "") else (
            "::1" if net.host == "::" else net.host)
        self._relay_listener_args = (self.signer, self._relay_stub, (gate, self.port), timeout,
                                     self._relays_changed)
        stack.push_async_callback(_timed, "relay listeners stop", self._stop_listener)
        if net.client_mode:
            self.listener = RelayListener(*self._relay_listener_args)
        elif net.relay:
            servicer.relay = self._hub = RelayHub(RelayLimits(
                True, net.relay_connections, net.relay_listeners, net.relay_mb << 20,
                net.relay_minutes * 60))

    async def _stop_listener(self) -> None:
        if self.listener is not None:
            await self.listener.close()

    def _relay_stub(self, peer: Peer) -> Any:
        return self.channels.relay_stub(peer.endpoint, peer.cert)

    def _relayed_stub(self, peer: Peer) -> Any:
        """A stub on the relayed path to ``peer`` (a hole punch is agreed over it)."""
        assert self.channels.relayed is not None
        return self.channels.stub(self.channels.relayed.endpoint(peer), peer.cert)

    def _observers(self) -> list[PeerInfo]:
        """Reachable peers, which can tell this node the address its router maps a port to."""
        return [p for p in self.peers if p.reachable and p.peer_id != self.me.peer_id]

    def _public_host(self) -> str:
        """This node's own host when peers can dial it (a hole punch needs no observer)."""
        return self.endpoint.rpartition(":")[0] if self.reachable else ""

    def _punched_up(self, endpoint: str, cert: bytes) -> None:
        """A hole-punched path is up: connect its channel now (the peer's gate closes a
        connection that stays silent)."""
        self.channels.stub_and_channel(endpoint, cert)[1].get_state(try_to_connect=True)

    def _relays_of(self, peer: Peer) -> list[Peer]:
        """The reachable peers known here that ``peer``'s record names as its relays."""
        known: dict[str, Peer] = {p.peer_id: p for p in self.peers if p.reachable}
        if self.reachable and self.cfg.network.relay and self.trainer is not None:
            known[self.me.peer_id] = self.peer_info()  # this node relays for it: its own hub
        return [known[r] for r in peer.relays if r in known]

    def _relays_changed(self) -> None:
        """A Listen call started or ended: announce the relays held now."""
        if not self._stop.is_set():
            task = asyncio.ensure_future(self._announce())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _announce_host(self) -> str:
        net = self.cfg.network
        if net.announce_host:
            return net.announce_host
        if net.client_mode or net.host not in ("0.0.0.0", "::", ""):
            return "127.0.0.1" if net.client_mode else net.host
        for addr in await self.discovery.visible_addrs():
            parts = addr.split("/")
            if len(parts) > 2 and parts[1] == "ip4" and not parts[2].startswith("127."):
                return parts[2]
        return socket.gethostbyname(socket.gethostname())

    async def _start_trainer(self, stack: contextlib.AsyncExitStack) -> None:
        assert self.trainer is not None
        thread = threading.Thread(target=self.trainer.run, args=(self._train_stop,),
                                  name="gasloc-trainer", daemon=True)
        thread.start()

        async def stop_trainer() -> None:
            self._train_stop.set()
            await asyncio.to_thread(thread.join)
            if self.cfg.checkpoint.checkpoint_dir and not self.train_stats.error:
                await self._checkpoint()

        stack.push_async_callback(_timed, "trainer stop", stop_trainer)

    async def _watch_trainer(self) -> None:
        assert self.trainer is not None
        while not self.trainer.finished.is_set():  # polled: no thread parked on the event
            await asyncio.sleep(0.2)
        if self.train_stats.error:
            self.error = self.train_stats.error
            log.error("trainer stopped: %s; shutting the node down", self.error)
        else:
            log.info("training limit reached at step %d", self.train_stats.step)
        self._log_progress()
        self.request_stop()

    def _periodic(self) -> list[tuple[str, Callable[[], Awaitable[None]], float, bool]]:
        """(name, job, period in seconds, run at once first) of the node's timers."""
        cfg = self.cfg
        jobs: list[tuple[str, Callable[[], Awaitable[None]], float, bool]] = [
            ("announce", self._announce, cfg.discovery.announce_interval_s, True),
            ("refresh-peers", self._refresh_peers, cfg.discovery.refresh_interval_s, True),
            ("progress", self._progress, cfg.metrics.log_interval_s, False),
        ]
        if cfg.checkpoint.checkpoint_dir:
            jobs.append(("checkpoint", self._checkpoint, cfg.checkpoint.checkpoint_interval_s,
                         False))
        if self.signer.admission is not None:  # a closed swarm: its owner's revocations
            jobs.append(("revocations", self._refresh_revocations, REVOCATION_REFRESH_S, True))
        if cfg.network.reachability_interval_s > 0 and not cfg.network.client_mode:
            jobs.append(("reachability", self._check_reachability,
                         cfg.network.reachability_interval_s, True))
        return jobs

    async def _probe_endpoint(self, endpoint: str, cert: bytes, peer_id: str) -> bool:
        """True if one Info call to ``endpoint``, trusting only ``cert``, is answered by
        ``peer_id`` (a peer's dial-back request: its announced endpoint must reach that very
        peer)."""
        try:
            reply = await self.channels.stub(endpoint, cert).Info(
                pb.InfoRequest(), timeout=self.cfg.network.connect_timeout_s)
        except (grpc.RpcError, OSError, ValueError) as exc:
            log.debug("dial-back to %s failed: %s", safe(endpoint), exc)
            return False
        return bool(reply.peer_id == peer_id)

    async def _check_reachability(self) -> None:
        """Ask known peers (any, unreachable ones too) to dial our announced endpoint back;
        :class:`Reachability` decides from several answers (see its module). The first
        check runs once peers are known (a node behind a router learns it at its start)."""
        until = time.monotonic() + self.cfg.network.reachability_interval_s
        while self.reachability.checks == 0 and not self.peers and time.monotonic() < until:
            await asyncio.sleep(1.0)
        if self.endpoint and self.peers:
            by_id = {p.peer_id: p for p in self.peers}
            await self.reachability.check(list(by_id), lambda pid: self._ask_dial_back(by_id[pid]))
            await self._follow_reachability()

    async def _follow_reachability(self) -> None:
        """Behind a router without ``--client-mode`` (the dial-backs failed): take callers
        through relays, as ``--client-mode`` does, until a dial-back succeeds again."""
        if self.cfg.network.client_mode or self._relay_listener_args is None:
            return
        if not self.reachable and self.listener is None:
            self.listener = RelayListener(*self._relay_listener_args)
            self.listener.update(self.peers)
            log.info("nobody can dial this node: taking exchanges through relays")
        elif self.reachable and self.listener is not None:
            listener, self.listener = self.listener, None
            await listener.close()
            await self._announce()

    async def _ask_dial_back(self, peer: PeerInfo) -> bool | None:
        """``peer``'s dial-back verdict on our endpoint, or None if it did not answer."""
        net = self.cfg.network
        try:
            # (through its relay for a helper behind a router)
            stub = self.channels.stub(self.channels.endpoint_for(peer), peer.cert)
            target, challenge = await target_of(stub, net.info_timeout_s + net.connect_timeout_s)
            reply = await stub.Info(
                info_request(self.signer, target, challenge, self.endpoint, self.tls.cert_der),
                timeout=net.info_timeout_s + net.connect_timeout_s)
        except (grpc.RpcError, OSError, ValueError) as exc:
            log.debug("reachability check via %s failed: %s", safe(peer.peer_id), exc)
            return None
        return bool(reply.probe_ok) if reply.authenticated else None

    async def _announce(self) -> None:
        await self.discovery.announce(self.peer_info(), self.cfg.discovery.announce_ttl_s)

    async def _refresh_revocations(self) -> None:
        """Adopt the owner's newest revocation list from the DHT; keep the newest one known
        stored there (a list outlives the nodes that stored it first)."""
        admission = self.signer.admission
        assert admission is not None
        found = await self.discovery.revocations()
        if found is not None and admission.revocations.update(found):
            log.info("the owner revoked %d peer(s) (list of %s)", len(found.entries),
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(found.issued)))
        latest = admission.revocations.latest
        if latest is not None and (found is None or found.issued < latest.issued):
            await self.discovery.publish_revocations(latest)
        if self.revoked() and not self.error and self.trainer is not None:
            self.error = self.revoked()
            log.error("%s; shutting the node down", self.error)
            self.request_stop()

    def revoked(self) -> str:
        """One line if the swarm's owner revoked this node (else "")."""
        admission = self.signer.admission
        if admission is None or not admission.revocations.revoked(self.signer.peer_id,
                                                                  time.time()):
            return ""
        return (f"the owner of this swarm revoked this node ({self.signer.peer_id}): every "
                "member refuses it; ask the owner for a new invitation (--invitation)")

    async def _refresh_peers(self) -> None:
        peers = self.filter(await self.discovery.peers())
        self.peers = compatible_codecs(peers, self.cfg.gossip.codec)
        self.mode.peers_changed(self.peers)
        if self.listener is not None:
            self.listener.update(self.peers)

    def _relay_counts(self) -> RelayCounts:
        """This node's relaying for the metrics (read from the scrape's thread: ints only)."""
        hub, listener = self._hub, self.listener
        held = len(listener.relays) if listener is not None else 0
        if hub is None:
            return RelayCounts(held=held)
        s = hub.stats
        return RelayCounts(s.relayed, s.refused, s.bytes, hub.open, hub.listeners, held)

    def _peer_counts(self) -> tuple[int, int]:
        """(known compatible peers, those dialable now) for the metrics."""
        peers = self.peers
        return len(peers), len(self.mode.candidates(peers))

    async def _checkpoint(self) -> None:
        assert self.trainer is not None
        try:
            payload = await asyncio.to_thread(self.trainer.state_for_checkpoint)
        except RankLost as exc:  # a sharded node whose ranks are gone
            log.warning("checkpoint skipped: %s", exc)
            return
        except ckpt.CheckpointError as exc:  # a sharded node's ranks could not write
            self.train_stats.checkpoint_failures += 1
            log.warning("%s (gasloc_checkpoint_failures_total %d)", exc,
                        self.train_stats.checkpoint_failures)
            return
        extra = await asyncio.to_thread(self.mode.checkpoint_state)
        if extra:
            payload["mode_state"] = extra
        theta = payload["theta"]
        if not (math.isfinite(float(theta.amax())) and math.isfinite(float(theta.amin()))):
            log.error("parameters are not finite at step %d: checkpoint skipped, the previous "
                      "one is kept", payload["step"])
            await asyncio.to_thread(ckpt.discard, payload, self.cfg.checkpoint.checkpoint_dir)
            return
        try:
            path = await asyncio.to_thread(ckpt.save_atomic, payload,
                                           self.cfg.checkpoint.checkpoint_dir,
                                           self.trainer.sharded is not None)
            self.train_stats.checkpoints_written += 1
            log.debug("checkpoint written to %s at step %d", path, payload["step"])
        except ckpt.CheckpointError as exc:
            self.train_stats.checkpoint_failures += 1
            log.warning("%s (gasloc_checkpoint_failures_total %d)", exc,
                        self.train_stats.checkpoint_failures)

    @property
    def checkpoint_problem(self) -> str:
        """One line if checkpoints were asked for and none could be written (else "")."""
        t, where = self.train_stats, self.cfg.checkpoint.checkpoint_dir
        if where and t.checkpoint_failures and not t.checkpoints_written:
            return (f"no checkpoint could be written to {where} ({t.checkpoint_failures} "
                    "attempts failed; see the warnings above)")
        return ""

    async def _progress(self) -> None:
        self._log_progress()

    def _log_progress(self) -> None:
        t = self.train_stats
        log.info("step %d loss %.4f val %.4f tok/s %.0f | %s | peers %d", t.step, t.train_loss,
                 t.val_loss, t.tokens_per_s, self.mode.progress(), len(self.peers))

    # ------------------------------------------------------------------ views
    def peer_info(self) -> PeerInfo:
        assert self.trainer is not None
        relays = self.listener.relays if self.listener is not None else ()
        return PeerInfo(self.me.peer_id, self.endpoint, PROTOCOL_VERSION, self.trainer.fingerprint,
                        self.train_stats.step, self.train_stats.tokens_per_s, self.reachable,
                        self.codecs, self.cfg.outer.algorithm, self.tls.cert_der, relays)

    @property
    def codecs(self) -> tuple[str, ...]:
        """What this node's record says it accepts: every plain codec, and its own residual
        one (half2 or sign1: it keeps links, so peers that keep them too send it residuals)."""
        own = self.cfg.gossip.codec
        return PLAIN_CODECS + ((own,) if own in RESIDUAL_CODECS else ())

    def info(self) -> pb.InfoReply:
        t, x = self.train_stats, self.stats
        fields: dict[str, Any] = dict(
            protocol_version=PROTOCOL_VERSION, software_version=__version__,
            run_id=self.me.run_id, peer_id=self.me.peer_id, model_fingerprint=self.me.fingerprint,
            step=t.step, rounds=t.rounds, tokens_per_s=t.tokens_per_s,
            val_loss=t.val_loss, first_val_loss=t.first_val_loss,
            peers=sorted(p.peer_id for p in self.peers),
            exchanges_ok_initiator=x.ok_initiator, exchanges_ok_responder=x.ok_responder,
            exchanges_failed=x.failed, bytes_sent=x.bytes_sent, bytes_received=x.bytes_received,
            endpoint=self.endpoint, algorithm=self.cfg.outer.algorithm,
            validation_set=self.trainer.validation_set if self.trainer else "",
            model=self.trainer.model_description if self.trainer else "")
        fields.update(self.mode.info_fields())  # DiLoCo modes: the all-reduce's bytes
        return pb.InfoReply(**fields)

    def join_hint(self, addrs: list[str]) -> str:
        """A ready-to-paste command: with a manifest, the credential the run needs (the rest
        comes from it); without, every run setting not at its default too (what a node needs
        to train the same run: the manifest's fields, the data first among them; tuning with
        no flag as its ``GASLOC_*`` variable before the command), then the peers."""
        if self.manifest is not None:
            needs = {"closed": ["--invitation", "FILE"], "keyed": ["--swarm-key", "FILE"],
                     "open": []}[self.manifest.admission]
            return " ".join(["gasloc-node join", *needs, "--peers", *addrs])
        env, extra = run_flags(self.cfg)
        extra += {"owner": ["--invitation", "FILE"], "member": ["--invitation", "FILE"],
                  "keyed": ["--swarm-key", "FILE"], "open": ["--open"]}[self.membership.role]
        return " ".join([*env, "gasloc-node join", *extra, "--peers", *addrs])

    def membership_lines(self) -> list[str]:
        """How this node takes part and how others may, for the start-up block."""
        m, owner = self.membership, self.membership.owner_id[:16]
        if m.role == "owner":
            return [f"  swarm    closed, owned by {m.owner_key_path} (owner {owner}); invite a "
                    f"member: gasloc-node invite --owner-key {m.owner_key_path} --out "
                    "member.invite (send the file privately: it holds the member's key)"]
        if m.role == "member":
            return [f"  swarm    closed, member by invitation of owner {owner}"]
        if m.role == "keyed":
            return ["  swarm    keyed: members hold the --swarm-key secret"]
        return ["  swarm    OPEN (--open): any key can join, exchange and download the model"]


def run_flags(cfg: NodeConfig) -> tuple[list[str], list[str]]:
    """(``GASLOC_X=value`` assignments, ``--flag value`` words) of every setting of ``cfg``'s
    run that is not at its default: the run id, the manifest's fields
    (:data:`~gasloc_p2p.node.manifest.RUN_FIELDS`) and the batch split."""
    from gasloc_p2p.node.manifest import RUN_FIELDS
    from gasloc_p2p.node.settings import env_name, options

    base, opts = NodeConfig(), options()
    env: list[str] = []
    flags = ([] if cfg.discovery.run_id == base.discovery.run_id else
             ["--run-id", shlex.quote(cfg.discovery.run_id)])
    for name in (*RUN_FIELDS, "batch_size", "grad_accum"):
        o = opts[name]
        value = getattr(getattr(cfg, o.section), name)
        if value == getattr(getattr(base, o.section), name):
            continue
        text = (",".join(value) if isinstance(value, tuple) else
                str(value).lower() if isinstance(value, bool) else str(value))
        if o.advanced:
            env.append(f"{env_name(o)}={shlex.quote(text)}")
        elif o.kind is bool:
            flags.append(o.cli if value else "--no-" + o.cli[2:])
        else:
            flags += [o.cli, shlex.quote(text)]
    return env, flags


def available_host_memory() -> int | None:
    """Bytes this machine can give a new allocation now: MemAvailable + SwapFree from
    /proc/meminfo (None where there is none to read)."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                      if line.split(":")[0] in ("MemAvailable", "SwapFree")}
    except (OSError, ValueError, IndexError):
        return None
    return sum(fields.values()) if "MemAvailable" in fields else None


async def _cancel_all(tasks: list[asyncio.Task[None]], recheck_s: float = 1.0) -> None:
    """Cancel ``tasks`` and wait until all are done. A cancellation can be lost in a race (a
    gRPC call ending as CANCELLED, 3.11's ``wait_for``) and the task would then run on and
    hold the TaskGroup's exit forever: a task still running after ``recheck_s`` is cancelled
    again."""
    pending: set[asyncio.Task[None]] = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recheck_s)
        for task in pending:
            log.warning("task %s still runs after its cancellation; cancelling it again",
                        task.get_name())


SLOW_TEARDOWN_S = 1.0  # teardown steps slower than this are logged at INFO


async def _timed(name: str, fn: Callable[[], Awaitable[None]]) -> None:
    """Run one teardown step, logging its duration (slow shutdowns are worth knowing about:
    at INFO beyond ``SLOW_TEARDOWN_S``, also when the step fails)."""
    t0 = time.monotonic()
    try:
        await fn()
    finally:
        took = time.monotonic() - t0
        log.log(logging.INFO if took > SLOW_TEARDOWN_S else logging.DEBUG, "stop: %s took "
                "%.2f s", name, took)
