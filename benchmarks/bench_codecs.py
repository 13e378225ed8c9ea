"""Throughput and error of the wire codecs (gasloc_p2p.core.codecs).

Usage: ``python -m benchmarks.bench_codecs [--numel 100000000] [--threads 1 2] [--reps 3]``

Throughput is MB/s (1e6 bytes) of float32 input, best of ``reps``. Decoding writes into a
preallocated output, as a receiver decoding into a reused buffer does: first-touch page
faults of a fresh 400 MB tensor are an allocator cost, not a codec cost.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from gasloc_p2p.core.codecs import CODEC_NAMES, get_codec


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(
    numel: int = 100_000_000,
    threads: tuple[int, ...] | list[int] = (1, 2),
    reps: int = 3,
    block_size: int = 1024,
    seed: int = 0,
) -> list[dict[str, object]]:
    """Benchmark every codec on a Gaussian float32 [numel] tensor at each thread count.

    Returns one row per (codec, threads): encode/decode/round-trip MB/s of float32 input,
    relative L2 error ||decode(encode(x)) - x|| / ||x|| and wire bytes / fp32 bytes.
    """
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    out = torch.empty_like(x)
    mb = numel * 4 / 1e6
    before = torch.get_num_threads()
    rows: list[dict[str, object]] = []
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for name in CODEC_NAMES:
                codec = get_codec(name, block_size)
                enc = codec.encode(x)  # warm-up, and the payload the decode timing uses
                t_enc = _best_seconds(partial(codec.encode, x), reps)
                t_dec = _best_seconds(partial(codec.decode, enc, out), reps)
                rel_err = float((out - x).norm() / x.norm())
                rows.append(
                    {
                        "codec": name,
                        "threads": n_threads,
                        "encode_MBps": mb / t_enc,
                        "decode_MBps": mb / t_dec,
                        "roundtrip_MBps": mb / (t_enc + t_dec),
                        "rel_err": rel_err,
                        "bytes_ratio": enc.nbytes / (numel * 4),
                    }
                )
                del enc
    finally:
        torch.set_num_threads(before)
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    """Render ``run`` rows as a fixed-width text table."""
    head = f"{'codec':<6} {'thr':>3} {'enc MB/s':>9} {'dec MB/s':>9} {'enc+dec':>9} "
    head += f"{'rel err':>9} {'bytes':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['codec']:<6} {r['threads']:>3} {r['encode_MBps']:>9.0f} {r['decode_MBps']:>9.0f} "
            f"{r['roundtrip_MBps']:>9.0f} {r['rel_err']:>9.2e} {r['bytes_ratio']:>7.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=1024)
    args = parser.parse_args(argv)
    rows = run(args.numel, args.threads, args.reps, args.block_size)
    print(f"numel={args.numel} float32, block_size={args.block_size}, best of {args.reps}")
    print(format_table(rows))


if __name__ == "__main__":
    main()
