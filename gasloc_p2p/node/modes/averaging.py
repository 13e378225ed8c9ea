"""The averaging seam of ``--algorithm diloco``: all-reduce one flat tensor with a group of peers.

:class:`Averager` is the small interface the DiLoCo round logic (:mod:`gasloc_p2p.node.modes.diloco`)
needs; :class:`HivemindAverager` runs hivemind's ``DecentralizedAverager`` (the engine OpenDiLoCo
uses) on the node's existing DHT, :class:`InMemoryAveragingHub` hands out process-local averagers
for tests, with fault injection by schedule (``fail_at``, as torchft's ``EventInjector``).

Every call blocks (it runs in the trainer thread, never on the event loop) and fails soft: a
round that finds no group, times out or is cancelled by ``stop`` returns a failed
:class:`AveragingResult` instead of raising.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gasloc_p2p.node.config import DilocoConfig
from gasloc_p2p.node.modes.compression import compression_class, install, make_compression
from gasloc_p2p.node.modes.uniform import GROUP_TAG, run_uniform_allreduce

log = logging.getLogger(__name__)
_POLL_S = 0.05  # how often a waiting round checks the stop event
_WATCHDOG_PERIOD_S = 1.0  # the averager process checks this often that the node still lives
_LOCKED = "averaged buffer locked"


@dataclass(frozen=True, eq=False)
class AveragingResult:
    """One averaging attempt. ``averaged``: ``[numel]`` float32 group mean, None on failure;
    ``gathered``: each member's ``gather`` payload by peer id (this node included)."""

    averaged: torch.Tensor | None
    gathered: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.averaged is not None

    @property
    def group_size(self) -> int:
        return len(self.gathered) if self.ok else 0

    @classmethod
    def failed(cls, error: str) -> AveragingResult:
        return cls(None, {}, error)


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
        return AveragingResult(session.mean.clone(),
                               {pid: g for pid, (_, g) in session.members.items()})

    def _close(self, session: _Session) -> None:
        session.closed = True
        if self._open is session:
            self._open = None
        if len(session.members) >= self.min_group_size:
            session.mean = torch.stack([t for t, _ in session.members.values()]).mean(dim=0)
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

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------- hivemind
_AVERAGER_CLASS: Any = None


def _averager_class() -> Any:
    """``DecentralizedAverager`` with the uniform all-reduce (:mod:`.uniform`: every member
    keeps the same result, bit for bit) plus two control messages for its background process.

    The averager process runs one coroutine per message sent through its control pipe (hivemind
    1.1.12's own mechanism for ``step``): ``_gasloc_set_target`` changes the target group size
    between rounds (the swarm size changes as nodes come and go), ``_gasloc_watch_parent``
    exits the process if the node dies, even by SIGKILL (it holds no p2pd of its own, but would
    otherwise linger as an orphan). Built lazily: importing hivemind takes a second.
    """
    global _AVERAGER_CLASS
    if _AVERAGER_CLASS is None:
        from hivemind.averaging import DecentralizedAverager

        class GaslocAverager(DecentralizedAverager):
            def run(self) -> None:  # in the averager's own (forked) process
                compression = self.allreduce_kwargs.get("compression")
                if isinstance(compression, compression_class()):
                    install(compression)
                super().run()

            async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any,
                                              group_id: Any = None, **kwargs: Any) -> None:
                await run_uniform_allreduce(self, tensors, group_info, group_id, **kwargs)

            async def _gasloc_set_target(self, size: int | None) -> None:
                self._matchmaking.target_group_size = size

            async def _gasloc_watch_parent(self, parent_pid: int, period_s: float) -> None:
                while os.getppid() == parent_pid:
                    await asyncio.sleep(period_s)
                os._exit(0)

        _AVERAGER_CLASS = GaslocAverager
    return _AVERAGER_CLASS


def averaging_prefix(run_id: str, fingerprint: str, codec: str = "",
                     part: str = "diloco") -> str:
    """The hivemind group-key prefix: run-, model-, codec- and ``part``-scoped (the payload's
    codec must be the same in a group; streaming-diloco averages each fragment under its own
    ``part``), and tagged with the all-reduce's version (:data:`.uniform.GROUP_TAG`: nodes
    running another all-reduce never meet); hivemind forbids dots in it."""
    return (f"gasloc_{run_id}_{part}_{codec}_{GROUP_TAG}_{fingerprint[:16]}"
            .replace(".", "_"))


class HivemindAverager(Averager):
    """hivemind ``DecentralizedAverager`` over one shared-memory ``[numel]`` buffer, on ``dht``."""

    def __init__(self, dht: Any, numel: int, prefix: str, cfg: DilocoConfig) -> None:
        """``prefix``: from :func:`averaging_prefix` (with ``cfg.diloco_codec``)."""
        self.dht = dht
        self.numel = numel
        self.prefix = prefix
        self.cfg = cfg
        self.peer_id = dht.peer_id.to_base58()
        self._avg: Any = None
        self._target: int | None = cfg.target_group_size or None
        self.compression = make_compression(cfg.diloco_codec)

    def start(self) -> None:
        cfg = self.cfg
        avg = _averager_class()(
            [torch.zeros(self.numel)], self.dht, start=False, prefix=self.prefix,
            target_group_size=self._target, min_group_size=cfg.min_group_size,
            min_matchmaking_time=cfg.matchmaking_time_s, request_timeout=cfg.request_timeout_s,
            allreduce_timeout=cfg.allreduce_timeout_s, next_chunk_timeout=cfg.part_timeout_s,
            compression=self.compression,
            allow_state_sharing=False, shutdown_timeout=5.0)
        # Process.start, not run_in_background: that one sets SIGINT to SIG_IGN in the caller,
        # which is not the main thread here (and the node handles SIGINT itself).
        avg.start()
        self._avg = avg
        avg.wait_until_ready(timeout=cfg.allreduce_timeout_s)
        avg._outer_pipe.send(("_gasloc_watch_parent", [os.getpid(), _WATCHDOG_PERIOD_S], {}))
        log.debug("hivemind averager up: prefix %s, %d params", self.prefix, self.numel)

    def average(self, tensor: torch.Tensor, gather: Mapping[str, Any], target_group_size: int,
                stop: threading.Event) -> AveragingResult:
        avg, cfg = self._avg, self.cfg
        if avg is None:
            return AveragingResult.failed("averager not started")
        with self._tensors() as buf:
            if buf is None:
                return AveragingResult.failed(_LOCKED)
            buf.copy_(tensor)
        target = cfg.target_group_size or target_group_size
        if target != self._target:
            avg._outer_pipe.send(("_gasloc_set_target", [target], {}))  # before the step's
            self._target = target
        control = avg.step(gather=dict(gather), timeout=cfg.averaging_timeout_s,
                           allow_retries=True, wait=False)
        deadline = time.monotonic() + cfg.averaging_timeout_s + cfg.allreduce_timeout_s + 5.0
        while not control.done():
            if stop.is_set() or time.monotonic() > deadline:
                control.cancel()
                return AveragingResult.failed("cancelled: the node is stopping" if stop.is_set()
                                              else "no result within the averaging deadlines")
            stop.wait(_POLL_S)
        try:
            gathered = control.result()
        except BaseException as exc:  # no group, timeout, a groupmate failed mid-way
            return AveragingResult.failed(f"{type(exc).__name__}: {exc}".strip(": "))
        if not gathered:
            return AveragingResult.failed("no group")
        with self._tensors() as buf:
            if buf is None:
                return AveragingResult.failed(_LOCKED)
            averaged = buf.clone()
        return AveragingResult(averaged, {_peer_name(p): g for p, g in gathered.items()})

    def bytes_sent(self) -> int:
        return int(self.compression.bytes_sent())

    def bytes_received(self) -> int:
        return int(self.compression.bytes_received())

    @contextlib.contextmanager
    def _tensors(self) -> Iterator[torch.Tensor | None]:
        """The shared buffer under the averager's lock, or None if the lock stays taken.

        hivemind's ``get_tensors()`` waits forever; an all-reduce task cancelled while its
        executor thread was taking the lock would then hang the trainer thread for good.
        """
        avg = self._avg
        if not avg.lock_averaged_tensors.acquire(timeout=self.cfg.allreduce_timeout_s):
            log.error("the averaged buffer stayed locked for %g s: hivemind's averager is stuck; "
                      "rounds fail until the node restarts", self.cfg.allreduce_timeout_s)
            yield None
            return
        try:
            yield avg._averaged_tensors[0]
        finally:
            avg.lock_averaged_tensors.release()

    def close(self) -> None:
        avg, self._avg = self._avg, None
        if avg is not None and avg.is_alive():
            avg.shutdown()
            if avg.is_alive():
                avg.kill()
                avg.join(5.0)


def _peer_name(peer: Any) -> str:
    to_base58 = getattr(peer, "to_base58", None)
    return str(to_base58() if to_base58 is not None else peer)
