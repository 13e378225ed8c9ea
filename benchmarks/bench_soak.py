"""Soak: a small swarm for 10 minutes with one node behind a 10 Mbit/s tbf-shaped link.

Usage: python -m benchmarks.bench_soak [--nodes 4] [--minutes 10] [--rate-mbit 10]
                                       [--warmup-minutes 2] [--sample-s 30]

Every node is a real `gasloc-node join` process (tiny model, fp32 payloads of 480 KB, 1 torch
thread, under `nice`) in its own network namespace (benchmarks.tools.netns), bound to that
namespace's address; the last node's egress is shaped with `tc tbf` to ``--rate-mbit``. Every ``--sample-s`` seconds
the benchmark reads each node's resident memory (the node process alone, and its whole process
group: node, DHT process and p2pd, from /proc) and the shaped node's exchanges (Info over
the bridge) and link bytes (kernel counters of its veth). It prints the series and a verdict:
every node's RSS growth from the end of the warm-up to the end below 10% (the node process and
the group), and the shaped node still exchanging after the warm-up. Exit code 1 if the verdict
fails; 2 if network namespaces are not usable here (root, ip and tc are needed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.swarm_eval import flags
from benchmarks.tools.netns import ShapedNetwork, netns_unavailable
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.tools.nodes import NodeChild, child_env, join_argv
from gasloc_p2p.tools.procs import Child, group_members

GROWTH_LIMIT = 0.10
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def rss_mb(pids: list[int]) -> float:
    """Resident memory of ``pids`` in MB (/proc/PID/statm; a vanished pid counts 0)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_KB
    return total / 1024


def start_node(name: str, host: object, log_dir: Path, node_flags: list[str]) -> NodeChild:
    """A niced node inside ``host``'s namespace (``ip netns exec`` keeps the pid)."""
    argv = host.cmd(["nice", "-n", "10", *join_argv(node_flags)])  # type: ignore[attr-defined]
    node = NodeChild.__new__(NodeChild)
    Child.__init__(node, name, argv, log_dir, child_env(log_dir, {}))
    node.endpoint = ""
    node.signer = Signer()  # Info is signed (an open swarm: any key will do)
    return node


def exchanges(node: NodeChild) -> int:
    try:
        info = node.info(timeout_s=10)
    except Exception:  # busy or restarting: count it as unknown
        return -1
    return int(info.exchanges_ok_initiator + info.exchanges_ok_responder)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate-mbit", type=float, default=10.0)
    p.add_argument("--warmup-minutes", type=float, default=2.0)
    p.add_argument("--sample-s", type=float, default=30.0)
    args = p.parse_args()
    reason = netns_unavailable()
    if reason:
        print(f"soak: not run: {reason}")
        return 2
    rates = [None] * (args.nodes - 1) + [args.rate_mbit]
    with tempfile.TemporaryDirectory() as tmp_dir, ShapedNetwork(rates) as net:
        tmp = Path(tmp_dir)
        nodes: list[NodeChild] = []
        peers: list[str] = []
        try:
            base = {"eval_interval_steps": 200, "metrics_port": -1, "dht_start_timeout_s": 120.0,
                    "codec": "fp32"}  # 480 KB payloads: the shaped link is the bottleneck
            for i, host in enumerate(net.hosts):
                extra = flags({**base, "host": host.addr})
                if nodes:
                    extra += ["--peers", *peers]
                nodes.append(start_node(f"n{i}", host, tmp, extra))
                if i == 0:
                    peers = nodes[0].join_peers(180)
            for node in nodes:
                node.wait_up(180)
            return _observe(args, net, nodes)
        finally:
            codes = [node.stop(30) for node in nodes]
            print(f"exit codes after SIGTERM: {codes}")


def _observe(args: argparse.Namespace, net: ShapedNetwork, nodes: list[NodeChild]) -> int:
    shaped, host = nodes[-1], net.hosts[-1]
    t0 = time.monotonic()
    series: list[tuple[float, list[float], list[float], int, int, int]] = []
    print(f"soak: {len(nodes)} nodes in network namespaces, {shaped.name} behind a "
          f"{args.rate_mbit:g} Mbit/s tbf link; {args.minutes:g} min, a sample every "
          f"{args.sample_s:g} s (RSS in MB: node process / whole group)", flush=True)
    while True:
        minute = (time.monotonic() - t0) / 60
        groups = [group_members(n.pid) for n in nodes]
        own = [rss_mb([n.pid]) for n in nodes]
        total = [rss_mb(g) for g in groups]
        x = exchanges(shaped)
        series.append((minute, own, total, x, host.tx_bytes(), host.rx_bytes()))
        print(f"  {minute:5.2f} min  " + "  ".join(
            f"{n.name} {o:6.1f}/{t:6.1f}" for n, o, t in zip(nodes, own, total, strict=True))
            + f"  | {shaped.name}: exchanges {x}, tx {series[-1][4] / 1e6:.1f} MB, "
              f"rx {series[-1][5] / 1e6:.1f} MB", flush=True)
        dead = [n.name for n in nodes if not n.alive]
        if dead:
            print(f"soak: FAILED: {dead} exited early")
            return 1
        if minute >= args.minutes:
            break
        time.sleep(max(0.0, t0 + (len(series)) * args.sample_s - time.monotonic()))
    return _verdict(args, nodes, series)


def _verdict(args: argparse.Namespace, nodes: list[NodeChild],
             series: list[tuple[float, list[float], list[float], int, int, int]]) -> int:
    warm = next(s for s in series if s[0] >= args.warmup_minutes)
    end = series[-1]
    ok = True
    for i, node in enumerate(nodes):
        g_own = end[1][i] / warm[1][i] - 1
        g_all = end[2][i] / warm[2][i] - 1
        good = g_own < GROWTH_LIMIT and g_all < GROWTH_LIMIT
        ok &= good
        print(f"{node.name}: RSS at {warm[0]:.1f} min {warm[1][i]:.1f} / {warm[2][i]:.1f} MB, "
              f"at {end[0]:.1f} min {end[1][i]:.1f} / {end[2][i]:.1f} MB: growth "
              f"{100 * g_own:+.1f}% / {100 * g_all:+.1f}% ({'ok' if good else 'TOO MUCH'})")
    span_s = (end[0] - warm[0]) * 60
    gossip = end[3] - warm[3] if end[3] >= 0 and warm[3] >= 0 else -1
    tx_mbit = (end[4] - warm[4]) * 8 / 1e6 / span_s
    print(f"{nodes[-1].name} (shaped): {gossip} exchanges after the warm-up "
          f"({end[3]} in all), egress {tx_mbit:.2f} Mbit/s on average "
          f"(limit {args.rate_mbit:g})")
    ok &= gossip > 0
    print(f"verdict: {'PASS' if ok else 'FAIL'} (every node's RSS growth after the warm-up "
          f"< {100 * GROWTH_LIMIT:.0f}%, the shaped node keeps exchanging)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
