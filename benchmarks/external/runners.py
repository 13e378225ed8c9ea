"""Start one system's nodes (a real process per node, each in its host's network namespace or
on loopback), wait for them to train ``spec.steps`` steps, and collect what they measured.

Systems (:data:`SYSTEMS`): ``gasloc`` (``gasloc-node join`` with its defaults), ``gasloc-diloco``
(the same daemon, ``--algorithm diloco``), ``gasloc-solo`` (no gossip) and
``gasloc-diloco-avg`` (DiLoCo mode with plain averaging, eta 1 and gamma 0, the outer step the
simulator found best), ``gasloc-diloco-topk`` (the same with SparseLoCo's payload, ``--diloco-codec
topk2:123``: an all-gather of the top 3% at 2 bits with error feedback; these three not in "all"), ``torchft-diloco`` (a lighthouse and one replica group
per node, gloo on CPU), ``hivemind`` (``hivemind.Optimizer`` with local updates). Every node's
result has its eval curve, bytes counted at its veth (kernel counters; None on loopback), bytes
its program counted or estimated, and the peak resident memory of its process group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from benchmarks.external.common import (
    RssSampler,
    Spec,
    flag_list,
    gasloc_evals,
    gasloc_sent_bytes,
    gasloc_utilization,
    read_records,
)
from gasloc_p2p.tools.nodes import NodeChild, node_env
from gasloc_p2p.tools.procs import Child

SYSTEMS = ("gasloc", "gasloc-diloco", "torchft-diloco", "hivemind")
# not in "all": the same nodes without gossip (--exchanges-per-round 0), a compute-only control;
# DiLoCo mode with plain averaging. (gasloc-bw and gasloc-paced ran --peer-choice bandwidth and
# --pacing compute, retired after commit db57895: docs/results/peer-choice.md, pacing.md.)
OPTIONAL_SYSTEMS = ("gasloc-solo", "gasloc-diloco-avg", "gasloc-diloco-topk")
ROOT = Path(__file__).resolve().parents[2]


class HostLike(Protocol):
    addr: str
    rate_mbit: float | None

    def cmd(self, argv: Sequence[str]) -> list[str]: ...


@dataclass
class LoopbackHost:
    """A host without a namespace: 127.0.0.1, unshaped, no veth counters (tests)."""

    addr: str = "127.0.0.1"
    rate_mbit: float | None = None
    dev: str = "lo"

    def cmd(self, argv: Sequence[str]) -> list[str]:
        return list(argv)


def torchft_unavailable() -> str | None:
    """None when torchft is importable, else why (for skips and the suite's table)."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return f"torchft is not installed ({exc}); `make bench-external` installs it"
    return None


def _counters(host: HostLike) -> tuple[int, int] | None:
    tx, rx = getattr(host, "tx_bytes", None), getattr(host, "rx_bytes", None)
    if tx is None or rx is None:
        return None
    return int(tx()), int(rx())


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def start_bootstrap(name: str, log_dir: Path, addr: str, timeout_s: float
                    ) -> tuple[Child, list[str]]:
    """A plain hivemind DHT on ``addr`` (the root namespace's gateway): every node joins it at
    once, so all start together (a first node would otherwise train alone for a while)."""
    dht = shutil.which("hivemind-dht", path=str(Path(sys.executable).parent))
    # wheels installed with --target (a GPU machine) leave the script elsewhere: its module
    argv = [dht] if dht is not None else [
        sys.executable, "-c", "from hivemind.hivemind_cli.run_dht import main; main()"]
    child = Child(name, [*argv, "--host_maddrs", f"/ip4/{addr}/tcp/0"], log_dir,
                  node_env({"HIVEMIND_LOGLEVEL": "INFO"}))
    try:
        found = child.wait_for(r"--initial_peers (/ip4/\S+/p2p/\S+)", timeout_s, stdout=False)
    except BaseException:
        child.stop(10)
        raise
    return child, [found.group(1)]


class _Run:
    """The children of one system's run, their hosts and logs."""

    def __init__(self, system: str, hosts: Sequence[HostLike], spec: Spec, data: Path,
                 log_dir: Path, gateway: str) -> None:
        self.system, self.hosts, self.spec, self.data = system, list(hosts), spec, data
        self.log_dir, self.gateway = log_dir, gateway
        log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []  # one per node, in host order
        self.helpers: list[Child] = []  # the lighthouse

    def env(self, host: HostLike) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        return node_env({"PYTHONPATH": path, "OMP_NUM_THREADS": "1",
                         "GLOO_SOCKET_IFNAME": getattr(host, "dev", "lo"),
                         "HIVEMIND_LOGLEVEL": "ERROR"})

    def start(self, timeout_s: float) -> None:
        getattr(self, "_start_" + self.system.replace("-", "_"))(timeout_s)

    # -------------------------------------------------------------- gasloc_p2p
    def _gasloc_flags(self, i: int, host: HostLike) -> list[str]:
        flags = flag_list({**self.spec.train_keys(str(self.data), i), "host": host.addr,
                           "log_interval_s": 5, "metrics_port": -1,
                           "init_from_swarm": False})
        if self.system == "gasloc-solo":
            flags += ["--exchanges-per-round", "0"]
        if self.system == "gasloc-diloco":
            flags += ["--algorithm", "diloco", "--diloco-eta", str(self.spec.diloco_eta),
                      "--diloco-gamma", str(self.spec.diloco_gamma)]
        if self.system in ("gasloc-diloco-avg", "gasloc-diloco-topk"):
            flags += ["--algorithm", "diloco", "--diloco-eta", "1", "--diloco-gamma", "0"]
        if self.system == "gasloc-diloco-topk":
            flags += ["--diloco-codec", "topk2:123"]
        return flags + list(self.spec.extra_flags)

    def bootstrap(self, timeout_s: float) -> list[str]:
        child, peers = start_bootstrap(f"{self.system}-bootstrap", self.log_dir, self.gateway,
                                       timeout_s)
        self.helpers.append(child)
        return peers

    def _start_gasloc(self, timeout_s: float) -> None:
        peers = self.bootstrap(timeout_s)
        self.children += [self._node_in_ns(i, peers) for i in range(len(self.hosts))]

    _start_gasloc_diloco = _start_gasloc_diloco_avg = _start_gasloc_diloco_topk = _start_gasloc
    _start_gasloc_bw = _start_gasloc_solo = _start_gasloc_paced = _start_gasloc

    def _node_in_ns(self, i: int, peers: list[str]) -> NodeChild:
        """A NodeChild whose command runs inside host i's namespace."""
        host = self.hosts[i]
        flags = self._gasloc_flags(i, host) + (["--peers", *peers] if peers else [])
        return NodeChild(f"{self.system}-n{i}", self.log_dir, flags, env=self.env(host),
                         prefix=host.cmd([]))

    # -------------------------------------------------------------- torchft
    def _start_torchft_diloco(self, timeout_s: float) -> None:
        bind = self.gateway
        port = _free_port(bind)
        lighthouse = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
        if lighthouse is None:
            raise RuntimeError("torchft_lighthouse not found next to the interpreter")
        self.helpers.append(Child(f"{self.system}-lighthouse", [
            lighthouse, "--min_replicas", str(len(self.hosts)), "--bind", f"{bind}:{port}",
            "--join_timeout_ms", "2000"], self.log_dir, node_env()))
        for i, host in enumerate(self.hosts):
            argv = [sys.executable, "-m", "benchmarks.external.torchft_node", "--spec",
                    self.spec.to_json(), "--data", str(self.data), "--index", str(i),
                    "--addr", host.addr, "--store-port", str(self._store_port(host)),
                    "--lighthouse", f"http://{bind}:{port}"]
            self.children.append(Child(f"{self.system}-n{i}", host.cmd(argv), self.log_dir,
                                       self.env(host)))

    @staticmethod
    def _store_port(host: HostLike) -> int:
        # A namespace has its own port space; on loopback the replicas need distinct ports.
        return _free_port(host.addr) if host.addr.startswith("127.") else 29500

    # -------------------------------------------------------------- hivemind
    def _hivemind(self, i: int, peers: list[str]) -> Child:
        host = self.hosts[i]
        argv = [sys.executable, "-m", "benchmarks.external.hivemind_node", "--spec",
                self.spec.to_json(), "--data", str(self.data), "--index", str(i),
                "--addr", host.addr, *(["--peers", *peers] if peers else [])]
        return Child(f"{self.system}-n{i}", host.cmd(argv), self.log_dir, self.env(host))

    def _start_hivemind(self, timeout_s: float) -> None:
        peers = self.bootstrap(timeout_s)
        self.children += [self._hivemind(i, peers) for i in range(len(self.hosts))]

    # -------------------------------------------------------------- results
    def wait(self, timeout_s: float) -> bool:
        """Wait for every node to exit; False on timeout (the caller stops them)."""
        deadline = time.monotonic() + timeout_s
        while any(c.alive for c in self.children):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def stop(self) -> None:
        for child in [*self.children, *self.helpers]:
            with contextlib.suppress(Exception):
                child.stop(20)

    def node_result(self, i: int, child: Child) -> dict[str, Any]:
        out = child.out.read_text(errors="replace")
        err = child.err.read_text(errors="replace")
        if self.system.startswith("gasloc"):
            evals, done = gasloc_evals(err), {}
            sent = gasloc_sent_bytes(err)
            done = {"program_bytes_sent": sent,
                    "program_bytes_kind": "counted: gossip payload" if sent is not None
                    else "not counted by the program (DiLoCo mode)", **gasloc_utilization(err)}
        else:
            records = read_records(out)
            evals = [r for r in records if r.get("event") == "eval"]
            done = next((r for r in records if r.get("event") == "done"), {})
        return {"name": child.name, "exit_code": child.proc.returncode, "evals": evals,
                "program_bytes_sent": done.get("program_bytes_sent"),
                "program_bytes_kind": done.get("program_bytes_kind", ""),
                "rate_mbit": self.hosts[i].rate_mbit,
                "utilization_est": done.get("utilization_est")}


def run_system(system: str, hosts: Sequence[HostLike], spec: Spec, data: Path, log_dir: Path,
               gateway: str = "127.0.0.1", timeout_s: float = 900.0) -> dict[str, Any]:
    """Run ``system`` on ``hosts`` (one node each) to ``spec.steps`` steps; its results."""
    if system not in SYSTEMS + OPTIONAL_SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS + OPTIONAL_SYSTEMS}")
    if system == "torchft-diloco" and (reason := torchft_unavailable()):
        return {"system": system, "skipped": reason, "nodes": []}
    run = _Run(system, hosts, spec, data, log_dir, gateway)
    before = [_counters(h) for h in hosts]
    t0 = time.time()
    finished = False
    try:
        run.start(min(timeout_s, 240.0))
        with RssSampler({c.name: c.pid for c in run.children}) as rss:
            finished = run.wait(timeout_s)
        peaks = dict(rss.peak)
    finally:
        run.stop()
    after = [_counters(h) for h in hosts]
    nodes = []
    for i, child in enumerate(run.children):
        node = run.node_result(i, child)
        node["rss_peak_bytes"] = peaks.get(child.name, 0)
        b, a = before[i], after[i]
        node["veth_tx_bytes"] = a[0] - b[0] if a and b else None
        node["veth_rx_bytes"] = a[1] - b[1] if a and b else None
        nodes.append(node)
    return {"system": system, "finished": finished, "wall_s": time.time() - t0,
            "log_dir": str(log_dir), "nodes": nodes}
