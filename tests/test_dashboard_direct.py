"""The dashboard without Prometheus: the swarm's own scraper answers the page's queries.

Unit checks of the arithmetic (rates, counter resets, histogram quantiles against the values
Prometheus computes for the same buckets), a scrape of a real HTTP /metrics endpoint, and the
page in headless Chromium against a live 2-node swarm with no Prometheus at all.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from gasloc_p2p.tools.dashboard import DashboardServer
from gasloc_p2p.tools.dashboard_page import PANELS, RECIPES, START_QUERY
from gasloc_p2p.tools.direct_metrics import DirectMetrics, Recipe, Scrape, histogram_quantile
from tests.browser_helpers import CHROMIUM, chromium, live_panels
from tests.node_helpers import scaled
from tests.swarm_helpers import live_swarm, wait_for


def test_every_panel_has_a_direct_recipe():
    assert set(RECIPES) == {query for _, query, _, _ in PANELS}


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.5 + 0.5 * (38 - 30) / 10)
    overflow = [(0.1, 0.0), (0.5, 0.0), (math.inf, 5.0)]
    assert histogram_quantile(0.5, overflow) == 0.5  # the highest finite bound
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))


def history(*scrapes: tuple[float, dict]) -> DirectMetrics:
    direct = DirectMetrics([])
    for at, values in scrapes:
        direct.history.append(Scrape(at, values))
    return direct


def key(name: str, **labels: str):
    return name, tuple(sorted(labels.items()))


def test_rates_are_summed_by_label_and_survive_a_counter_reset():
    c = "gasloc_exchanges_total"
    direct = history(
        (100.0, {key(c, node="a", outcome="ok"): 10, key(c, node="b", outcome="ok"): 0}),
        (110.0, {key(c, node="a", outcome="ok"): 30, key(c, node="b", outcome="ok"): 10}),
        (120.0, {key(c, node="a", outcome="ok"): 5, key(c, node="b", outcome="ok"): 20}))
    series = direct.query_range(Recipe("rate", c, by="outcome", window_s=10.5), 0, 1e9)
    assert series == [{"metric": {"outcome": "ok"},
                       "values": [[110.0, repr(3.0)], [120.0, repr(1.5)]]}]  # reset: a +5
    by_node = direct.query_range(Recipe("rate", c, by="node", window_s=30), 105, 125)
    assert [s["metric"]["node"] for s in by_node] == ["a", "b"]
    assert by_node[0]["values"][-1] == [120.0, repr((5 + 20) / 20)]  # first in window: t=100


def test_scrapes_a_real_metrics_endpoint():
    registry = CollectorRegistry()
    loss = Gauge("gasloc_val_loss", "loss", registry=registry)
    sent = Counter("gasloc_sent_bytes", "bytes", ["codec"], registry=registry)
    loss.set(2.5)
    sent.labels("int8").inc(1000)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        direct = DirectMetrics([("n0", url), ("dead", "http://127.0.0.1:9/metrics")])
        direct.scrape_once()
        sent.labels("int8").inc(500)
        direct.history[-1].at -= 5.0  # as if the first scrape were 5 s ago
        direct.scrape_once()
        gauge = direct.query_range(RECIPES["gasloc_val_loss"], 0, 1e12)
        assert gauge == [{"metric": {"node": "n0"}, "values": [
            [direct.history[0].at, repr(2.5)], [direct.history[1].at, repr(2.5)]]}]
        rate = direct.query_range(Recipe("rate", "gasloc_sent_bytes_total", "node"), 0, 1e12)
        value = float(rate[0]["values"][0][1])
        assert value == pytest.approx(500 / 5.0, rel=0.05)
        up = {s["metric"]["node"]: s["value"][1] for s in direct.instant_up()}
        assert up == {"n0": "1", "dead": "0"}
        with DashboardServer(direct=direct) as board:
            q = urllib.parse.urlencode({"query": "gasloc_val_loss", "start": 0, "end": 1e12,
                                        "step": 1})
            with urllib.request.urlopen(f"{board.url}api/v1/query_range?{q}", timeout=5) as r:
                body = json.load(r)
            assert body["status"] == "success" and body["data"]["result"] == gauge
            with pytest.raises(urllib.error.HTTPError) as err:  # not a panel's query
                urllib.request.urlopen(f"{board.url}api/v1/query?query=up%5B5m%5D", timeout=5)
            assert err.value.code == 400 and "no Prometheus" in json.load(err.value)["error"]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install -y chromium")
@pytest.mark.long  # test_dashboard.py shows the same page from Prometheus in the suite
def test_dashboard_without_prometheus_shows_a_live_swarm_in_chromium(tmp_path):
    with live_swarm(tmp_path, nodes=2, dashboard=True, prometheus=False) as swarm:
        assert swarm.prometheus is None and swarm.dashboard is not None
        assert swarm.direct is not None
        loss = RECIPES["gasloc_val_loss"]
        sent = RECIPES["sum by (node) (rate(gasloc_sent_bytes_total[30s]))"]

        def enough_history() -> bool:
            series = swarm.direct.query_range(loss, 0, 1e12)  # type: ignore[union-attr]
            rates = swarm.direct.query_range(sent, 0, 1e12)  # type: ignore[union-attr]
            return (len(series) == 2 and all(len(s["values"]) >= 4 for s in series)
                    and len(rates) == 2 and all(len(s["values"]) >= 4 for s in rates))

        wait_for(enough_history, 90, "val loss history and gossip traffic from the scraper")
        dom, _ = live_panels(swarm.dashboard.url, tmp_path / "profile", scaled(90))
        assert 'data-up="2"' in dom  # the status line: 2/2 nodes up


def young_swarm(age_s: float, scrapes: int = 25) -> DirectMetrics:
    """Scrapes of a 2-node swarm whose older node started ``age_s`` ago (the last 100 s)."""
    now = time.time()
    direct = DirectMetrics([])
    for k in range(scrapes):
        direct.history.append(Scrape(now - 100 + 100 * k / (scrapes - 1), {
            ("gasloc_val_loss", (("node", "n0"),)): 5.0 - 0.1 * k,
            ("process_start_time_seconds", (("node", "n0"),)): now - age_s,
            ("process_start_time_seconds", (("node", "n1"),)): now - age_s / 2}))
    return direct


def test_the_start_query_answers_the_oldest_nodes_start():
    direct = young_swarm(120.0)
    start = direct.history[-1].values[("process_start_time_seconds", (("node", "n0"),))]
    with DashboardServer(direct=direct) as board:
        q = urllib.parse.urlencode({"query": START_QUERY})
        with urllib.request.urlopen(f"{board.url}api/v1/query?{q}", timeout=5) as r:
            body = json.load(r)
    assert body["status"] == "success"
    assert float(body["data"]["result"][0]["value"][1]) == start
    assert DirectMetrics([]).instant_start() == []  # before the first scrape: no answer


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install -y chromium")
def test_the_page_opens_on_the_swarm_since_it_started(tmp_path):
    """A swarm 2 minutes old fills the charts: the window starts when its oldest node started
    (plus a margin), not 15 minutes back with the curves squeezed into the right edge."""
    with DashboardServer(direct=young_swarm(120.0)) as board:
        dom = chromium(["--dump-dom", board.url + "?refresh=60"], tmp_path / "profile",
                       scaled(90)).stdout
    body = re.search(r"<body[^>]*>", dom)
    assert body is not None, dom[-2000:]
    range_s = re.search(r'data-range="([\d.]+)"', body.group(0))
    assert range_s is not None and 120 <= float(range_s.group(1)) <= 135, body.group(0)
    loss = re.search(r'<path d="M([\d.]+),[^"]*"[^>]*data-label="n0"', dom)
    assert loss is not None, dom[-3000:]
    assert float(loss.group(1)) < 300  # the first sample (100 s ago) in the left half of 600
    selected = re.findall(r'<button data-range="(\w+)" class="on">', dom)
    assert selected == ["start"], selected  # the "since start" button is the one selected
