"""The dashboard without Prometheus: scrape the nodes' ``/metrics`` here and answer the page's
queries from those samples.

``gasloc-node swarm`` on a bare machine (no ``prometheus`` binary) still gives its user live
curves: :class:`DirectMetrics` scrapes every node every few seconds into a bounded in-memory
history and answers the Prometheus query API shape the page reads (``query_range`` for each
panel, ``query`` for ``up``), for the dashboard's own queries only. Each panel declares a
:class:`Recipe` (gauge, summed counter rate, or histogram quantiles) that computes what its
PromQL does in Prometheus: ``rate`` over a window from the first and last sample in it,
``histogram_quantile`` by linear interpolation within the bucket.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)
Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, Labels]  # (sample name, sorted labels including "node")


@dataclass(frozen=True)
class Recipe:
    """How to compute one panel from scraped samples.

    kind: ``gauge`` (each node's value), ``rate`` (per-second increase of a counter over
    ``window_s``, summed by the label ``by``), ``quantiles`` (``histogram_quantile`` of each
    of ``quantiles`` over the summed bucket rates; series labelled ``q`` = p50, p95, ...).
    """

    kind: str
    metric: str
    by: str = "node"
    window_s: float = 30.0
    quantiles: tuple[float, ...] = ()


@dataclass
class Scrape:
    at: float  # wall-clock seconds
    values: dict[SeriesKey, float]


class DirectMetrics:
    """A scraper of ``targets`` (name, metrics URL) with ``history_s`` of samples."""

    def __init__(self, targets: Sequence[tuple[str, str]], interval_s: float = 2.0,
                 history_s: float = 3600.0, timeout_s: float = 1.5) -> None:
        self.targets = list(targets)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.history: deque[Scrape] = deque(maxlen=max(2, int(history_s / interval_s) + 1))
        self.up: dict[str, bool] = {name: False for name, _ in self.targets}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ scraping
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gasloc-direct-metrics",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.scrape_once()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def scrape_once(self) -> None:
        values: dict[SeriesKey, float] = {}
        up: dict[str, bool] = {}
        for name, url in self.targets:
            try:
                with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:
                    text = reply.read(8 << 20).decode("utf-8", "replace")
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        labels = tuple(sorted({**s.labels, "node": name}.items()))
                        values[(s.name, labels)] = float(s.value)
                up[name] = True
            except (OSError, ValueError) as exc:
                log.debug("scrape of %s (%s) failed: %s", name, url, exc)
                up[name] = False
        with self._lock:
            self.history.append(Scrape(time.time(), values))
            self.up = up

    # ------------------------------------------------------------------ queries
    def instant_up(self) -> list[dict[str, Any]]:
        """``up`` as Prometheus' instant-query result."""
        with self._lock:
            up, now = dict(self.up), time.time()
        return [{"metric": {"__name__": "up", "node": name}, "value": [now, "1" if ok else "0"]}
                for name, ok in sorted(up.items())]

    def instant_start(self) -> list[dict[str, Any]]:
        """When the swarm started (the dashboard's ``START_QUERY``): the earliest
        ``process_start_time_seconds`` of the nodes in the last scrape; empty before one."""
        with self._lock:
            last = self.history[-1] if self.history else None
        starts = [v for (name, _), v in (last.values.items() if last else ())
                  if name == "process_start_time_seconds"]
        if not starts or last is None:
            return []
        return [{"metric": {}, "value": [last.at, repr(min(starts))]}]

    def query_range(self, recipe: Recipe, start: float, end: float) -> list[dict[str, Any]]:
        """The recipe's series over [start, end] in Prometheus' matrix-result shape."""
        with self._lock:
            scrapes = list(self.history)
        out: dict[str, list[list[Any]]] = {}
        for i, scrape in enumerate(scrapes):
            if not start <= scrape.at <= end:
                continue
            if recipe.kind == "gauge":
                points = _gauges(scrape, recipe)
            else:
                window = _window(scrapes, i, recipe.window_s)
                if len(window) < 2:
                    continue
                rates = _rates(window, recipe.metric)
                points = (_sum_by(rates, recipe.by) if recipe.kind == "rate"
                          else _quantiles(rates, recipe.quantiles))
            for label, value in points.items():
                if math.isfinite(value):
                    out.setdefault(label, []).append([scrape.at, repr(value)])
        key = "q" if recipe.kind == "quantiles" else recipe.by
        return [{"metric": {key: label}, "values": values} for label, values in sorted(out.items())]


def _gauges(scrape: Scrape, recipe: Recipe) -> dict[str, float]:
    return {dict(labels).get(recipe.by, ""): v for (name, labels), v in scrape.values.items()
            if name == recipe.metric}


def _window(scrapes: list[Scrape], i: int, window_s: float) -> list[Scrape]:
    """The scrapes within ``window_s`` up to and including scrapes[i], oldest first."""
    j = i
    while j > 0 and scrapes[i].at - scrapes[j - 1].at <= window_s:
        j -= 1
    return scrapes[j:i + 1]


def _rates(window: list[Scrape], metric: str) -> dict[Labels, float]:
    """Per-second increase of every series of ``metric`` over the window: the sum of its
    increases between consecutive scrapes (a counter that went down was reset, so that step's
    increase is its new value, as Prometheus counts it) over the time the series was seen."""
    increase: dict[Labels, float] = {}
    since: dict[Labels, float] = {}
    for prev, cur in zip(window, window[1:], strict=False):
        for (name, labels), v in cur.values.items():
            v0 = prev.values.get((name, labels))
            if name != metric or v0 is None:
                continue
            increase[labels] = increase.get(labels, 0.0) + (v - v0 if v >= v0 else v)
            since.setdefault(labels, prev.at)
    last = window[-1].at
    return {labels: inc / (last - since[labels]) for labels, inc in increase.items()
            if last > since[labels]}


def _sum_by(rates: dict[Labels, float], by: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in rates.items():
        key = dict(labels).get(by, "")
        out[key] = out.get(key, 0.0) + v
    return out


def _quantiles(bucket_rates: dict[Labels, float], qs: Sequence[float]) -> dict[str, float]:
    """``histogram_quantile(q, sum by (le) (rate(..._bucket)))`` for each q."""
    by_le: dict[float, float] = {}
    for labels, v in bucket_rates.items():
        le = float(dict(labels).get("le", "nan"))
        if not math.isnan(le):
            by_le[le] = by_le.get(le, 0.0) + v
    return {f"p{round(q * 100)}": histogram_quantile(q, sorted(by_le.items())) for q in qs}


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus' estimate from cumulative ``(upper bound, count)`` buckets, ascending."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # the highest finite bound, as Prometheus answers
            width = count - below
            return lower + (upper - lower) * ((rank - below) / width if width > 0 else 1.0)
        lower, below = upper, count
    return lower
