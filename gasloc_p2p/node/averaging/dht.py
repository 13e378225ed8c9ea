"""hivemind's ``DecentralizedAverager`` behind the :class:`~.base.Averager` interface.

The rest of the node never imports hivemind's averaging internals: this module (with
:mod:`.uniform`, the all-reduce every member ends with bit for bit, and :mod:`.compression`, the
project's codecs as a hivemind compression) is all of the glue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from gasloc_p2p.node.averaging.base import Averager, AveragingResult
from gasloc_p2p.node.averaging.compression import compression_class, install, make_compression
from gasloc_p2p.node.averaging.uniform import GROUP_TAG, run_uniform_allreduce
from gasloc_p2p.node.config import DilocoConfig

log = logging.getLogger(__name__)
_POLL_S = 0.05  # how often a waiting round checks the stop event
_WATCHDOG_PERIOD_S = 1.0  # the averager process checks this often that the node still lives
_LOCKED = "averaged buffer locked"
GATHERED, MESSAGES = "gasloc_gathered", "gasloc_messages"  # an all-gather's step result


@functools.cache
def _averager_class() -> Any:
    """``DecentralizedAverager`` with the uniform all-reduce (:mod:`.uniform`: every member
    keeps the same result, bit for bit) plus two control messages for its background process.

    The averager process runs one coroutine per message sent through its control pipe (hivemind
    1.1.12's own mechanism for ``step``): ``_gasloc_set_target`` changes the target group size
    between rounds (the swarm size changes as nodes come and go), ``_gasloc_watch_parent``
    exits the process if the node dies, even by SIGKILL (it holds no p2pd of its own, but would
    otherwise linger as an orphan). Built lazily: importing hivemind takes a second.
    """
    from hivemind.averaging import DecentralizedAverager

    class GaslocAverager(DecentralizedAverager):
        def run(self) -> None:  # in the averager's own (forked) process
            compression = self.allreduce_kwargs.get("compression")
            if isinstance(compression, compression_class()):
                install(compression)
            super().run()

        async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any,
                                          group_id: Any = None, **kwargs: Any) -> None:
            target = self._matchmaking.target_group_size
            self._gasloc_messages = await run_uniform_allreduce(
                self, tensors, group_info, group_id,
                max_members=gather_cap(target) if target else None, **kwargs)

        async def _aggregate_with_group(self, group_info: Any, min_vector_size: int,
                                        **kwargs: Any) -> Any:
            """hivemind's, plus an all-gather's messages: the step's result carries them
            to the node's process (the gathered metadata under ``GATHERED``)."""
            self._gasloc_messages = None
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            messages, self._gasloc_messages = self._gasloc_messages, None
            if messages is None:
                return gathered
            return {GATHERED: gathered, MESSAGES: messages}

        async def _gasloc_set_target(self, size: int | None) -> None:
            self._matchmaking.target_group_size = size

        async def _gasloc_watch_parent(self, parent_pid: int, period_s: float) -> None:
            while os.getppid() == parent_pid:
                await asyncio.sleep(period_s)
            os._exit(0)

    return GaslocAverager


def gather_cap(target: int) -> int:
    """The largest group an all-gather joins when this node aims at groups of ``target``: a
    leader picks the group, and every member's message is held at once, so the size is
    bounded by this node's own figure; with room for a swarm that grew since this node last
    counted it (a cap of exactly ``target`` refused honest groups and stalled their rounds)."""
    return 2 * target + 8


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

    def __init__(self, dht: Any, numel: int, prefix: str, cfg: DilocoConfig,
                 transfer_s: float = 0.0) -> None:
        """``prefix``: from :func:`averaging_prefix` (with ``cfg.diloco_codec``); ``numel``:
        float32 values averaged (an all-gather, a sparse codec: its messages' bytes / 4);
        ``transfer_s``: the time this node's share of the traffic takes on the slowest link it
        plans for, added to the all-reduce's deadline (a 1B model's fp32 all-reduce moves 8 GB
        each way: 120 s would fail every round below 500 Mbit/s)."""
        self.dht = dht
        self.numel = numel
        self.message_bytes = 4 * numel
        self.prefix = prefix
        self.cfg = cfg
        self.allreduce_s = cfg.allreduce_timeout_s + transfer_s
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
            allreduce_timeout=self.allreduce_s, next_chunk_timeout=cfg.part_timeout_s,
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
        deadline = time.monotonic() + cfg.averaging_timeout_s + self.allreduce_s + 5.0
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

    def allgather(self, message: bytes, gather: Mapping[str, Any], target_group_size: int,
                  stop: threading.Event) -> AveragingResult:
        if not self.compression.gathers:
            raise NotImplementedError(f"{self.cfg.diloco_codec} syncs all-reduce")
        if len(message) > self.message_bytes:
            raise ValueError(f"a message of {len(message)} bytes for {self.message_bytes}")
        padded = torch.zeros(self.numel)
        padded.view(torch.uint8)[:len(message)] = torch.frombuffer(
            bytearray(message), dtype=torch.uint8) if message else torch.empty(0, dtype=torch.uint8)
        result = self.average(padded, gather, target_group_size, stop)
        if not result.ok:
            return result
        got = result.gathered.get(GATHERED), result.gathered.get(MESSAGES)
        if not isinstance(got[0], Mapping) or not isinstance(got[1], list):
            return AveragingResult.failed("the all-gather returned no messages")
        gathered = {_peer_name(p): g for p, g in got[0].items()}
        messages = dict(got[1])
        if set(messages) != set(gathered) or any(len(m) != self.message_bytes
                                                 for m in messages.values()):
            return AveragingResult.failed("the all-gather's messages do not match its group")
        return AveragingResult(torch.empty(0), {p: gathered[p] for p in messages},
                               messages=tuple(messages.values()))

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
        if not avg.lock_averaged_tensors.acquire(timeout=self.allreduce_s):
            log.error("the averaged buffer stayed locked for %g s: hivemind's averager is stuck; "
                      "rounds fail until the node restarts", self.allreduce_s)
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
