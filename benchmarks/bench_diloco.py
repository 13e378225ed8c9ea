"""DiLoCo in the daemon: wall time of one averaging round on loopback (`--algorithm diloco`).

Usage: python benchmarks/bench_diloco.py [--nodes 2] [--rounds 10] [--inner-steps 20]
                                         [--codec fp32] [--data PATH] [-- more join flags]

Starts ``--nodes`` `gasloc-node join --algorithm diloco` processes on 127.0.0.1 (default model
unless extra flags say otherwise, torch threads 1 each), lets every node average twice (warm-up),
then measures over the next ``--rounds`` averaged rounds of every node, from its Info counters:
- averaging s/round: the trainer thread's wait for matchmaking plus the hivemind all-reduce of
  the outer gradient (it includes waiting for the slowest node: the cost DiLoCo pays);
- round s: wall time per outer epoch (H inner steps, evaluations and the averaging);
- other s/round: the rest of a round, mostly the H inner steps.
Timings on shared 2-core machines vary by about 30% run to run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gasloc_p2p.node.config import NodeConfig  # noqa: E402
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb  # noqa: E402
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc  # noqa: E402


class Proc:
    """One `gasloc-node join --algorithm diloco` child in its own session, logs in files."""

    def __init__(self, name: str, tmp: Path, args: list[str]) -> None:
        self.err, self.out = tmp / f"{name}.err", tmp / f"{name}.out"
        env = dict(os.environ, PYTHONUNBUFFERED="1", HIVEMIND_LOGLEVEL="ERROR")
        with self.err.open("w") as err, self.out.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gasloc_p2p.cli", "--log-level", "INFO", "join",
                 "--algorithm", "diloco", "--host", "127.0.0.1", "--torch-threads", "1",
                 "--log-interval-s", "30", *args],
                stdout=out, stderr=err, env=env, start_new_session=True)
        self.endpoint = ""

    def wait(self, pattern: str, stdout: bool, timeout_s: float = 180) -> str:
        path = self.out if stdout else self.err
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, path.read_text())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited: {self.err.read_text()[-2000:]}")
            time.sleep(0.2)
        raise TimeoutError(pattern)

    def info(self) -> pb.InfoReply:
        with grpc.insecure_channel(self.endpoint) as channel:
            reply: pb.InfoReply = pb_grpc.GossipStub(channel).Info(pb.InfoRequest(), timeout=5)
            return reply

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def wait_rounds(nodes: list[Proc], at_least: list[int], timeout_s: float) -> list[pb.InfoReply]:
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
    parser.add_argument("--codec", default="fp32", help="--diloco-codec of every node")
    parser.add_argument("--data", default="", help="corpus (default: Shakespeare, downloaded)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("extra", nargs="*", help="more gasloc-node join flags (after --)")
    args = parser.parse_args()
    flags = [*(["--data", args.data] if args.data else []), "--diloco-codec", args.codec,
             "--inner-steps", str(args.inner_steps), *args.extra]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        nodes = [Proc("n0", tmp, flags)]
        try:
            peers = nodes[0].wait(r"--peers (.+)", stdout=True).split()
            nodes += [Proc(f"n{i}", tmp, [*flags, "--peers", *peers])
                      for i in range(1, args.nodes)]
            numel = 0
            for n in nodes:
                n.endpoint = n.wait(r"up: gRPC (\S+),", stdout=False)
                numel = int(n.wait(r"model (\d+) params", stdout=False))
            first = wait_rounds(nodes, [2] * len(nodes), args.timeout_s)
            t0 = time.monotonic()
            last = wait_rounds(nodes, [i.averaging_rounds_ok + args.rounds for i in first],
                               args.timeout_s)
            t1 = time.monotonic()
        finally:
            for n in nodes:
                n.stop()
    print(f"DiLoCo averaging on loopback: {len(nodes)} nodes, {numel:,} parameters "
          f"({numel * 4 / 1e6:.2f} MB fp32 outer gradient, --diloco-codec {args.codec}), "
          f"H = {args.inner_steps}, torch threads 1 per node {' '.join(args.extra)}")
    print(f"{'node':<5} {'rounds ok':>9} {'failed':>6} {'averaging s/round':>17} "
          f"{'round s':>8} {'other s/round':>13} {'group':>5}")
    for n, a, b in zip(nodes, first, last, strict=True):
        waited = (b.averaging_rounds_ok + b.averaging_rounds_failed
                  - a.averaging_rounds_ok - a.averaging_rounds_failed)
        avg_s = (b.total_averaging_s - a.total_averaging_s) / max(1, waited)
        round_s = (t1 - t0) / max(1, b.outer_epoch - a.outer_epoch)
        print(f"{n.out.stem:<5} {b.averaging_rounds_ok - a.averaging_rounds_ok:>9} "
              f"{b.averaging_rounds_failed - a.averaging_rounds_failed:>6} {avg_s:>17.3f} "
              f"{round_s:>8.2f} {round_s - avg_s:>13.2f} {b.last_group_size:>5}")


if __name__ == "__main__":
    main()
