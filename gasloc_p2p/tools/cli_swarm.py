"""``gasloc-node swarm`` (a local swarm without Docker) and ``gasloc-node dashboard``.

``swarm`` exits 0 when every node stopped cleanly, 1 when a part failed to start or a node did
not exit cleanly, 2 for bad flags. Ctrl+C, SIGTERM or SIGHUP stop everything (more signals
during the stop are ignored: it is bounded by ``--stop-grace`` and ends with SIGKILL).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gasloc_p2p.flags import add_flags, given, options
from gasloc_p2p.tools.procs import ChildError
from gasloc_p2p.tools.prometheus import PrometheusError
from gasloc_p2p.tools.swarm import DEFAULT_NODE_ARGS, Swarm, SwarmConfig


def add_swarm_parser(sub: Any) -> None:
    p = sub.add_parser(
        "swarm", help="run a local swarm: N nodes, Prometheus (if installed), a dashboard",
        description="Start N `gasloc-node join` processes on 127.0.0.1 (the first starts the "
                    "swarm, the others join it), a local Prometheus scraping their /metrics "
                    "(Debian package `prometheus`, if installed) and a dashboard page; show "
                    "one progress line per node; Ctrl+C stops everything. Node flags go after "
                    "`--`, e.g. `gasloc-node swarm --nodes 4 -- --codec int4 --data my.txt`; "
                    f"they override the swarm's defaults: {' '.join(DEFAULT_NODE_ARGS)}")
    add_flags(p, options({"swarm": SwarmConfig}), skip=("node_args",))
    p.add_argument("node_args", nargs=argparse.REMAINDER, metavar="-- NODE_FLAGS",
                   help="flags passed to every `gasloc-node join`")
    p.set_defaults(func=run_swarm)


def add_dashboard_parser(sub: Any) -> None:
    p = sub.add_parser(
        "dashboard", help="serve the swarm dashboard for a running Prometheus",
        description="Serve the dashboard page (loss, throughput, gossip traffic per node) "
                    "for a Prometheus that scrapes gasloc nodes, e.g. the compose swarm's: "
                    "`gasloc-node dashboard --prometheus http://127.0.0.1:9090`.")
    p.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL")
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=8050, help="listen port (0: any free port)")
    p.set_defaults(func=run_dashboard)


@contextmanager
def _stop_on_signals(event: threading.Event) -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP set ``event`` (the main thread polls it) while inside."""

    def handler(signum: int, frame: object) -> None:
        if not event.is_set():
            print(f"\n{signal.Signals(signum).name}: stopping", file=sys.stderr,
                  flush=True)
        event.set()

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _config(args: argparse.Namespace) -> SwarmConfig:
    node_args = list(args.node_args)
    if node_args[:1] == ["--"]:
        node_args = node_args[1:]
    flags = {k: v for k, v in given(args, options({"swarm": SwarmConfig})).items()
             if k != "node_args"}
    return SwarmConfig(**flags, node_args=tuple(node_args)).validate()


def run_swarm(args: argparse.Namespace) -> int:
    """Entry point of ``gasloc-node swarm``; returns the exit code."""
    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"gasloc-node swarm: error: {exc}", file=sys.stderr)
        return 2
    cancel = threading.Event()
    code = 0
    with _stop_on_signals(cancel):
        swarm = Swarm(cfg)
        try:
            swarm.start(cancel)
            swarm.watch(cancel)
        except (ChildError, PrometheusError, OSError) as exc:
            if not cancel.is_set():  # a stop during start-up is not a failure
                print(f"gasloc-node swarm: error: {exc}", file=sys.stderr, flush=True)
                code = 1
        finally:
            code = max(code, swarm.stop())
    return code


def run_dashboard(args: argparse.Namespace) -> int:
    """Entry point of ``gasloc-node dashboard``: serve until SIGINT/SIGTERM."""
    from gasloc_p2p.tools.dashboard import DashboardServer

    cancel = threading.Event()
    with _stop_on_signals(cancel):
        try:
            board = DashboardServer(args.prometheus, args.host, args.port)
            board.start()
        except OSError as exc:
            print(f"gasloc-node dashboard: error: {exc}", file=sys.stderr)
            return 1
        print(f"dashboard: {board.url} (Prometheus {args.prometheus}); Ctrl+C stops",
              flush=True)
        try:
            while not cancel.wait(1.0):
                pass
        finally:
            board.stop()
    return 0
