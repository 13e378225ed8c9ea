"""A member with free identities against a swarm: 5 honest nodes + the attack of issue 23, beside
the same 5 honest nodes unattacked.

Usage: python -m benchmarks.bench_byzantine [--honest 5] [--minutes 10] [--k 3.5]

Two swarms of real `gasloc-node join` processes (tiny model, 1 torch thread each, under `nice`)
train side by side for ``--minutes``:

- ``attacked``: ``--honest`` honest nodes and the attacker of :mod:`benchmarks.tools.sybil`:
  a fresh ed25519 key for every exchange, a payload ``p_victim + k * drift * u`` (the victim's
  own public iterate at most 2 s old, pushed along one fixed random direction ``u`` by ``k``
  times the victim's own drift per round: just under the guard's soft limit of 4), valid
  signatures and Commits, one exchange in flight per victim, all the time;
- ``clean``: the same honest nodes alone (the same keys, so the same data): the best any
  defence can do is to ignore the attacker entirely.

Every node stops after ``--minutes`` and writes a final checkpoint. Printed: each swarm's
network-average validation loss and the ratio attacked / clean (goal <= 1.05); the attacker's
exchanges by outcome; per honest node the push left in it (its displacement along ``u``, in
RMS units) against the push the attacker committed and the bound the guard sets (rounds x
block budget x own drift: every node here shares 127.0.0.0/24 with the attacker, so the block
budget is the binding one).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.swarm_eval import Evaluator, flags
from benchmarks.tools.sybil import Tally, along, attack, direction, read_drift_log
from gasloc_p2p.protocol.auth import load_or_create_identity
from gasloc_p2p.protocol.guard import GuardRule
from gasloc_p2p.tools.nodes import NodeChild

RUN_ID = "gasloc"
EXCHANGES = re.compile(r"exchanges ok \d+ \(init (\d+) resp")


def start_swarm(tag: str, tmp: Path, keys: list[Path], extra: dict[str, object],
                wrap: Callable[[str], tuple[str, ...]] = lambda name: ()) -> list[NodeChild]:
    """One niced node per key (the same keys in both swarms: the same data); ``wrap(name)``:
    a command the node's runs under (before ``nice``)."""
    def node_flags(i: int) -> list[str]:
        return flags({**extra, "checkpoint_dir": str(tmp / f"{tag}{i}.ckpt"),
                      "identity_file": str(keys[i])})

    def prefix(name: str) -> tuple[str, ...]:
        return (*wrap(name), "nice", "-n", "5")

    nodes = [NodeChild(f"{tag}0", tmp, node_flags(0), prefix=prefix(f"{tag}0"))]
    peers = nodes[0].join_peers(300)
    nodes += [NodeChild(f"{tag}{i}", tmp, [*node_flags(i), "--peers", *peers],
                        prefix=prefix(f"{tag}{i}")) for i in range(1, len(keys))]
    return nodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--honest", type=int, default=5)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--k", type=float, default=3.5, help="the push, in the victim's drifts")
    p.add_argument("--logs", default="", help="keep the nodes' logs and files in this directory")
    args = p.parse_args()
    seconds = 60 * args.minutes
    extra = {"eval_interval_steps": 100000, "max_time_s": seconds,
             "checkpoint_interval_s": 3600.0, "dht_start_timeout_s": 240.0,
             "dht_timeout_s": 30.0}
    evaluator = Evaluator(extra)
    theta0 = evaluator.theta0
    u = direction(theta0.numel())
    tally = Tally()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_byzantine_") as tmp_dir:
        tmp = Path(args.logs or tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        keys = [tmp / f"key{i}" for i in range(args.honest)]
        for k in keys:
            load_or_create_identity(str(k))
        swarms: dict[str, list[NodeChild]] = {}
        try:
            swarms["clean"] = start_swarm("c", tmp, keys, extra)
            swarms["attacked"] = start_swarm("a", tmp, keys, extra)
            for node in (n for ns in swarms.values() for n in ns):
                node.wait_up(300)
            asyncio.run(attack(swarms["attacked"], RUN_ID, theta0, args.k,
                               time.monotonic() + seconds, tally))
            codes: dict[str, int | None] = {n.name: n.proc.wait(timeout=seconds + 600)
                                            for ns in swarms.values() for n in ns}
        finally:
            for nodes in swarms.values():
                for node in nodes:
                    node.stop(30)
        took = time.monotonic() - t0
        rows = {name: [_node_row(tmp, n, theta0, u) for n in nodes]
                for name, nodes in swarms.items()}
    _report(args, evaluator, took, codes, rows, tally)


def _node_row(tmp: Path, node: NodeChild, theta0: torch.Tensor,
              u: torch.Tensor) -> dict[str, float]:
    final = torch.load(tmp / f"{node.name}.ckpt" / "node.pt", weights_only=True)
    drifts = read_drift_log(node.err)
    counts = EXCHANGES.findall(node.err.read_text(errors="replace"))
    return {"theta": final["theta"], "rounds": final["rounds"], "steps": final["step"],
            "initiated": int(counts[-1]) if counts else 0,
            "along": along(final["theta"], theta0, u),
            "drift": statistics.median(drifts) if drifts else float("nan"),
            "finite": bool(torch.isfinite(final["theta"]).all())}


def _report(args: argparse.Namespace, evaluator: Evaluator, took: float,
            codes: dict[str, int | None], rows: dict[str, list[dict[str, float]]],
            tally: Tally) -> None:
    rule = GuardRule()
    print(f"byzantine: {args.honest} honest nodes + a member with a fresh key per exchange "
          f"(push {args.k:g} drifts along one direction) vs the same {args.honest} honest "
          f"nodes alone; {args.minutes:g} min, {took:.0f} s in all; exit codes {codes}")
    print(f"validation loss at theta_0 {evaluator.loss(evaluator.theta0):.4f}")
    print("attacker's exchanges: " + ", ".join(f"{k} {v}" for k, v in
                                               tally.outcomes.most_common()))
    losses = {}
    for name, nodes in rows.items():
        mean = torch.stack([r["theta"] for r in nodes]).mean(0)  # type: ignore[misc]
        losses[name] = evaluator.loss(mean)
        print(f"{name:>9}: network-average val loss {losses[name]:.4f}; steps "
              f"{[r['steps'] for r in nodes]}; exchanges started by the honest nodes "
              f"{[r['initiated'] for r in nodes]}; all finite {all(r['finite'] for r in nodes)}")
    print("push left along the attack's direction (RMS units), per honest node:")
    for i, r in enumerate(rows["attacked"]):
        name = f"a{i}"
        bound = r["rounds"] * rule.block_budget * r["drift"]
        print(f"  {name}: left {r['along']:+.3g} (clean twin {rows['clean'][i]['along']:+.3g});"
              f" committed by the attacker {tally.pushed[name]:.3g}; bound {bound:.3g} = "
              f"{r['rounds']} rounds x {rule.block_budget:g} x drift {r['drift']:.3g}")
    print(f"ratio attacked / clean {losses['attacked'] / losses['clean']:.3f} (goal <= 1.05)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
