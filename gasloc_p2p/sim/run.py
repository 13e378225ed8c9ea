"""Run simulations, collect their histories, and write JSON results and a PNG plot."""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gasloc_p2p.data import TokenData
from gasloc_p2p.sim.clock import Clock
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.consensus import ConsensusWorkers
from gasloc_p2p.sim.diloco import run_diloco, run_local
from gasloc_p2p.sim.gossip import run_gossip
from gasloc_p2p.sim.workers import SimWorkers, load_token_data

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]  # (mean steps done, total steps per worker), per round end


def run(cfg: SimConfig, data: TokenData | None = None,
        progress: Progress | None = None) -> dict[str, Any]:
    """One simulated run; returns a JSON-ready dict with its config, history and summary."""
    cfg.validate()
    torch.set_num_threads(cfg.threads)
    started, cpu_started = time.perf_counter(), time.process_time()
    if cfg.task == "consensus":
        sim: SimWorkers = ConsensusWorkers(cfg)
    else:
        sim = SimWorkers(cfg, data if data is not None
                         else load_token_data(cfg.data, cfg.tokenizer))
    clock = Clock(cfg.workers)
    history: list[dict[str, float]] = []  # full evaluations, every eval_every steps
    trace: list[dict[str, float]] = []  # the quick loss at every round end

    def record(now: float, force: bool = False) -> None:
        """Called by the drivers at every round end (async: every H mean steps)."""
        steps = sim.mean_steps()
        point = {"steps": steps, "tokens": steps * cfg.workers * sim.tokens_per_step,
                 "sim_seconds": now,
                 "bytes_per_worker": sum(clock.bytes_sent) / cfg.workers}
        if cfg.trace_batches and (not trace or steps > trace[-1]["steps"]):
            trace.append({**point, "loss": sim.trace_loss(), "consensus": sim.consensus()})
        if progress is not None:  # every round end: a watcher projects the run's end from it
            progress(int(steps), cfg.steps)
        if not force and history and steps - history[-1]["steps"] < cfg.eval_every:
            return
        point.update(sim.evaluate())
        history.append(point)

    record(0.0, force=True)
    stats: dict[str, float] = {}
    if cfg.algorithm in ("diloco", "streaming-diloco"):
        run_diloco(sim, clock, record)
    elif cfg.algorithm == "local" and cfg.mode == "sync":
        run_local(sim, clock, record)
    else:
        stats = run_gossip(sim, clock, record)
    if history[-1]["sim_seconds"] != clock.now or history[-1]["steps"] != trace_steps(sim):
        record(clock.now, force=True)
    final = history[-1]
    return {"config": dataclasses.asdict(cfg), "label": label(cfg), "history": history,
            "trace": trace, "final": final, "stats": stats, "params": int(sim.theta0.numel()),
            "wall_seconds": time.perf_counter() - started,
            "cpu_seconds": time.process_time() - cpu_started}


def trace_steps(sim: SimWorkers) -> float:
    return sim.mean_steps()


def label(cfg: SimConfig) -> str:
    """What the run is, outer step included: ``diloco (Nesterov 0.7/0.9) int8`` is not
    ``diloco (plain averaging) int8``."""
    parts = [cfg.algorithm]
    if cfg.algorithm == "gasloc":
        parts.append(cfg.mode)
        if cfg.momentum == "acid":
            parts.append("acid")
    if cfg.algorithm in ("gasloc", "diloco", "streaming-diloco"):
        parts.append(outer_step_name(cfg.outer_eta, cfg.outer_gamma,
                                     "Nesterov" if cfg.algorithm != "gasloc" else cfg.momentum))
    if cfg.algorithm in ("gasloc", "gossip-sgd"):
        parts.append(f"{cfg.graph}")
    if cfg.algorithm != "local":
        parts.append(cfg.codec)
    if cfg.reference != "theta0":
        parts.append(f"ref {cfg.reference}")
    if cfg.ef_beta != 1.0:
        parts.append(f"ef beta {cfg.ef_beta:g}")
    return " ".join(parts)


def outer_step_name(eta: float, gamma: float, momentum: str) -> str:
    """``(plain averaging)`` at eta 1, gamma 0; ``(Nesterov 0.7/0.9)``: eta, then gamma."""
    if gamma == 0.0:
        return "(plain averaging)" if eta == 1.0 else f"(eta {eta:g}, no momentum)"
    return f"({momentum} {eta:g}/{gamma:g})"


def write_results(results: Sequence[dict[str, Any]], out_dir: Path, name: str = "sim") -> Path:
    """Write ``{name}.json`` and ``{name}.png`` into ``out_dir``; returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(list(results), indent=1))
    tmp.replace(path)
    plot(results, out_dir / f"{name}.png")
    return path


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Write :func:`figure` of ``results`` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(results)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend under the consensus panel
    plt.close(fig)


def figure(results: Sequence[dict[str, Any]]) -> Any:
    """Validation loss of the network-average model vs tokens and vs simulated time (the quick
    loss logged at every round end, else the full evaluations), and the consensus distance vs
    tokens (at every round end where logged, else at the evaluations): one line per
    configuration (mean over its seeds, with the min-max band of the seeds), a marker at every
    point measured. The consensus axis is logarithmic: a zero (replicas identical, as DiLoCo's
    after a sync) is not drawn, and the legend says at how many points it was zero."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    groups: dict[str, list[dict[str, Any]]] = {}
    for res in results:
        groups.setdefault(res["label"], []).append(res)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    axes[2].set_yscale("log", nonpositive="mask")  # no floor: zeros stay out of the picture
    for lbl, runs in groups.items():
        name = lbl + (f" ({len(runs)} seeds)" if len(runs) > 1 else "")
        loss_from = "trace" if runs[0].get("trace") else "history"
        loss_y = "loss" if loss_from == "trace" else "val_loss"
        color = _line(axes[0], *_points(runs, loss_from, "tokens", loss_y), name, None)
        _line(axes[1], *_points(runs, loss_from, "sim_seconds", loss_y), name, color)
        cons_from = ("trace" if all(r.get("trace") and "consensus" in r["trace"][0]
                                    for r in runs) else "history")  # older results: history
        xs, ys = _points(runs, cons_from, "tokens", "consensus")
        zeros = sum(statistics.fmean(v) <= 0 for v in ys)
        note = f"; 0 at {zeros} of {len(ys)} points (replicas identical)" if zeros else ""
        kept = [(x, v) for x, v in zip(xs, ys, strict=True) if statistics.fmean(v) > 0]
        _line(axes[2], [x for x, _ in kept], [v for _, v in kept], name + note, color)
    axes[0].set(xlabel="tokens (all workers)", ylabel="val loss (avg model, nats)")
    axes[1].set(xlabel="simulated seconds", ylabel="val loss (avg model, nats)")
    axes[2].set(xlabel="tokens (all workers)", ylabel="consensus distance (log)")
    low = min([p["val_loss"] for r in results for p in r["history"]]
              + [p["loss"] for r in results for p in r.get("trace", [])])
    for ax in axes[:2]:
        ax.set_ylim(low - 0.05, low + 1.2)  # the interesting part, not the first drop
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in (axes[0], axes[2]):
        ax.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter(sep=""))  # 200k, 1M
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14),
                   title="zeros are not drawn on the log axis", title_fontsize=6)
    fig.tight_layout()
    return fig


def _points(runs: list[dict[str, Any]], source: str, xkey: str,
            ykey: str) -> tuple[list[float], list[list[float]]]:
    """x (mean over seeds) and the seeds' y values at each point logged in every run."""
    length = min(len(r[source]) for r in runs)
    xs = [statistics.fmean(r[source][k][xkey] for r in runs) for k in range(length)]
    return xs, [[r[source][k][ykey] for r in runs] for k in range(length)]


def _line(ax: Any, xs: list[float], ys: list[list[float]], name: str, color: Any) -> Any:
    """The seeds' mean with a marker at each point, and their min-max band; the color."""
    line, = ax.plot(xs, [statistics.fmean(v) for v in ys], marker=".", markersize=4,
                    label=name, color=color)
    if ys and len(ys[0]) > 1:
        ax.fill_between(xs, [min(v) for v in ys], [max(v) for v in ys],
                        color=line.get_color(), alpha=0.15)
    return line.get_color()
