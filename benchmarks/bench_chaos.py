"""Chaos: a swarm whose nodes are SIGKILLed and restarted, and that still learns.

Usage: python -m benchmarks.bench_chaos [--nodes 5] [--duration-s 180] [--kill-every-s 20]

Runs real `gasloc-node join` processes (tiny model, 1 torch thread each, checkpoints every
5 s). Every ``--kill-every-s`` a random node is SIGKILLed (its whole process group: the DHT and
p2pd too) and restarted with the same checkpoint directory (it resumes, or, if it had none yet,
starts from verified swarm state). At the start and the end it evaluates the network-average
model (the mean of the published states of the nodes that answer) on the fixed validation
batches (and the loss at theta_0). Prints the kills, restarts, both losses, and any non-finite value or NaN found in the
states or the logs. Exit code 1 if a NaN shows up or the final loss is not below the first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.swarm_eval import Evaluator, flags, network_average
from gasloc_p2p.tools.nodes import NodeChild


def maddrs(node: NodeChild) -> list[str]:
    """The DHT multiaddrs a node printed (stdout for a new swarm, its log when it joined)."""
    text = node.out.read_text(errors="replace") + node.err.read_text(errors="replace")
    found = re.findall(r"gasloc-node join .*--peers (.+)$", text, re.M)
    return found[-1].split() if found else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--kill-every-s", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    extra = {"checkpoint_interval_s": 5.0, "eval_interval_steps": 1000}
    evaluator = Evaluator(extra)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)

        def launch(i: int, generation: int, peers: list[str]) -> NodeChild:
            node_flags = flags({**extra, "checkpoint_dir": str(tmp / f"ckpt{i}")})
            return NodeChild(f"n{i}-{generation}", tmp,
                             [*node_flags, *(["--peers", *peers] if peers else [])])

        nodes = [launch(0, 0, [])]
        peers = nodes[0].join_peers(240)
        nodes += [launch(i, 0, peers) for i in range(1, args.nodes)]
        generations = [0] * args.nodes
        kills = restarts = 0
        everyone = list(nodes)
        try:
            for node in nodes:
                node.wait_up(240)
            at_theta0 = evaluator.loss(evaluator.theta0)
            mean, nan_first = network_average(nodes)
            first = evaluator.loss(mean) if mean is not None else float("nan")
            t_end = time.monotonic() + args.duration_s
            while time.monotonic() + args.kill_every_s <= t_end:
                time.sleep(args.kill_every_s)  # the restarted node is not waited for
                i = rng.randrange(args.nodes)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(nodes[i].pid, signal.SIGKILL)  # the node, its DHT and p2pd
                nodes[i].proc.wait(30)
                kills += 1
                generations[i] += 1
                alive = [m for n in nodes if n.alive for m in maddrs(n)]
                nodes[i] = launch(i, generations[i], alive)
                everyone.append(nodes[i])
                restarts += 1
                print(f"  t={args.duration_s - (t_end - time.monotonic()):.0f} s: killed and "
                      f"restarted n{i}", flush=True)
            time.sleep(max(0.0, t_end - time.monotonic()))
            for node in nodes:  # the last restarted ones must serve to be measured
                node.wait_up(240)
            mean, nan_states = network_average(nodes)
            last = evaluator.loss(mean) if mean is not None else float("nan")
            steps = [n.info().step for n in nodes]
        finally:
            for node in nodes:
                node.stop(30)
        logs = "".join(n.err.read_text(errors="replace") for n in everyone)
    rejected = logs.count("sent an implausible update")
    clipped = len(re.findall(r"exchange (?:to|from) \S+ clipped", logs))
    nan_logs = sum(logs.count(word) for word in ("loss nan", "val nan", "non-finite",
                                                 "diverged", "rolled back"))
    print(f"chaos: {args.nodes} nodes, {args.duration_s:.0f} s, a random node SIGKILLed and "
          f"restarted every {args.kill_every_s:g} s: {kills} kills, {restarts} restarts; "
          f"{rejected} updates rejected as implausible, {clipped} exchanges clipped")
    print(f"network-average val loss: at theta_0 {at_theta0:.4f}, once all nodes were up "
          f"{first:.4f}, at the end {last:.4f}; steps now {steps}")
    print(f"non-finite states {nan_first + nan_states}; NaN/divergence/rollback lines in logs "
          f"{nan_logs}")
    sys.exit(0 if nan_first + nan_states == 0 and nan_logs == 0 and last < first else 1)


if __name__ == "__main__":
    main()
