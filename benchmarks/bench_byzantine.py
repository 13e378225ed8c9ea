"""Bounded updates against a malicious member: a 6-node swarm with 1 attacker vs all honest.

Usage: python benchmarks/bench_byzantine.py [--nodes 6] [--train-s 150] [--attack cycle]
                                            [--guard-factor 8]

Two swarms of real `gasloc-node join` processes (tiny model, 1 torch thread each, under
`nice`) run side by side for the same wall time, so they share the machine's load: an honest
one, and one whose last node runs benchmarks/byzantine_node.py (the real protocol, but every
public iterate it sends is theta_0 + f(delta): scaled 10x, sign-flipped or random noise of 3x
the delta's RMS; ``cycle`` picks one per exchange). At the end it downloads every honest node's
published state, averages them and evaluates the network-average model on the fixed validation
batches. Prints both losses, their ratio (goal: within 5%), and the rejected-update counts of
the honest nodes (gasloc_updates_rejected_total via Info is not exposed, so read from logs).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.swarm_eval import Evaluator, flags, network_average  # noqa: E402
from gasloc_p2p.tools.nodes import NodeChild, join_argv, node_env  # noqa: E402
from gasloc_p2p.tools.procs import Child  # noqa: E402

HERE = Path(__file__).resolve().parent


class EvilChild(NodeChild):
    """A node process running byzantine_node.py instead of the plain CLI."""

    def __init__(self, name: str, log_dir: Path, node_flags: list[str], attack: str) -> None:
        argv = ["nice", "-n", "5", sys.executable, str(HERE / "byzantine_node.py"), attack,
                *join_argv(node_flags)[3:]]
        Child.__init__(self, name, argv, log_dir, node_env())
        self.endpoint = ""


def niced(name: str, log_dir: Path, node_flags: list[str]) -> NodeChild:
    child = NodeChild.__new__(NodeChild)
    Child.__init__(child, name, ["nice", "-n", "5", *join_argv(node_flags)], log_dir, node_env())
    child.endpoint = ""
    return child


def start_swarm(tag: str, tmp: Path, n: int, extra: dict[str, object],
                attack: str | None) -> list[NodeChild]:
    base = flags(extra)
    first = niced(f"{tag}0", tmp, base)
    nodes = [first]
    peers = first.join_peers(240)
    for i in range(1, n):
        node_flags = [*base, "--peers", *peers]
        nodes.append(EvilChild(f"{tag}{i}", tmp, node_flags, attack) if attack and i == n - 1
                     else niced(f"{tag}{i}", tmp, node_flags))
    return nodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--train-s", type=float, default=150.0)
    p.add_argument("--attack", default="cycle", choices=("cycle", "scaled", "signflip", "random"))
    p.add_argument("--guard-factor", type=float, default=8.0)
    args = p.parse_args()
    extra = {"guard_factor": args.guard_factor, "eval_interval_steps": 1000}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        swarms: dict[str, list[NodeChild]] = {}
        try:
            swarms["honest"] = start_swarm("h", tmp, args.nodes, extra, None)
            swarms["attacked"] = start_swarm("m", tmp, args.nodes, extra, args.attack)
            for nodes in swarms.values():
                for node in nodes:
                    node.wait_up(240)
            t0 = time.monotonic()
            time.sleep(args.train_s)
            evaluator = Evaluator(extra)
            results = {}
            for name, nodes in swarms.items():
                honest = nodes if name == "honest" else nodes[:-1]
                mean, nan = network_average(honest)
                steps = [node.info().step for node in honest]
                results[name] = (evaluator.loss(mean) if mean is not None else float("nan"),
                                 nan, sum(steps) / len(steps))
            took = time.monotonic() - t0
        finally:
            for nodes in swarms.values():
                for node in nodes:
                    node.stop(30)
        rejected = {name: sum(_rejections(node.err.read_text(errors="replace"))
                              for node in nodes) for name, nodes in swarms.items()}
    start = evaluator.loss(evaluator.theta0)
    print(f"byzantine: {args.nodes} nodes per swarm, 1 attacker ({args.attack}) in one, "
          f"{took:.0f} s of training side by side, guard factor {args.guard_factor:g}")
    print(f"validation loss at theta_0 {start:.4f}")
    for name, (loss, nan, steps) in results.items():
        print(f"{name:>8}: network-average val loss of its honest nodes {loss:.4f} "
              f"(mean step {steps:.0f}, non-finite states {nan}, updates rejected "
              f"{rejected[name]})")
    ratio = results["attacked"][0] / results["honest"][0]
    print(f"ratio attacked / honest {ratio:.3f} (goal <= 1.05)")


def _rejections(log: str) -> list[int]:
    return [1 for _ in re.finditer(r"sent an implausible update", log)]


if __name__ == "__main__":
    main()
