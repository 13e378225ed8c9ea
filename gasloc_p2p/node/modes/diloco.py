"""``--algorithm diloco``: the DiLoCo baseline inside the node daemon (ALGORITHM.md section 3).

The node does not gossip (:class:`DilocoMode` builds no exchanger, peer book or gossip loop).
At each of its round ends (every H inner steps) the trainer thread calls
:meth:`DilocoRounds.round_end`, which

1. under the training lock takes the outer gradient ``g = anchor - theta`` (``[numel]``), and a
   small digest of ``(anchor, Nesterov buffer)``;
2. without the lock, all-reduces ``g`` with the swarm through an :class:`Averager` (hivemind's
   ``DecentralizedAverager`` on the node's own DHT); the wait for the slowest groupmate is the
   cost DiLoCo pays, recorded per round;
3. under the lock applies Nesterov SGD (:class:`gasloc_p2p.core.diloco.NesterovOuter`) with the
   mean gradient, or with its own ``g`` when no group formed (alone, timeout: the failed round
   is recorded and training goes on, as in torchft), and resets ``theta`` to the new anchor.

A node that applies its own gradient while others average drifts away from them for good: plain
DiLoCo has no way back. So each member also gathers its digest, epoch and gRPC endpoint; after a
successful round every member picks the same reference (the highest epoch, then the largest
set of matching digests, then the peer id), and a member out of step downloads the reference's
anchor and buffer (DownloadState), as hivemind's optimizer loads state from peers when it falls
behind. The epoch counts outer steps along the shared history: nodes in step share it. It is
kept in ``state.rounds`` (so checkpoints save it with the anchor, atomically) and never goes
down: the reference has the highest epoch of its group.

State: the node's :class:`AsyncGaslocState` with momentum form "local" holds ``theta``, the
anchor and ``m``, which is exactly the Nesterov buffer (DiLoCo is the "local" form with the drift
replaced by the mean drift), so checkpoints, resume and late-join downloads work unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.diloco import NesterovOuter
from gasloc_p2p.node.config import DilocoConfig, NodeConfig
from gasloc_p2p.node.modes.averaging import (
    Averager,
    AveragingResult,
    HivemindAverager,
    averaging_prefix,
)
from gasloc_p2p.node.modes.base import Mode, ModeContext
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.stats import TrainStats
from gasloc_p2p.node.transport.service import StateSnapshot, download_state
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb

log = logging.getLogger(__name__)
DIGEST_PARTS = 8  # contiguous chunks per tensor in the digest
DIGEST_REL_TOL = 1e-4  # relative to the chunk's norm: far above float32 rounding of averaging
HISTORY = 256  # per-round records kept

#: endpoint -> (epoch, anchor [numel], Nesterov buffer [numel]) of that node; blocking.
FetchState = Callable[[str], tuple[int, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class RoundRecord:
    """One DiLoCo round: ``outcome`` is ok | failed | solo; ``seconds`` waited for averaging."""

    epoch: int
    outcome: str
    group_size: int
    seconds: float
    error: str = ""


@dataclass
class DilocoStats:
    """DiLoCo outcomes, written by the trainer thread; read for logs, Info and metrics."""

    rounds_ok: int = 0  # averaged in a group of >= 2
    rounds_failed: int = 0  # no group or all-reduce error: own outer gradient applied
    rounds_solo: int = 0  # no peer known: own outer gradient, no waiting
    last_group_size: int = 0
    last_averaging_s: float = 0.0
    total_averaging_s: float = 0.0  # every round that waited (ok and failed)
    ok_averaging_s: float = 0.0  # rounds that averaged
    resyncs: int = 0
    resync_failures: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    history: deque[RoundRecord] = field(default_factory=lambda: deque(maxlen=HISTORY))

    @property
    def mean_averaging_s(self) -> float:
        """Mean wall time of a successful round's averaging, seconds (NaN before one)."""
        return self.ok_averaging_s / self.rounds_ok if self.rounds_ok else math.nan

    def record(self, rec: RoundRecord) -> None:
        self.history.append(rec)
        self.last_averaging_s = rec.seconds
        if rec.outcome == "solo":
            self.rounds_solo += 1
            return
        self.total_averaging_s += rec.seconds
        if rec.outcome == "ok":
            self.rounds_ok += 1
            self.ok_averaging_s += rec.seconds
            self.last_group_size = rec.group_size
        else:
            self.rounds_failed += 1
            self.failures[rec.error.split(":")[0] or "unknown"] += 1


# ---------------------------------------------------------------------------- pure helpers
def state_digest(tensors: Sequence[torch.Tensor], parts: int = DIGEST_PARTS) -> list[float]:
    """Per contiguous chunk of each tensor: (sum, L2 norm) in float64; ``4 * parts`` floats for
    two tensors. Equal states give digests equal up to rounding; see :func:`digests_match`."""
    out: list[float] = []
    for t in tensors:
        for chunk in torch.tensor_split(t.detach(), parts):
            out.append(float(chunk.sum(dtype=torch.float64)))
            out.append(float(torch.linalg.vector_norm(chunk, dtype=torch.float64)))
    return out


def digests_match(a: Sequence[float], b: Sequence[float], rel_tol: float = DIGEST_REL_TOL) -> bool:
    """Whether two digests describe the same state: every chunk sum within ``rel_tol`` of the
    chunk's norm (float32 rounding moves a sum by about 1e-7 of the norm, one missed or extra
    outer step by far more)."""
    if len(a) != len(b):
        return False
    for i in range(0, len(a), 2):
        scale = max(a[i + 1], b[i + 1], 1e-30)
        if not abs(a[i] - b[i]) <= rel_tol * scale:
            return False
    return True


def choose_reference(members: Mapping[str, Mapping[str, Any]]) -> str:
    """The member whose state the group keeps: the highest epoch (the longest history, as
    hivemind prefers the peer with the highest epoch to load state from), then most members
    with a matching digest, then the largest peer id. Every member computes the same answer."""

    def key(pid: str) -> tuple[int, int, str]:
        mine = members[pid]["digest"]
        support = sum(digests_match(mine, m["digest"]) for m in members.values())
        return int(members[pid]["epoch"]), support, pid

    return max(members, key=key)


# ---------------------------------------------------------------------------- round logic
class DilocoRounds:
    """The round-end hook of a DiLoCo node (see the module docstring); trainer thread only."""

    def __init__(self, state: AsyncGaslocState, lock: TrainingLock, averager: Averager,
                 cfg: DilocoConfig, train_stats: TrainStats, stop: threading.Event,
                 peer_count: Callable[[], int], endpoint: Callable[[], str],
                 fetch_state: FetchState | None = None) -> None:
        """``state`` must use the "local" momentum form (``cfg.async_config()``); ``peer_count``:
        compatible peers known now, this node excluded; ``endpoint``: this node's gRPC address;
        ``fetch_state``: download another node's state (None: never resynchronize)."""
        if state.cfg.momentum != "local":
            raise ValueError("DiLoCo keeps its Nesterov buffer in the 'local' momentum memory")
        self.state = state
        self.lock = lock
        self.averager = averager
        self.cfg = cfg
        self.train_stats = train_stats
        self.stop = stop
        self.peer_count = peer_count
        self.endpoint = endpoint
        self.fetch_state = fetch_state
        self.stats = DilocoStats()
        # the buffer is state.memory (on the device): every update of either is in place
        self.outer = NesterovOuter(state.theta.numel(), cfg.diloco_eta, cfg.diloco_gamma,
                                   buf=state.memory)

    def round_end(self) -> None:
        """Average the outer gradient with the swarm and take the outer step (blocking)."""
        st = self.state
        with self.lock.urgent(), torch.no_grad():
            own = st.anchor - st.theta
            digest = state_digest([st.anchor, self.outer.buf])
            epoch = st.rounds
        t0 = time.monotonic()
        result = self._average(own, digest, epoch)
        seconds = time.monotonic() - t0
        reference = self._reference(result) if result is not None and result.ok else None
        in_step = reference is not None and (reference[0] == self.averager.peer_id
                                             or digests_match(digest, reference[1]["digest"]))
        grad = result.averaged if result is not None and result.averaged is not None else own
        with self.lock.urgent(), torch.no_grad():
            self.outer.step_(st.anchor, grad)
            st.theta.copy_(st.anchor)
            st.rounds = int(reference[1]["epoch"]) + 1 if in_step and reference else epoch + 1
            self.train_stats.rounds = st.rounds
        self._record(result, seconds)
        if reference is not None and not in_step:
            log.warning("this node's anchor (epoch %d) differs from its group's (reference "
                        "epoch %s): a round failed here or there; resynchronizing", epoch,
                        reference[1]["epoch"])
            self._resync(reference[1], grad)

    def _average(self, own: torch.Tensor, digest: list[float],
                 epoch: int) -> AveragingResult | None:
        """All-reduce ``own``; None when no group is possible (then nothing waits)."""
        peers = self.peer_count()
        if peers + 1 < self.cfg.min_group_size:
            return None  # DiLoCo with one worker: no communication
        gather = {"epoch": epoch, "digest": digest, "endpoint": self.endpoint()}
        return self.averager.average(own, gather, peers + 1, self.stop)

    def _reference(self, result: AveragingResult) -> tuple[str, Mapping[str, Any]] | None:
        """The group's reference member and its metadata (None if any metadata is malformed)."""
        members = {pid: g for pid, g in result.gathered.items()
                   if isinstance(g, Mapping) and {"epoch", "digest", "endpoint"} <= set(g)}
        if len(members) != len(result.gathered):
            log.warning("a groupmate sent malformed round metadata; not checking sync this round")
            return None
        ref = choose_reference(members)
        return ref, members[ref]

    def _record(self, result: AveragingResult | None, seconds: float) -> None:
        if result is None:
            rec = RoundRecord(self.epoch, "solo", 1, seconds)
        elif result.ok:
            rec = RoundRecord(self.epoch, "ok", result.group_size, seconds)
            log.debug("averaged with %s in %.3f s: epoch %d", sorted(
                (p[-6:], g.get("epoch")) for p, g in result.gathered.items()
                if isinstance(g, Mapping)), seconds, self.epoch)
        else:
            rec = RoundRecord(self.epoch, "failed", 1, seconds, result.error)
            log.debug("averaging round failed after %.2f s (%s): applied the own outer gradient",
                      seconds, result.error)
        self.stats.record(rec)

    def _resync(self, ref: Mapping[str, Any], grad: torch.Tensor) -> None:
        """Adopt the reference member's anchor and buffer (it may not have stepped yet)."""
        if self.fetch_state is None:
            return
        try:
            epoch, anchor, buf = self.fetch_state(str(ref["endpoint"]))
        except Exception as exc:  # keep our own state; the next round checks again
            self.stats.resync_failures += 1
            log.warning("state download from %s failed: %s", ref["endpoint"], exc)
            return
        if anchor.shape != self.state.anchor.shape or buf.shape != anchor.shape:
            self.stats.resync_failures += 1
            log.warning("state from %s has %d params, this model %d", ref["endpoint"],
                        anchor.numel(), self.state.anchor.numel())
            return
        st = self.state
        with self.lock.urgent(), torch.no_grad():
            st.anchor.copy_(anchor)
            self.outer.buf.copy_(buf)
            if epoch == int(ref["epoch"]):  # downloaded before the reference applied this round
                self.outer.step_(st.anchor, grad)
                epoch += 1
            st.theta.copy_(st.anchor)
            st.rounds = self.train_stats.rounds = max(epoch, st.rounds)
        self.stats.resyncs += 1
        log.info("adopted the state of %s at epoch %d", ref["endpoint"], epoch)

    # ------------------------------------------------------------------------- views
    @property
    def epoch(self) -> int:
        """Outer steps along the shared history (``state.rounds``)."""
        return self.state.rounds

    def set_epoch(self, epoch: int) -> None:
        """After adopting a peer's state at start-up (its DownloadState ``rounds``)."""
        with self.lock.urgent():
            self.state.rounds = self.train_stats.rounds = epoch

    def snapshot(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(epoch, anchor copy, buffer copy) under the lock: what DownloadState serves."""
        with self.lock.urgent():
            return self.state.rounds, self.state.anchor.clone(), self.outer.buf.clone()

    def info_fields(self) -> dict[str, Any]:
        """The DiLoCo fields of the Info reply."""
        s = self.stats
        return {"averaging_rounds_ok": s.rounds_ok, "averaging_rounds_failed": s.rounds_failed,
                "averaging_rounds_solo": s.rounds_solo, "last_group_size": s.last_group_size,
                "last_averaging_s": s.last_averaging_s, "total_averaging_s": s.total_averaging_s,
                "outer_epoch": self.epoch, "resyncs": s.resyncs,
                "bytes_sent": self.averager.bytes_sent(),
                "bytes_received": self.averager.bytes_received()}

    def progress_text(self) -> str:
        s = self.stats
        return (f"diloco epoch {self.epoch}: rounds ok {s.rounds_ok} failed {s.rounds_failed} "
                f"solo {s.rounds_solo} | group {s.last_group_size}, averaging last "
                f"{s.last_averaging_s:.2f} s mean {s.mean_averaging_s:.2f} s | resyncs "
                f"{s.resyncs}")


# ---------------------------------------------------------------------------- daemon glue
def state_fetcher(loop: asyncio.AbstractEventLoop,
                  download: Callable[[str], Any], stop: threading.Event) -> FetchState:
    """A blocking :data:`FetchState` for the trainer thread: runs the coroutine
    ``download(endpoint) -> (meta, anchor, buffer)`` on the node's event loop, gives up when
    ``stop`` is set (the download itself carries its own deadline)."""

    def fetch(endpoint: str) -> tuple[int, torch.Tensor, torch.Tensor]:
        future = asyncio.run_coroutine_threadsafe(download(endpoint), loop)
        while not future.done():
            if stop.is_set():
                future.cancel()
                raise RuntimeError("the node is stopping")
            concurrent.futures.wait([future], timeout=0.1)
        meta, anchor, buf = future.result()
        return int(meta.rounds), anchor, buf

    return fetch


class DilocoMode(Mode):
    """DiLoCo: an all-reduce of the outer gradient at each round end; no gossip machinery
    (inbound Exchange streams are answered BUSY). Start it before the trainer thread and any
    gRPC channel exist: the hivemind averager forks."""

    name = "diloco"

    def __init__(self, averager: Averager | None = None) -> None:
        """``averager``: default hivemind's, on the discovery's DHT (tests inject their own)."""
        self.averager = averager
        self.rounds: DilocoRounds | None = None
        self.ctx: ModeContext | None = None
        self._averaging = False  # the averager started and is not closed yet

    @staticmethod
    def outer_config(cfg: NodeConfig) -> AsyncConfig:
        return cfg.diloco.async_config()

    async def start(self, ctx: ModeContext) -> None:
        cfg, trainer = ctx.cfg, ctx.trainer
        self.ctx = ctx
        if self.averager is None:
            dht = ctx.discovery.averaging_backend()
            if dht is None:
                raise RuntimeError("--algorithm diloco needs the hivemind DHT discovery")
            self.averager = HivemindAverager(
                dht, trainer.flat.numel,
                averaging_prefix(cfg.discovery.run_id, trainer.fingerprint,
                                 cfg.diloco.diloco_codec), cfg.diloco)
        self._averaging = True  # close even a half-started averager (close is safe twice)
        await asyncio.to_thread(self.averager.start)

        async def download(peer_endpoint: str) -> Any:
            return await download_state(ctx.channels.stub(peer_endpoint), ctx.me,
                                        cfg.gossip.download_timeout_s)

        self.rounds = DilocoRounds(
            trainer.state, ctx.lock, self.averager, cfg.diloco, ctx.train_stats, ctx.stop,
            lambda: len(ctx.peers()), ctx.endpoint,
            state_fetcher(asyncio.get_running_loop(), download, ctx.stop))
        log.info("DiLoCo mode: all-reduce every %d inner steps (%s payload), outer Nesterov "
                 "eta %g gamma %g", cfg.train.inner_steps, cfg.diloco.diloco_codec,
                 cfg.diloco.diloco_eta, cfg.diloco.diloco_gamma)

    def _started(self) -> DilocoRounds:
        assert self.rounds is not None, "start the mode first"
        return self.rounds

    def round_end(self) -> None:
        self._started().round_end()

    def adopted(self, meta: pb.StateMeta) -> None:
        self._started().set_epoch(int(meta.rounds))  # a DiLoCo peer's "rounds" is its epoch

    def snapshot(self) -> StateSnapshot:
        """The anchor (shared by nodes in step), not mid-round theta, and the buffer."""
        assert self.ctx is not None
        epoch, anchor, buf = self._started().snapshot()
        return StateSnapshot(self.ctx.train_stats.step, epoch, "diloco", anchor, buf)

    def info_fields(self) -> dict[str, Any]:
        return self._started().info_fields()

    def progress(self) -> str:
        return self._started().progress_text()

    async def stop(self) -> None:
        if self._averaging and self.averager is not None:
            self._averaging = False
            await asyncio.to_thread(self.averager.close)
