"""``--algorithm diloco`` and ``--algorithm streaming-diloco``: one mode, two settings.

DiLoCo is Streaming DiLoCo with one fragment (the whole model) and no overlap (``tau`` 0), as in
torchft; the rounds are :class:`~gasloc_p2p.node.modes.diloco_rounds.DilocoRounds`. The node
does not gossip (inbound Exchange streams are answered BUSY).

Averaging: one hivemind averager serves every fragment (one group key, sized to the largest
fragment, zero-padded), so nodes out of phase still meet: a group that synced different
fragments counts as failed and realigns its members' schedules. A sync that starts while
another is still in flight (``--tau`` longer than the gap between two sync starts) waits for it
before its own all-reduce. (Per-fragment averagers, each under its own key, would run such
syncs at once, but nodes out of phase rarely meet; observed on a loaded machine: most syncs
failed.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.core.flat import Fragment, layer_fragments, whole
from gasloc_p2p.model import layer_index
from gasloc_p2p.node.averaging.base import Averager
from gasloc_p2p.node.config import NodeConfig
from gasloc_p2p.node.modes.base import Mode, ModeContext
from gasloc_p2p.node.modes.diloco_rounds import DilocoRounds, FetchState
from gasloc_p2p.node.stats import FragmentStats
from gasloc_p2p.node.transport.service import StateSnapshot, download_state
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb

log = logging.getLogger(__name__)


def state_fetcher(loop: asyncio.AbstractEventLoop,
                  download: Callable[[str], Any], stop: threading.Event) -> FetchState:
    """A blocking :data:`FetchState` for the trainer thread: runs the coroutine
    ``download(endpoint) -> (meta, anchor, outer state)`` on the node's event loop, gives up
    when ``stop`` is set (the download itself carries its own deadline)."""

    def fetch(endpoint: str) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
        future = asyncio.run_coroutine_threadsafe(download(endpoint), loop)
        while not future.done():
            if stop.is_set():
                future.cancel()
                raise RuntimeError("the node is stopping")
            concurrent.futures.wait([future], timeout=0.1)
        meta, anchor, outer = future.result()
        return int(meta.rounds), anchor, outer

    return fetch


def diloco_fragments(algorithm: str, flat_spans: Any, numel: int, parts: int) -> list[Fragment]:
    """DiLoCo: the whole model; Streaming DiLoCo: strided layers (``parts`` of them) plus the
    non-layer tensors, the simulator's split."""
    if algorithm == "diloco":
        return [whole(numel)]
    return layer_fragments(flat_spans, layer_index, parts, "strided")


class DilocoMode(Mode):
    """DiLoCo (one fragment, blocking) or Streaming DiLoCo (staggered fragments, overlapped).
    Start it before the trainer thread and any gRPC channel exist: the hivemind averager
    forks."""

    name = "diloco"
    keeps_anchor = True

    def __init__(self, algorithm: str = "diloco",
                 averagers: Sequence[Averager] | None = None) -> None:
        """``algorithm``: diloco | streaming-diloco; ``averagers``: one per fragment or one for
        all (default: hivemind's, on the discovery's DHT; tests inject their own)."""
        if algorithm not in ("diloco", "streaming-diloco"):
            raise ValueError(f"not a DiLoCo algorithm: {algorithm!r}")
        self.name = algorithm  # type: ignore[misc]  # the instance's --algorithm
        self.averagers = list(averagers) if averagers is not None else None
        self.rounds: DilocoRounds | None = None
        self.ctx: ModeContext | None = None
        self._averaging = False

    @staticmethod
    def outer_config(cfg: NodeConfig) -> AsyncConfig:
        return cfg.diloco.async_config()  # "local": its momentum is the Nesterov buffer

    async def start(self, ctx: ModeContext) -> None:
        cfg, trainer = ctx.cfg, ctx.trainer
        self.ctx = ctx
        tau = cfg.diloco.tau if self.name == "streaming-diloco" else 0
        fragments = diloco_fragments(self.name, trainer.flat.spans, trainer.flat.numel,
                                     cfg.gossip.fragments)
        if self.averagers is None:
            from gasloc_p2p.node.averaging.dht import HivemindAverager, averaging_prefix

            dht = ctx.discovery.averaging_backend()
            if dht is None:
                raise RuntimeError(f"--algorithm {self.name} needs the hivemind DHT discovery")
            part = "diloco" if len(fragments) == 1 else f"stream{len(fragments)}"
            width = max(f.numel for f in fragments)
            sparse = cfg.diloco.sparse_spec()
            upload = cfg.diloco.sync_upload_bytes(width)  # as `plan` counts it
            if sparse is not None:  # an all-gather of messages: their bytes, as float32s
                width = -(-sparse.wire_bytes(width) // 4)
            self.averagers = [HivemindAverager(
                dht, width, averaging_prefix(
                    cfg.discovery.run_id, trainer.fingerprint, cfg.diloco.diloco_codec, part),
                cfg.diloco, cfg.gossip.transfer_s(upload))]
        self._averaging = True  # close even half-started averagers (close is safe twice)
        for averager in self.averagers:
            await asyncio.to_thread(averager.start)

        async def download(peer_endpoint: str) -> Any:
            # the endpoint comes from the group's gather: dial it only as a signed record
            # announces it, trusting the certificate that record names
            peer = next((p for p in ctx.peers() if p.endpoint == peer_endpoint), None)
            if peer is None:
                raise LookupError(f"no signed record announces {peer_endpoint!r}")
            numel, own = trainer.state.theta.numel(), trainer.state.outer
            return await download_state(ctx.channels.stub(peer.endpoint, peer.cert), ctx.me,
                                        cfg.gossip.download_deadline_s(numel, len(own.buffers)),
                                        numel, cfg.network.info_timeout_s, outer=own)

        self.rounds = DilocoRounds(
            trainer.state, fragments, cfg.train.inner_steps, tau, ctx.lock, self.averagers,
            cfg.diloco, ctx.train_stats, ctx.stop, lambda: len(ctx.peers()), ctx.endpoint,
            state_fetcher(asyncio.get_running_loop(), download, ctx.stop))
        trainer.round_end_every_step = True  # the schedule decides what each step does
        log.info("%s mode: %d fragment(s) at offsets %s of every %d steps, tau %d, merge alpha "
                 "%g, %s payload, %d averager(s), outer Nesterov eta %g gamma %g", self.name,
                 len(fragments), [self.rounds.schedule.offset(f) for f in range(len(fragments))],
                 cfg.train.inner_steps, tau, cfg.diloco.merge_alpha, cfg.diloco.diloco_codec,
                 len(self.averagers), cfg.diloco.diloco_eta, cfg.diloco.diloco_gamma)

    def _started(self) -> DilocoRounds:
        assert self.rounds is not None, "start the mode first"
        return self.rounds

    def round_end(self) -> None:
        """Called after every inner step (``Trainer.round_end_every_step``)."""
        self._started().after_step()

    def adopted(self, meta: pb.StateMeta) -> None:
        self._started().set_epoch(int(meta.rounds))

    def checkpoint_state(self) -> dict[str, Any]:
        """A sparse payload's error feedback (what the messages left out so far)."""
        feedback = self.rounds.feedback_state() if self.rounds is not None else {}
        return {"error_feedback": feedback} if feedback else {}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        saved = state.get("error_feedback")
        if isinstance(saved, Mapping):
            self._started().restore_feedback(saved)

    def snapshot(self) -> StateSnapshot:
        """The anchor (every fragment's global copy, shared by nodes in step; not mid-round
        theta) and the outer optimizer's state (the Nesterov buffers)."""
        assert self.ctx is not None
        rounds, anchor, outer = self._started().snapshot()
        return StateSnapshot(self.ctx.train_stats.step, rounds,
                             self.ctx.trainer.state.outer.name, anchor, outer)

    def info_fields(self) -> dict[str, Any]:
        fields = self._started().info_fields()
        fields["fragment_syncs"] = [pb.FragmentSync(**f) for f in fields["fragment_syncs"]]
        return fields

    def fragment_stats(self) -> Sequence[FragmentStats]:
        return self.rounds.stats if self.rounds is not None else ()

    def progress(self) -> str:
        return self._started().progress_text()

    async def stop(self) -> None:
        if self.rounds is not None:
            await asyncio.to_thread(self.rounds.finish)
        if self._averaging and self.averagers is not None:
            self._averaging = False
            for averager in self.averagers:
                await asyncio.to_thread(averager.close)
