"""One exchange's tensor work, counted and timed, against copies of the same bytes (issue 22).

Counts (any device; on a CPU through ``TorchDispatchMode``): tensor operations and host
synchronisations of one whole exchange (prepare, check with the guard's screen, commit, both
sides), with the engine's device chunks (2^27 elements) and with the old cache-sized ones
(2^18): the first must not grow with the model. Times (``--device cuda`` on a GPU): one side's
prepare + check + commit against a device-to-device copy of the model's float32 bytes (goal:
at most 5x), alone and while a training-like load keeps the GPU busy.

Run: ``python -m benchmarks.bench_engine [--sizes 1e6,1e7,1e8] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

from benchmarks.engine_counts import count_exchange, engines
from gasloc_p2p.core.codecs import CodecSpec


def time_exchange(numel: int, device: str, busy: bool = False, reps: int = 3) -> dict[str, float]:
    """Seconds of one side's prepare + check + commit on ``device`` and of a device-to-device
    copy of ``numel`` float32 values (best of ``reps``); ``busy``: while another thread keeps
    the device multiplying matrices (training's load)."""
    a, b = engines(numel, 0, device=device)
    spec = CodecSpec.parse("int8")
    stop = threading.Event()
    loader = threading.Thread(target=_load, args=(device, stop), daemon=True) if busy else None
    if loader is not None:
        loader.start()
    try:
        pb = b.prepare("A", 0, spec)
        best, copy_s = float("inf"), float("inf")
        src = a.state.theta
        dst = torch.empty_like(src)
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            _sync(device)
            copy_s = min(copy_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            pa = a.prepare("B", 0, spec)
            got = a.check(spec, numel, bytearray(pb.payload), pb.crc32, pa)
            a.commit(pa, got, 0.5)
            best = min(best, time.perf_counter() - t0)
    finally:
        stop.set()
        if loader is not None:
            loader.join()
    return {"numel": numel, "exchange_s": best, "copy_s": copy_s, "ratio": best / copy_s}


def _load(device: str, stop: threading.Event) -> None:
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(20):
            x = torch.tanh(x @ x)
        _sync(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1e6,1e7,1e8", help="parameter counts to count")
    p.add_argument("--device", default="cpu")
    p.add_argument("--time-sizes", default="", help="parameter counts to time (default: none "
                                                    "on a CPU, 135M and 1.24B on a GPU)")
    p.add_argument("--json", default="", help="also write the figures here")
    args = p.parse_args(argv)
    rows = []
    print("per exchange (both sides): tensor ops and host syncs; device chunks 2^27 vs the "
          "old 2^18")
    for n in (int(float(s)) for s in args.sizes.split(",")):
        big, small = count_exchange(n, 1 << 27), count_exchange(n, 1 << 18)
        rows.append({"numel": n, "ops": big["ops"], "syncs": big["syncs"],
                     "ops_small_chunks": small["ops"], "syncs_small_chunks": small["syncs"]})
        print(f"  {n / 1e6:7.0f}M  ops {big['ops']:5d}  syncs {big['syncs']:3d}   "
              f"(2^18 chunks: ops {small['ops']:6d}, syncs {small['syncs']:3d})", flush=True)
    times = []
    sizes = args.time_sizes or ("135e6,1.236e9" if args.device.startswith("cuda") else "")
    for n in (int(float(s)) for s in sizes.split(",") if s):
        for busy in (False, True):
            r = time_exchange(n, args.device, busy)
            r["busy"] = busy
            times.append(r)
            print(f"  {n / 1e6:7.0f}M on {args.device}{' (busy)' if busy else ''}: exchange "
                  f"{r['exchange_s'] * 1e3:.1f} ms, copy {r['copy_s'] * 1e3:.2f} ms, "
                  f"{r['ratio']:.1f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": rows, "times": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
