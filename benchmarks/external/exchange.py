"""One GASLoC exchange over a shaped link: its wall time against payload bytes / link rate.

Two ``gasloc-node join`` processes, host 0 shaped to ``rate_mbit`` (its egress), host 1
unshaped; every exchange carries one payload each way, so the slow direction bounds it. The
nodes' Prometheus endpoints are polled from the root namespace while they train; the last
sample of host 0 gives the committed exchanges' mean duration
(``gasloc_exchange_duration_seconds``) and payload bytes per exchange
(``gasloc_sent_bytes_total`` / exchanges). Ratio = mean duration / (payload * 8 / rate).
"""

from __future__ import annotations

import contextlib
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.external.common import Spec, flag_list
from benchmarks.external.runners import start_bootstrap
from gasloc_p2p.tools.nodes import NodeChild, node_env
from gasloc_p2p.tools.procs import Child

METRICS_PORT = 9464  # every host is its own namespace: the same port on each


def scrape(addr: str, port: int = METRICS_PORT, timeout_s: float = 3.0) -> dict[str, float]:
    """``name{labels} value`` samples of a node's /metrics, summed over labels."""
    with urllib.request.urlopen(f"http://{addr}:{port}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^([a-z_]+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def exchange_figures(sample: dict[str, float], rate_mbit: float) -> dict[str, Any]:
    """Mean exchange seconds, payload bytes per exchange and the ratio to payload / rate."""
    count = sample.get("gasloc_exchange_duration_seconds_count", 0.0)
    if count <= 0:
        return {"exchanges": 0}
    mean_s = sample["gasloc_exchange_duration_seconds_sum"] / count
    payload = sample.get("gasloc_sent_bytes_total", 0.0) / count
    ideal_s = payload * 8 / (rate_mbit * 1e6)
    return {"exchanges": int(count), "mean_exchange_s": mean_s, "payload_bytes": payload,
            "payload_over_rate_s": ideal_s, "ratio": mean_s / ideal_s if ideal_s else None}


def measure_exchange(rate_mbit: float, spec: Spec, data: Path, log_dir: Path,
                     exchanges: int = 8, timeout_s: float = 420.0) -> dict[str, Any]:
    """Run the two nodes on a fresh shaped network until host 0 (the slow one) has committed
    ``exchanges`` exchanges (or ``timeout_s``); its figures."""
    from benchmarks.tools.netns import ShapedNetwork

    log_dir.mkdir(parents=True, exist_ok=True)
    last: dict[str, float] = {}
    with ShapedNetwork([rate_mbit, None]) as net:
        nodes: list[Child] = []
        try:
            boot, peers = start_bootstrap("exchange-bootstrap", log_dir, net.gateway, 120)
            nodes.append(boot)
            for i, host in enumerate(net.hosts):
                keys = {**spec.train_keys(str(data), i), "host": host.addr,
                        "metrics_port": METRICS_PORT, "init_from_swarm": False}
                nodes.append(NodeChild(f"exchange-n{i}", log_dir,
                                       flag_list(keys) + ["--peers", *peers],
                                       env=node_env({"OMP_NUM_THREADS": "1"}),
                                       prefix=host.cmd([])))
            deadline = time.monotonic() + timeout_s
            while nodes[1].alive and time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    last = scrape(net.hosts[0].addr)
                if last.get("gasloc_exchange_duration_seconds_count", 0) >= exchanges:
                    break
                time.sleep(1.0)
        finally:
            for node in nodes:
                node.stop(20)
    return {"rate_mbit": rate_mbit, **exchange_figures(last, rate_mbit)}
