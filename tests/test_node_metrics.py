"""Prometheus metrics of a node: one registry per node, names and labels, values after real
exchanges and steps (read with ``registry.get_sample_value``), the /metrics server's life."""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import socket
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gasloc_p2p import __version__
from gasloc_p2p.node.config import ConfigError, NodeConfig
from gasloc_p2p.node.daemon import Node
from gasloc_p2p.node.discovery.base import InMemoryDiscovery, InMemoryRegistry
from gasloc_p2p.node.observability.metrics import OUTCOMES, NodeCollector, NodeMetrics
from gasloc_p2p.node.settings import build_config
from gasloc_p2p.node.stats import ExchangeStats, FragmentStats, RelayCounts, TrainStats
from gasloc_p2p.node.transport.circuits.hub import RelayHub, RelayLimits, RelayRefused
from tests.daemon_helpers import tiny_config, write_corpus
from tests.node_helpers import make_peer, run, wait_until

DOCUMENTED = {
    "gasloc_train_steps", "gasloc_tokens", "gasloc_rounds", "gasloc_train_loss",
    "gasloc_val_loss", "gasloc_tokens_per_second", "gasloc_exchanges",
    "gasloc_exchanges_by_role", "gasloc_sent_bytes", "gasloc_received_bytes",
    "gasloc_exchange_duration_seconds", "gasloc_exchange_staleness_rounds",
    "gasloc_peers_known", "gasloc_peers_reachable", "gasloc_consensus_estimate",
    "gasloc_event_loop_lag_seconds", "gasloc_threads", "gasloc_info",
    "gasloc_rollbacks", "gasloc_checkpoint_failures", "gasloc_updates_rejected",
    "gasloc_updates_clipped", "gasloc_exchanges_by_path", "gasloc_exchange_path_seconds",
    "gasloc_exchange_partners", "gasloc_relay_connections", "gasloc_relay_refused",
    "gasloc_relay_bytes", "gasloc_relay_open", "gasloc_relay_listeners", "gasloc_relays_held",
    "gasloc_uplink_full", "gasloc_uplink_slots",
}
FRAGMENT_METRICS = {
    "gasloc_fragment_syncs", "gasloc_fragment_sent_bytes", "gasloc_fragment_received_bytes",
    "gasloc_fragment_last_sync_step", "gasloc_fragment_stall_seconds",
    "gasloc_fragment_averaging_seconds", "gasloc_fragment_resyncs",
}


def collector_registry(stats: ExchangeStats, train: TrainStats | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    info = {"version": "v", "run_id": "r", "codec": "int8", "algorithm": "gasloc"}
    registry.register(NodeCollector(train or TrainStats(), stats, lambda: None, info,
                                    lambda: 0.0))
    return registry


def test_a_real_exchange_moves_the_gossip_metrics():
    async def main():
        a, b = await make_peer("a", 1), await make_peer("b", 2)
        try:
            frag = a.engine.fragments[0]
            pa, pb = a.state.public_iterate(frag), b.state.public_iterate(frag)
            true_msd = float((pa - pb).pow(2).sum()) / frag.numel
            await a.exchange(b, fragment=0)
            await wait_until(lambda: b.exchanger.stats.ok_responder == 1, what="b's commit")
        finally:
            await a.close()
            await b.close()
        return a.exchanger.stats, b.exchanger.stats, true_msd

    sa, sb, true_msd = run(main())
    ra, rb = collector_registry(sa), collector_registry(sb)
    get_a, get_b = ra.get_sample_value, rb.get_sample_value
    assert get_a("gasloc_exchanges_total", {"outcome": "ok"}) == 1
    assert get_a("gasloc_exchanges_by_role_total", {"role": "initiator"}) == 1
    assert get_a("gasloc_exchanges_by_role_total", {"role": "responder"}) == 0
    assert get_b("gasloc_exchanges_by_role_total", {"role": "responder"}) == 1
    for outcome in OUTCOMES[1:]:
        assert get_a("gasloc_exchanges_total", {"outcome": outcome}) == 0
    sent = get_a("gasloc_sent_bytes_total", {"codec": "int8"})
    assert sent and sent == get_b("gasloc_received_bytes_total", {"codec": "int8"})
    assert sent == sa.bytes_sent  # the per-codec split adds up to the total
    for get in (get_a, get_b):
        assert get("gasloc_exchange_duration_seconds_count") == 1
        assert 0 < get("gasloc_exchange_duration_seconds_sum") < 30
        assert get("gasloc_exchange_duration_seconds_bucket", {"le": "+Inf"}) == 1
        assert get("gasloc_exchange_staleness_rounds_bucket", {"le": "0.0"}) == 1
        assert get("gasloc_exchange_staleness_rounds_sum") == 0
        # int8 references track the public iterates closely: the estimate is the true MSD
        assert get("gasloc_consensus_estimate") == pytest.approx(true_msd, rel=0.05)


def test_training_values_and_unknown_gauges_are_left_out():
    train = TrainStats(step=40, rounds=2, tokens=5120, tokens_per_s=900.0, train_loss=2.5)
    registry = collector_registry(ExchangeStats(), train)
    get = registry.get_sample_value
    assert get("gasloc_train_steps_total") == 40 and get("gasloc_rounds_total") == 2
    assert get("gasloc_tokens_total") == 5120 and get("gasloc_tokens_per_second") == 900
    assert get("gasloc_train_loss") == 2.5
    assert get("gasloc_val_loss") is None  # NaN until the first validation: not exported
    assert get("gasloc_consensus_estimate") is None  # no commit yet
    train.val_loss = 3.0  # read at scrape time
    assert get("gasloc_val_loss") == 3.0


def test_fragment_series_are_read_at_scrape_time_and_absent_without_fragments():
    fragments: list[FragmentStats] = []
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(TrainStats(), ExchangeStats(), lambda: None, {"a": "b"},
                                    lambda: 0.0, lambda: fragments))
    get = registry.get_sample_value
    assert not FRAGMENT_METRICS & {m.name for m in registry.collect()}  # not streaming
    fragments += [FragmentStats(0, 10, ok=3, failed=1, solo=2, last_start_step=20,
                                wait_s=0.5, averaging_s=2.0, resyncs=1, bytes_sent=700,
                                bytes_received=650), FragmentStats(5, 10, ok=4)]
    assert {m.name for m in registry.collect()} >= FRAGMENT_METRICS
    syncs = {(f, o): get("gasloc_fragment_syncs_total", {"fragment": f, "outcome": o})
             for f in "01" for o in ("ok", "failed", "solo")}
    assert syncs == {("0", "ok"): 3, ("0", "failed"): 1, ("0", "solo"): 2, ("1", "ok"): 4,
                     ("1", "failed"): 0, ("1", "solo"): 0}
    zero = {"fragment": "0"}
    assert get("gasloc_fragment_sent_bytes_total", zero) == 700
    assert get("gasloc_fragment_received_bytes_total", zero) == 650
    assert get("gasloc_fragment_last_sync_step", zero) == 20
    assert get("gasloc_fragment_stall_seconds_total", zero) == 0.5
    assert get("gasloc_fragment_averaging_seconds_total", zero) == 2.0
    assert get("gasloc_fragment_resyncs_total", zero) == 1
    fragments[1].ok += 1  # a live object: the next scrape sees it
    assert get("gasloc_fragment_syncs_total", {"fragment": "1", "outcome": "ok"}) == 5
    root = Path(__file__).resolve().parent.parent
    for doc in (root / "docs/observability.md",):
        text = doc.read_text()
        for family in registry.collect():
            if family.name in FRAGMENT_METRICS:  # the sample names users query
                assert family.samples[0].name in text, (doc.name, family.samples[0].name)


def test_relay_series_are_read_at_scrape_time_from_a_real_hub():
    hub = RelayHub(RelayLimits())
    held = [0]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(
        TrainStats(), ExchangeStats(), lambda: None, {"a": "b"}, lambda: 0.0, tuple,
        lambda: RelayCounts(hub.stats.relayed, hub.stats.refused, hub.stats.bytes, hub.open,
                            hub.listeners, held[0])))
    get = registry.get_sample_value

    async def run() -> None:
        with pytest.raises(RelayRefused):
            await hub.call("B", _no_bytes, _drop)
        async with hub.listening("B") as tokens:
            assert get("gasloc_relay_listeners") == 1
            call = asyncio.ensure_future(hub.call("B", _once(b"ping"), _drop))
            token = await asyncio.wait_for(tokens.get(), 5)
            assert get("gasloc_relay_open") == 1
            await hub.accept(token, _once(b"pong!"), _drop)
            await asyncio.wait_for(call, 5)

    asyncio.run(run())
    held[0] = 2
    assert (get("gasloc_relay_connections_total"), get("gasloc_relay_refused_total"),
            get("gasloc_relay_bytes_total"), get("gasloc_relay_open"),
            get("gasloc_relay_listeners"), get("gasloc_relays_held")) == (1, 1, 9, 0, 0, 2)


async def _no_bytes() -> bytes:
    return b""


def _once(data: bytes) -> Callable[[], Awaitable[bytes]]:
    chunks = [data, b""]

    async def read() -> bytes:
        return chunks.pop(0) if chunks else b""
    return read


async def _drop(data: bytes) -> None:
    pass


def test_every_documented_family_is_in_the_observability_table():
    text = (Path(__file__).resolve().parent.parent / "docs/observability.md").read_text()
    missing = [name for name in sorted(DOCUMENTED) if f"`{name}" not in text]
    assert not missing, missing


def test_failures_have_their_own_outcomes():
    stats = ExchangeStats(ok_initiator=3, ok_responder=2, applied=4, failed=4, busy=1,
                          rejected_inbound=5)
    stats.record_commit(0.2, 0.0, 0.0, 100)  # a weight-0 commit tells nothing
    stats.staleness.update({0: 2, 3: 1, 40: 1})
    get = collector_registry(stats).get_sample_value
    expected = {"ok": 4, "failed": 4, "busy": 1, "rejected": 5}
    for outcome, n in expected.items():
        assert get("gasloc_exchanges_total", {"outcome": outcome}) == n
    assert get("gasloc_exchange_staleness_rounds_bucket", {"le": "3.0"}) == 3
    assert get("gasloc_exchange_staleness_rounds_bucket", {"le": "+Inf"}) == 4
    assert get("gasloc_exchange_staleness_rounds_sum") == 43
    assert get("gasloc_consensus_estimate") is None  # w = 0 tells nothing


def test_names_labels_and_process_metrics_of_a_node_registry():
    metrics = NodeMetrics(NodeConfig(), TrainStats(val_loss=4.0, train_loss=4.1), ExchangeStats(),
                          lambda: None)
    families = {m.name: m for m in metrics.registry.collect()}
    gasloc = {name for name in families if name.startswith("gasloc_")}
    assert gasloc == DOCUMENTED - {"gasloc_consensus_estimate"}  # absent before a commit
    assert "process_resident_memory_bytes" in families and "process_cpu_seconds" in families
    for m in families.values():
        for s in m.samples:
            assert not {"peer", "peer_id", "endpoint"} & s.labels.keys(), s
    get = metrics.registry.get_sample_value
    assert get("gasloc_info", {"version": __version__, "run_id": "gasloc", "codec": "int8",
                               "algorithm": "gasloc"}) == 1
    assert get("gasloc_threads") >= 1 and get("process_resident_memory_bytes") > 1e6


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_two_nodes_in_one_process_serve_their_own_registries():
    def cfg(**kw: object) -> NodeConfig:
        return build_config(argparse.Namespace(host="127.0.0.1", **kw), environ={})

    async def main():
        ta, tb = TrainStats(step=7), TrainStats(step=11)
        a = NodeMetrics(cfg(run_id="ra"), ta, ExchangeStats(), lambda: None)
        b = NodeMetrics(cfg(run_id="rb"), tb, ExchangeStats(), lambda: None)
        off = NodeMetrics(cfg(metrics_port=-1), TrainStats(), ExchangeStats(), lambda: None)
        for m in (a, b, off):
            await m.start()
        try:
            assert a.port != b.port and a.port > 0 and not off.url
            got_a = await asyncio.to_thread(_scrape, a.url)
            got_b = await asyncio.to_thread(_scrape, b.url)
            assert got_a["gasloc_train_steps_total[]"] == 7
            assert got_b["gasloc_train_steps_total[]"] == 11
            assert any("('run_id', 'rb')" in k for k in got_b if k.startswith("gasloc_info"))
            await asyncio.sleep(1.2)  # two loop-lag samples
            assert 0 <= a.loop_lag_s < 1
        finally:
            for m in (a, b, off):
                await m.stop()
        await a.stop()  # twice is harmless
        with socket.socket() as s:  # the port is released (TIME_WAIT left by the scrape is ok)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", a.port))
            s.listen()

    run(main())


def test_metrics_config_flags_and_environment():
    assert build_config(environ={"GASLOC_METRICS_PORT": "9400"}).metrics.metrics_port == 9400
    for bad in ({"GASLOC_METRICS_PORT": "-2"}, {"GASLOC_METRICS_PORT": "70000"},
                {"GASLOC_METRICS_HOST": "a b"}, {"GASLOC_METRICS_PORT": "5000",
                                                  "GASLOC_PORT": "5000"}):
        with pytest.raises(ConfigError, match="metrics"):
            build_config(environ=bad)


def test_a_training_node_exposes_steps_and_a_busy_port_is_an_actionable_error(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")

    async def main():
        reg = InMemoryRegistry()
        node = Node(tiny_config(corpus), InMemoryDiscovery(reg, "gasloc", "solo"))
        async with node:
            assert node.metrics.url.startswith("http://127.0.0.1:")
            await wait_until(lambda: node.train_stats.step >= 5, timeout_s=60, what="steps")
            got = await asyncio.to_thread(_scrape, node.metrics.url)
            assert got["gasloc_train_steps_total[]"] >= 5
            assert not math.isnan(got["gasloc_val_loss[]"])  # validated before the first step
            taken = Node(tiny_config(corpus, metrics_port=node.metrics.port),
                         InMemoryDiscovery(reg, "gasloc", "other"))
            with pytest.raises(OSError, match="--metrics-port"):
                await taken.start()
            assert taken.trainer is None  # failed before anything else started

    run(main(), timeout_s=90)


def test_every_metric_the_grafana_dashboard_uses_is_served():
    board = Path(__file__).resolve().parent.parent / "docker/grafana/dashboards/gasloc.json"
    if not board.exists():
        pytest.skip("no Grafana dashboard in docker/")
    used = set(re.findall(r"\b((?:gasloc|process)_[a-z_]+)", board.read_text()))
    stats = ExchangeStats()
    stats.record_commit(0.1, 0.5, 1.0, 10)  # so that the consensus gauge exists
    stats.add_sent("int8", 5)
    stats.add_received("int8", 5)
    metrics = NodeMetrics(NodeConfig(), TrainStats(val_loss=4.0, train_loss=4.1), stats,
                          lambda: None)
    served = {s.name for m in metrics.registry.collect() for s in m.samples}
    assert used and used <= served, sorted(used - served)


def test_info_names_the_algorithm():
    cfg = build_config(environ={"GASLOC_ALGORITHM": "diloco", "GASLOC_RUN_ID": "d"})
    metrics = NodeMetrics(cfg, TrainStats(), ExchangeStats(), lambda: None)
    labels = {"version": __version__, "run_id": "d", "codec": "int8", "algorithm": "diloco"}
    assert metrics.registry.get_sample_value("gasloc_info", labels) == 1
