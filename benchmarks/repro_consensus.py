"""The ``consensus`` part of reproduce.py: the pure-consensus toy on the real sync driver.

Rows: n in {16, 32}, ring and exponential graphs (and the complete graph at n = 16 as the
control where momentum should give nothing; a ring at n = 4, the training tables' size), gamma
in {0, .3, .5, .7, .8, .9}, fresh random 1-peer matchings, w = 1/2 (and 0.3 on rings), exact
float64 exchanges. The drift is zero, so ``eta`` scales nothing and
every gamma is at the same effective step; only mixing and momentum act.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from gasloc_p2p.sim.analysis import mean_ci, paired_ci, time_to_target
from gasloc_p2p.sim.config import SimConfig

ROUNDS = 1000
SHRINK = 1e-6  # consensus distance (squared) relative to the start: the RMS disagreement / 1000
GAMMAS = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9)
SETUPS = ((4, "ring"), (16, "ring"), (16, "exponential"), (16, "complete"), (32, "ring"),
          (32, "exponential"))
SMALL_W = (0.3, (0.0, 0.7, 0.9))  # ring rows at w = 0.3 (the spec's advice for large gamma)
BASE = SimConfig(task="consensus", algorithm="gasloc", mode="sync", H=1, steps=ROUNDS,
                 eval_every=1, trace_batches=0, eval_workers=False, codec="none",
                 dtype="float64", eta=1.0, threads=1)


# The same toy on the asynchronous driver (the daemon's node state): exchanges at exponential
# waiting times, one participation per worker per round on average, instantaneous (no latency),
# so momentum acid (A2CiD2, with its parameters from the graph) can be set against plain gossip
# and against the mixed outer momentum.
ASYNC = replace(BASE, mode="async", participations_per_round=1.0, latency_s=0.0,
                bandwidth_mbps=1e6)
ASYNC_SETUPS = ((16, "ring"), (16, "exponential"), (16, "complete"), (32, "ring"),
                (32, "exponential"), (64, "ring"))


def async_rows() -> list[tuple[str, SimConfig]]:
    out = []
    for n, graph in ASYNC_SETUPS:
        b = replace(ASYNC, workers=n, graph=graph)
        out += [(f"n{n} {graph} g0", b), (f"n{n} {graph} g0 acid", replace(b, momentum="acid"))]
        if graph == "ring" and n <= 32:  # the mixed momentum's best gamma in the sync toy
            out.append((f"n{n} {graph} g{0.5 if n == 16 else 0.7}",
                        replace(b, gamma=0.5 if n == 16 else 0.7)))
        if graph == "ring" and n == 32:  # A2CiD2's rate off its theory value
            rate, beta = replace(b, momentum="acid").acid()
            out += [(f"n{n} {graph} g0 acid rate x{k:g}",
                     replace(b, momentum="acid", acid_rate=rate * k, acid_beta=beta))
                    for k in (0.5, 2.0)]
    return out


def rows() -> list[tuple[str, SimConfig]]:
    out = []
    for n, graph in SETUPS:
        out += [(f"n{n} {graph} g{gamma:g}", replace(BASE, workers=n, graph=graph, gamma=gamma))
                for gamma in GAMMAS]
        if graph == "ring":
            w, gammas = SMALL_W
            out += [(f"n{n} {graph} w{w:g} g{gamma:g}",
                     replace(BASE, workers=n, graph=graph, gamma=gamma, w=w)) for gamma in gammas]
    return out


def rounds_to(res: dict[str, Any], shrink: float = SHRINK) -> float | None:
    """Rounds until the relative consensus distance first reaches ``shrink`` (log-linear
    interpolation between the two rounds around the crossing); None if never."""
    pts = [{"steps": p["steps"], "log": math.log(max(p["val_loss"], 1e-300))}
           for p in res["history"]]
    return time_to_target(pts, math.log(shrink), x="steps", y="log")


def table(group: dict[str, list[dict[str, Any]]]) -> list[str]:
    head = ["config", "seeds", "rounds to RMS disagreement / 1000 (reached)",
            "Δ rounds vs g0 (paired)", "speed-up vs g0", "rel. distance @100 rounds",
            "max |mean drift|", "MB/worker"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, runs in group.items():
        runs = sorted(runs, key=lambda r: r["config"]["seed"])
        ref_name = name.rsplit(" g", 1)[0] + " g0"
        ref = {r["config"]["seed"]: r for r in group.get(ref_name, [])}
        got = [rounds_to(r) for r in runs]
        reached = [x for x in got if x is not None]
        cells = [name, str(len(runs))]
        cells.append(f"{_fmt(mean_ci(reached), '.1f')} ({len(reached)}/{len(runs)})" if reached
                     else f"> {ROUNDS} (0/{len(runs)})")
        pairs = [(x, rounds_to(ref[r["config"]["seed"]])) for x, r in zip(got, runs, strict=True)
                 if r["config"]["seed"] in ref]
        ok = [(a, b) for a, b in pairs if a is not None and b is not None]
        if name == ref_name:
            cells += ["(reference)", "1.00x"]
        elif len(ok) >= 2 and len(ok) == len(pairs):
            cells.append(_fmt(paired_ci([a for a, _ in ok], [b for _, b in ok]), "+.1f"))
            cells.append(f"{sum(b for _, b in ok) / sum(a for a, _ in ok):.2f}x")
        else:
            cells += ["n/a (not all reached)", "n/a"]
        at100 = [_value_at_round(r, 100) for r in runs]
        geo = math.exp(sum(math.log(max(v, 1e-300)) for v in at100) / len(at100))
        cells.append("0 (exact)" if geo <= 1e-290 else f"{geo:.1e}")
        cells.append(f"{max(p.get('mean_drift', 0.0) for r in runs for p in r['history']):.0e}")
        cells.append(f"{mean_ci([r['final']['bytes_per_worker'] / 1e6 for r in runs])[0]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _value_at_round(res: dict[str, Any], rnd: int) -> float:
    return next((p["val_loss"] for p in res["history"] if p["steps"] >= rnd),
                res["history"][-1]["val_loss"])


def _fmt(mean_half: tuple[float, float], fmt: str) -> str:
    mean, half = mean_half
    return f"{mean:{fmt}}" + ("" if math.isnan(half) else f" ± {half:{fmt.lstrip('+')}}")


def plot(group: dict[str, list[dict[str, Any]]], path: Path,
         setups: tuple[tuple[int, str], ...] = SETUPS) -> None:
    """Relative consensus distance vs rounds (geometric mean over seeds), one panel per
    (n, graph), one line per gamma (and w)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [f"n{n} {graph}" for n, graph in setups]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), sharey=True)
    for ax, panel in zip(axes, panels, strict=True):
        for name, runs in group.items():
            if not name.startswith(panel + " "):
                continue
            length = min(len(r["history"]) for r in runs)
            xs = [runs[0]["history"][k]["steps"] for k in range(length)]
            ys = [math.exp(sum(math.log(max(r["history"][k]["val_loss"], 1e-300)) for r in runs)
                           / len(runs)) for k in range(length)]
            ax.plot(xs, ys, label=name[len(panel) + 1:], lw=1)
        ax.axhline(SHRINK, color="k", lw=0.5, ls="--")
        ax.set(title=panel, xlabel="rounds", yscale="log", ylim=(1e-12, 1e3))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0].set_ylabel("consensus distance / start")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
