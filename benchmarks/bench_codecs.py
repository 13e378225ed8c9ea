"""Throughput and error of the wire codecs (gasloc_p2p.core.codecs, core.sparse).

Usage: ``python -m benchmarks.bench_codecs [--numel 100000000] [--threads 1 2] [--reps 3]
[--sparse topk2:41 randk8:123 dense2]``

Throughput is MB/s (1e6 bytes) of float32 input, best of ``reps``. Decoding writes into a
preallocated output, as a receiver decoding into a reused buffer does: first-touch page
faults of a fresh 400 MB tensor are an allocator cost, not a codec cost.

Sparse codecs decode two ways: to their entries (positions and values, what a gossip
correction or an error-feedback update reads: ``dec``) and to a dense tensor (``dense``, a
zero fill and a scatter). Their relative error is over the entries sent; ``bytes`` is wire
bytes over fp32 bytes, ``vs int8`` the int8 payload over theirs.

``--clock cpu`` times with the process's CPU time instead of the wall clock: on a shared
machine it leaves out the time other processes held the core (for one thread only; with more
threads it sums them).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from gasloc_p2p.core import sparse
from gasloc_p2p.core.codecs import CODEC_NAMES, get_codec
from gasloc_p2p.core.wire import RESIDUAL_CODECS

SPARSE = ("topk2:41", "topk2:123", "topk1:41", "randk2:512", "randk1:1024", "randk8:123", "dense2")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = _clock()
        fn()
        best = min(best, _clock() - t0)
    return best


def run(
    numel: int = 100_000_000,
    threads: tuple[int, ...] | list[int] = (1, 2),
    reps: int = 3,
    block_size: int = 1024,
    seed: int = 0,
    sparse_specs: tuple[str, ...] | list[str] = SPARSE,
    codecs: tuple[str, ...] | list[str] = CODEC_NAMES,
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
            for name in codecs:
                # residual codecs at the block their study measured and the daemon uses
                codec = get_codec(name, None if name in RESIDUAL_CODECS else block_size)
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
            for text in sparse_specs:
                rows.append(_sparse_row(text, x, out, n_threads, reps, block_size))
    finally:
        torch.set_num_threads(before)
    return rows


def _sparse_row(text: str, x: torch.Tensor, out: torch.Tensor, n_threads: int, reps: int,
                block_size: int) -> dict[str, object]:
    spec = sparse.SparseSpec.parse(text)
    mb = x.numel() * 4 / 1e6
    msg = sparse.encode(spec, x, seed=1)
    t_enc = _best_seconds(partial(sparse.encode, spec, x, 1), reps)
    t_dec = _best_seconds(lambda: (sparse.positions(msg), sparse.values(msg)), reps)
    t_dense = _best_seconds(partial(sparse.decode, msg, out), reps)
    pos = sparse.positions(msg)
    sent = x[pos]
    int8 = get_codec("int8", block_size).wire_bytes(x.numel())
    return {"codec": text, "threads": n_threads, "encode_MBps": mb / t_enc,
            "decode_MBps": mb / t_dec, "roundtrip_MBps": mb / (t_enc + t_dec),
            "dense_roundtrip_MBps": mb / (t_enc + t_dense),
            "rel_err": float((sparse.values(msg) - sent).norm() / sent.norm()),
            "bytes_ratio": msg.nbytes / (x.numel() * 4), "vs_int8": int8 / msg.nbytes}


def format_table(rows: list[dict[str, object]]) -> str:
    """Render ``run`` rows as a fixed-width text table."""
    head = f"{'codec':<10} {'thr':>3} {'enc MB/s':>9} {'dec MB/s':>9} {'enc+dec':>9} "
    head += f"{'+dense':>7} {'rel err':>9} {'bytes':>7} {'vs int8':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        dense = r.get("dense_roundtrip_MBps")
        ratio = r.get("vs_int8")
        lines.append(
            f"{r['codec']:<10} {r['threads']:>3} {r['encode_MBps']:>9.0f} "
            f"{r['decode_MBps']:>9.0f} {r['roundtrip_MBps']:>9.0f} "
            f"{'' if dense is None else f'{dense:.0f}':>7} {r['rel_err']:>9.2e} "
            f"{r['bytes_ratio']:>7.4f} {'' if ratio is None else f'{ratio:.1f}x':>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--sparse", nargs="*", default=list(SPARSE),
                        help="sparse codecs (core/sparse.py), e.g. topk2:41 randk8:123 dense2")
    parser.add_argument("--codecs", nargs="*", default=list(CODEC_NAMES),
                        help="block codecs to time beside them")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall (default) or cpu: process CPU time, for a shared machine "
                             "(one thread)")
    args = parser.parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]
    rows = run(args.numel, args.threads, args.reps, args.block_size, sparse_specs=args.sparse,
               codecs=args.codecs)
    print(f"numel={args.numel} float32, block_size={args.block_size}, best of {args.reps}, "
          f"{args.clock} clock")
    print(format_table(rows))
    print(digest_line(args.numel, args.reps))


def digest_line(numel: int, reps: int) -> str:
    """The signed payload digest of an int8 payload of ``numel`` values (about ``numel``
    bytes): one SHA-256 over it against the digest tree (``core.wire.payload_digest``), whose
    leaves the host's cores hash in parallel; wall clock."""
    import hashlib

    from gasloc_p2p.core import wire

    data = bytearray(numel)
    one = _wall_best(lambda: hashlib.sha256(data).digest(), reps)
    tree = _wall_best(lambda: wire.payload_digest(data), reps)
    return (f"payload digest of {numel / 1e6:,.0f} MB: one SHA-256 {one * 1e3:.0f} ms, the tree "
            f"({wire._HASH_THREADS} threads) {tree * 1e3:.0f} ms: {one / tree:.2f}x")


def _wall_best(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    main()
