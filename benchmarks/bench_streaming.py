"""Streaming DiLoCo in the daemon: peak bandwidth per sync and compute utilization, on loopback.

Usage: python -m benchmarks.bench_streaming [--nodes 2] [--fragments 4] [--taus 0 3]
                                            [--codec fp4] [--seconds 60] [-- more join flags]

For each ``--taus`` value, starts ``--nodes`` `gasloc-node join --algorithm streaming-diloco`
processes on 127.0.0.1 (torch threads 1 each), waits until every fragment averaged twice on
every node (warm-up), then measures for ``--seconds`` from the nodes' Info counters:
- bytes/sync of each fragment: encoded payload bytes a node sent in one fragment's all-reduce
  (hivemind parts, counted by the codec wrapper). The peak of streaming mode is the largest
  fragment's; whole-model DiLoCo sends all fragments at once, so its peak is their sum (the
  same all-reduce over the whole vector): the ratio is the peak-bandwidth reduction (about the
  number of fragments when they are of similar size);
- utilization: inner steps per second of wall time, and the share of wall time the trainer
  stalled waiting for all-reduce results (with tau = 0 every sync blocks training; with
  tau > 0 it overlaps tau inner steps). The fragments share one averager sized to the largest
  fragment, so the smaller (non-layer) fragment is zero-padded and costs as much as a layer.
Loopback, not a shaped link: the all-reduce's cost here is hivemind's matchmaking and
round trips rather than bandwidth (``benchmarks/bench_streaming_link.py`` runs the nodes on
tbf-shaped links in network namespaces). Timings on shared 2-core machines vary by about 30%.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.compress import parse_codec
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.tools.nodes import NodeChild

FLAGS = ["--algorithm", "streaming-diloco", "--host", "127.0.0.1", "--torch-threads", "1",
         "--log-interval-s", "30", "--eval-interval-steps", "1000000"]


def start_node(name: str, tmp: Path, flags: list[str]) -> NodeChild:
    return NodeChild(name, tmp, [*FLAGS, *flags], env={"HIVEMIND_LOGLEVEL": "ERROR"})


def wait_warm(nodes: list[NodeChild], syncs: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [n.info() for n in nodes]
        if all(i.fragment_syncs and min(f.syncs_ok for f in i.fragment_syncs) >= syncs
               for i in infos):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"syncs {[[f.syncs_ok for f in i.fragment_syncs] for i in infos]}")
        time.sleep(0.5)


def measure(args: argparse.Namespace, tau: int) -> dict[str, object]:
    """Run one swarm with ``--tau tau``; per-node deltas over the measured window."""
    flags = [*(["--data", args.data] if args.data else []), "--fragments", str(args.fragments),
             "--tau", str(tau), "--diloco-codec", args.codec, "--inner-steps",
             str(args.inner_steps), *args.extra]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        nodes = [start_node("n0", tmp, flags)]
        try:
            peers = nodes[0].join_peers(180)
            nodes += [start_node(f"n{i}", tmp, [*flags, "--peers", *peers])
                      for i in range(1, args.nodes)]
            for n in nodes:
                n.wait_up(180)
            numel = int(nodes[0].wait_for(r"model (\d+) params", 10, stdout=False).group(1))
            wait_warm(nodes, 2, args.timeout_s)
            t0, first = time.monotonic(), [n.info() for n in nodes]
            time.sleep(args.seconds)
            t1, last = time.monotonic(), [n.info() for n in nodes]
        finally:
            for n in nodes:
                n.stop(30)
    return {"numel": numel, "seconds": t1 - t0, "first": first, "last": last}


def report(tau: int, run: dict[str, object], codec: str) -> tuple[float, float, float]:
    """Print one run's table; returns (steps/s, stalled share, peak bandwidth reduction), means
    over nodes. The reduction compares a whole-model sync with the same codec (computed: an
    all-reduce's ``2 (n-1)/n * wire_bytes(numel)``, a sparse all-gather's ``(n-1)(n+1)/n``
    messages) with the largest measured bytes of one fragment's sync."""
    first: list[pb.InfoReply] = run["first"]  # type: ignore[assignment]
    last: list[pb.InfoReply] = run["last"]  # type: ignore[assignment]
    seconds = float(run["seconds"])  # type: ignore[arg-type]
    numel, n = int(run["numel"]), len(last)  # type: ignore[call-overload]
    spec = parse_codec(codec)
    if isinstance(spec, CodecSpec):  # an all-reduce: 2 (n - 1) / n of the vector
        whole = 2 * (n - 1) / n * spec.codec().wire_bytes(numel)
    else:  # a sparse all-gather: (n - 1)(n + 1) / n messages per node on average
        assert spec is not None
        whole = (n - 1) * (n + 1) / n * spec.wire_bytes(numel)
    print(f"\n--tau {tau}: {n} nodes, {numel:,} parameters, window {seconds:.0f} s; a "
          f"whole-model {codec} sync: {whole:,.0f} bytes per node")
    print(f"{'node':<5} {'steps/s':>7} {'stalled %':>9} {'syncs ok':>8} {'failed':>6} "
          f"{'peak B/sync':>11}  bytes/sync per fragment (numel)")
    rows = []
    for k, (a, b) in enumerate(zip(first, last, strict=True)):
        pairs = list(zip(a.fragment_syncs, b.fragment_syncs, strict=True))
        stalled = sum(fb.wait_s - fa.wait_s for fa, fb in pairs) / seconds
        per_frag = [(fb.bytes_sent - fa.bytes_sent)
                    / max(1, fb.syncs_ok + fb.syncs_failed - fa.syncs_ok - fa.syncs_failed)
                    for fa, fb in pairs]
        ok = sum(fb.syncs_ok - fa.syncs_ok for fa, fb in pairs)
        failed = sum(fb.syncs_failed - fa.syncs_failed for fa, fb in pairs)
        frags = " ".join(f"{p:,.0f} ({fb.numel:,})" for p, (_, fb) in zip(per_frag, pairs,
                                                                          strict=True))
        rate = (b.step - a.step) / seconds
        print(f"n{k:<4} {rate:>7.2f} {100 * stalled:>8.1f}% {ok:>8} {failed:>6} "
              f"{max(per_frag):>11,.0f}  {frags}")
        rows.append((rate, stalled, whole / max(per_frag) if max(per_frag) else math.nan))
    return tuple(sum(r[i] for r in rows) / len(rows) for i in range(3))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--fragments", type=int, default=4, help="--fragments (layers split)")
    parser.add_argument("--taus", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--codec", default="fp4", help="--diloco-codec of every node")
    parser.add_argument("--inner-steps", type=int, default=20, help="H of every node")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window per run")
    parser.add_argument("--data", default="", help="corpus (default: Shakespeare, downloaded)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("extra", nargs="*", help="more gasloc-node join flags (after --)")
    args = parser.parse_args()
    print(f"Streaming DiLoCo on loopback: --fragments {args.fragments} --diloco-codec "
          f"{args.codec} --inner-steps {args.inner_steps}, torch threads 1 per node "
          f"{' '.join(args.extra)}")
    runs = [(tau, measure(args, tau)) for tau in args.taus]
    summary = [(tau, *report(tau, run, args.codec)) for tau, run in runs]
    print("\nsummary (means over nodes): inner steps per second of wall time, share of wall time "
          "stalled waiting for all-reduce results, whole-model / streaming peak bytes per sync")
    for tau, rate, stalled, ratio in summary:
        print(f"  tau {tau}: {rate:.2f} steps/s, stalled {100 * stalled:.1f}%, peak bandwidth "
              f"reduction {ratio:.2f}x")

if __name__ == "__main__":
    main()
