"""Prometheus metrics of one node: its own registry, read at scrape time, served on /metrics.

Every :class:`NodeMetrics` has its own ``CollectorRegistry`` (never the global one), so several
nodes in one process coexist. Nothing on the training or exchange path touches Prometheus: the
trainer and the exchanger update plain counters (:mod:`gasloc_p2p.node.stats`) and
:class:`NodeCollector` turns them into metric families when Prometheus scrapes.

The names below are an interface (``docker/grafana/dashboards/gasloc.json``, the project's own
dashboard and ``gasloc-node swarm`` use them); label sets are closed and carry no peer ids.

=====================================  =========  ================================================
name                                   type       meaning
=====================================  =========  ================================================
gasloc_train_steps_total               counter    inner optimizer steps (restored on resume)
gasloc_tokens_total                    counter    training tokens consumed
gasloc_rounds_total                    counter    round ends (outer updates)
gasloc_train_loss                      gauge      loss of the last inner step
gasloc_val_loss                        gauge      last validation loss (fixed held-out batches)
gasloc_tokens_per_second               gauge      training throughput (EMA over steps)
gasloc_rollbacks_total                 counter    non-finite losses rolled back to a good anchor
gasloc_checkpoint_failures_total       counter    checkpoints that could not be written
gasloc_exchanges_total{outcome}        counter    gossip exchanges by outcome, see OUTCOMES
gasloc_exchanges_by_role_total{role}   counter    committed exchanges, role initiator|responder
gasloc_exchanges_by_path_total{path}   counter    initiated commits by path, see PATHS
gasloc_exchange_path_seconds_total     counter    their wall time, summed, by path
gasloc_exchange_partners               gauge      distinct peers committed with (either role)
gasloc_relay_connections_total         counter    connections this node relayed for peers behind
                                                  routers (as a relay)
gasloc_relay_refused_total             counter    relayed connections it refused (its limits)
gasloc_relay_bytes_total               counter    bytes it relayed, both directions
gasloc_relay_open                      gauge      relayed connections it holds now
gasloc_relay_listeners                 gauge      peers behind routers listening at it now
gasloc_relays_held                     gauge      relays this node listens at (behind a router)
gasloc_updates_rejected_total          counter    exchanges aborted: implausibly large update
gasloc_updates_clipped_total           counter    exchanges committed with a clipped weight
gasloc_compute_utilization             gauge      estimated compute / (compute + exchange work),
                                                  EMA over windows of a round (stats.Utilization)
gasloc_sent_bytes_total{codec}         counter    payload bytes sent (Chunk data), by codec
gasloc_received_bytes_total{codec}     counter    payload bytes received, by codec
gasloc_exchange_duration_seconds       histogram  wall time of committed exchanges, both roles
gasloc_exchange_staleness_rounds       histogram  round ends (both sides) a commit spanned
gasloc_peers_known                     gauge      compatible peers listed by discovery
gasloc_peers_reachable                 gauge      of those: dialable and not in backoff
gasloc_consensus_estimate              gauge      EMA of ||p_i - p_j||^2 / fragment numel
gasloc_event_loop_lag_seconds          gauge      last overshoot of a 0.5 s sleep on the loop
gasloc_threads                         gauge      OS threads of the process
gasloc_info{version,run_id,codec,      gauge      always 1; the labels describe the node
algorithm}
gasloc_fragment_syncs_total            counter    DiLoCo-mode syncs of each fragment by
{fragment,outcome}                                outcome ok | failed | solo (no group possible)
gasloc_fragment_sent_bytes_total       counter    encoded all-reduce payload bytes this node sent
{fragment}                                        for the fragment (inputs and averaged parts)
gasloc_fragment_received_bytes_total   counter    ... and received
{fragment}
gasloc_fragment_last_sync_step         gauge      schedule step at which the fragment's last sync
{fragment}                                        started (its offset modulo H)
gasloc_fragment_stall_seconds_total    counter    training waited on the fragment's result at
{fragment}                                        merge (what the tau-step overlap did not hide)
gasloc_fragment_averaging_seconds_     counter    wall time of the fragment's syncs, start to
total{fragment}                                   result (overlapped with training)
gasloc_fragment_resyncs_total          counter    fragment state adopted from a groupmate after
{fragment}                                        it fell off the group's history
process_*                              various    prometheus_client's ProcessCollector (RSS,
                                                  CPU seconds, open fds, start time)
=====================================  =========  ================================================

``gasloc_consensus_estimate``: at each commit the correction is ``c = w (D(m_j) - D(m_i))``
over the exchanged fragment, and the two messages are the two public iterates, quantized, so
``(||c|| / w)^2 / numel`` estimates the mean squared per-parameter distance between this node
and the peer; the gauge is an EMA (weight 0.8 on the previous value) over commits, absent
before the first. Gauges whose value is not known yet (losses before the first step or
validation) are left out of the scrape rather than exported as NaN.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gasloc_p2p import __version__
from gasloc_p2p.node.stats import (
    Buckets,
    ExchangeStats,
    FragmentStats,
    RelayCounts,
    TrainStats,
)

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from gasloc_p2p.node.config import NodeConfig

log = logging.getLogger(__name__)

# gasloc_exchanges_total{outcome}: a closed set, one event each.
OUTCOMES = (
    "ok",             # committed and applied (either role)
    "failed",         # error, timeout or abort before commit (either role): nothing applied
    "busy",           # our attempt was answered BUSY by the peer (another peer is tried)
    "rejected",       # an inbound exchange we refused (at the limit, or incompatible)
)
ROLES = ("initiator", "responder")
PATHS = ("direct", "holepunched", "relayed")
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
LOOP_LAG_PERIOD_S = 0.5
#: (compatible peers known, those dialable now), None before the node knows any
PeerCounts = Callable[[], "tuple[int, int] | None"]
#: the mode's per-fragment sync counters (empty but in streaming-diloco mode)
FragmentSource = Callable[[], Sequence[FragmentStats]]
FRAGMENT_OUTCOMES = ("ok", "failed", "solo")
#: the node's relaying now (a relay's hub and the Listen calls it holds behind a router)
RelaySource = Callable[[], RelayCounts]


def os_threads() -> int:
    """OS threads of this process (torch, gRPC and Python threads); Python's count if no /proc."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _histogram(name: str, doc: str, bounds: tuple[float, ...], counts: list[int],
               total: float) -> HistogramMetricFamily:
    """A histogram family from per-bucket (not cumulative) counts, the last one being +Inf."""
    cumulative, running = [], 0
    for bound, count in zip((*bounds, math.inf), counts, strict=True):
        running += count
        cumulative.append(("+Inf" if math.isinf(bound) else repr(float(bound)), running))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)


class NodeCollector(Collector):
    """Reads a node's stats at scrape time (from the HTTP server's thread).

    The stats are written by the trainer thread and the event loop; each field has one writer,
    and the counters are copied (one C-level call under the GIL) before iterating.
    """

    def __init__(self, train: TrainStats, exchange: ExchangeStats, peers: PeerCounts,
                 info: Mapping[str, str], loop_lag_s: Callable[[], float],
                 fragments: FragmentSource = tuple, relay: RelaySource = RelayCounts) -> None:
        self.train = train
        self.exchange = exchange
        self.peers = peers
        self.info = dict(info)
        self.loop_lag_s = loop_lag_s
        self.fragments = fragments
        self.relay = relay

    def collect(self) -> Iterator[Metric]:
        yield from self._training()
        yield from self._gossip()
        yield from self._fragments(list(self.fragments()))
        yield from self._relaying(self.relay())
        yield from self._system()

    @staticmethod
    def _fragments(stats: list[FragmentStats]) -> Iterator[Metric]:
        """The ``gasloc_fragment_*`` families (none outside streaming-diloco mode)."""
        if not stats:
            return
        syncs = CounterMetricFamily("gasloc_fragment_syncs", "Streaming-diloco syncs of each "
                                    "fragment by outcome.", labels=["fragment", "outcome"])
        for f, s in enumerate(stats):
            for outcome, n in zip(FRAGMENT_OUTCOMES, (s.ok, s.failed, s.solo), strict=True):
                syncs.add_metric([str(f), outcome], n)
        yield syncs
        per_fragment: tuple[tuple[str, str, type, Callable[[FragmentStats], float]], ...] = (
            ("gasloc_fragment_sent_bytes", "Encoded all-reduce bytes sent for the fragment.",
             CounterMetricFamily, lambda s: s.bytes_sent),
            ("gasloc_fragment_received_bytes", "Encoded all-reduce bytes received for the "
             "fragment.", CounterMetricFamily, lambda s: s.bytes_received),
            ("gasloc_fragment_last_sync_step", "Schedule step of the fragment's last sync "
             "start.", GaugeMetricFamily, lambda s: s.last_start_step),
            ("gasloc_fragment_stall_seconds", "Training waited on the fragment's result at "
             "merge.", CounterMetricFamily, lambda s: s.wait_s),
            ("gasloc_fragment_averaging_seconds", "Wall time of the fragment's syncs.",
             CounterMetricFamily, lambda s: s.averaging_s),
            ("gasloc_fragment_resyncs", "Fragment state adopted from a groupmate.",
             CounterMetricFamily, lambda s: s.resyncs))
        for name, doc, kind, read in per_fragment:
            family = kind(name, doc, labels=["fragment"])
            for f, s in enumerate(stats):
                family.add_metric([str(f)], read(s))
            yield family

    @staticmethod
    def _relaying(r: RelayCounts) -> Iterator[Metric]:
        """The ``gasloc_relay*`` families (zeros on a node that relays nothing)."""
        for name, doc, n in (
                ("gasloc_relay_connections", "Connections this node relayed for peers behind "
                 "routers.", r.connections),
                ("gasloc_relay_refused", "Relayed connections refused (the relay's limits).",
                 r.refused),
                ("gasloc_relay_bytes", "Bytes relayed, both directions.", r.bytes)):
            yield CounterMetricFamily(name, doc, value=n)
        for name, doc, n in (
                ("gasloc_relay_open", "Relayed connections held now.", r.open),
                ("gasloc_relay_listeners", "Peers behind routers listening at this node now.",
                 r.listeners),
                ("gasloc_relays_held", "Relays this node listens at now (behind a router).",
                 r.held)):
            yield GaugeMetricFamily(name, doc, value=n)

    def _training(self) -> Iterator[Metric]:
        t = self.train
        yield CounterMetricFamily("gasloc_train_steps", "Inner optimizer steps.", value=t.step)
        yield CounterMetricFamily("gasloc_tokens", "Training tokens consumed.", value=t.tokens)
        yield CounterMetricFamily("gasloc_rounds", "Round ends (outer updates).", value=t.rounds)
        for name, doc, n in (
                ("gasloc_rollbacks", "Non-finite losses rolled back to the last good round end.",
                 t.rollbacks),
                ("gasloc_checkpoint_failures", "Checkpoints that could not be written.",
                 t.checkpoint_failures)):
            yield CounterMetricFamily(name, doc, value=n)
        yield GaugeMetricFamily("gasloc_tokens_per_second", "Training throughput (EMA).",
                                value=t.tokens_per_s)
        for name, doc, value in (("gasloc_train_loss", "Loss of the last inner step.",
                                  t.train_loss),
                                 ("gasloc_val_loss", "Last validation loss.", t.val_loss)):
            if math.isfinite(value):
                yield GaugeMetricFamily(name, doc, value=value)

    def _gossip(self) -> Iterator[Metric]:
        x = self.exchange
        outcomes = CounterMetricFamily("gasloc_exchanges", "Gossip exchanges by outcome.",
                                       labels=["outcome"])
        # separate monotonic fields (ok - dropped could step back between two writes)
        counts = {"ok": x.applied, "failed": x.failed, "busy": x.busy, "rejected": x.rejected_inbound}
        for outcome in OUTCOMES:
            outcomes.add_metric([outcome], counts[outcome])
        yield outcomes
        roles = CounterMetricFamily("gasloc_exchanges_by_role", "Committed exchanges by role.",
                                    labels=["role"])
        for role, n in zip(ROLES, (x.ok_initiator, x.ok_responder), strict=True):
            roles.add_metric([role], n)
        yield roles
        paths = CounterMetricFamily("gasloc_exchanges_by_path", "Committed exchanges this node "
                                    "initiated, by path: direct, holepunched or relayed (to a "
                                    "peer behind a router).", labels=["path"])
        seconds = CounterMetricFamily("gasloc_exchange_path_seconds", "Wall time of the "
                                      "exchanges this node initiated and committed, by path.",
                                      labels=["path"])
        for path in PATHS:
            paths.add_metric([path], x.by_path.get(path, 0))
            seconds.add_metric([path], x.path_seconds.get(path, 0.0))
        yield paths
        yield seconds
        full = CounterMetricFamily("gasloc_uplink_full", "Exchanges not run because this "
                                   "node's uplink carried all it could within the peers' "
                                   "deadlines: inbound ones answered BUSY, own gossip events "
                                   "skipped.", labels=["kind"])
        full.add_metric(["refused"], x.uplink_busy)
        full.add_metric(["skipped"], x.uplink_waits)
        yield full
        yield GaugeMetricFamily("gasloc_uplink_slots", "Exchanges at once this node's "
                                "measured uplink carries within the peers' deadlines (0: not "
                                "measured yet).", value=x.uplink_slots)
        yield GaugeMetricFamily("gasloc_exchange_partners", "Distinct peers this node committed "
                                "exchanges with (either role).", value=len(x.partners))
        yield CounterMetricFamily("gasloc_updates_rejected", "Exchanges aborted because the "
                                  "peer's update was implausibly large (bounded updates).",
                                  value=x.implausible)
        if math.isfinite(x.utilization):
            yield GaugeMetricFamily("gasloc_compute_utilization", "Estimated compute / (compute "
                                    "+ exchange work) of this node (EMA over windows of a "
                                    "round).", value=x.utilization)
        yield CounterMetricFamily("gasloc_updates_clipped", "Exchanges committed with a clipped "
                                  "weight: the peer was farther than the guard's soft limit "
                                  "but within its hard limit.", value=x.clipped)
        for name, doc, by_codec in (
                ("gasloc_sent_bytes", "Payload bytes sent, by codec.", x.sent_by_codec),
                ("gasloc_received_bytes", "Payload bytes received, by codec.",
                 x.received_by_codec)):
            family = CounterMetricFamily(name, doc, labels=["codec"])
            for codec, nbytes in sorted(dict(by_codec).items()):
                family.add_metric([codec], nbytes)
            yield family
        d: Buckets = x.duration_s
        yield _histogram("gasloc_exchange_duration_seconds", "Wall time of committed exchanges.",
                         d.bounds, list(d.counts), d.total)
        yield self._staleness(dict(x.staleness))
        if math.isfinite(x.consensus):
            yield GaugeMetricFamily("gasloc_consensus_estimate", "EMA of ||p_i - p_j||^2 per "
                                    "parameter, from exchange corrections.", value=x.consensus)
        known, reachable = self.peers() or (0, 0)
        yield GaugeMetricFamily("gasloc_peers_known", "Compatible peers from discovery.",
                                value=known)
        yield GaugeMetricFamily("gasloc_peers_reachable", "Dialable peers not in backoff.",
                                value=reachable)

    @staticmethod
    def _staleness(counts: dict[int, int]) -> HistogramMetricFamily:
        per_bucket = [0] * (len(STALENESS_BUCKETS) + 1)
        for staleness, n in counts.items():
            index = next((i for i, b in enumerate(STALENESS_BUCKETS) if staleness <= b),
                         len(STALENESS_BUCKETS))
            per_bucket[index] += n
        total = float(sum(k * n for k, n in counts.items()))
        return _histogram("gasloc_exchange_staleness_rounds", "Round ends spanned by commits.",
                          STALENESS_BUCKETS, per_bucket, total)

    def _system(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("gasloc_event_loop_lag_seconds", "Overshoot of a periodic "
                                f"{LOOP_LAG_PERIOD_S:g} s sleep on the event loop.",
                                value=self.loop_lag_s())
        yield GaugeMetricFamily("gasloc_threads", "OS threads of the process.",
                                value=os_threads())
        info = GaugeMetricFamily("gasloc_info", "Node description (value 1).",
                                 labels=list(self.info))
        info.add_metric(list(self.info.values()), 1)
        yield info


class NodeMetrics:
    """One node's registry and /metrics server; :meth:`start` and :meth:`stop` run on the loop.

    ``stop`` releases the port and is safe to call twice (or without ``start``).
    """

    def __init__(self, cfg: NodeConfig, train: TrainStats, exchange: ExchangeStats,
                 peers: PeerCounts, fragments: FragmentSource = tuple,
                 relay: RelaySource = RelayCounts) -> None:
        """``fragments``: the mode's per-fragment sync counters, ``relay`` the node's relaying,
        both read at scrape time."""
        m = cfg.metrics
        self.port_wanted = m.metrics_port
        self.host = m.metrics_host or cfg.network.host
        self.loop_lag_s = 0.0
        self.registry = CollectorRegistry(auto_describe=False)
        info = {"version": __version__, "run_id": cfg.discovery.run_id,
                "codec": cfg.gossip.codec, "algorithm": cfg.outer.algorithm}
        self.registry.register(NodeCollector(train, exchange, peers, info,
                                             lambda: self.loop_lag_s, fragments, relay))
        ProcessCollector(registry=self.registry)
        self.port = 0
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._lag_task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.port_wanted >= 0

    @property
    def url(self) -> str:
        """``http://host:port/metrics`` once serving (wildcard hosts shown as 127.0.0.1)."""
        if self._server is None:
            return ""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        host = "[::1]" if host == "::" else f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    async def start(self) -> None:
        """Serve /metrics (unless disabled) and start measuring the loop lag; OSError if the
        port is taken (nothing is left running then)."""
        if self.enabled:
            try:
                self._server, self._thread = start_http_server(self.port_wanted, self.host,
                                                               self.registry)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot serve /metrics on {self.host}:"
                              f"{self.port_wanted} ({exc.strerror}); choose another "
                              "--metrics-port, 0 for any free port, or -1 for none") from None
            self.port = int(self._server.server_address[1])
            log.info("metrics on %s", self.url)
        self._lag_task = asyncio.create_task(self._watch_loop_lag(), name="metrics-loop-lag")

    async def stop(self) -> None:
        task, self._lag_task = self._lag_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is not None:
            await asyncio.to_thread(_close_server, server, thread)

    async def _watch_loop_lag(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(LOOP_LAG_PERIOD_S)
            self.loop_lag_s = max(0.0, loop.time() - t0 - LOOP_LAG_PERIOD_S)


def _close_server(server: WSGIServer, thread: threading.Thread | None) -> None:
    server.shutdown()  # returns once serve_forever has exited (within its 0.5 s poll)
    server.server_close()
    if thread is not None:
        thread.join(timeout=5)
