"""A local swarm without Docker: N ``gasloc-node join`` processes, Prometheus, the dashboard.

:class:`Swarm` starts the first node (it creates the swarm and prints the multiaddrs others
join with), then the other nodes with those multiaddrs, each with its own /metrics port; then
a local Prometheus scraping every node (if the binary is installed) and the dashboard page in
this process. :meth:`Swarm.watch` prints one progress line per node, read from the nodes'
/metrics, until the duration is over, every node has exited, or ``cancel`` is set (signals).
:meth:`Swarm.stop` ends everything in reverse order: dashboard, Prometheus, nodes (SIGTERM to
all at once, a grace period, then SIGKILL of each node's process group).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client.parser import text_string_to_metric_families

from gasloc_p2p.core.options import opt
from gasloc_p2p.protocol.membership import (
    Invitation,
    expires_in,
    load_or_create_owner_key,
    public_bytes,
    write_invitation,
)
from gasloc_p2p.tools.dashboard import DashboardServer
from gasloc_p2p.tools.direct_metrics import DirectMetrics
from gasloc_p2p.tools.nodes import (
    CREDENTIAL_FLAGS,
    JOIN_HINT,
    METRICS_LINE,
    NodeChild,
    split_tuning,
)
from gasloc_p2p.tools.prometheus import INSTALL_HINT, LocalPrometheus, find_prometheus

INVITE_DAYS = 7.0  # a local swarm's invitations (the files stay in the run folder)

log = logging.getLogger(__name__)

# A small model on loopback with one torch thread per node (3 nodes share 2 cores here):
# about 0.4M parameters, a validation every 25 steps, fast discovery. Flags given after `--`
# come later on the command line and override these.
DEFAULT_NODE_ARGS: tuple[str, ...] = (
    "--host", "127.0.0.1", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
    "--torch-threads", "1", "--n-layer", "2", "--n-embd", "128", "--n-head", "4",
    "--seq-len", "64", "--batch-size", "16", "--warmup-steps", "50",
    "--eval-interval-steps", "25", "--eval-batches", "4", "--inner-steps", "20",
    "--announce-interval-s", "2", "--announce-ttl-s", "8", "--refresh-interval-s", "2",
    "--log-interval-s", "10",
)


@dataclass(frozen=True)
class SwarmConfig:
    """What ``gasloc-node swarm`` starts; ``prometheus`` None means "if installed"."""

    nodes: int = opt(3, "number of nodes")
    prometheus: bool | None = opt(None, "run a local Prometheus (default: if the binary is "
                                        "installed)")
    prometheus_port: int = opt(0, "Prometheus port on 127.0.0.1 (0: any free port)")
    scrape_interval_s: float = opt(2.0, "Prometheus scrape interval, seconds",
                                   flag="--scrape-interval", metavar="S")
    dashboard_port: int = opt(0, "dashboard port (0: any free port; -1: no dashboard)")
    dashboard_host: str = opt("127.0.0.1", "dashboard address")
    duration_s: float = opt(0.0, "stop after this many seconds (0: run until Ctrl+C or every "
                                 "node has exited)", flag="--duration", metavar="S")
    refresh_s: float = opt(3.0, "progress view refresh period, seconds", flag="--refresh",
                           metavar="S")
    run_dir: str = opt("", "logs and Prometheus data (default: a new temporary directory, "
                           "kept for the logs)")
    start_timeout_s: float = opt(300.0, "deadline for each node to come up, seconds",
                                 flag="--start-timeout", metavar="S")
    stop_grace_s: float = opt(30.0, "on stop, wait this long for each node before SIGKILL",
                              flag="--stop-grace", metavar="S")
    node_log_level: str = opt("INFO", "log level of the nodes (their logs are in --run-dir)",
                              choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    node_args: tuple[str, ...] = ()  # flags for every node: the command's `-- NODE_FLAGS`

    def validate(self) -> SwarmConfig:
        problems = [
            (self.nodes >= 1, "--nodes must be >= 1"),
            (self.duration_s >= 0, "--duration must be >= 0 seconds (0: until Ctrl+C)"),
            (self.refresh_s > 0, "--refresh must be > 0 seconds"),
            (self.scrape_interval_s > 0, "--scrape-interval must be > 0 seconds"),
            (-1 <= self.dashboard_port < 65536, "--dashboard-port must be in [0, 65535] or -1"),
            (0 <= self.prometheus_port < 65536, "--prometheus-port must be in [0, 65535]"),
            (self.node_log_level in ("DEBUG", "INFO", "WARNING", "ERROR"),
             "--node-log-level must be DEBUG, INFO, WARNING or ERROR"),
            ("--peers" not in self.node_args, "node flags must not set --peers: the first "
                                              "node starts the swarm, the others join it"),
        ]
        for ok, message in problems:
            if not ok:
                raise ValueError(message)
        return self


@dataclass
class NodeView:
    """What the progress line shows for one node (NaN: not known)."""

    step: float = math.nan
    val_loss: float = math.nan
    tokens_per_s: float = math.nan
    ok: float = math.nan
    failed: float = math.nan
    peers: float = math.nan
    sent_bytes: float = math.nan


def read_metrics(url: str, timeout_s: float = 1.5) -> NodeView | None:
    """A node's /metrics as a :class:`NodeView`, or None if it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    view = NodeView(sent_bytes=0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gasloc_train_steps_total":
                view.step = s.value
            elif s.name == "gasloc_val_loss":
                view.val_loss = s.value
            elif s.name == "gasloc_tokens_per_second":
                view.tokens_per_s = s.value
            elif s.name == "gasloc_exchanges_total" and s.labels.get("outcome") in ("ok",
                                                                                   "failed"):
                setattr(view, s.labels["outcome"], s.value)
            elif s.name == "gasloc_peers_known":
                view.peers = s.value
            elif s.name == "gasloc_sent_bytes_total":
                view.sent_bytes += s.value
    return view


def format_line(name: str, view: NodeView | None, exit_code: int | None) -> str:
    if exit_code is not None:
        return f"{name:<7} exited with code {exit_code}"
    if view is None:
        return f"{name:<7} (metrics not answering)"

    def num(v: float, spec: str) -> str:
        return format(v, spec) if math.isfinite(v) else "-".rjust(len(format(0.0, spec)))

    return (f"{name:<7} step {num(view.step, '>6.0f')}  val loss {num(view.val_loss, '>6.3f')}  "
            f"tok/s {num(view.tokens_per_s, '>6.0f')}  exchanges ok {num(view.ok, '>4.0f')} "
            f"failed {num(view.failed, '>3.0f')}  peers {num(view.peers, '.0f')}  "
            f"sent {num(view.sent_bytes / 1e6, '>7.2f')} MB")


class Swarm:
    """``with Swarm(cfg) as swarm: swarm.start(cancel); swarm.watch(cancel)``."""

    def __init__(self, cfg: SwarmConfig, out: TextIO | None = None) -> None:
        self.cfg = cfg.validate()
        self.out = out or sys.stdout
        self.run_dir = Path(cfg.run_dir or tempfile.mkdtemp(prefix="gasloc-swarm-"))
        self.nodes: list[NodeChild] = []
        self.metrics_urls: list[str] = []
        self.prometheus: LocalPrometheus | None = None
        self.dashboard: DashboardServer | None = None
        self.direct: DirectMetrics | None = None
        self._exited: list[str] = []
        self._temporary = not cfg.run_dir

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ start
    def start(self, cancel: threading.Event) -> None:
        """Start every part; ChildError/PrometheusError/OSError if one cannot start."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._say(f"swarm of {self.cfg.nodes} node(s); logs in {self.run_dir}")
        self._prefetch_data()
        first = self._launch(0, self._credential(0))
        maddrs = first.wait_for(JOIN_HINT, self.cfg.start_timeout_s, cancel=cancel).group(2).split()
        self._say(f"node0 started the swarm; the others join via {maddrs[0]}")
        for i in range(1, self.cfg.nodes):
            self._launch(i, [*self._credential(i), "--peers", *maddrs])
        for child in self.nodes:
            found = child.wait_for(METRICS_LINE, self.cfg.start_timeout_s, cancel=cancel)
            self.metrics_urls.append(found.group(1))
        self._say("nodes up: " + ", ".join(f"{c.name} {u}" for c, u in
                                            zip(self.nodes, self.metrics_urls, strict=True)))
        self._start_prometheus()
        self._start_dashboard()

    def _credential(self, index: int) -> list[str]:
        """A run as any: node0 owns it (its owner key in the run folder) and runs its manifest
        (``run.json``, from the nodes' flags), the others join with invitations it signed and
        take the run's settings from node0. Node flags that name a credential (``--open``,
        ``--swarm-key``, ...) are used as given instead."""
        if any(f.split("=")[0] in CREDENTIAL_FLAGS for f in self.cfg.node_args):
            return []
        owner_path = self.run_dir / "owner.key"
        owner = load_or_create_owner_key(str(owner_path))
        if index == 0:
            return ["--owner-key", str(owner_path), "--manifest", self._manifest(owner_path)]
        member = Ed25519PrivateKey.generate()
        path = self.run_dir / f"node{index}.invite"
        path.unlink(missing_ok=True)
        write_invitation(str(path), Invitation.issue(owner, public_bytes(member),
                                                     expires_in(INVITE_DAYS)),
                         member.private_bytes_raw())
        return ["--invitation", str(path)]

    def _manifest(self, owner_path: Path) -> str:
        """``run.json`` in the run folder: the manifest of the nodes' flags (``init``)."""
        from gasloc_p2p.cli import build_parser
        from gasloc_p2p.node.cli_run import manifest_of
        from gasloc_p2p.node.settings import build_config

        flags, tuning = split_tuning([*DEFAULT_NODE_ARGS, *self.cfg.node_args,
                                      "--owner-key", str(owner_path)])
        args = build_parser().parse_args(["join", *flags])
        cfg = build_config(args, environ={**os.environ, **tuning})
        path = self.run_dir / "run.json"
        path.write_text(manifest_of(cfg, "local swarm").to_json())
        return str(path)

    def _prefetch_data(self) -> None:
        """Fetch the default corpus once here, not N times concurrently in the nodes."""
        if "--data" in self.cfg.node_args or os.environ.get("GASLOC_DATA"):
            return
        from gasloc_p2p.data import ensure_shakespeare

        self._say(f"corpus: {ensure_shakespeare()}")

    def _launch(self, index: int, extra: list[str]) -> NodeChild:
        # every file a node keeps (its keys: gasloc_p2p/state_dir.py) in the run folder too,
        # not in the user's data folder, where runs of a local swarm would pile up unseen
        child = NodeChild(f"node{index}", self.run_dir,
                          [*DEFAULT_NODE_ARGS, *self.cfg.node_args, *extra],
                          log_level=self.cfg.node_log_level,
                          env={"XDG_DATA_HOME": str(self.run_dir / "state")})
        self.nodes.append(child)
        return child

    def _start_prometheus(self) -> None:
        wanted = self.cfg.prometheus
        if wanted is False:
            return
        binary = find_prometheus()
        if binary is None:
            message = f"no 'prometheus' binary: running without it ({INSTALL_HINT})"
            if wanted:
                raise FileNotFoundError(message.replace("running without it", "needed by "
                                                        "--prometheus"))
            self._say(message)
            return
        targets = [(c.name, url.split("//", 1)[1].split("/", 1)[0])
                   for c, url in zip(self.nodes, self.metrics_urls, strict=True)]
        prom = LocalPrometheus(targets, self.run_dir / "prometheus", self.cfg.scrape_interval_s,
                               self.cfg.prometheus_port, binary)
        self.prometheus = prom
        prom.start()
        self._say(f"Prometheus: {prom.url}  (graph: {prom.url}/graph)")

    def _start_dashboard(self) -> None:
        if self.cfg.dashboard_port < 0:
            return
        if self.prometheus is not None:
            board = DashboardServer(self.prometheus.url, self.cfg.dashboard_host,
                                    self.cfg.dashboard_port)
        else:  # no Prometheus: the dashboard scrapes the nodes itself
            self.direct = DirectMetrics(
                [(c.name, url) for c, url in zip(self.nodes, self.metrics_urls, strict=True)],
                self.cfg.scrape_interval_s)
            self.direct.start()
            board = DashboardServer("", self.cfg.dashboard_host, self.cfg.dashboard_port,
                                    direct=self.direct)
        self.dashboard = board
        board.start()
        self._say(f"dashboard: {board.url}  (reads {board.source})")

    # ------------------------------------------------------------------ run
    def watch(self, cancel: threading.Event) -> None:
        """Progress lines every ``refresh_s`` until the duration, all nodes exit, or cancel."""
        started = time.monotonic()
        tty = self.out.isatty()
        drawn = 0
        with ThreadPoolExecutor(max(1, len(self.nodes)), "swarm-progress") as pool:
            while True:
                elapsed = time.monotonic() - started
                lines = self._progress(pool, elapsed)
                if tty and drawn:
                    self.out.write(f"\x1b[{drawn}F")  # back to the first line of the block
                self.out.write("".join(f"{line}\x1b[K\n" if tty else f"{line}\n"
                                       for line in lines))
                self.out.flush()
                drawn = len(lines)
                if all(not c.alive for c in self.nodes):
                    self._say("every node has exited")
                    return
                remaining = self.cfg.duration_s - elapsed if self.cfg.duration_s else math.inf
                if remaining <= 0 or cancel.wait(min(self.cfg.refresh_s, remaining)):
                    return

    def _progress(self, pool: ThreadPoolExecutor, elapsed: float) -> list[str]:
        views = list(pool.map(read_metrics, self.metrics_urls))
        head = f"[{elapsed:6.0f} s] {sum(c.alive for c in self.nodes)}/{len(self.nodes)} nodes"
        if self.dashboard is not None:
            head += f" · dashboard {self.dashboard.url}"
        lines = [head]
        for child, view in zip(self.nodes, views, strict=True):
            code = child.proc.poll()
            if code is not None and child.name not in self._exited:
                self._exited.append(child.name)
                if code != 0:
                    log.warning("%s exited with code %s; its log ends with:\n%s", child.name,
                                code, child.tail(1500))
            lines.append("  " + format_line(child.name, view, code))
        return lines

    # ------------------------------------------------------------------ stop
    def stop(self) -> int:
        """Stop everything (safe twice); 0 if every node stopped cleanly, else 1."""
        board, self.dashboard = self.dashboard, None
        if board is not None:
            board.stop()
        direct, self.direct = self.direct, None
        if direct is not None:
            direct.stop()
        prom, self.prometheus = self.prometheus, None
        if prom is not None:
            prom.stop()
            if self._temporary:  # its TSDB goes with it; the logs stay
                shutil.rmtree(prom.workdir / "data", ignore_errors=True)
        nodes, self.nodes = self.nodes, []
        if not nodes:
            return 0
        self._say(f"stopping {len(nodes)} node(s)")
        for child in nodes:
            child.terminate()  # all at once: they stop in parallel
        codes = [child.stop(self.cfg.stop_grace_s) for child in nodes]
        bad = [f"{c.name}: {code}" for c, code in zip(nodes, codes, strict=True) if code != 0]
        if bad:
            self._say(f"nodes that did not exit cleanly: {', '.join(bad)} (logs in "
                      f"{self.run_dir})")
        else:
            self._say("stopped cleanly")
        self._say(f"the nodes' logs, keys, checkpoints and invitations stay in {self.run_dir}"
                  + (": delete it when done" if self._temporary else ""))
        return 1 if bad else 0

    def _say(self, text: str) -> None:
        print(f"swarm: {text}", file=self.out, flush=True)
