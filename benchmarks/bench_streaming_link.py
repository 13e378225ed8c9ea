"""Streaming DiLoCo vs whole-model DiLoCo on tbf-shaped links: utilization and bandwidth.

Usage (root, iproute2): python -m benchmarks.bench_streaming_link [--nodes 3] [--rate-mbit 8]
        [--fragments 4] [--taus 0 8] [--codec fp4] [--inner-steps 50] [--seconds 60]
        [-- more join flags]

Every node runs in its own network namespace (:mod:`benchmarks.tools.netns`), its gRPC, DHT
and metrics ports bound to the namespace's address. One after the other, on the same network:
``--algorithm streaming-diloco`` at each ``--taus`` value, then ``--algorithm diloco`` (the
whole model all-reduced every H steps, blocking), all with the same codec. The links are left
unshaped while the nodes warm up (the joiners adopt the first node's state, one full-state
download per fragment, which would take minutes on the slow link) until every node has averaged
every fragment twice; then every node's egress is shaped with ``tc tbf`` to ``--rate-mbit``,
and after ``--settle-s`` the bench records for ``--seconds`` each node's Info counters and,
four times a second, the bytes its veth sent (kernel counter). Per configuration (means over
nodes):

- steps/s and utilization: the share of wall time the trainer was not stalled waiting for an
  all-reduce result, by Info's own count (``total_averaging_s``: DiLoCo waits for every round,
  streaming only for the part of a sync the ``--tau`` overlap did not hide). It leaves out the
  state downloads of a node that fell off the group's history (resyncs: counted, and their
  bytes show in the veth's count, not in the program's averaging count);
- bytes per sync, the program's own count (encoded hivemind parts): the burst one sync puts on
  the link; whole-model DiLoCo's is about the fragments' sum, streaming's the largest fragment's
  (the averager is shared and sized to it), so their ratio is the peak-bandwidth reduction;
- the veth's mean and peak (largest 1 s window) send rate, and the veth bytes over the
  program's count (framing, TCP/IP, libp2p, DHT and matchmaking traffic on top of payloads,
  and TCP's resends of what the shaper dropped: its drop count is shown).

Timings on shared 2-core machines vary by about 30%: compare rows of one run.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.tools.netns import Host, ShapedNetwork, netns_unavailable
from gasloc_p2p.data import ensure_shakespeare
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.tools.nodes import CREDENTIAL_FLAGS, NodeChild, child_env, join_argv
from gasloc_p2p.tools.procs import Child

FLAGS = ["--torch-threads", "1", "--log-interval-s", "30", "--eval-interval-steps", "1000000",
         "--matchmaking-time-s", "2", "--request-timeout-s", "1", "--n-layer", "4",
         "--seq-len", "64", "--batch-size", "4", "--warmup-steps", "10"]
SAMPLE_S = 0.25


class NsNode(NodeChild):
    """``gasloc-node join`` inside ``host``'s namespace, its ports on the host's address."""

    def __init__(self, name: str, host: Host, log_dir: Path, flags: list[str]) -> None:
        if not any(f.split("=")[0] in CREDENTIAL_FLAGS for f in flags):
            flags = [*flags, "--open"]  # swarms are closed by default: these run open ones
        argv = host.cmd(join_argv(["--host", host.addr, *flags]))
        Child.__init__(self, name, argv, log_dir,
                       child_env(log_dir, {"HIVEMIND_LOGLEVEL": "ERROR"}))
        self.endpoint = ""
        self.signer = Signer()
        self.host = host


def start_nodes(hosts: list[Host], log_dir: Path, flags: list[str], nodes: list[NsNode]
                ) -> None:
    """A node in every host, the first starting the swarm and the others joining it; each
    is appended to ``nodes`` as it starts (the caller stops them, also after a failure), and
    all are up on return."""
    nodes.append(NsNode("n0", hosts[0], log_dir, flags))
    peers = nodes[0].join_peers(180)
    nodes += [NsNode(f"n{i}", hosts[i], log_dir, [*flags, "--peers", *peers])
              for i in range(1, len(hosts))]
    for n in nodes:
        n.wait_up(180)


@dataclass
class Run:
    label: str
    seconds: float
    first: list[pb.InfoReply]
    last: list[pb.InfoReply]
    tx: list[list[tuple[float, int]]]  # per node: (time, veth tx bytes) samples
    drops: list[int]  # per node: packets the shaper dropped in the window
    per_sync: list[float] = field(default_factory=list)  # program bytes per sync, per node


def syncs_ok(info: pb.InfoReply) -> int:
    """Fewest averaged syncs of any fragment (streaming) or averaged rounds (DiLoCo)."""
    if info.fragment_syncs:
        return min(f.syncs_ok for f in info.fragment_syncs)
    return int(info.averaging_rounds_ok)


def wait_warm(nodes: list[NsNode], syncs: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while min(syncs_ok(n.info()) for n in nodes) < syncs:
        if time.monotonic() > deadline:
            raise TimeoutError(f"warm-up: syncs {[syncs_ok(n.info()) for n in nodes]}")
        time.sleep(0.5)


def tbf_drops(host: Host) -> int:
    """Packets the host's shaper has dropped (TCP sends them again: the veth counts both)."""
    found = re.search(r"dropped (\d+)", host.qdisc_stats())
    return int(found.group(1)) if found else 0


def sample_tx(hosts: list[Host], stop: threading.Event) -> list[list[tuple[float, int]]]:
    """Every host's veth tx counter, every :data:`SAMPLE_S`, until ``stop``."""
    out: list[list[tuple[float, int]]] = [[] for _ in hosts]
    while True:
        for k, h in enumerate(hosts):
            out[k].append((time.monotonic(), h.tx_bytes()))
        if stop.wait(SAMPLE_S):
            return out


def say(text: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {text}", flush=True)


def measure(net: ShapedNetwork, label: str, flags: list[str], args: argparse.Namespace) -> Run:
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(args.log_dir) / label.replace(" ", "_") if args.log_dir else Path(tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        hosts = net.hosts
        nodes: list[NsNode] = []
        try:
            start_nodes(hosts, tmp, flags, nodes)
            say(f"{label}: {len(nodes)} nodes up; warming up on unshaped links")
            wait_warm(nodes, 2, args.timeout_s)
            for h in hosts:
                h.shape(args.rate_mbit)
            time.sleep(args.settle_s)
            say(f"{label}: links shaped to {args.rate_mbit:g} Mbit/s; measuring "
                f"{args.seconds:g} s")
            stop = threading.Event()
            samples: list[list[list[tuple[float, int]]]] = []
            sampler = threading.Thread(target=lambda: samples.append(sample_tx(hosts, stop)))
            t0, first = time.monotonic(), [n.info() for n in nodes]
            drops0 = [tbf_drops(h) for h in hosts]
            sampler.start()
            time.sleep(args.seconds)
            last = [n.info() for n in nodes]
            drops = [tbf_drops(h) - d for h, d in zip(hosts, drops0, strict=True)]
            t1 = time.monotonic()
            stop.set()
            sampler.join()
        finally:
            for n in nodes:
                n.stop(30)
            for h in hosts:
                h.shape(None)
    return Run(label, t1 - t0, first, last, samples[0], drops)


def sync_bytes(a: pb.InfoReply, b: pb.InfoReply) -> float:
    """Program-counted bytes one sync sent: the largest fragment's (streaming) or a round's."""
    if b.fragment_syncs:
        return max((fb.bytes_sent - fa.bytes_sent)
                   / max(1, fb.syncs_ok + fb.syncs_failed - fa.syncs_ok - fa.syncs_failed)
                   for fa, fb in zip(a.fragment_syncs, b.fragment_syncs, strict=True))
    rounds = b.averaging_rounds_ok + b.averaging_rounds_failed
    rounds -= a.averaging_rounds_ok + a.averaging_rounds_failed
    return (b.bytes_sent - a.bytes_sent) / max(1, rounds)


def peak_rate(samples: list[tuple[float, int]], window_s: float = 1.0) -> float:
    """Largest bytes/s over any ``window_s`` span of the samples."""
    best, j = 0.0, 0
    for i in range(len(samples)):
        while samples[i][0] - samples[j][0] > window_s:
            j += 1
        span = samples[i][0] - samples[j][0]
        if span >= window_s * 0.9:
            best = max(best, (samples[i][1] - samples[j][1]) / span)
    return best


def report(run: Run) -> dict[str, float]:
    rows = []
    for a, b, tx, drops in zip(run.first, run.last, run.tx, run.drops, strict=True):
        stalled = (b.total_averaging_s - a.total_averaging_s) / run.seconds
        veth = tx[-1][1] - tx[0][1]
        span = tx[-1][0] - tx[0][0]
        program = b.bytes_sent - a.bytes_sent
        rows.append({"steps/s": (b.step - a.step) / run.seconds, "utilization": 1 - stalled,
                     "B/sync": sync_bytes(a, b), "veth mean Mbit/s": veth * 8 / span / 1e6,
                     "veth peak Mbit/s": peak_rate(tx) * 8 / 1e6,
                     "veth / program": veth / program if program else float("nan"),
                     "tbf drops": float(drops), "resyncs": float(b.resyncs - a.resyncs),
                     "failed": float(sum(f.syncs_failed for f in b.fragment_syncs)
                                     - sum(f.syncs_failed for f in a.fragment_syncs)
                                     + b.averaging_rounds_failed - a.averaging_rounds_failed)})
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rate-mbit", type=float, default=8.0, help="egress of every node")
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="after shaping, wait this long before measuring")
    parser.add_argument("--fragments", type=int, default=4, help="--fragments (layers split)")
    parser.add_argument("--taus", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--codec", default="fp4", help="--diloco-codec of every node")
    parser.add_argument("--inner-steps", type=int, default=50, help="H of every node")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window per run")
    parser.add_argument("--data", default="", help="corpus (default: Shakespeare, fetched here "
                        "once: the namespaces reach nothing but each other)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--log-dir", default="", help="keep the nodes' logs here")
    parser.add_argument("extra", nargs="*", help="more gasloc-node join flags (after --)")
    args = parser.parse_args()
    reason = netns_unavailable()
    if reason is not None:
        sys.exit(f"bench_streaming_link: {reason}")
    data = args.data or str(ensure_shakespeare())
    common = [*FLAGS, "--data", data, "--diloco-codec",
              args.codec, "--inner-steps", str(args.inner_steps), *args.extra]
    configs = [(f"streaming tau {tau}", ["--algorithm", "streaming-diloco", "--fragments",
                                         str(args.fragments), "--tau", str(tau), *common])
               for tau in args.taus]
    configs.append(("diloco (whole model)", ["--algorithm", "diloco", *common]))
    print(f"{args.nodes} nodes, each in its own namespace, egress tbf {args.rate_mbit:g} Mbit/s; "
          f"--fragments {args.fragments} --diloco-codec {args.codec} --inner-steps "
          f"{args.inner_steps} {' '.join(args.extra)}; {args.seconds:g} s windows")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_streaming_link: terminated"))
    results = []
    with ShapedNetwork([None] * args.nodes) as net:  # shaped after each warm-up
        for label, flags in configs:
            results.append((label, report(measure(net, label, flags, args))))
            say(f"{label}: done")
    keys = list(results[0][1])
    print("\n| configuration | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for label, r in results:
        print(f"| {label} | " + " | ".join(
            f"{r[k]:,.0f}" if k in ("B/sync", "tbf drops") else f"{r[k]:.2f}" for k in keys)
              + " |")
    whole = results[-1][1]["B/sync"]
    for label, r in results[:-1]:
        print(f"{label}: bytes per sync {whole / r['B/sync']:.2f}x fewer than whole-model "
              f"DiLoCo, veth peak {results[-1][1]['veth peak Mbit/s'] / r['veth peak Mbit/s']:.2f}x"
              f" lower; utilization {r['utilization']:.2f} vs "
              f"{results[-1][1]['utilization']:.2f}")


if __name__ == "__main__":
    main()
