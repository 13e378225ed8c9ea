"""A local Prometheus (Debian's ``prometheus`` binary) scraping a set of gasloc nodes.

Used by ``gasloc-node swarm`` and by the tests. It listens on 127.0.0.1 only, keeps its TSDB
under the given work directory, and scrapes every node as job ``gasloc`` with a ``node`` label
(``node0``, ``node1``, ...). :func:`query` and :func:`query_range` are thin clients of its
HTTP API (``/api/v1/query``, ``/api/v1/query_range``).
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gasloc_p2p.tools.procs import Child

log = logging.getLogger(__name__)
INSTALL_HINT = "install it with: apt-get install -y prometheus (Debian/Ubuntu)"


class PrometheusError(RuntimeError):
    """Prometheus is missing, did not start, or answered a query with an error."""


def find_prometheus() -> str | None:
    """Path of the ``prometheus`` binary, or None."""
    return shutil.which("prometheus")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def scrape_config(targets: Sequence[tuple[str, str]], scrape_interval_s: float) -> str:
    """Prometheus YAML (JSON is valid YAML) scraping ``(name, host:port)`` targets."""
    interval = f"{max(1, round(scrape_interval_s * 1000))}ms"
    timeout = f"{max(1, round(min(scrape_interval_s, 10) * 800))}ms"
    doc = {
        "global": {"scrape_interval": interval, "scrape_timeout": timeout,
                   "evaluation_interval": interval},
        "scrape_configs": [{
            "job_name": "gasloc",
            "static_configs": [{"targets": [addr], "labels": {"node": name}}
                               for name, addr in targets],
        }],
    }
    return json.dumps(doc, indent=2)


class LocalPrometheus:
    """``start()`` a Prometheus child on 127.0.0.1; ``stop()`` ends it (safe twice)."""

    def __init__(self, targets: Sequence[tuple[str, str]], workdir: Path,
                 scrape_interval_s: float = 2.0, port: int = 0,
                 binary: str | None = None) -> None:
        self.targets = list(targets)
        self.workdir = Path(workdir)
        self.scrape_interval_s = scrape_interval_s
        self.port_wanted = port
        self.binary = binary or find_prometheus()
        self.port = 0
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}" if self.port else ""

    def start(self, timeout_s: float = 60.0) -> None:
        """Write the config, start the binary and wait for ``/-/ready``."""
        if self.binary is None:
            raise PrometheusError(f"no 'prometheus' binary on PATH; {INSTALL_HINT}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(scrape_config(self.targets, self.scrape_interval_s))
        self.port = self.port_wanted or free_port()
        argv = [self.binary, f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1d", "--log.level=warn"]
        self.child = Child("prometheus", argv, self.workdir)
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if not self.child.alive:
                raise PrometheusError(f"prometheus exited with code {self.child.proc.returncode}"
                                      f": {self.child.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise PrometheusError(f"prometheus not ready within {timeout_s:g} s")
            time.sleep(0.2)
        log.debug("prometheus on %s scraping %d node(s) every %g s", self.url,
                 len(self.targets), self.scrape_interval_s)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, grace_s: float = 10.0) -> None:
        child, self.child = self.child, None
        if child is not None:
            child.stop(grace_s)

    def query(self, promql: str) -> list[dict[str, Any]]:
        return query(self.url, promql)

    def __enter__(self) -> LocalPrometheus:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _api(url: str, path: str, params: dict[str, str], timeout_s: float) -> Any:
    full = f"{url}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(full, timeout=timeout_s) as reply:
            body = json.load(reply)
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read() or b"{}")
    except (OSError, ValueError) as exc:
        raise PrometheusError(f"{full}: {exc}") from exc
    if body.get("status") != "success":
        raise PrometheusError(f"{full}: {body.get('error', body)}")
    return body["data"]["result"]


def query(url: str, promql: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """An instant query: ``[{"metric": {...}, "value": [t, "v"]}, ...]``."""
    result: list[dict[str, Any]] = _api(url, "/api/v1/query", {"query": promql}, timeout_s)
    return result


def query_range(url: str, promql: str, start: float, end: float, step_s: float,
                timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """A range query: ``[{"metric": {...}, "values": [[t, "v"], ...]}, ...]``."""
    params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}
    result: list[dict[str, Any]] = _api(url, "/api/v1/query_range", params, timeout_s)
    return result
