"""Helpers for the tests that run real node processes with Prometheus and the dashboard."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from gasloc_p2p.tools.nodes import NodeChild
from gasloc_p2p.tools.swarm import Swarm, SwarmConfig
from tests.daemon_helpers import write_corpus
from tests.node_helpers import scaled

T = TypeVar("T")


# Flags of the fast test nodes started as processes (torch threads 1, 2 layers, width 64).
PROCESS_NODE_ARGS = (
    "--host", "127.0.0.1", "--n-layer", "2", "--n-embd", "64", "--seq-len", "64",
    "--batch-size", "8", "--inner-steps", "20", "--torch-threads", "1", "--warmup-steps", "20",
    "--eval-interval-steps", "50", "--eval-batches", "2", "--exchanges-per-round", "1",
    "--announce-interval-s", "1", "--announce-ttl-s", "4", "--refresh-interval-s", "1",
    "--log-interval-s", "5", "--backoff-s", "3", "--no-init-from-swarm")


class NodeProc(NodeChild):
    """A `gasloc-node join` test process: :data:`PROCESS_NODE_ARGS` then ``flags``; every
    wait is scaled by GASLOC_TEST_TIMEOUT_SCALE."""

    def __init__(self, name: str, tmp: Path, flags: list[str],
                 base: tuple[str, ...] = PROCESS_NODE_ARGS) -> None:
        super().__init__(name, tmp, [*base, *flags])

    def join_hint(self, timeout_s: float = 60) -> str:
        return super().join_hint(scaled(timeout_s))

    def wait_up(self, timeout_s: float = 60) -> str:
        return super().wait_up(scaled(timeout_s))


P = TypeVar("P", bound=NodeProc)


def start_three(nodes: list[P], cls: type[P], tmp: Path, flags: list[str], prefix: str,
                algorithm: str) -> list[P]:
    """A seed and two nodes joining it (``prefix`` 0..2), appended to ``nodes`` as they start
    (so the caller's ``finally`` stops whatever started), then waited up. The seed's join hint
    must name ``--algorithm <algorithm>``."""
    seed = cls(f"{prefix}0", tmp, flags)
    nodes.append(seed)
    hint = seed.join_hint()
    assert f"--algorithm {algorithm}" in hint, hint
    maddrs = hint.split("--peers ")[1].split()
    nodes += [cls(f"{prefix}{i}", tmp, [*flags, "--peers", *maddrs]) for i in (1, 2)]
    for node in nodes:
        node.wait_up()
    return nodes


def stopped_within(node: NodeChild, timeout_s: float) -> int:
    """The exit code of ``node`` (already sent SIGTERM) once it exits within ``timeout_s``.
    If it does not, its threads' stacks (SIGUSR1: faulthandler) end the assertion message."""
    try:
        return node.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        node.signal(signal.SIGUSR1)
        time.sleep(2)
        raise AssertionError(f"{node.name} still runs {timeout_s:g} s after SIGTERM; its log "
                             f"and stacks:\n{node.tail(12000)}") from None


def tiny_node_args(corpus: Path) -> tuple[str, ...]:
    """A fast node (2 layers, width 64) on a small local corpus, quick discovery."""
    return ("--data", str(corpus), "--n-embd", "64", "--batch-size", "8",
            "--inner-steps", "10", "--warmup-steps", "20", "--eval-interval-steps", "20",
            "--eval-batches", "2", "--exchanges-per-round", "2", "--announce-interval-s", "1",
            "--announce-ttl-s", "4", "--refresh-interval-s", "1", "--log-interval-s", "5",
            "--no-init-from-swarm")


@contextmanager
def live_swarm(tmp_path: Path, nodes: int = 2, dashboard: bool = False,
               prometheus: bool = True) -> Iterator[Swarm]:
    """A started swarm (real processes; a real Prometheus, or with ``prometheus=False`` the
    dashboard's own scraper, reading every second); stopped after."""
    corpus = write_corpus(tmp_path / "corpus")
    cfg = SwarmConfig(nodes=nodes, prometheus=prometheus, scrape_interval_s=1.0,
                      dashboard_port=0 if dashboard else -1, run_dir=str(tmp_path / "run"),
                      node_args=tiny_node_args(corpus), start_timeout_s=scaled(90),
                      stop_grace_s=scaled(20))
    with (tmp_path / "swarm.out").open("w") as out, Swarm(cfg, out) as swarm:
        swarm.start(threading.Event())
        yield swarm
        children = list(swarm.nodes)
        assert swarm.stop() == 0, "a node did not exit cleanly"
        for child in children:  # a DHT's fork server notices its node's exit within a second
            wait_for(lambda c=child: not c.group_alive(), scaled(15),
                     f"{child.name}'s children to exit (it left processes behind)")


def wait_for(fn: Callable[[], T], timeout_s: float, what: str, period_s: float = 0.5) -> T:
    """Poll ``fn`` until it returns a true value (scaled timeout)."""
    deadline = time.monotonic() + scaled(timeout_s)
    last: Any = None
    while time.monotonic() < deadline:
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - keep polling, report the last one
            last = exc
        else:
            if value:
                return value
            last = value
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")
