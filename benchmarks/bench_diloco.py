"""DiLoCo in the daemon: wall time of one averaging round on loopback (`--algorithm diloco`).

Usage: python -m benchmarks.bench_diloco [--nodes 2] [--rounds 10] [--inner-steps 20]
                                         [--codecs fp32 topk2:123] [--data PATH]
                                         [-- more join flags]

Starts ``--nodes`` `gasloc-node join --algorithm diloco` processes on 127.0.0.1 (default model
unless extra flags say otherwise, torch threads 1 each), lets every node average twice (warm-up),
then measures over the next ``--rounds`` averaged rounds of every node, from its Info counters:
- averaging s/round: the trainer thread's wait for matchmaking plus the hivemind all-reduce of
  the outer gradient (it includes waiting for the slowest node: the cost DiLoCo pays);
- round s: wall time per outer epoch (H inner steps, evaluations and the averaging);
- other s/round: the rest of a round, mostly the H inner steps;
- sent and received B/round: payload bytes a node put on and took off the wire per round
  (hivemind parts and, for a sparse codec's all-gather, the reducers' relays), and the fp32
  outer gradient's size over the bytes sent.
Each of ``--codecs`` runs its own swarm, one after the other.
Timings on shared 2-core machines vary by about 30% run to run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gasloc_p2p.node.config import NodeConfig
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.tools.nodes import NodeChild

DILOCO_FLAGS = ["--algorithm", "diloco", "--host", "127.0.0.1", "--torch-threads", "1",
                "--log-interval-s", "30"]


def start_node(name: str, tmp: Path, flags: list[str]) -> NodeChild:
    return NodeChild(name, tmp, [*DILOCO_FLAGS, *flags], env={"HIVEMIND_LOGLEVEL": "ERROR"})


def wait_rounds(nodes: list[NodeChild], at_least: list[int], timeout_s: float) -> list[pb.InfoReply]:
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [n.info() for n in nodes]
        if all(i.averaging_rounds_ok >= k for i, k in zip(infos, at_least, strict=True)):
            return infos
        if time.monotonic() > deadline:
            raise TimeoutError(f"averaged rounds {[i.averaging_rounds_ok for i in infos]}")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10, help="averaged rounds measured")
    parser.add_argument("--inner-steps", type=int, default=NodeConfig().train.inner_steps,
                        help="H of every node")
    parser.add_argument("--codecs", nargs="+", default=["fp32"],
                        help="--diloco-codec of every node; one swarm per codec")
    parser.add_argument("--data", default="", help="corpus (default: Shakespeare, downloaded)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("extra", nargs="*", help="more gasloc-node join flags (after --)")
    args = parser.parse_args()
    for codec in args.codecs:
        run(args, codec)


def run(args: argparse.Namespace, codec: str) -> None:
    flags = [*(["--data", args.data] if args.data else []), "--diloco-codec", codec,
             "--inner-steps", str(args.inner_steps), *args.extra]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        nodes = [start_node("n0", tmp, flags)]
        try:
            peers = nodes[0].join_peers(180)
            nodes += [start_node(f"n{i}", tmp, [*flags, "--peers", *peers])
                      for i in range(1, args.nodes)]
            numel = 0
            for n in nodes:
                n.wait_up(180)
                numel = int(n.wait_for(r"model (\d+) params", 10, stdout=False).group(1))
            first = wait_rounds(nodes, [2] * len(nodes), args.timeout_s)
            t0 = time.monotonic()
            last = wait_rounds(nodes, [i.averaging_rounds_ok + args.rounds for i in first],
                               args.timeout_s)
            t1 = time.monotonic()
        finally:
            for n in nodes:
                n.stop(30)
    print(f"\nDiLoCo averaging on loopback: {len(nodes)} nodes, {numel:,} parameters "
          f"({numel * 4 / 1e6:.2f} MB fp32 outer gradient, --diloco-codec {codec}), "
          f"H = {args.inner_steps}, torch threads 1 per node {' '.join(args.extra)}")
    print(f"{'node':<5} {'rounds ok':>9} {'failed':>6} {'averaging s/round':>17} "
          f"{'round s':>8} {'other s/round':>13} {'group':>5} {'sent B/round':>12} "
          f"{'received B/round':>16} {'fp32 / sent':>11}")
    for n, a, b in zip(nodes, first, last, strict=True):
        waited = (b.averaging_rounds_ok + b.averaging_rounds_failed
                  - a.averaging_rounds_ok - a.averaging_rounds_failed)
        avg_s = (b.total_averaging_s - a.total_averaging_s) / max(1, waited)
        round_s = (t1 - t0) / max(1, b.outer_epoch - a.outer_epoch)
        sent = (b.bytes_sent - a.bytes_sent) / max(1, waited)
        got = (b.bytes_received - a.bytes_received) / max(1, waited)
        print(f"{n.name:<5} {b.averaging_rounds_ok - a.averaging_rounds_ok:>9} "
              f"{b.averaging_rounds_failed - a.averaging_rounds_failed:>6} {avg_s:>17.3f} "
              f"{round_s:>8.2f} {round_s - avg_s:>13.2f} {b.last_group_size:>5} "
              f"{sent:>12,.0f} {got:>16,.0f} {4 * numel / max(sent, 1):>11.1f}")


if __name__ == "__main__":
    main()
