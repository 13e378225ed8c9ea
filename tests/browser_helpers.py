"""Headless Chromium for the dashboard tests: run it, and read the panels from its DOM."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))
                 if p), None)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  "--window-size=1280,900", "--virtual-time-budget=5000"]


class Panels(HTMLParser):
    """Collects each panel's attributes, its chart's attributes and its lines' labels."""

    def __init__(self) -> None:
        super().__init__()
        self.panels: list[dict] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("class") == "panel":
            self.panels.append({"panel": a, "svg": {}, "lines": {}})
        elif tag == "svg" and self.panels:
            self.panels[-1]["svg"] = a
        elif tag == "path" and self.panels and a.get("data-label"):
            self.panels[-1]["lines"][a["data-label"]] = int(a.get("data-points") or 0)


def chromium(args: list[str], profile: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """Run headless Chromium in its own process group; kill the whole group afterwards."""
    assert CHROMIUM is not None
    proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # renderer and zygote children too
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def live_panels(base_url: str, profile: Path, timeout_s: float) -> tuple[str, dict[str, dict]]:
    """Load the dashboard of a live 2-node swarm in Chromium: its DOM and its panels by query,
    after checking that every panel is there and that the per-node charts have live lines."""
    from gasloc_p2p.tools.dashboard_page import PANELS

    dom = chromium(["--dump-dom", base_url + "?range=300&refresh=60"], profile, timeout_s)
    assert "<main>" in dom.stdout, dom.stderr[-2000:]
    parser = Panels()
    parser.feed(dom.stdout)
    panels = {p["panel"]["data-query"]: p for p in parser.panels}
    assert len(panels) == len(PANELS)
    for query in ("gasloc_val_loss", "gasloc_tokens_per_second",
                  "sum by (node) (rate(gasloc_sent_bytes_total[30s]))"):
        p = panels[query]
        assert p["panel"]["data-state"] == "ok", p
        assert set(p["lines"]) == {"node0", "node1"}, p
        assert min(p["lines"].values()) >= 3, p
    return dom.stdout, panels
