"""The daemon glue of ``--algorithm streaming-diloco`` (the rounds: :mod:`.streaming`).

Averaging: one hivemind averager (one group key, sized to the largest fragment, zero-padded)
serves every fragment, so nodes out of phase still meet: a group that synced different
fragments counts as failed and realigns its members' schedules (:meth:`StreamingRounds.land`).
A sync that starts while another is still in flight (``--tau`` longer than the gap between two
sync starts) waits for it before its own all-reduce. (Per-fragment averagers, each under its own
key, would run such syncs at once, but nodes out of phase rarely meet; observed on a
loaded machine: most syncs failed.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.core.flat import layer_fragments
from gasloc_p2p.model import layer_index
from gasloc_p2p.node.config import NodeConfig
from gasloc_p2p.node.modes.averaging import Averager, HivemindAverager, averaging_prefix
from gasloc_p2p.node.modes.base import Mode, ModeContext
from gasloc_p2p.node.modes.diloco import state_fetcher
from gasloc_p2p.node.modes.streaming import StreamingRounds
from gasloc_p2p.node.runtime.stats import FragmentStats
from gasloc_p2p.node.transport.service import StateSnapshot, download_state
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb

log = logging.getLogger(__name__)


class StreamingMode(Mode):
    """Streaming DiLoCo: staggered per-fragment all-reduces overlapped with training; no gossip
    machinery (inbound Exchange streams are answered BUSY). Start it before the trainer thread
    and any gRPC channel exist: the hivemind averagers fork."""

    name = "streaming-diloco"

    def __init__(self, averagers: Sequence[Averager] | None = None) -> None:
        """``averagers``: one per fragment; default hivemind's on the discovery's DHT."""
        self.averagers = list(averagers) if averagers is not None else None
        self.rounds: StreamingRounds | None = None
        self.ctx: ModeContext | None = None
        self._averaging = False

    @staticmethod
    def outer_config(cfg: NodeConfig) -> AsyncConfig:
        return cfg.diloco.async_config()  # "local": memory starts at zero, holds the buffers

    async def start(self, ctx: ModeContext) -> None:
        cfg, trainer = ctx.cfg, ctx.trainer
        self.ctx = ctx
        fragments = layer_fragments(trainer.flat.spans, layer_index, cfg.gossip.fragments,
                                    "strided")  # the simulator's split
        if self.averagers is None:
            dht = ctx.discovery.averaging_backend()
            if dht is None:
                raise RuntimeError("--algorithm streaming-diloco needs the hivemind DHT discovery")
            self.averagers = [HivemindAverager(
                dht, max(f.numel for f in fragments), averaging_prefix(
                    cfg.discovery.run_id, trainer.fingerprint, cfg.diloco.diloco_codec,
                    f"stream{len(fragments)}"), cfg.diloco)]
        self._averaging = True  # close even half-started averagers (close is safe twice)
        for averager in self.averagers:
            await asyncio.to_thread(averager.start)

        async def download(peer_endpoint: str) -> Any:
            return await download_state(ctx.channels.stub(peer_endpoint), ctx.me,
                                        cfg.gossip.download_timeout_s)

        self.rounds = StreamingRounds(
            trainer.state, fragments, cfg.train.inner_steps, ctx.lock, self.averagers,
            cfg.diloco, ctx.train_stats, ctx.stop, lambda: len(ctx.peers()), ctx.endpoint,
            state_fetcher(asyncio.get_running_loop(), download, ctx.stop))
        trainer.round_end_every_step = True  # the schedule decides what each step does
        log.info("streaming-diloco mode: %d fragments at offsets %s of every %d steps, tau %d, "
                 "merge alpha %g, %s payload, %d averager(s), outer Nesterov eta %g gamma %g",
                 len(fragments),
                 [self.rounds.schedule.offset(f) for f in range(len(fragments))],
                 cfg.train.inner_steps, cfg.diloco.tau, cfg.diloco.merge_alpha,
                 cfg.diloco.diloco_codec, len(self.averagers), cfg.diloco.diloco_eta,
                 cfg.diloco.diloco_gamma)

    def _started(self) -> StreamingRounds:
        assert self.rounds is not None, "start the mode first"
        return self.rounds

    def round_end(self) -> None:
        """Called after every inner step (``Trainer.round_end_every_step``)."""
        self._started().after_step()

    def adopted(self, meta: pb.StateMeta) -> None:
        self._started().set_epoch(int(meta.rounds))

    def snapshot(self) -> StateSnapshot:
        """The anchor (every fragment's global copy) and the Nesterov buffers."""
        assert self.ctx is not None
        rounds, anchor, buf = self._started().snapshot()
        return StateSnapshot(self.ctx.train_stats.step, rounds, self.name, anchor, buf)

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
