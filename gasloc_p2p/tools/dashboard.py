"""Serve the swarm dashboard: the page plus a read-only proxy to Prometheus' query API.

``GET /`` is the page (:mod:`gasloc_p2p.tools.dashboard_page`); ``GET /api/v1/query`` and
``/api/v1/query_range`` are forwarded to Prometheus (same origin for the page: no CORS, and
Prometheus can stay on loopback), or, without Prometheus, answered from the nodes' /metrics
scraped here (:mod:`gasloc_p2p.tools.direct_metrics`, the page's own queries only);
``GET /healthz`` answers ``ok``. Nothing else is proxied.
The stdlib ``ThreadingHTTPServer`` runs in one thread; :meth:`DashboardServer.stop` releases
the port and is safe to call twice.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from gasloc_p2p.tools.dashboard_page import RECIPES, START_QUERY, render_page
from gasloc_p2p.tools.direct_metrics import DirectMetrics

log = logging.getLogger(__name__)
PROXIED = ("/api/v1/query", "/api/v1/query_range", "/api/v1/targets")
PROXY_TIMEOUT_S = 15.0


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", self.server.page)
        elif path == "/healthz":
            self._send(200, "text/plain", b"ok\n")
        elif self.server.direct is not None and path in ("/api/v1/query", "/api/v1/query_range"):
            self._direct(path)
        elif path in PROXIED and self.server.direct is None:
            self._proxy()
        else:
            self._send(404, "text/plain", b"not found\n")

    def _proxy(self) -> None:
        url = self.server.prometheus_url + self.path
        try:
            with urllib.request.urlopen(url, timeout=PROXY_TIMEOUT_S) as reply:
                status, body = reply.status, reply.read()
                ctype = reply.headers.get("Content-Type", "application/json")
        except urllib.error.HTTPError as exc:  # Prometheus' own errors (bad query) are JSON
            status, body = exc.code, exc.read()
            ctype = exc.headers.get("Content-Type", "application/json")
        except OSError as exc:
            status, ctype = 502, "application/json"
            body = json.dumps({"status": "error", "errorType": "unavailable",
                               "error": f"Prometheus at {self.server.prometheus_url}: "
                                        f"{exc}"}).encode()
        self._send(status, ctype, body)

    def _direct(self, path: str) -> None:
        """Answer the page's own queries from the scraped samples (no Prometheus)."""
        direct = self.server.direct
        assert direct is not None
        params = parse_qs(urlsplit(self.path).query)
        query = params.get("query", [""])[0]
        recipe = RECIPES.get(query)
        try:
            if path == "/api/v1/query" and query == "up":
                data = {"resultType": "vector", "result": direct.instant_up()}
            elif path == "/api/v1/query" and query == START_QUERY:
                data = {"resultType": "vector", "result": direct.instant_start()}
            elif path == "/api/v1/query_range" and recipe is not None:
                start, end = float(params["start"][0]), float(params["end"][0])
                data = {"resultType": "matrix", "result": direct.query_range(recipe, start, end)}
            else:
                raise LookupError(query)
        except (LookupError, ValueError):
            body = {"status": "error", "errorType": "bad_data",
                    "error": "this dashboard reads the nodes directly (no Prometheus): it "
                             "answers only its own panels' queries"}
            self._send(400, "application/json", json.dumps(body).encode())
            return
        self._send(200, "application/json",
                   json.dumps({"status": "success", "data": data}).encode())

    def _send(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    prometheus_url: str
    direct: DirectMetrics | None
    page: bytes


class DashboardServer:
    """The dashboard on ``http://host:port/`` backed by the Prometheus at ``prometheus_url``,
    or, with ``direct``, by the nodes' own /metrics scraped in this process."""

    def __init__(self, prometheus_url: str = "", host: str = "127.0.0.1", port: int = 0,
                 title: str = "gasloc swarm", direct: DirectMetrics | None = None) -> None:
        if not prometheus_url and direct is None:
            raise ValueError("the dashboard needs a Prometheus URL or direct metrics")
        self.prometheus_url = prometheus_url.rstrip("/")
        self.direct = direct
        self.host = host
        self.port_wanted = port
        self.title = title
        self.port = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.port}/" if self._server else ""

    def start(self) -> None:
        """Bind (OSError with the port in the message if taken) and serve in a thread."""
        try:
            server = _Server((self.host, self.port_wanted), _Handler)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve the dashboard on {self.host}:"
                                     f"{self.port_wanted} ({exc.strerror}); choose another "
                                     "--dashboard-port (0: any free port)") from None
        server.prometheus_url = self.prometheus_url
        server.direct = self.direct
        server.page = render_page(self.title).encode()
        self._server = server
        self.port = int(server.server_address[1])
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="gasloc-dashboard", daemon=True)
        self._thread.start()
        log.debug("dashboard on %s (%s)", self.url, self.source)

    @property
    def source(self) -> str:
        return (f"Prometheus {self.prometheus_url}" if self.direct is None
                else f"the nodes' /metrics, scraped every {self.direct.interval_s:g} s")

    def stop(self) -> None:
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> DashboardServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
