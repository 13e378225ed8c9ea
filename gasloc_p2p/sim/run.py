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
Progress = Callable[[int, int], None]  # (mean steps done, total steps per worker)


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
            trace.append({**point, "loss": sim.trace_loss()})
        if not force and history and steps - history[-1]["steps"] < cfg.eval_every:
            return
        if progress is not None:
            progress(int(steps), cfg.steps)
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
    """Validation loss of the network-average model vs tokens and vs simulated time (the quick
    loss logged at every round end, else the full evaluations), and the consensus distance vs
    tokens: one line per configuration (mean over its seeds, with the min-max band of the
    seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict[str, Any]]] = {}
    for res in results:
        groups.setdefault(res["label"], []).append(res)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = [(0, "tokens", "val_loss"), (1, "sim_seconds", "val_loss"), (2, "tokens", "consensus")]
    for lbl, runs in groups.items():
        seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
        for ax_i, xkey, ykey in panels:
            # losses: the round-end trace where there is one; consensus: the full evaluations
            key, y = ("trace", "loss") if ykey == "val_loss" and runs[0].get("trace") else (
                "history", ykey)
            length = min(len(r[key]) for r in runs)
            xs = [statistics.fmean(r[key][k][xkey] for r in runs) for k in range(length)]
            ys = [[max(r[key][k][y], 1e-12) for r in runs] for k in range(length)]
            line, = axes[ax_i].plot(xs, [statistics.fmean(v) for v in ys], label=lbl + seeds)
            if len(runs) > 1:
                axes[ax_i].fill_between(xs, [min(v) for v in ys], [max(v) for v in ys],
                                        color=line.get_color(), alpha=0.15)
    axes[0].set(xlabel="tokens (all workers)", ylabel="val loss (avg model, nats)")
    axes[1].set(xlabel="simulated seconds", ylabel="val loss (avg model, nats)")
    axes[2].set(xlabel="tokens (all workers)", ylabel="consensus distance", yscale="log")
    low = min([p["val_loss"] for r in results for p in r["history"]]
              + [p["loss"] for r in results for p in r.get("trace", [])])
    for ax in axes[:2]:
        ax.set_ylim(low - 0.05, low + 1.2)  # the interesting part, not the first drop
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
