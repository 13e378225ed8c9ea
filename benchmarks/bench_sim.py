"""Simulator overhead: wall time per round for N workers as a ratio to N x H single steps.

Usage: python -m benchmarks.bench_sim [--workers 8] [--rounds 5] [--H 10] [--algorithm gasloc]
The single-step time is measured in the same run, before and after, on worker 0 of a one-worker
simulation of the same config, so the ratio is the simulator's own cost (outer update, quantized exchanges, bookkeeping).
Target: at most 1.15.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from gasloc_p2p.sim import async_, sync
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.workers import SimWorkers


def step_seconds(sim: SimWorkers, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        sim.inner_step(0)
    return (time.perf_counter() - start) / steps


def measure(cfg: SimConfig) -> dict[str, float]:
    torch.set_num_threads(cfg.threads)
    probe = SimWorkers(dataclasses.replace(cfg, workers=1))
    step_seconds(probe, 5)  # warm-up
    before = step_seconds(probe, 3 * cfg.H)
    sim = SimWorkers(cfg)
    clock = sync.Clock(cfg.workers)
    rounds = [0]
    start = time.perf_counter()
    if cfg.mode == "async":
        async_.run_async(sim, clock, lambda now: rounds.__setitem__(0, rounds[0] + 1))
    else:
        sync.SYNC_DRIVERS[cfg.algorithm](sim, clock, lambda now: None)
    elapsed = time.perf_counter() - start
    after = step_seconds(probe, 3 * cfg.H)
    single = (before + after) / 2
    n_rounds = cfg.steps / cfg.H
    per_round = elapsed / n_rounds
    return {"per_round_s": per_round, "single_step_s": single,
            "ratio": per_round / (cfg.workers * cfg.H * single)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--H", type=int, default=10)
    parser.add_argument("--algorithms", default="gasloc,diloco,streaming-diloco")
    parser.add_argument("--codec", default="int8")
    args = parser.parse_args()
    print(f"simulator overhead, {args.workers} workers, {args.rounds} rounds of H={args.H}")
    print(f"{'algorithm':<18} {'codec':<6} {'round s':>8} {'step ms':>8} {'ratio':>6}")
    for algo in args.algorithms.split(","):
        cfg = SimConfig(algorithm=algo, workers=args.workers, H=args.H,
                        steps=args.rounds * args.H, codec=args.codec, eval_every=10**9,
                        n_layer=4, n_embd=128, seq_len=128, batch_size=16, fragments=2)
        r = measure(cfg)
        print(f"{algo:<18} {args.codec:<6} {r['per_round_s']:>8.2f} "
              f"{1e3 * r['single_step_s']:>8.1f} {r['ratio']:>6.3f}")


if __name__ == "__main__":
    main()
