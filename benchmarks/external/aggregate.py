"""From the nodes' eval records to the suite's figures: the swarm's curve, time to a target
loss, loss at equal tokens, per-node traffic and memory, and the ratios the issue asks for.

The swarm's curve at eval step k is the mean over nodes of each node's own validation loss
(its current parameters, the same batches, the same ``evaluate``), at the time the *last* node
got there, counted from the *last* node's step-0 evaluation: from the moment the whole swarm
trains (a node's start-up, slow on a loaded machine, is not counted, nor is the head start of
a node that started first).
Every node trains the same steps, so eval step k is the same tokens for every system.
"""

from __future__ import annotations

import math
from typing import Any

DILOCOS = ("gasloc-diloco", "gasloc-diloco-avg", "gasloc-diloco-topk", "torchft-diloco", "hivemind")
COMPARED = DILOCOS  # the default GASLoC against each of these


def curve(run: dict[str, Any]) -> list[dict[str, float]]:
    """[{step, tokens, t, loss}] at the eval steps every node of ``run`` reported."""
    per_node = []
    for node in run.get("nodes", []):
        evals = {e["step"]: e for e in node["evals"] if e.get("val_loss") is not None}
        if 0 not in evals:
            return []
        per_node.append((evals[0]["t"], evals))
    if not per_node:
        return []
    steps = sorted(set.intersection(*(set(ev) for _, ev in per_node)))
    start = max(t0 for t0, _ in per_node)
    out = []
    for s in steps:
        losses = [ev[s]["val_loss"] for _, ev in per_node]
        out.append({"step": s, "tokens": per_node[0][1][s]["tokens"],
                    "t": max(0.0, max(ev[s]["t"] for _, ev in per_node) - start),
                    "loss": sum(losses) / len(losses)})
    return out


def time_to_target(points: list[dict[str, float]], target: float) -> float | None:
    """Seconds until the curve first reaches ``target`` (linear between evals); None if never."""
    if points and points[0]["loss"] <= target:
        return points[0]["t"]
    for a, b in zip(points, points[1:], strict=False):
        if b["loss"] <= target:
            frac = (a["loss"] - target) / (a["loss"] - b["loss"])
            return a["t"] + frac * (b["t"] - a["t"])
    return None


def default_target(curves: dict[str, list[dict[str, float]]]) -> float | None:
    """The worst system's best loss: the lowest loss every system reached."""
    bests = [min(p["loss"] for p in c) for c in curves.values() if c]
    return max(bests) if bests else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(runs: list[dict[str, Any]], target: float | None = None) -> dict[str, Any]:
    """Rows per system for one link case, its target and the GASLoC ratios."""
    curves = {r["system"]: curve(r) for r in runs if not r.get("skipped")}
    target = target if target is not None else default_target(curves)
    rows = []
    for run in runs:
        if run.get("skipped"):
            rows.append({"system": run["system"], "skipped": run["skipped"]})
            continue
        pts, nodes = curves[run["system"]], run["nodes"]
        spans = [n["evals"][-1]["t"] - n["evals"][0]["t"] for n in nodes if len(n["evals"]) > 1]
        tokens = [n["evals"][-1]["tokens"] for n in nodes if n["evals"]]
        tx = [n["veth_tx_bytes"] for n in nodes if n.get("veth_tx_bytes") is not None]
        prog = [n["program_bytes_sent"] for n in nodes if n.get("program_bytes_sent") is not None]
        rows.append({
            "system": run["system"], "finished": run.get("finished", False),
            "final_loss": pts[-1]["loss"] if pts else None,
            "final_tokens_per_node": pts[-1]["tokens"] if pts else None,
            "time_to_target_s": time_to_target(pts, target) if pts and target else None,
            "train_wall_s": pts[-1]["t"] if pts else None,
            "tokens_per_s_per_node": _mean([k / s for k, s in zip(tokens, spans, strict=False)
                                            if s > 0]),
            "veth_tx_mb_per_node": _mean([b / 1e6 for b in tx]),
            "veth_tx_mb_max_node": max(tx) / 1e6 if tx else None,
            "program_mb_per_node": _mean([b / 1e6 for b in prog]),
            "program_bytes_kind": nodes[0].get("program_bytes_kind", "") if nodes else "",
            "rss_peak_gb_max_node": max(n["rss_peak_bytes"] for n in nodes) / 1e9 if nodes else None,
            "utilization_est": [n.get("utilization_est") for n in nodes],
        })
    return {"target_loss": target, "rows": rows, "ratios": ratios(rows), "curves": curves}


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """GASLoC against each DiLoCo: time to target (GASLoC / other) and the relative final-loss
    gap at equal tokens ((GASLoC - other) / other)."""
    by = {r["system"]: r for r in rows if not r.get("skipped")}
    g = by.get("gasloc")
    out: dict[str, dict[str, float | None]] = {}
    if g is None:
        return out
    for name in COMPARED:
        o = by.get(name)
        if o is None:
            continue
        tt = (g["time_to_target_s"] / o["time_to_target_s"]
              if g["time_to_target_s"] and o["time_to_target_s"] else None)
        gap = ((g["final_loss"] - o["final_loss"]) / o["final_loss"]
               if g["final_loss"] is not None and o["final_loss"] else None)
        out[name] = {"time_to_target_ratio": tt, "final_loss_gap": gap}
    return out


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def markdown(case: str, summary: dict[str, Any]) -> str:
    """One case's table and ratio lines."""
    lines = [f"**{case}** (target loss {_fmt(summary['target_loss'], '.3f')}: the lowest every "
             "system reached)", "",
             "| system | final val loss | tokens/node | time to target s | train s | "
             "tokens/s/node | veth tx MB/node (max) | program MB/node | peak RSS GB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        if r.get("skipped"):
            lines.append(f"| {r['system']} | skipped: {r['skipped']} |||||||| ")
            continue
        lines.append(
            f"| {r['system']}{'' if r['finished'] else ' (timed out)'} | "
            f"{_fmt(r['final_loss'], '.4f')} | {_fmt(r['final_tokens_per_node'], ',')} | "
            f"{_fmt(r['time_to_target_s'], '.1f')} | {_fmt(r['train_wall_s'], '.1f')} | "
            f"{_fmt(r['tokens_per_s_per_node'], '.0f')} | {_fmt(r['veth_tx_mb_per_node'], '.2f')}"
            f" ({_fmt(r['veth_tx_mb_max_node'], '.2f')}) | "
            f"{_fmt(r['program_mb_per_node'], '.2f')} | {_fmt(r['rss_peak_gb_max_node'], '.2f')} |")
    lines.append("")
    for r in summary["rows"]:
        util = [u for u in r.get("utilization_est") or [] if u is not None]
        if util:
            lines.append(f"- {r['system']}: the nodes' own compute-utilization estimates "
                         f"{', '.join(_fmt(u, '.3f') for u in r['utilization_est'])}")
    for name, rr in summary["ratios"].items():
        lines.append(f"- GASLoC / {name}: time to target {_fmt(rr['time_to_target_ratio'], '.2f')}"
                     f", final loss gap at equal tokens {_fmt(rr['final_loss_gap'], '+.2%')}")
    return "\n".join(lines) + "\n"
