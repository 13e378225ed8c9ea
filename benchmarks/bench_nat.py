"""Nodes behind home routers: who exchanges with whom, by which path, and how fast.

    python -m benchmarks.bench_nat [--seconds 600] [--rate-mbit 20] [--symmetric]

Builds the internet and homes in network namespaces (:class:`benchmarks.tools.netns.NatNetwork`):
one reachable node on the public bridge, and ``--homes`` homes of ``--per-home`` nodes, each home
behind its own router doing NAT (iptables MASQUERADE, nothing forwarded; ``--symmetric``: the
last home's router maps every connection to a random port). The home nodes join with the
public node's join line and ``--client-mode`` (``--auto``: without it; they learn from
dial-backs that nobody can reach them); nothing else is configured. After ``--seconds``
it prints each node's partners by path (direct: gRPC to a reachable node; relayed: through a
reachable node's relay), the reachable node's share of all exchanges, every routed node's first
exchange after its start, and each path's exchange time against the payload's time at the
link rate. Needs root, iproute2 and iptables.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.tools.netns import Host, NatNetwork, nat_unavailable
from gasloc_p2p.core.codecs import get_codec
from gasloc_p2p.tools.nodes import join_argv, node_env
from gasloc_p2p.tools.procs import Child

FLAGS = ["--open", "--torch-threads", "1", "--max-steps", "1000000", "--log-interval-s", "10"]
VIA = re.compile(r"^(\S+ \S+) DEBUG gasloc_p2p\.node\.stats: exchange to (\w+) via (\w+) in "
                 r"([\d.]+) s$", re.M)
UP = re.compile(r"^(\S+ \S+) INFO gasloc_p2p\.node\.daemon: node (\w+) up: gRPC")
MODEL = re.compile(r"up: gRPC .*, model (\d+) params .* codec (\w+)")
TRAFFIC = re.compile(r"exchanges ok (\d+) .* sent ([\d.]+) MB recv ([\d.]+) MB")


@dataclass
class Node:
    name: str
    host: Host
    child: Child | _Logs
    peer_id: str = ""
    up_at: float = 0.0
    sent: list[tuple[float, str, str, float]] = field(default_factory=list)  # t, to, path, s
    ok: int = 0
    mb: float = 0.0
    payload_mb: float = 0.0  # one payload on the wire, from the model's size and codec


def _clock(stamp: str) -> float:
    day, clock = stamp.split(" ")
    t = time.mktime(time.strptime(f"{day} {clock.split(',')[0]}", "%Y-%m-%d %H:%M:%S"))
    return t + int(clock.split(",")[1]) / 1000


class _Logs:
    """An earlier run's logs, where :func:`read` looks for a child's."""

    def __init__(self, log_dir: Path, name: str) -> None:
        self.err = log_dir / f"{name}.err"


def net_host_unknown() -> Host:
    return Host(ns="", addr="", rate_mbit=None)


def start(name: str, host: Host, log_dir: Path, flags: list[str],
          env: dict[str, str] | None = None) -> Node:
    argv = host.cmd(join_argv([*flags, "--identity-file", str(log_dir / f"{name}.key")],
                              "DEBUG"))
    return Node(name, host, Child(name, argv, log_dir,
                                  node_env({"HIVEMIND_LOGLEVEL": "ERROR", **(env or {})})))


def read(node: Node) -> None:
    text = node.child.err.read_text(errors="replace")
    up = next((m for m in map(UP.match, text.splitlines()) if m), None)
    if up is not None:
        node.up_at, node.peer_id = _clock(up.group(1)), up.group(2)
    node.sent = [(_clock(t), to, path, float(s)) for t, to, path, s in VIA.findall(text)]
    model = MODEL.search(text)
    if model is not None:
        node.payload_mb = get_codec(model.group(2)).wire_bytes(int(model.group(1))) / 1e6
    last = TRAFFIC.findall(text)
    if last:
        ok, sent, recv = last[-1]
        node.ok, node.mb = int(ok), float(sent)


def sharing(exchanges: list[tuple[str, str, float, float]], shaped: set[str]) -> list[int]:
    """For each exchange ``(initiator, partner, end, seconds)``: how many other exchanges
    overlapped it in time on either of its two nodes (as initiator or partner) where that
    node's uplink is shaped (``shaped``: their names; an unshaped one is not shared). A node's
    uplink carries every exchange it runs at once, so one that overlapped another took about
    twice the payload's time on the link wherever that node's uplink is the slow side
    (bench_nat's 3-node run: a relayed exchange of 14.8 s beside a direct one of 13.3 s on the
    same home uplink, each 7.4-7.6 s alone); only exchanges that ran alone time the path."""
    spans = [(a, b, end - seconds, end) for a, b, end, seconds in exchanges]
    out = []
    for i, (a, b, start, end) in enumerate(spans):
        out.append(sum(1 for j, (c, d, s2, e2) in enumerate(spans)
                       if j != i and s2 < end and start < e2 and {a, b} & {c, d} & shaped))
    return out


def report(nodes: list[Node], rate_mbit: float, public_rate: float | None) -> dict[str, object]:
    by_prefix = {n.peer_id[:12]: n for n in nodes}
    pairs: Counter[tuple[str, str, str]] = Counter()
    partners: dict[str, set[str]] = defaultdict(set)
    times: dict[str, list[float]] = defaultdict(list)
    first_at: dict[str, float] = {}
    for n in nodes:
        for at, to, path, seconds in n.sent:
            other = by_prefix.get(to)
            name = other.name if other else to
            pairs[(n.name, name, path)] += 1
            partners[n.name].add(name)
            partners[name].add(n.name)
            times[path].append(seconds)
            for who in (n.name, name):  # either side's first commit, whoever started it
                first_at[who] = min(first_at.get(who, at), at)
    total = sum(pairs.values())
    public = nodes[0].name
    with_public = sum(c for (a, b, _), c in pairs.items() if public in (a, b))
    print(f"\n{'initiator':>10} -> {'partner':<10} {'path':<11} exchanges")
    for (a, b, path), c in sorted(pairs.items()):
        print(f"{a:>10} -> {b:<10} {path:<11} {c}")
    print("\nnode        distinct partners   first exchange (either role) after its start (s)")
    firsts = {}
    for n in nodes:
        first = first_at.get(n.name, float("nan"))
        firsts[n.name] = first - n.up_at if n.up_at else float("nan")
        print(f"{n.name:<10} {len(partners[n.name]):>8}            {firsts[n.name]:8.1f}")
    # (not sent bytes over exchanges: those count the failed exchanges' bytes too)
    payload_mb = max((n.payload_mb for n in nodes), default=0.0) or float("nan")
    payload_s = payload_mb * 8 / rate_mbit
    print(f"\nexchanges {total}; the reachable node takes part in {with_public} "
          f"({with_public / max(total, 1):.0%})")
    print(f"payload about {payload_mb:.2f} MB each way: {payload_s:.2f} s at {rate_mbit:g} "
          f"Mbit/s (homes' uplink; the reachable node's: "
          f"{f'{public_rate:g} Mbit/s' if public_rate else 'unshaped'})")
    for path, values in sorted(times.items()):
        median = statistics.median(values)
        print(f"  {path:<11} median {median:.2f} s = {median / payload_s:.2f}x payload/link "
              f"({len(values)} exchanges)")
    # the same, for the exchanges that had both nodes' uplinks to themselves, by kind of pair
    records = [(n.name, by_prefix[to].name if to in by_prefix else to, at, seconds, path)
               for n in nodes for at, to, path, seconds in n.sent]
    shaped = {n.name for n in nodes if n.name != public or public_rate}
    shared = sharing([(a, b, at, s) for a, b, at, s, _ in records], shaped)
    alone: dict[str, list[float]] = defaultdict(list)
    for (a, b, _, seconds, path), k in zip(records, shared, strict=True):
        if k == 0:
            pair = "home-home" if public not in (a, b) else "public-home"
            alone[f"{path} {pair}"].append(seconds)
    print(f"alone on both nodes' shaped uplinks ({shared.count(0)} of {len(records)} exchanges; "
          "the others overlapped another exchange on a shaped uplink of either node):")
    for kind, values in sorted(alone.items()):
        median = statistics.median(values)
        print(f"  {kind:<23} median {median:.2f} s = {median / payload_s:.2f}x payload/link "
              f"({len(values)} exchanges, {min(values):.2f}-{max(values):.2f} s)")
    return {"pairs": pairs, "partners": {k: len(v) for k, v in partners.items()},
            "share": with_public / max(total, 1), "firsts": firsts, "times": times,
            "alone": dict(alone)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600.0, help="measured run")
    parser.add_argument("--homes", type=int, default=2)
    parser.add_argument("--per-home", type=int, default=2, help="nodes behind each router")
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="each home node's uplink")
    parser.add_argument("--public-rate-mbit", type=float, default=0.0,
                        help="the reachable node's uplink (0: unshaped)")
    parser.add_argument("--auto", action="store_true",
                        help="home nodes without --client-mode: they find out from dial-backs")
    parser.add_argument("--symmetric", action="store_true",
                        help="the last home's router maps each connection to a random port")
    parser.add_argument("--congestion", default="cubic",
                        help="TCP congestion control of the nodes' namespaces (cubic: what "
                             "Linux, Windows and macOS run by default; 'system': this "
                             "machine's own, here bbr, which retransmitted 20-45%% of the "
                             "bytes on the shaped uplinks)")
    parser.add_argument("--log-dir", default="", help="keep the nodes' logs here")
    parser.add_argument("--report", default="", metavar="DIR",
                        help="only print the report of an earlier run's --log-dir")
    parser.add_argument("extra", nargs="*", help="more join flags for every node (after --)")
    args = parser.parse_args(argv)
    if args.report:
        names = sorted(p.stem for p in Path(args.report).glob("home*.err"))
        again = [Node(name, net_host_unknown(), _Logs(Path(args.report), name))
                 for name in ["public", *names]]
        for n in again:
            read(n)
        report(again, args.rate_mbit, args.public_rate_mbit or None)
        return 0
    reason = nat_unavailable()
    if reason is not None:
        print(f"bench_nat: {reason}", file=sys.stderr)
        return 2
    public_rate = args.public_rate_mbit or None
    homes = [[args.rate_mbit] * args.per_home for _ in range(args.homes)]
    symmetric = [args.homes - 1] if args.symmetric else []
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-nat-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    nodes: list[Node] = []
    congestion = None if args.congestion == "system" else args.congestion
    with NatNetwork([public_rate], homes, symmetric, congestion) as net:
        try:
            first = start("public", net.public[0], log_dir,
                          [*FLAGS, "--host", net.public[0].addr, *args.extra])
            nodes.append(first)
            peers = first.child.wait_for(r"--peers (\S+)", 120).group(1)
            for h, hosts in enumerate(net.homes):
                for i, host in enumerate(hosts):
                    mode = [] if args.auto else ["--client-mode"]
                    nodes.append(start(f"home{h}.{i}", host, log_dir,
                                       [*FLAGS, *mode, "--peers", peers, *args.extra]))
            for n in nodes:
                n.child.wait_for(r"up: gRPC", 180, stdout=False)
            print(f"bench_nat: {len(nodes)} nodes up ({args.homes} homes behind routers"
                  f"{', the last symmetric' if args.symmetric else ''}); running "
                  f"{args.seconds:g} s; logs in {log_dir}", flush=True)
            time.sleep(args.seconds)
        finally:
            for n in nodes:
                n.child.stop(30.0)
    for n in nodes:
        read(n)
    report(nodes, args.rate_mbit, public_rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
