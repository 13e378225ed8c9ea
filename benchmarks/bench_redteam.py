"""The red-team suite (issue 39): member attacks that know the defence, each against 5 honest
nodes beside the same 5 nodes unattacked.

Usage: python -m benchmarks.bench_redteam [--attacks farm-push,member-push,...] [--honest 5]
           [--minutes 10] [--logs DIR] [--defence-cost REPEATS]

For every attack of :mod:`benchmarks.tools.redteam` (default: all), two swarms of real
``gasloc-node join`` processes (tiny model, one torch thread each, under ``nice``) train side
by side for ``--minutes``: ``attacked`` (the honest nodes and the attacker) and ``clean`` (the
same keys, so the same data, alone: what a perfect defence gives). Printed per attack, with the
issue's targets:

- the network-average validation loss of each swarm and the ratio attacked / clean (within 5%
  at 10 minutes, 10% at 30);
- the push left in each honest node along the attacker's direction (RMS units: along the sum
  of what the attacker committed to it, less its clean twin's component) against the
  clean swarm's consensus distance (the RMS distance of a node from the swarm's mean): at most
  that;
- the exchanges the honest nodes started (all with honest peers: the attacker publishes no
  record), attacked / clean: at least 0.5;
- the attacker's exchanges by outcome.

Each attack takes ``--minutes`` plus about a minute; ``make bench-redteam`` runs them all.

``--defence-cost N`` runs no attack: two clean swarms side by side, one on the defaults and
one with every defence off, ``N`` times with the start order swapped; it prints the steps per
CPU-second (tokens/s on a core) defended / undefended (target: at least 0.97) and the loss
ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_byzantine import RUN_ID, start_swarm
from benchmarks.swarm_eval import Evaluator
from benchmarks.tools.redteam import ATTACKS, Attack, run_attack
from benchmarks.tools.sybil import Tally, along, direction, read_drift_log
from gasloc_p2p.protocol.auth import load_or_create_identity
from gasloc_p2p.tools.nodes import NodeChild

INITIATED = re.compile(r"exchanges ok \d+ \(init (\d+) resp")
ROLLBACKS = re.compile(r"rolled back")


def swarm_setup(honest: int, seconds: float, tmp: Path) -> tuple[dict[str, object], list[Path]]:
    """The honest nodes' flags for a run of ``seconds`` and their keys (made in ``tmp``; the
    same keys in both swarms, so the same data)."""
    extra: dict[str, object] = {"eval_interval_steps": 100000, "max_time_s": seconds,
                                "checkpoint_interval_s": 3600.0, "dht_start_timeout_s": 240.0,
                                "dht_timeout_s": 30.0}
    keys = [tmp / f"key{i}" for i in range(honest)]
    for k in keys:
        load_or_create_identity(str(k))
    return extra, keys


def run_one(attack: Attack, honest: int, minutes: float, tmp: Path,
            evaluator: Evaluator) -> dict[str, Any]:
    """Both swarms side by side, the attack on one; the figures of :func:`report`."""
    seconds = 60 * minutes
    extra, keys = swarm_setup(honest, seconds, tmp)
    tally, swarms = Tally(), {}
    t0 = time.monotonic()
    try:
        swarms["clean"] = start_swarm("c", tmp, keys, extra)
        swarms["attacked"] = start_swarm("a", tmp, keys, extra)
        for node in (n for ns in swarms.values() for n in ns):
            node.wait_up(300)
        asyncio.run(run_attack(attack, swarms["attacked"], RUN_ID, evaluator.theta0,
                               time.monotonic() + seconds, tally))
        codes = {n.name: n.proc.wait(timeout=seconds + 600)
                 for ns in swarms.values() for n in ns}
    finally:
        for nodes in swarms.values():
            for node in nodes:
                node.stop(30)
    u = direction(evaluator.theta0.numel())
    rows = {name: [_row(tmp, n, evaluator.theta0, u) for n in nodes]
            for name, nodes in swarms.items()}
    return {"attack": attack, "codes": codes, "rows": rows, "tally": tally,
            "took": time.monotonic() - t0}


def _row(tmp: Path, node: NodeChild, theta0: torch.Tensor, u: torch.Tensor) -> dict[str, Any]:
    final = torch.load(tmp / f"{node.name}.ckpt" / "node.pt", weights_only=True)
    log = node.err.read_text(errors="replace")
    counts = INITIATED.findall(log)
    drifts = read_drift_log(node.err)
    return {"theta": final["theta"], "steps": final["step"],
            "initiated": int(counts[-1]) if counts else 0,
            "along": along(final["theta"], theta0, u), "rollbacks": len(ROLLBACKS.findall(log)),
            "drift": statistics.median(drifts) if drifts else math.nan}


def consensus_rms(thetas: list[torch.Tensor]) -> float:
    """The mean RMS distance of a node from the swarm's mean (RMS units)."""
    stack = torch.stack(thetas).double()
    return float((stack - stack.mean(0)).pow(2).mean(1).sqrt().mean())


def push_left(rows: dict[str, list[dict[str, Any]]], tally: Tally,
              theta0: torch.Tensor) -> list[float]:
    """Per honest node: the push left along the sum of what the attacker committed to it
    (unit RMS; ``u`` for a victim it never pushed), less its clean twin's component along the
    same direction (the twin holds the same key, so the same data): for a fixed direction the
    twin's is about 0, for the loss's ascent it is what honest training alone did there."""
    u = direction(theta0.numel())
    out = []
    for i, (hit, twin) in enumerate(zip(rows["attacked"], rows["clean"], strict=True)):
        d = tally.vectors.get(f"a{i}")
        if d is None or float(d.pow(2).mean()) == 0.0:
            d = u.double()
        d = (d / d.pow(2).mean().sqrt()).float()
        out.append(abs(along(hit["theta"], theta0, d) - along(twin["theta"], theta0, d)))
    return out


def report(result: dict[str, Any], evaluator: Evaluator) -> dict[str, float]:
    attack, rows, tally = result["attack"], result["rows"], result["tally"]
    losses = {name: evaluator.loss(torch.stack([r["theta"] for r in nodes]).mean(0))
              for name, nodes in rows.items()}
    cd = consensus_rms([r["theta"] for r in rows["clean"]])
    pushes = push_left(rows, tally, evaluator.theta0)
    started = {name: sum(r["initiated"] for r in nodes) for name, nodes in rows.items()}
    figures = {"loss_ratio": losses["attacked"] / losses["clean"],
               "push_left_max": max(pushes), "clean_consensus": cd,
               "exchange_ratio": started["attacked"] / max(started["clean"], 1)}
    print(f"\n== {attack.name}: {attack} ({result['took']:.0f} s; exit codes "
          f"{sorted(set(result['codes'].values()))})")
    print("attacker's exchanges: " + ", ".join(f"{k} {v}" for k, v in
                                               tally.outcomes.most_common()))
    for name, nodes in rows.items():
        print(f"{name:>9}: network-average val loss {losses[name]:.4f}; steps "
              f"{[r['steps'] for r in nodes]}; exchanges started {[r['initiated'] for r in nodes]}"
              f"; rollbacks {[r['rollbacks'] for r in nodes]}; drift scale "
              f"{[round(r['drift'], 5) for r in nodes]}")
    left = ", ".join(f"{r['along']:+.3g}" for r in rows["attacked"])
    twins = ", ".join(f"{r['along']:+.3g}" for r in rows["clean"])
    print(f"along the fixed direction u (RMS units): {left} (clean twins {twins}); along "
          f"what the attacker committed, less the clean twin's: "
          f"{', '.join(f'{p:.3g}' for p in pushes)}; committed by the attacker "
          f"{sum(tally.pushed.values()):.3g}")
    print(f"loss attacked / clean {figures['loss_ratio']:.3f} (target <= 1.05 at 10 min, 1.10 "
          f"at 30); push left {figures['push_left_max']:.3g} vs clean consensus distance "
          f"{cd:.3g} (target: at most); honest exchanges attacked / clean "
          f"{figures['exchange_ratio']:.2f} (target >= 0.5)")
    sys.stdout.flush()
    return figures


# every defence of issue 39 off: the guard (clip, refuse, budgets, trust), the push meter, the
# rise rollback and the direction test
DEFENCES_OFF = {"guard_factor": 0.0, "guard_push_limit": 0.0, "guard_loss_rise": 0.0,
                "guard_min_z": -1.0, "guard_loss_gate": 0.0}


def defence_cost(honest: int, minutes: float, tmp: Path, evaluator: Evaluator,
                 repeats: int) -> tuple[float, float]:
    """What the defences cost honest training: two clean swarms side by side, ``defended``
    (the defaults) and ``undefended`` (:data:`DEFENCES_OFF`), no attacker, each node under
    ``/usr/bin/time``. The cost is CPU per step: the steps each swarm took per CPU-second its
    nodes used (their children, the DHT's daemon, included), which the scheduler's share of
    the cores does not move (the steps in the same time swung from 0.92x to 1.37x between
    runs of one configuration). Run ``repeats`` times, the start order swapped each time. Returns (steps
    per CPU-second defended / undefended, final loss the same)."""
    seconds = 60 * minutes
    extra, keys = swarm_setup(honest, seconds, tmp)
    steps = {"defended": 0, "undefended": 0}
    cpu = {"defended": 0.0, "undefended": 0.0}
    losses: dict[str, list[float]] = {"defended": [], "undefended": []}
    for r in range(repeats):
        order = ["defended", "undefended"][:: 1 if r % 2 == 0 else -1]
        swarms: dict[str, list[NodeChild]] = {}
        try:
            for name in order:
                swarms[name] = start_swarm(f"{name[0]}{r}-", tmp, keys, {
                    **extra, **(DEFENCES_OFF if name == "undefended" else {})},
                    wrap=lambda node: ("/usr/bin/time", "-o", str(tmp / f"{node}.cpu"),
                                       "-f", "%U %S"))
            for node in (n for ns in swarms.values() for n in ns):
                node.wait_up(300)
            for node in (n for ns in swarms.values() for n in ns):
                node.proc.wait(timeout=seconds + 600)
        finally:
            for nodes in swarms.values():
                for node in nodes:
                    node.stop(30)
        for name, nodes in swarms.items():
            finals = [torch.load(tmp / f"{n.name}.ckpt" / "node.pt", weights_only=True)
                      for n in nodes]
            taken = [int(f["step"]) for f in finals]
            used = [sum(map(float, (tmp / f"{n.name}.cpu").read_text().split()[-2:]))
                    for n in nodes]
            steps[name] += sum(taken)
            cpu[name] += sum(used)
            losses[name].append(evaluator.loss(torch.stack([f["theta"] for f in finals])
                                               .mean(0)))
            print(f"run {r + 1} ({' first, '.join(order)} second): {name}: steps {taken}, "
                  f"CPU-s {[round(u) for u in used]} ({sum(taken) / sum(used):.2f} steps per "
                  f"CPU-s), network-average val loss {losses[name][-1]:.4f}")
    rate = {name: steps[name] / max(cpu[name], 1e-9) for name in steps}
    ratio = rate["defended"] / rate["undefended"]
    loss = statistics.mean(losses["defended"]) / statistics.mean(losses["undefended"])
    print(f"defence cost: steps per CPU-second (tokens/s on a core) defended / undefended "
          f"{ratio:.3f} (target >= 0.97): {rate['defended']:.3f} against "
          f"{rate['undefended']:.3f} over {repeats} run(s) of {minutes:g} min, {honest} nodes "
          f"each (steps {steps['defended']} against {steps['undefended']}); val loss defended "
          f"/ undefended {loss:.3f}")
    return ratio, loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--honest", type=int, default=5)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--logs", default="", help="keep the nodes' logs and files here")
    p.add_argument("--defence-cost", type=int, default=0, metavar="REPEATS",
                   help="instead of the attacks: what the defences cost honest training "
                        "(tokens/s, defaults against every defence off), REPEATS runs")
    args = p.parse_args()
    if args.defence_cost:
        evaluator = Evaluator({"eval_interval_steps": 100000})
        with tempfile.TemporaryDirectory(prefix="redteam_cost_") as tmp_dir:
            tmp = Path(args.logs) if args.logs else Path(tmp_dir)
            tmp.mkdir(parents=True, exist_ok=True)
            defence_cost(args.honest, args.minutes, tmp, evaluator, args.defence_cost)
        return
    names = [a for a in args.attacks.split(",") if a]
    unknown = [a for a in names if a not in ATTACKS]
    if unknown:
        p.error(f"--attacks: unknown {unknown}; choose from {list(ATTACKS)}")
    evaluator = Evaluator({"eval_interval_steps": 100000})
    summary = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"redteam_{name}_") as tmp_dir:
            tmp = Path(args.logs) / name if args.logs else Path(tmp_dir)
            tmp.mkdir(parents=True, exist_ok=True)
            result = run_one(ATTACKS[name], args.honest, args.minutes, tmp, evaluator)
            summary[name] = report(result, evaluator)
    print(f"\n== summary ({args.minutes:g} min, {args.honest} honest nodes)")
    print("| attack | loss attacked / clean | push left (max) | clean consensus | "
          "honest exchanges attacked / clean |\n|---|---|---|---|---|")
    for name, f in summary.items():
        print(f"| {name} | {f['loss_ratio']:.3f} | {f['push_left_max']:.3g} | "
              f"{f['clean_consensus']:.3g} | {f['exchange_ratio']:.2f} |")


if __name__ == "__main__":
    main()
