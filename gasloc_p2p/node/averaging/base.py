"""The averaging seam of the DiLoCo modes: all-reduce one flat tensor with a group of peers.

:class:`Averager` is the small interface the DiLoCo round logic (:mod:`gasloc_p2p.node.modes.diloco`)
needs; :class:`~gasloc_p2p.node.averaging.dht.HivemindAverager` runs hivemind's
``DecentralizedAverager`` (the engine OpenDiLoCo uses) on the node's existing DHT (all of the
hivemind glue lives in this sub-package); :class:`InMemoryAveragingHub` hands out
process-local averagers for tests, with fault injection by schedule (``fail_at``, as torchft's
``EventInjector``).

Every call blocks (it runs in the trainer thread, never on the event loop) and fails soft: a
round that finds no group, times out or is cancelled by ``stop`` returns a failed
:class:`AveragingResult` instead of raising.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_POLL_S = 0.05  # how often a waiting round checks the stop event


@dataclass(frozen=True, eq=False)
class AveragingResult:
    """One averaging attempt. ``averaged``: ``[numel]`` float32 group mean, None on failure;
    ``gathered``: each member's ``gather`` payload by peer id (this node included), in the
    group's order (the same on every member); ``messages``: after an all-gather, each
    member's message in that order; ``own``: what this node applies if the round failed
    (None: its own outer gradient)."""

    averaged: torch.Tensor | None
    gathered: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""
    messages: tuple[bytes, ...] = ()
    own: torch.Tensor | None = None

    @property
    def ok(self) -> bool:
        return self.averaged is not None

    @property
    def group_size(self) -> int:
        return len(self.gathered) if self.ok else 0

    @classmethod
    def failed(cls, error: str) -> AveragingResult:
        return cls(None, {}, error)

    def with_own(self, own: torch.Tensor) -> AveragingResult:
        return dataclasses.replace(self, own=own)


class Averager(abc.ABC):
    """All-reduce (mean) of one ``[numel]`` float32 tensor across a group of peers."""

    peer_id: str

    @abc.abstractmethod
    def start(self) -> None:
        """Blocking start-up (may fork: call it before the trainer thread starts)."""

    @abc.abstractmethod
    def average(self, tensor: torch.Tensor, gather: Mapping[str, Any], target_group_size: int,
                stop: threading.Event) -> AveragingResult:
        """Average ``tensor`` with whoever is averaging now; never raises for network reasons.

        ``gather``: a small msgpack-able dict delivered to every groupmate; ``target_group_size``:
        the group is complete (no more waiting) at this many members; ``stop``: give up now.
        """

    def allgather(self, message: bytes, gather: Mapping[str, Any], target_group_size: int,
                  stop: threading.Event) -> AveragingResult:
        """Deliver ``message`` to whoever is gathering now and collect theirs: a result whose
        ``messages`` are every member's, this node's included, in the group's order
        (``averaged`` is an empty tensor; an averager of a fixed message size returns them
        zero-padded to it). Only averagers built for an all-gather (a sparse
        ``--diloco-codec``) have it."""
        raise NotImplementedError(f"{type(self).__name__} does not all-gather")

    @abc.abstractmethod
    def close(self) -> None:
        """Release processes and memory; safe to call twice."""

    def bytes_sent(self) -> int:
        """Encoded payload bytes this averager sent to groupmates so far (0 if not counted)."""
        return 0

    def bytes_received(self) -> int:
        """Encoded payload bytes this averager received from groupmates so far."""
        return 0


# ---------------------------------------------------------------------------------- in memory
@dataclass(eq=False)
class _Session:
    target: int
    closes_at: float  # time.monotonic() when the group closes with whoever joined
    members: dict[str, tuple[torch.Tensor, Mapping[str, Any]]] = field(default_factory=dict)
    closed: bool = False
    mean: torch.Tensor | None = None


class InMemoryAveragingHub:
    """Process-local matchmaking: calls that arrive within ``matchmaking_time_s`` of the first
    one form a group (complete at the first caller's target size); a group smaller than
    ``min_group_size`` fails, like a hivemind round that finds nobody."""

    def __init__(self, matchmaking_time_s: float = 0.5, min_group_size: int = 2) -> None:
        self.matchmaking_time_s = matchmaking_time_s
        self.min_group_size = min_group_size
        self._cond = threading.Condition()
        self._open: _Session | None = None
        self._calls: dict[str, int] = {}
        self._fail_at: set[tuple[str, int]] = set()

    def averager(self, peer_id: str) -> InMemoryAverager:
        return InMemoryAverager(self, peer_id)

    def fail_at(self, peer_id: str, call: int) -> None:
        """Make ``peer_id``'s ``call``-th :meth:`InMemoryAverager.average` (0-based) fail."""
        self._fail_at.add((peer_id, call))

    def _average(self, peer_id: str, tensor: torch.Tensor, gather: Mapping[str, Any],
                 target: int, stop: threading.Event) -> AveragingResult:
        with self._cond:
            call = self._calls.get(peer_id, 0)
            self._calls[peer_id] = call + 1
            if (peer_id, call) in self._fail_at:
                return AveragingResult.failed("injected failure")
            session = self._open
            if session is None or session.closed:
                session = self._open = _Session(target, time.monotonic() + self.matchmaking_time_s)
            session.members[peer_id] = (tensor.detach().clone(), dict(gather))
            if len(session.members) >= session.target:
                self._close(session)
            while not session.closed:
                if stop.is_set():
                    del session.members[peer_id]
                    return AveragingResult.failed("cancelled: the node is stopping")
                remaining = session.closes_at - time.monotonic()
                if remaining <= 0:
                    self._close(session)
                    break
                self._cond.wait(min(remaining, _POLL_S))
        if session.mean is None:
            return AveragingResult.failed(f"no group: {len(session.members)} peer(s) in the "
                                          f"matchmaking window, {self.min_group_size} needed")
        gathered = {pid: g for pid, (_, g) in sorted(session.members.items())}
        if tensor.dtype == torch.uint8:  # an all-gather: the messages in the group's order
            return AveragingResult(tensor.new_empty(0), gathered, messages=tuple(
                bytes(session.members[pid][0].numpy()) for pid in gathered))
        return AveragingResult(session.mean.clone(), gathered)

    def _close(self, session: _Session) -> None:
        session.closed = True
        if self._open is session:
            self._open = None
        if len(session.members) >= self.min_group_size:
            tensors = [t for t, _ in session.members.values()]
            session.mean = (tensors[0].new_empty(0) if tensors[0].dtype == torch.uint8
                            else torch.stack(tensors).mean(dim=0))
        self._cond.notify_all()


class InMemoryAverager(Averager):
    """One peer's handle on an :class:`InMemoryAveragingHub`."""

    def __init__(self, hub: InMemoryAveragingHub, peer_id: str) -> None:
        self.hub = hub
        self.peer_id = peer_id

    def start(self) -> None:
        pass

    def average(self, tensor: torch.Tensor, gather: Mapping[str, Any], target_group_size: int,
                stop: threading.Event) -> AveragingResult:
        return self.hub._average(self.peer_id, tensor, gather, target_group_size, stop)

    def allgather(self, message: bytes, gather: Mapping[str, Any], target_group_size: int,
                  stop: threading.Event) -> AveragingResult:
        data = torch.frombuffer(bytearray(message), dtype=torch.uint8) if message \
            else torch.empty(0, dtype=torch.uint8)
        return self.hub._average(self.peer_id, data, gather, target_group_size, stop)

    def close(self) -> None:
        pass
