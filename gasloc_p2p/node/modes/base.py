"""The seam between the node and its outer algorithm: one small :class:`Mode` interface.

The node (:mod:`gasloc_p2p.node.daemon`) owns what every mode shares: discovery, the
model and trainer thread, the gRPC server (Info, DownloadState), checkpoints, metrics and the
compatible-peer list. A mode owns the outer algorithm: what runs at each round end, what it
needs on the network (GASLoC: the gossip exchanger, peer book and loop; DiLoCo: an all-reduce
averager), what a late joiner downloads, and its lines in Info and the progress log. Adding an
outer algorithm adds a file and one entry in :data:`gasloc_p2p.node.modes.registry.MODES`,
as torchft's ``LocalSGD`` and ``DiLoCo`` sit over its ``Manager``.

Lifecycle, driven by the node: ``round_end`` is handed to the trainer when it is built;
``await start(ctx)`` once the trainer and data exist (before the gRPC server and the trainer
thread); ``tasks()`` are run in the node's TaskGroup once the trainer thread runs; ``await
stop()`` after the server and the trainer have stopped (safe to call twice, or without start).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.node.config import NodeConfig
from gasloc_p2p.node.discovery.base import Discovery, PeerInfo
from gasloc_p2p.node.runtime.clock import Clock
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.trainer import Trainer
from gasloc_p2p.node.stats import ExchangeStats, FragmentStats, TrainStats
from gasloc_p2p.node.transport.exchange import GossipTransport
from gasloc_p2p.node.transport.service import PeerChannels, StateSnapshot
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.messages import Identity

#: A long-running job of a mode: (task name, coroutine factory); cancelled at stop.
ModeTask = tuple[str, Callable[[], Coroutine[Any, Any, None]]]


@dataclass(frozen=True, eq=False)
class ModeContext:
    """Everything a mode may use, passed once to :meth:`Mode.start`.

    ``stop``: set when the trainer must stop (a blocking round end gives up on it);
    ``peers``: the compatible peers known now (this node excluded); ``endpoint``: this node's
    announced gRPC ``host:port`` (empty until the server runs); ``seed``: this node's seed for
    its random choices.
    """

    cfg: NodeConfig
    trainer: Trainer
    lock: TrainingLock
    train_stats: TrainStats
    exchange_stats: ExchangeStats
    discovery: Discovery
    channels: PeerChannels
    me: Identity
    clock: Clock
    stop: threading.Event
    peers: Callable[[], Sequence[PeerInfo]]
    endpoint: Callable[[], str]
    seed: int


class Mode(abc.ABC):
    """An outer algorithm run by the node (see the module docstring for the lifecycle)."""

    #: the ``--algorithm`` value this mode implements (its key in the registry)
    name: ClassVar[str]
    #: the mode reads the anchor even where the momentum form does not (DiLoCo's global copy)
    keeps_anchor: ClassVar[bool] = False

    @staticmethod
    @abc.abstractmethod
    def outer_config(cfg: NodeConfig) -> AsyncConfig:
        """The outer state's configuration (momentum form, eta, gamma) for the trainer."""

    @abc.abstractmethod
    def round_end(self) -> None:
        """The outer update, called by the trainer thread after every ``H``-th inner step,
        without the training lock: the mode takes the lock itself (and may block, e.g. on the
        network, but must give up once ``ctx.stop`` is set)."""

    def trainer_round_end(self) -> Callable[[], None] | None:
        """What the trainer calls at a round end: :meth:`round_end`, or None for the trainer's
        own GASLoC update inside the last step's lock hold (see :class:`Trainer`)."""
        return self.round_end

    @abc.abstractmethod
    async def start(self, ctx: ModeContext) -> None:
        """Build the mode's machinery (on the event loop, before the gRPC server exists)."""

    def tasks(self) -> list[ModeTask]:
        """Long-running jobs for the node's TaskGroup, started once the trainer runs."""
        return []

    @property
    def exchanger(self) -> GossipTransport | None:
        """What serves inbound Exchange streams; None: they are answered BUSY."""
        return None

    def peers_changed(self, peers: Sequence[PeerInfo]) -> None:  # noqa: B027 (optional hook)
        """The node refreshed its compatible peers (this node excluded)."""

    def candidates(self, peers: Sequence[PeerInfo]) -> list[PeerInfo]:
        """Of ``peers``, those this node would dial now (by default: the reachable ones)."""
        return [p for p in peers if p.reachable]

    def adopted(self, meta: pb.StateMeta) -> None:  # noqa: B027 (optional hook)
        """At start-up the trainer adopted a peer's downloaded state described by ``meta``."""

    def checkpoint_state(self) -> dict[str, Any]:
        """The mode's own state for the node's checkpoint (host tensors, string keys; blocking:
        run in a thread); nothing by default."""
        return {}

    def restore_state(self, state: Mapping[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Take back what :meth:`checkpoint_state` wrote (the node resumed its checkpoint)."""

    @abc.abstractmethod
    def snapshot(self) -> StateSnapshot:
        """What DownloadState serves (copies taken under the lock; blocking: run in a thread)."""

    def info_fields(self) -> dict[str, Any]:
        """The mode's own fields of the Info reply."""
        return {}

    def fragment_stats(self) -> Sequence[FragmentStats]:
        """Per-fragment sync counters (streaming-diloco), read at scrape time; none by
        default."""
        return ()

    @abc.abstractmethod
    def progress(self) -> str:
        """The mode's part of the periodic progress log line."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release the mode's resources; safe to call twice and without :meth:`start`."""
