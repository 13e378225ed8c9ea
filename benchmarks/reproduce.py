"""The simulator measurements of docs/results, one part at a time (each <= 30 min here).

Usage: python -m benchmarks.reproduce --only PART[,PART] [--seeds 0,1,2] [--jobs 2]
Parts: momentum-h10, momentum-h50, async, slow, consensus, gamma-sweep-h100, gamma-sweep-h10,
graphs, graphs-16, mixing, acid-consensus, acid, gamma-graphs-8, gamma-graphs-16 (see PARTS).
Training runs: n = 4 workers (graphs: 8, graphs-16 and acid: 16), 1000 inner steps per worker,
the default tiny GPT (2 layers, width 64; 121k parameters) on byte-level Shakespeare, i.i.d.
shards, int8 payloads. consensus and acid-consensus: the pure-consensus toy
(repro_consensus.py), no training. Each run is cached as JSON under --cache, so an interrupted
part resumes.

``--rebuild`` only rewrites the tables and plots from the runs a part's published
``{part}.json`` holds, grouped by their labels (so it works in a fresh clone). It also rebuilds
the ARCHIVED parts: tables of options retired from the code after commit db57895 (their rows
cannot run any more; their results stay). The published tables before that commit were measured
with per-peer quantization references ("links"), since retired for "plain" (no measured
difference: docs/results/references.md); re-running a part measures today's code.
Writes ``docs/results/{part}.json|md|png`` and ``docs/results/reproduction.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import repro_codecs, repro_consensus, repro_ladder
from gasloc_p2p.data import registry
from gasloc_p2p.sim.analysis import mean_ci, paired_ci, time_to_target, value_at
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.consensus import DIM
from gasloc_p2p.sim.run import run, write_results

N, STEPS = 4, 1000
BUDGETS = (0.25, 0.5, 1.0)  # fractions of the token budget at which losses are read
TARGETS = (2.8, 2.6, 2.4)  # losses (nats/byte) for time-to-target, in the slow part

BASE = SimConfig(workers=N, steps=STEPS, H=10, codec="int8", eval_every=STEPS // 4,
                 eval_batches=64, trace_batches=4, eval_workers=False, threads=1)
Row = tuple[str, SimConfig]


def _momentum(H: int, baselines: bool = True) -> list[Row]:
    """Outer momentum at equal effective step eta / (1 - gamma) = 1, against plain averaging
    (and, with ``baselines``, all-reduce averaging; the published table also has a NoLoCo row,
    retired)."""
    b = dataclasses.replace(BASE, H=H, graph="ring")
    r = dataclasses.replace
    rows = [
        ("gasloc sync g0 eta1 (plain pair averaging)", r(b, algorithm="gasloc", gamma=0.0, eta=1.0)),
        ("gasloc sync g0.5 eta0.5", r(b, algorithm="gasloc", gamma=0.5, eta=0.5)),
        ("gasloc sync g0.9 eta0.1", r(b, algorithm="gasloc", gamma=0.9, eta=0.1)),
    ]
    return rows if not baselines else rows + [
        ("diloco g0 eta1 (all-reduce averaging)", r(b, algorithm="diloco", gamma=0.0, eta=1.0)),
    ]


def _async() -> list[Row]:
    """Async against sync at equal bytes: one participation per round on each side."""
    b = dataclasses.replace(BASE, graph="ring", algorithm="gasloc")
    r = dataclasses.replace
    return [
        ("sync g0 eta1 (1 exchange/round)", r(b, gamma=0.0, eta=1.0)),
        ("async g0 eta1, 1 participation/round", r(b, mode="async", gamma=0.0, eta=1.0,
                                                   participations_per_round=1.0)),
    ]


def _slow() -> list[Row]:
    """Worker 0 computes 3x slower and sits on a 20x slower link (1 of 20 Mbit/s); where the
    method allows it, it takes H_0 = 3 steps per round against 10 (rounds equal in time)."""
    b = dataclasses.replace(BASE, slow_workers=1, slow_compute_factor=3.0, slow_link_factor=20.0,
                            bandwidth_mbps=20.0)
    hi = dict(H_per_worker=(3, 10, 10, 10), budget="total")
    r = dataclasses.replace
    return [
        ("diloco g0 eta1, H_i (blocking all-reduce)", r(b, algorithm="diloco", gamma=0.0,
                                                         eta=1.0, **hi)),
        ("streaming-diloco g0 eta1 tau5 (overlapped)", r(b, algorithm="streaming-diloco",
                                                          gamma=0.0, eta=1.0, tau=5)),
        ("gasloc async g0 eta1, 1/round, H_i", r(b, algorithm="gasloc", mode="async",
                                                 graph="complete", gamma=0.0, eta=1.0,
                                                 participations_per_round=1.0, **hi)),
        ("gasloc async old default (mixed g0.5 eta0.7, 2/round), H_i",
         r(b, algorithm="gasloc", mode="async", graph="complete", gamma=0.5, eta=0.7,
           participations_per_round=2.0, **hi)),
    ]


def _gamma_sweep(H: int, extra: bool = True) -> list[Row]:
    """Sync GASLoC on a ring, gamma in {0, .3, .5, .7, .9} at equal effective step
    eta / (1 - gamma) = 1. Rows in priority order (parts run row by row, so an interrupted part
    has the first rows complete). Without ``extra``: only the rows momentum-h10 lacks (it has
    gamma 0.5 and 0.9, the same configurations and seeds). The published tables also have rows
    with the momentum ramped up over a few rounds (an outer warm-up, retired)."""
    b = dataclasses.replace(BASE, H=H, graph="ring", algorithm="gasloc")
    r = dataclasses.replace
    rows = []
    for g in (0.0, 0.9, 0.5, 0.7, 0.3) if extra else (0.0, 0.7, 0.3):
        name = f"gasloc sync g{g:g} eta{1 - g:.1g}" + (" (plain pair averaging)" if g == 0
                                                       else "")
        rows.append((name, r(b, gamma=g, eta=round(1 - g, 6))))
    return rows


def _graphs() -> list[Row]:
    """n = 8: the default GASLoC (plain pair averaging, 1-peer matchings) on a ring and on the
    exponential graph, against DiLoCo (all-reduce averaging, eta 1 gamma 0: the same outer
    step) and DiLoCo with its paper's Nesterov 0.7 / 0.9; bytes in the table."""
    b = dataclasses.replace(BASE, workers=8, H=10)
    r = dataclasses.replace
    return [
        ("gasloc sync g0 eta1 ring (default)", r(b, algorithm="gasloc", graph="ring")),
        ("gasloc sync g0 eta1 exponential", r(b, algorithm="gasloc", graph="exponential")),
        ("diloco g0 eta1 (all-reduce averaging)", r(b, algorithm="diloco", gamma=0.0, eta=1.0)),
    ]


def _mixing() -> list[Row]:
    """The gossip weight w below 1/2 (sync, ring, plain averaging), and the two async momentum
    forms at gamma 0.5, eta 0.5 (equal effective step 1)."""
    r = dataclasses.replace
    sync = r(BASE, algorithm="gasloc", graph="ring", gamma=0.0, eta=1.0)
    asyn = r(BASE, algorithm="gasloc", mode="async", graph="complete", gamma=0.5, eta=0.5,
             participations_per_round=1.0)
    return [
        ("sync ring g0 eta1 w 1/2 (default)", sync),
        ("sync ring g0 eta1 w 0.3", r(sync, w=0.3)),
        ("async g0.5 eta0.5 mixed momentum", r(asyn, momentum="mixed")),
        ("async g0.5 eta0.5 local momentum", r(asyn, momentum="local")),
    ]


def _graphs16() -> list[Row]:
    """n = 16: the default GASLoC on a ring (diameter 8) and on the exponential graph."""
    b = dataclasses.replace(BASE, workers=16, H=10, algorithm="gasloc")
    r = dataclasses.replace
    return [
        ("gasloc sync g0 eta1 ring (default)", r(b, graph="ring")),
        ("gasloc sync g0 eta1 exponential", r(b, graph="exponential")),
    ]


def _acid() -> list[Row]:
    """n = 16 on a ring, async, one participation per round: plain gossip against A2CiD2's
    continuous momentum (its parameters from the graph) and the mixed outer momentum."""
    b = dataclasses.replace(BASE, workers=16, H=10, algorithm="gasloc", mode="async",
                            graph="ring", gamma=0.0, eta=1.0, participations_per_round=1.0)
    r = dataclasses.replace
    rate, beta = r(b, momentum="acid").acid()
    return [
        ("async g0 eta1 ring (plain gossip)", b),
        (f"async acid ring (A2CiD2: rate {rate:.3f}, beta {beta:.2f})", r(b, momentum="acid")),
        ("async mixed g0.5 eta0.5 ring", r(b, gamma=0.5, eta=0.5)),
    ]


def _gamma_graphs(n: int, gammas: tuple[float, ...]) -> list[Row]:
    """Sync GASLoC at n workers on a ring and on the exponential graph, outer momentum at equal
    effective step eta / (1 - gamma) = 1 (H = 10), plain pair averaging first."""
    b = dataclasses.replace(BASE, workers=n, H=10, algorithm="gasloc")
    r = dataclasses.replace
    return [(f"{graph} g{g:g} eta{1 - g:.1g}" + (" (plain pair averaging)" if g == 0 else ""),
             r(b, graph=graph, gamma=g, eta=round(1 - g, 6)))
            for graph in ("ring", "exponential") for g in gammas]


TITLES: dict[str, str] = {  # as published (a table keeps the title it was measured under)
    "momentum-h10": "H = 10: outer momentum at equal effective step, NoLoCo, DiLoCo",
    "momentum-h50": "H = 50: outer momentum at equal effective step",
    "async": "Async against sync GASLoC at equal participation (bytes)",
    "slow": "One worker 3x slower compute on a 20x slower link: time to target",
    "consensus": "The pure-consensus toy on the sync driver: where momentum accelerates "
                 "agreement",
    "gamma-sweep-h100": "H = 100: outer momentum at equal effective step, with and without "
                        "warm-up",
    "gamma-sweep-h10": "H = 10: outer momentum 0.3, 0.7 and 0.9 with warm-up at equal "
                       "effective step (0.5 and 0.9 without warm-up: momentum-h10)",
    "graphs": "n = 8: ring against exponential graph, and DiLoCo",
    "graphs-16": "n = 16: ring against exponential graph",
    "mixing": "Gossip weight below 1/2, and mixed against local momentum",
    "acid-consensus": "The pure-consensus toy on the async driver: A2CiD2's continuous "
                      "momentum against plain gossip and the mixed outer momentum",
    "acid": "n = 16 ring, async: A2CiD2's continuous momentum against plain gossip and the "
            "mixed outer momentum",
    "gamma-graphs-8": "n = 8, ring and exponential graph: outer momentum at equal effective "
                      "step",
    "gamma-graphs-16": "n = 16, ring and exponential graph: outer momentum at equal effective "
                       "step",
    **repro_codecs.TITLES,
    **repro_ladder.TITLES,
    # archived: their options were retired after commit db57895 (rebuilt from their JSON only)
    "staleness": "Async at the slow-link profile: staleness policies",
    "capacity": "n = 12, complete graph: per-peer reference capacity against per-node "
                "error feedback",
    "noloco": "NoLoCo tuned: momentum, outer lr and pull around the untuned setting",
    "references": "n = 8: quantization reference schemes at equal bytes, int8",
    "references-int4": "n = 8: quantization reference schemes at equal bytes, int4",
}
PARTS: dict[str, list[Row]] = {
    "momentum-h10": _momentum(10),
    "momentum-h50": _momentum(50, False),
    "async": _async(),
    "slow": _slow(),
    "consensus": repro_consensus.rows(),
    "gamma-sweep-h100": _gamma_sweep(100),
    "gamma-sweep-h10": _gamma_sweep(10, extra=False),
    "graphs": _graphs(),
    "graphs-16": _graphs16(),
    "mixing": _mixing(),
    "acid-consensus": repro_consensus.async_rows(),
    "acid": _acid(),
    "gamma-graphs-8": _gamma_graphs(8, (0.0, 0.3, 0.5, 0.7, 0.9)),
    "gamma-graphs-16": _gamma_graphs(16, (0.0, 0.5, 0.9)),
    "codecs-8": repro_codecs.rows(BASE, 8),
    "codecs-16": repro_codecs.rows(BASE, 16),
    "home-8": repro_codecs.home_rows(BASE, 8),
    "home-8-deciding": repro_codecs.home_rows(BASE, 8, deciding=True),
    "home-links-8": repro_codecs.home_link_rows(BASE, 8),
    "home-links-8-uneven": repro_codecs.home_link_rows(BASE, 8, uneven=True),
    "home-links-8-deciding": repro_codecs.home_link_rows(BASE, 8, deciding=True),
    "home-links-8-bound": repro_codecs.home_link_bound_rows(BASE),
    "home-links-16": repro_codecs.home_link_rows(BASE, 16),
    **{part: repro_ladder.rows(part) for part in repro_ladder.PARTS},
}
ARCHIVED = [p for p in TITLES if p not in PARTS]
CONSENSUS_PARTS = ("consensus", "acid-consensus")  # they publish every 25th round only


def config_key(config: dict[str, Any]) -> str:
    """A run's configuration (``dataclasses.asdict`` of its SimConfig) as the key of its
    cached run."""
    return json.dumps(config, sort_keys=True)


def cache_path(cache: Path, cfg: SimConfig) -> Path:
    """One file per configuration (seed included): parts that share a row share its runs."""
    key = config_key(dataclasses.asdict(cfg))
    return cache / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def published_groups(path: Path) -> dict[str, list[dict[str, Any]]]:
    """A part's published runs (its ``{part}.json``) by row label, in published order."""
    group: dict[str, list[dict[str, Any]]] = {}
    for res in json.loads(path.read_text()) if path.exists() else []:
        group.setdefault(res["label"], []).append(res)
    return group


def _run(item: tuple[str, str, SimConfig, Path]) -> tuple[str, str, dict[str, Any]]:
    part, name, cfg, cache = item
    path = cache_path(cache, cfg)
    if path.exists():
        res = json.loads(path.read_text())
    else:
        res = run(cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res))
    res["label"] = name
    return part, name, res


def _fmt(mean_half: tuple[float, float], fmt: str = ".3f") -> str:
    mean, half = mean_half
    return f"{mean:{fmt}}" + ("" if math.isnan(half) else f" ± {half:{fmt.lstrip('+')}}")


def _budget_losses(res: dict[str, Any], frac: float) -> float:
    c = res["config"]
    tokens = frac * c["workers"] * c["steps"] * c["batch_size"] * c["seq_len"]
    value = value_at(res["history"], "tokens", tokens, "val_loss")
    return math.nan if value is None else value


def table(part: str, group: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown rows: losses at token budgets (mean ± 95% t half-width over seeds), the paired
    difference to the first row at the full budget, bytes, simulated time, time to targets."""
    targets = TARGETS if part == "slow" else ()
    names = list(group)
    ref = {r["config"]["seed"]: r for r in group[names[0]]}
    head = ["config", "seeds"] + [f"loss @{int(f * 100)}% tokens" for f in BUDGETS]
    head += ["Δ vs first row @100% (paired)", "MB/worker", "sim s"]
    head += [f"sim s to {t} (reached)" for t in targets]
    if targets:
        head.append(f"speed-up to {targets[-2]} vs first row")
    if part == "async":
        head.append("participations/round (measured)")
    workers = part.startswith("references")
    if workers:
        head += ["worst worker @100%", "consensus @100%"]
    warmups = part.startswith("gamma-sweep")
    if warmups:
        head.append("Δ vs same gamma without warm-up @100% (paired)")
    graphs = part.startswith("gamma-graphs")
    if graphs:
        head.append("Δ vs g0 on the same graph @100% (paired)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref_t = {}
    for name in names:
        runs = sorted(group[name], key=lambda r: r["config"]["seed"])
        cells = [name, str(len(runs))]
        cells += [_fmt(mean_ci([_budget_losses(r, f) for r in runs])) for f in BUDGETS]
        paired = [r for r in runs if r["config"]["seed"] in ref]
        if name == names[0]:
            cells.append("(reference)")
        elif len(paired) >= 2:
            cells.append(_fmt(paired_ci([_budget_losses(r, 1.0) for r in paired],
                                        [_budget_losses(ref[r["config"]["seed"]], 1.0)
                                         for r in paired]), "+.3f"))
        else:
            cells.append("n/a")
        cells.append(f"{mean_ci([r['final']['bytes_per_worker'] / 1e6 for r in runs])[0]:.2f}")
        cells.append(f"{mean_ci([r['final']['sim_seconds'] for r in runs])[0]:.0f}")
        for t in targets:
            times = [time_to_target(r["trace"], t) for r in runs]
            got = [x for x in times if x is not None]
            cells.append(f"{_fmt(mean_ci(got), '.1f')} ({len(got)}/{len(times)})" if got
                         else f"not reached (0/{len(times)})")
            if t == targets[-2]:
                ref_t.setdefault(name, got if len(got) == len(times) else [])
        if targets:
            base, mine = ref_t.get(names[0], []), ref_t.get(name, [])
            cells.append(f"{sum(base) / sum(mine):.2f}x" if base and mine else "n/a")
        if part == "async":
            parts = [r["stats"].get("participations_per_round") for r in runs]
            cells.append("1 (sync matching)" if None in parts
                         else f"{mean_ci([float(p) for p in parts])[0]:.2f}")
        if workers:
            cells.append(_fmt(mean_ci([r["final"]["worst_val_loss"] for r in runs])))
            cells.append(f"{mean_ci([r['final']['consensus'] for r in runs])[0]:.3g}")
        if warmups:
            cells.append(_versus(runs, group.get(name.split(", warm-up")[0], []))
                         if ", warm-up" in name else "")
        if graphs:
            plain = name.split(" ")[0] + " g0 eta1 (plain pair averaging)"
            cells.append("(reference)" if name == plain else _versus(runs, group.get(plain, [])))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _versus(runs: list[dict[str, Any]], others: list[dict[str, Any]]) -> str:
    """Paired difference of the final losses of ``runs`` against ``others`` (same seeds)."""
    ref = {r["config"]["seed"]: r for r in others}
    paired = [r for r in runs if r["config"]["seed"] in ref]
    if len(paired) < 2:
        return "n/a (not run here)"
    return _fmt(paired_ci([_budget_losses(r, 1.0) for r in paired],
                          [_budget_losses(ref[r["config"]["seed"]], 1.0) for r in paired]),
                "+.3f")


def write_part(part: str, group: dict[str, list[dict[str, Any]]], out: Path,
               seeds: Sequence[int]) -> None:
    title = TITLES[part]
    runs = [r for rs in group.values() for r in rs]
    # CPU time where recorded (runs on a loaded machine take longer in wall time)
    wall = sum(r.get("cpu_seconds", r["wall_seconds"]) for r in runs) / 60
    cfg = runs[0]["config"]
    if part in CONSENSUS_PARTS:
        write_consensus(part, group, out, seeds, wall, len(runs))
        return
    if part in repro_codecs.TITLES:
        lines = [*repro_codecs.describe(part, group, ",".join(map(str, seeds)), wall), "",
                 *repro_codecs.table(group, times=part.startswith("home-links")), "", f"![{part}]({part}.png)", ""]
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{part}.md").write_text("\n".join(lines))
        write_results(runs, out, part)
        print("\n".join(lines), flush=True)
        return
    lines = [f"## {part}: {title}", "",
             f"`python -m benchmarks.reproduce --only {part} --seeds "
             f"{','.join(map(str, seeds))}`: {len(runs)} runs of n = {cfg['workers']} workers x "
             f"{cfg['steps']} inner steps, {runs[0]['params']:,} parameters, "
             f"{wall:.0f} CPU-minutes (1 thread per run).", "",
             "Losses: the network-average model on 65,536 validation tokens (nats/"
             f"{'token' if part in repro_ladder.GPU_PARTS else 'byte'}), mean ± "
             "95% t half-width over seeds; Δ: paired by seed against the first row (negative = "
             "better). MB/worker: bytes each worker sent over the run."]
    if part == "slow":
        lines.append("Time to target: simulated seconds until the quick loss (first 4,096 "
                     "validation tokens, logged at every round end) reaches the target, "
                     "linearly interpolated; speed-up: ratio of mean times (all seeds "
                     "reached).")
    lines += ["", *table(part, group), "", f"![{part}]({part}.png)", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{part}.md").write_text("\n".join(lines))
    write_results(runs, out, part)
    print("\n".join(lines), flush=True)


def write_consensus(part: str, group: dict[str, list[dict[str, Any]]], out: Path,
                    seeds: Sequence[int], wall: float, count: int) -> None:
    driver = (
        "The real sync GASLoC driver (sim/gossip.py: the node state with mixed momentum and "
        "sim/exchange.py) with no training: each worker starts at its own standard-normal "
        f"point in R^{DIM}, takes no gradient step, and gossips over fresh random 1-peer "
        "matchings of the graph (w = 1/2 unless the row says w), exact float64 exchanges."
        if part == "consensus" else
        "The real async GASLoC driver (sim/gossip.py with the daemon's node state, "
        "core/async_state.py) with no training: each worker starts at its own standard-normal "
        f"point in R^{DIM}, takes no gradient step (one step is one round), and starts "
        "exchanges with a uniformly drawn free graph neighbour at exponential waiting times, "
        "one participation per worker per round on average, w = 1/2, exact float64 exchanges "
        "with no latency. 'acid': A2CiD2's continuous momentum, its rate and gossip step from "
        "the graph and the participation rate (core/topology.py acid_parameters); 'rate xk': "
        "the rate scaled by k.")
    lines = [f"## {part}: " + TITLES[part], "",
             f"`python -m benchmarks.reproduce --only {part} --seeds "
             f"{','.join(map(str, seeds))}`: {count} runs of {repro_consensus.ROUNDS} rounds "
             f"({wall:.1f} CPU-minutes). {driver} The drift is zero, so every gamma is at the "
             "same effective step (eta scales nothing).", "",
             "Rounds: until the consensus distance mean_i ||x_i - mean(x)||^2 falls to 1e-6 of "
             "its start (the RMS disagreement / 1000), log-interpolated, mean ± 95% t "
             "half-width over seeds; Δ: paired by seed against gamma 0 of the same n, graph and "
             "w (negative = faster). Rel. distance @100 rounds: geometric mean over seeds. "
             "Max |mean drift|: how far the network mean moved (mixing and momentum keep it; "
             "large only where a run diverges).", "",
             *repro_consensus.table(group), "", f"![{part}]({part}.png)", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{part}.md").write_text("\n".join(lines))
    path = out / f"{part}.json"
    keep = ("steps", "val_loss", "bytes_per_worker")  # every 25th round: the table reads all
    slim = [{**r, "history": [{k: p[k] for k in keep} for p in r["history"][::25]],
             "rounds_to_1e-6": repro_consensus.rounds_to(r)} for rs in group.values() for r in rs]
    path.write_text(json.dumps(slim))
    repro_consensus.plot(group, out / f"{part}.png", repro_consensus.SETUPS
                         if part == "consensus" else repro_consensus.ASYNC_SETUPS)
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", required=True,
                        help=f"comma-separated parts: {', '.join(PARTS)} (and, with --rebuild, "
                             f"the archived {', '.join(ARCHIVED)})")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None,
                        help="inner steps per worker, overriding each part's (for smoke tests)")
    parser.add_argument("--device", default="",
                        help="run every row on this device instead of its own (smoke tests)")
    parser.add_argument("--data", default="",
                        help="every row's --data instead of its own (smoke tests)")
    parser.add_argument("--smoke", action="store_true",
                        help="every row at a smoke size (2 workers, 4 steps, a 1-layer model): "
                             "the command end to end in seconds, for the tests")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--cache", type=Path, default=Path("runs/reproduce"))
    parser.add_argument("--rebuild", action="store_true",
                        help="only rewrite the markdown and plots from the published "
                             "{part}.json (training parts; no run)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    todo = [p.strip() for p in args.only.split(",") if p.strip()]
    known = TITLES if args.rebuild else PARTS
    unknown = [p for p in todo if p not in known]
    if unknown:
        retired = [p for p in unknown if p in ARCHIVED]
        parser.error(f"part(s) {retired} measured options retired after commit db57895: "
                     "--rebuild only" if retired and len(retired) == len(unknown)
                     else f"unknown part(s) {unknown}; choose from {list(known)}")
    for part in todo:
        started = time.perf_counter()
        if args.rebuild:
            # the consensus parts publish every 25th round only: no table can be rebuilt
            group = ({} if part in CONSENSUS_PARTS
                     else published_groups(args.out / f"{part}.json"))
            if not group:
                raise SystemExit(f"--rebuild: no cached or published runs of part {part!r}")
        else:
            group = {}
            short: dict[str, Any] = {} if args.steps is None else {
                "steps": args.steps, "eval_every": max(1, args.steps // 4)}
            short.update({k: v for k, v in (("device", args.device), ("data", args.data)) if v})
            if args.smoke:
                short.update(n_layer=1, n_embd=32, n_head=2, seq_len=32, batch_size=4,
                             workers=2, steps=4, eval_every=2, eval_batches=2, trace_batches=1)
            for _, cfg in PARTS[part]:
                data = short.get("data", cfg.data)
                if part in repro_ladder.PARTS and not registry.is_built(data):
                    raise SystemExit(f"{part}: no corpus at {data}: build it with `make corpus`")
            items = [(part, name, dataclasses.replace(cfg, seed=s, **short), args.cache)
                     for name, cfg in PARTS[part] for s in seeds]
            with ProcessPoolExecutor(args.jobs) as pool:
                for _, name, res in pool.map(_run, items):
                    group.setdefault(name, []).append(res)
                    print(f"{part} {name} seed {res['config']['seed']}: "
                          f"{res['final']['val_loss']:.3f} ({res['wall_seconds']:.0f} s)",
                          flush=True)
            group = {name: group[name] for name, _ in PARTS[part] if name in group}
        # a rebuilt table names the seeds its runs have (a one-seed rung stays one seed)
        used = (sorted({r["config"]["seed"] for runs in group.values() for r in runs})
                if args.rebuild and group else seeds)
        write_part(part, group, args.out, used)
        print(f"{part}: {(time.perf_counter() - started) / 60:.1f} min wall", flush=True)
    parts = [(args.out / f"{p}.md").read_text() for p in TITLES
             if (args.out / f"{p}.md").exists()]
    intro = ["# Measurements in the simulator (issue 14)", "",
             "Each part: `python -m benchmarks.reproduce --only PART` (`--jobs 2`, one torch "
             "thread per run, under about 30 minutes on 2 cores). Regime of every training "
             "table unless it says otherwise: n = 4 workers, 1000 inner steps per worker (512 "
             "tokens per step), 121k-parameter GPT, byte-level Shakespeare, i.i.d. shards, int8 "
             "payloads, 3 seeds unless a row says otherwise. Simulated time: 0.05 s per inner "
             "step, 100 Mbit/s links, 20 ms latency (slow part: 20 Mbit/s, the slow worker 1 "
             "Mbit/s and 3x slower compute). Tables published before commit db57895 used "
             "per-peer quantization references (retired; docs/results/references.md).", ""]
    (args.out / "reproduction.md").write_text("\n".join(intro) + "\n" + "\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
