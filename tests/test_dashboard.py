"""The dashboard page, rendered for real: a live 2-node swarm, a live Prometheus, the page
served by the project and opened in headless Chromium; the charts must have data points.

The screenshot is saved in the test's tmp dir; with ``GASLOC_UPDATE_SCREENSHOT=1`` it is also
copied to ``docs/dashboard.png`` (the README's picture). Skipped without Chromium or Prometheus
(CI installs both: apt-get install -y prometheus chromium).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gasloc_p2p.tools.dashboard import DashboardServer
from gasloc_p2p.tools.dashboard_page import PANELS, START_QUERY, render_page
from gasloc_p2p.tools.prometheus import INSTALL_HINT, find_prometheus, query, query_range
from tests.browser_helpers import CHROMIUM, chromium, live_panels
from tests.node_helpers import scaled
from tests.swarm_helpers import live_swarm, wait_for

ROOT = Path(__file__).resolve().parent.parent
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install -y chromium")
@pytest.mark.skipif(find_prometheus() is None, reason=f"no 'prometheus' binary: {INSTALL_HINT}")
def test_dashboard_shows_a_live_swarm_in_chromium(tmp_path):
    swarm_started = time.time()
    with live_swarm(tmp_path, nodes=2, dashboard=True) as swarm:
        assert swarm.prometheus is not None and swarm.dashboard is not None
        prom = swarm.prometheus.url

        def enough_history() -> bool:
            series = query_range(prom, "gasloc_val_loss", *window(prom), 1)
            rates = query_range(prom, 'sum(rate(gasloc_exchanges_total{outcome="ok"}[30s]))',
                                *window(prom), 1)
            return (len(series) == 2 and all(len(s["values"]) >= 4 for s in series)
                    and bool(rates) and any(float(v) > 0 for _, v in rates[0]["values"]))

        wait_for(enough_history, 60, "val loss history and exchanges in Prometheus")
        # the page's "since start" window: the oldest node's start, from Prometheus itself
        started = float(query(prom, START_QUERY)[0]["value"][1])
        assert swarm_started - 5 <= started <= time.time(), (swarm_started, started)
        page = swarm.dashboard.url + "?range=300&refresh=60"
        _, panels = live_panels(swarm.dashboard.url, tmp_path / "profile-dom", scaled(90))
        exchanges = panels["sum by (outcome) (rate(gasloc_exchanges_total[30s]))"]
        assert exchanges["panel"]["data-state"] == "ok" and exchanges["lines"].get("ok", 0) > 0

        shot = tmp_path / "dashboard.png"
        result = chromium([f"--screenshot={shot}", page], tmp_path / "profile-shot", scaled(90))
        assert shot.exists(), result.stderr[-2000:]
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # charts, not a blank
        if os.environ.get("GASLOC_UPDATE_SCREENSHOT"):
            shutil.copy(shot, ROOT / "docs" / "dashboard.png")


def window(prom: str) -> tuple[float, float]:
    """The last 5 minutes on Prometheus' clock."""
    end = float(query(prom, "vector(time())")[0]["value"][0])
    return end - 300, end


def test_page_is_self_contained_and_lists_every_panel():
    page = render_page("t")
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    for _, promql, _, _ in PANELS:
        assert json.dumps(promql) in page


def test_server_proxies_only_the_query_api_and_reports_a_dead_prometheus():
    with DashboardServer("http://127.0.0.1:9", port=0) as board:  # port 9: nothing listens
        with urllib.request.urlopen(board.url, timeout=5) as reply:
            assert reply.status == 200 and b"gasloc swarm" in reply.read()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(board.url + "api/v1/query?query=up", timeout=20)
        assert err.value.code == 502
        assert json.load(err.value)["status"] == "error"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(board.url + "api/v1/admin/tsdb/delete_series", timeout=5)
        assert err.value.code == 404
        port = board.port
    board.stop()  # twice is harmless
    with DashboardServer("http://127.0.0.1:9", port=port):  # the port was released
        pass
