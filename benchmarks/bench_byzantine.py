"""Bounded updates against a malicious member: 5 honest nodes + 1 attacker vs honest swarms.

Usage: python -m benchmarks.bench_byzantine [--honest 5] [--steps 500] [--attack cycle]
                                            [--guard-factor 8] [--guard-warmup 8]

Three swarms of real `gasloc-node join` processes (tiny model, 1 torch thread each, under
`nice`) run side by side:

- ``attacked``: ``--honest`` honest nodes and one running benchmarks/byzantine_node.py (the
  real protocol, but every payload it sends encodes theta_0 + f(p - theta_0): scaled 10x,
  sign-flipped or random noise of 3x the delta's RMS; ``cycle`` picks one per exchange);
- ``honest``: the same ``--honest`` honest nodes alone. This is the fair baseline: the same
  honest nodes, the same data (a node's batches follow from its key, and every swarm uses the
  same keys), and the best any defence can do is to ignore the attacker entirely;
- ``honest+1``: ``--honest`` + 1 honest nodes, for reference (it trains on one more node's
  data, so it is expected to end a little lower than ``honest`` even without any attack).

Every node trains ``--steps`` inner steps and exits, writing a final checkpoint; the benchmark
averages the honest nodes' final parameters and evaluates that network-average model on the
fixed validation batches. Equal steps, not equal wall time. Prints the losses, the ratio
attacked / honest (goal: <= 1.05), per attack how many payloads the attacker prepared and how
many an honest peer accepted, the guard's rejections of the attacker and of honest peers (false
positives), the exchanges the guard clipped (with the attacker, with honest peers), and the
exchanges between honest nodes in each swarm.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.swarm_eval import Evaluator, flags
from gasloc_p2p.protocol.auth import load_or_create_identity
from gasloc_p2p.tools.nodes import NodeChild, join_argv, node_env
from gasloc_p2p.tools.procs import Child

HERE = Path(__file__).resolve().parent
EXCHANGES = re.compile(r"exchanges ok (\d+) \(init \d+ resp \d+\) failed (\d+) busy (\d+)")
REJECTED = re.compile(r"peer (\S+) sent an implausible update \((.*)$", re.MULTILINE)
CLIPPED = re.compile(r"exchange (?:to|from) (\S+) clipped")


def child(name: str, log_dir: Path, node_flags: list[str], attack: str = "") -> NodeChild:
    """A niced node process; with ``attack``, byzantine_node.py instead of the plain CLI."""
    if attack:
        argv = ["nice", "-n", "5", sys.executable, "-m", "benchmarks.byzantine_node", attack,
                str(log_dir / f"{name}.attacks.json"), *join_argv(node_flags)[3:]]
    else:
        argv = ["nice", "-n", "5", *join_argv(node_flags)]
    node = NodeChild.__new__(NodeChild)
    Child.__init__(node, name, argv, log_dir, node_env())
    node.endpoint = ""
    return node


def start_swarm(tag: str, tmp: Path, keys: list[Path], extra: dict[str, object],
                attack: str) -> list[NodeChild]:
    """One node per key (the same keys in every swarm: same peer ids, same data); the last
    one is the attacker when ``attack`` is set."""
    def node_flags(i: int) -> list[str]:
        return flags({**extra, "checkpoint_dir": str(tmp / f"{tag}{i}.ckpt"),
                      "identity_file": str(keys[i])})

    nodes = [child(f"{tag}0", tmp, node_flags(0))]
    peers = nodes[0].join_peers(300)
    for i in range(1, len(keys)):
        evil = attack if i == len(keys) - 1 else ""
        nodes.append(child(f"{tag}{i}", tmp, [*node_flags(i), "--peers", *peers], evil))
    return nodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--honest", type=int, default=5)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--attack", default="cycle", choices=("cycle", "scaled", "signflip", "random"))
    p.add_argument("--guard-factor", type=float, default=8.0)
    p.add_argument("--guard-warmup", type=int, default=8)
    p.add_argument("--logs", default="", help="keep the nodes' logs and files in this directory")
    args = p.parse_args()
    extra = {"guard_factor": args.guard_factor, "guard_warmup": args.guard_warmup,
             "eval_interval_steps": 100000, "max_steps": args.steps,
             "checkpoint_interval_s": 3600.0, "dht_start_timeout_s": 240.0,
             "dht_timeout_s": 30.0}
    evaluator = Evaluator(extra)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_byzantine_") as tmp_dir:
        tmp = Path(args.logs or tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        keys = [tmp / f"key{i}" for i in range(args.honest + 1)]
        ids = [load_or_create_identity(str(k)).peer_id for k in keys]
        swarms: dict[str, list[NodeChild]] = {}
        try:
            swarms["honest"] = start_swarm("h", tmp, keys[:-1], extra, "")
            swarms["honest+1"] = start_swarm("p", tmp, keys, extra, "")
            swarms["attacked"] = start_swarm("m", tmp, keys, extra, args.attack)
            codes = {n.name: n.proc.wait(timeout=3600) for ns in swarms.values() for n in ns}
        finally:
            for nodes in swarms.values():
                for node in nodes:
                    node.stop(30)
        took = time.monotonic() - t0
        results = {name: _swarm_result(evaluator, tmp, nodes, ids, name == "attacked")
                   for name, nodes in swarms.items()}
        report = tmp / f"m{args.honest}.attacks.json"
        attacks = json.loads(report.read_text()) if report.exists() else {}
    _report(args, evaluator, took, codes, results, attacks)


def _swarm_result(evaluator: Evaluator, tmp: Path, nodes: list[NodeChild], ids: list[str],
                  attacked: bool) -> dict[str, object]:
    honest = nodes[:-1] if attacked else nodes
    attacker = ids[len(nodes) - 1] if attacked else None
    finals = [torch.load(tmp / f"{n.name}.ckpt" / "node.pt", weights_only=True)
              for n in honest if (tmp / f"{n.name}.ckpt" / "node.pt").exists()]
    mean = torch.stack([f["theta"] for f in finals]).mean(0)
    ok = rej_attacker = rej_honest = failed = busy = clip_attacker = clip_honest = 0
    by_rule = {"size": 0, "direction": 0}  # which test rejected the attacker
    for node in honest:
        log = node.err.read_text(errors="replace")
        counts = EXCHANGES.findall(log)
        if counts:
            ok += int(counts[-1][0])
            failed += int(counts[-1][1])
            busy += int(counts[-1][2])
        for peer, why in REJECTED.findall(log):
            if peer == attacker:
                rej_attacker += 1
                by_rule["direction" if "cosine" in why else "size"] += 1
            else:
                rej_honest += 1
        for peer in CLIPPED.findall(log):  # the log names a peer by its first 12 characters
            if attacker is not None and attacker.startswith(peer):
                clip_attacker += 1
            else:
                clip_honest += 1
    return {"loss": evaluator.loss(mean), "steps": [f["step"] for f in finals],
            "nan": sum(not bool(torch.isfinite(f["theta"]).all()) for f in finals),
            "ok": ok, "failed": failed, "busy": busy, "rej_attacker": rej_attacker,
            "rej_honest": rej_honest, "by_rule": by_rule, "clip_attacker": clip_attacker,
            "clip_honest": clip_honest}


def _report(args: argparse.Namespace, evaluator: Evaluator, took: float,
            codes: dict[str, int | None], results: dict[str, dict[str, object]],
            attacks: dict[str, dict[str, int]]) -> None:
    print(f"byzantine: {args.honest} honest nodes + 1 attacker ({args.attack}) vs the same "
          f"{args.honest} honest nodes alone (and {args.honest + 1} honest nodes); "
          f"{args.steps} steps per node, {took:.0f} s, guard factor {args.guard_factor:g} "
          f"warm-up {args.guard_warmup}; exit codes {codes}")
    print(f"validation loss at theta_0 {evaluator.loss(evaluator.theta0):.4f}")
    committed = sum(a["committed"] for a in attacks.values())
    for name, r in results.items():
        pairs = (int(r["ok"]) - (committed if name == "attacked" else 0)) / 2  # type: ignore
        print(f"{name:>9}: network-average val loss of its honest nodes {r['loss']:.4f} "
              f"(steps {r['steps']}, non-finite {r['nan']}); honest-honest exchanges "
              f"{pairs:.0f}, failed {r['failed']}, busy {r['busy']}; guard rejections of the "
              f"attacker {r['rej_attacker']} {r['by_rule']}, of honest peers {r['rej_honest']}; "
              f"exchanges clipped with the attacker {r['clip_attacker']}, with honest peers "
              f"{r['clip_honest']}")
    for kind, a in attacks.items():
        print(f"  attack {kind:>8}: payloads prepared {a['prepared']} (exchanges the attacker "
              f"started or was admitted to), accepted by an honest peer {a['committed']}")
    honest, attacked = results["honest"]["loss"], results["attacked"]["loss"]
    print(f"ratio attacked / honest {attacked / honest:.3f} (goal <= 1.05); "  # type: ignore
          f"attacked / honest+1 {attacked / results['honest+1']['loss']:.3f}")  # type: ignore


if __name__ == "__main__":
    main()
