"""Bounded updates against a malicious member: a 6-node swarm with 1 attacker vs all honest.

Usage: python benchmarks/bench_byzantine.py [--nodes 6] [--steps 500] [--attack cycle]
                                            [--guard-factor 8] [--guard-warmup 8]

Two swarms of real `gasloc-node join` processes (tiny model, 1 torch thread each, under
`nice`) run side by side: an honest one, and one whose last node runs
benchmarks/byzantine_node.py (the real protocol, but every public iterate it sends is
theta_0 + f(delta): scaled 10x, sign-flipped or random noise of 3x the delta's RMS; ``cycle``
picks one per exchange). Every node trains ``--steps`` inner steps and exits, writing a final
checkpoint; the benchmark averages the honest nodes' final parameters and evaluates that
network-average model on the fixed validation batches. Equal steps, not equal wall time: the
two swarms start at different moments on a loaded machine. Prints both losses, their ratio
(goal: within 5%), and how many updates the honest nodes rejected as implausible.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.swarm_eval import Evaluator, flags  # noqa: E402
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
    def node_flags(i: int) -> list[str]:
        return flags({**extra, "checkpoint_dir": str(tmp / f"{tag}{i}.ckpt")})

    first = niced(f"{tag}0", tmp, node_flags(0))
    nodes = [first]
    peers = first.join_peers(300)
    for i in range(1, n):
        node_flags_i = [*node_flags(i), "--peers", *peers]
        nodes.append(EvilChild(f"{tag}{i}", tmp, node_flags_i, attack) if attack and i == n - 1
                     else niced(f"{tag}{i}", tmp, node_flags_i))
    return nodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--attack", default="cycle", choices=("cycle", "scaled", "signflip", "random"))
    p.add_argument("--guard-factor", type=float, default=8.0)
    p.add_argument("--guard-warmup", type=int, default=8)
    args = p.parse_args()
    extra = {"guard_factor": args.guard_factor, "guard_warmup": args.guard_warmup, "eval_interval_steps": 100000,
             "max_steps": args.steps, "checkpoint_interval_s": 3600.0,
             "dht_start_timeout_s": 240.0, "dht_timeout_s": 30.0}
    evaluator = Evaluator(extra)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        swarms: dict[str, list[NodeChild]] = {}
        try:
            swarms["honest"] = start_swarm("h", tmp, args.nodes, extra, None)
            swarms["attacked"] = start_swarm("m", tmp, args.nodes, extra, args.attack)
            codes = {n.name: n.proc.wait(timeout=3600) for ns in swarms.values() for n in ns}
        finally:
            for nodes in swarms.values():
                for node in nodes:
                    node.stop(30)
        results = {}
        for name, nodes in swarms.items():
            honest = nodes if name == "honest" else nodes[:-1]
            paths = [tmp / f"{n.name}.ckpt" / "node.pt" for n in honest]
            finals = [torch.load(path, weights_only=True) for path in paths if path.exists()]
            mean = torch.stack([f["theta"] for f in finals]).mean(0)
            nan = sum(not bool(torch.isfinite(f["theta"]).all()) for f in finals)
            results[name] = (evaluator.loss(mean), nan, [f["step"] for f in finals])
        rejected = {name: sum(_rejections(node.err.read_text(errors="replace"))
                              for node in nodes) for name, nodes in swarms.items()}
    took = time.monotonic() - t0
    start = evaluator.loss(evaluator.theta0)
    print(f"byzantine: {args.nodes} nodes per swarm, 1 attacker ({args.attack}) in one, "
          f"{args.steps} steps per node, {took:.0f} s, guard factor {args.guard_factor:g} "
          f"warm-up {args.guard_warmup}; "
          f"exit codes {codes}")
    print(f"validation loss at theta_0 {start:.4f}")
    for name, (loss, nan, steps) in results.items():
        print(f"{name:>8}: network-average val loss of its honest nodes {loss:.4f} "
              f"(steps {steps}, non-finite {nan}, updates rejected {rejected[name]})")
    ratio = results["attacked"][0] / results["honest"][0]
    print(f"ratio attacked / honest {ratio:.3f} (goal <= 1.05)")


def _rejections(log: str) -> int:
    return len(re.findall(r"sent an implausible update", log))


if __name__ == "__main__":
    main()
