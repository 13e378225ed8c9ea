"""Core benchmark: cost of the GASLoC outer update as a ratio to a plain ``copy_``.

Usage: python -m benchmarks.bench_core [--numel 100000000] [--threads 1 2] [--skip-codecs]
Prints one table for the outer-update ops and, unless skipped, the codec throughput table
(benchmarks/bench_codecs.py). Ratios are measured side by side in the same run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState


def best_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """Best wall time of ``fn`` in seconds (the minimum filters this shared machine's noise)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(numel: int, threads: int) -> list[dict[str, float | str]]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(numel, generator=gen)
    theta0 = torch.randn(numel, generator=gen)
    dst = torch.empty_like(theta)
    base = best_time(lambda: dst.copy_(theta))
    rows: list[dict[str, float | str]] = [{"op": "copy_ (baseline)", "seconds": base, "ratio": 1.0}]
    for momentum in ("mixed", "local"):
        state = AsyncGaslocState(theta, theta0, AsyncConfig(momentum=momentum))
        t = best_time(state.round_end)
        rows.append({"op": f"round_end ({momentum})", "seconds": t, "ratio": t / base})
        del state
    state = AsyncGaslocState(theta, theta0, AsyncConfig())
    t = best_time(lambda: state.public_iterate(out=dst))
    rows.append({"op": "public_iterate (out=)", "seconds": t, "ratio": t / base})
    corr = torch.randn(numel, generator=gen) * 1e-3
    t = best_time(lambda: state.apply_correction(corr))
    rows.append({"op": "apply_correction", "seconds": t, "ratio": t / base})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--skip-codecs", action="store_true")
    args = parser.parse_args()
    print(f"GASLoC outer update on {args.numel / 1e6:.0f}M float32 elements")
    print(f"{'threads':>7}  {'op':<22} {'ms':>9} {'x copy_':>8}")
    for threads in args.threads:
        for row in run(args.numel, threads):
            print(f"{threads:>7}  {row['op']:<22} {1e3 * float(row['seconds']):>9.1f} "
                  f"{float(row['ratio']):>8.2f}")
    if not args.skip_codecs:
        import bench_codecs

        print()
        bench_codecs.main([f"--numel={args.numel}", "--threads", *map(str, args.threads)])


if __name__ == "__main__":
    main()
