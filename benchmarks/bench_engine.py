"""One exchange's tensor work, counted and timed, against copies of the same bytes (issue 22).

Counts (any device; on a CPU through ``TorchDispatchMode``): tensor operations and host
synchronisations of one whole exchange (prepare, check with the guard's screen, commit, both
sides), with the engine's device chunks (``ON_DEVICE_CHUNK``, 2^24 elements) and with the old
cache-sized ones (2^18): within a device chunk the first does not grow with the model; past
it the syncs stay and the launches add one chunk's worth per 2^24 elements. Times (``--device cuda`` on a GPU): one side's
prepare + check + commit against a device-to-device copy of the model's float32 bytes (goal:
at most 5x), alone and while a training-like load keeps the GPU busy.

Run: ``python -m benchmarks.bench_engine [--sizes 1e6,1e7,1e8] [--device cpu|cuda]
[--time-sizes 135e6] [--codecs int8,half2] [--alone]`` (``--sizes ""``: no counts).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

from benchmarks.engine_counts import count_exchange, engines, seed_links
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.wire import RESIDUAL_CODECS, payload_digest
from gasloc_p2p.protocol.engine import ON_DEVICE_CHUNK


def time_exchange(numel: int, device: str, busy: bool = False, reps: int = 3,
                  stream_payloads: bool | None = None,
                  kernels: bool | None = None, codec: str = "int8") -> dict[str, float]:
    """One side's prepare + check + commit on ``device`` (best of ``reps``, wall clock), split
    into its parts: the host SHA-256 of our payload (the peer's is computed by the session as its
    chunks arrive, overlapping the network), and on a GPU (one profiled exchange) the
    kernels' and the host<->device copies' device time; against a device-to-device copy of
    ``numel`` float32 values. The peer's payload sits in a pinned receive buffer, as the
    session leaves it. ``busy``: while another thread keeps the device multiplying matrices
    (training's load). ``stream_payloads``: the engine's choice (None: streamed int8
    payloads on a GPU; False: both payloads kept on the device, for the side-by-side figure).
    ``kernels``: streamed int8 through the fused Triton kernels (None: where available) or
    the eager passes (False). ``codec``: the payloads' (a residual one against a link both
    sides seeded first; its reference in host memory, as a node keeps it)."""
    a, b = engines(numel, 0, device=device, stream_payloads=stream_payloads, kernels=kernels)
    spec = CodecSpec.parse(codec)
    links = seed_links(a, b, numel) if spec.name in RESIDUAL_CODECS else [None, None]
    a.warm_up(spec)
    streaming = a.streams(spec)
    pb = b.prepare("A", 0, spec, link=links[1])
    received = a.payload_buffer(len(pb.payload))
    received[:] = pb.payload
    seen = payload_digest(received)  # the session's, computed chunk by chunk as they arrive
    stop = threading.Event()
    loader = threading.Thread(target=_load, args=(device, stop), daemon=True) if busy else None
    if loader is not None:
        loader.start()

    def exchange() -> None:
        pa = a.prepare("B", 0, spec, link=links[0])
        got = a.check(spec, numel, received, pb.digest, pa, seen)
        a.commit(pa, got, 0.5)

    try:
        best, copy_s, digest_s = float("inf"), float("inf"), float("inf")
        src = a.state.theta
        dst = torch.empty_like(src)
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            _sync(device)
            copy_s = min(copy_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            exchange()
            best = min(best, time.perf_counter() - t0)
            t0 = time.perf_counter()
            payload_digest(pb.payload)  # prepare's, of our own payload
            digest_s = min(digest_s, time.perf_counter() - t0)
        kernels_s, copies_s = _device_times(exchange) if device.startswith("cuda") else (0, 0)
    finally:
        stop.set()
        if loader is not None:
            loader.join()
    return {"numel": numel, "exchange_s": best, "copy_s": copy_s, "ratio": best / copy_s,
            "digest_s": digest_s, "kernels_s": kernels_s, "copies_s": copies_s,
            "kernel_ratio": kernels_s / copy_s, "payload_bytes": len(pb.payload),
            "codec": codec, "streamed": streaming,
            "fused": streaming and a.kernels and spec.name == "int8"}


def _device_times(fn: object) -> tuple[float, float]:
    """Device seconds of ``fn``'s kernels and of its host<->device copies (the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
    kernels = copies = 0.0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time
        if "Memcpy" in event.name or "Memset" in event.name:
            copies += us
        else:
            kernels += us
    return kernels / 1e6, copies / 1e6


def _load(device: str, stop: threading.Event) -> None:
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(20):
            x = torch.tanh(x @ x)
        _sync(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def describe(r: dict[str, float]) -> str:
    how = ("payloads on the device" if not r.get("streamed")
           else "streamed, fused kernels" if r.get("fused") else "streamed, eager passes")
    return (f"{how}: exchange {r['exchange_s'] * 1e3:.1f} ms wall, of which SHA-256 of our payload "
            f"{r['digest_s'] * 1e3:.1f} ms; kernels {r['kernels_s'] * 1e3:.2f} ms, host<->device "
            f"copies (outer state, payloads) {r['copies_s'] * 1e3:.2f} ms (payload "
            f"{r['payload_bytes'] / 2**20:.0f} MiB); device copy of the fp32 model {r['copy_s'] * 1e3:.2f} ms: kernels "
            f"{r['kernel_ratio']:.1f}x, wall {r['ratio']:.1f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1e6,1e7,1e8", help="parameter counts to count")
    p.add_argument("--device", default="cpu")
    p.add_argument("--time-sizes", default="", help="parameter counts to time (default: none "
                                                    "on a CPU, 135M and 1.24B on a GPU)")
    p.add_argument("--codecs", default="int8", help="payload codecs to time, comma-separated")
    p.add_argument("--alone", action="store_true", help="time only with the GPU otherwise idle")
    p.add_argument("--json", default="", help="also write the figures here")
    args = p.parse_args(argv)
    rows = []
    print("per exchange (both sides): tensor ops and host syncs; device chunks 2^24 vs the "
          "old 2^18")
    for n in (int(float(s)) for s in args.sizes.split(",") if s):
        big, small = count_exchange(n, ON_DEVICE_CHUNK), count_exchange(n, 1 << 18)
        rows.append({"numel": n, "ops": big["ops"], "syncs": big["syncs"],
                     "ops_small_chunks": small["ops"], "syncs_small_chunks": small["syncs"]})
        print(f"  {n / 1e6:7.0f}M  ops {big['ops']:5d}  syncs {big['syncs']:3d}   "
              f"(2^18 chunks: ops {small['ops']:6d}, syncs {small['syncs']:3d})", flush=True)
    times = []
    sizes = args.time_sizes or ("135e6,1.236e9" if args.device.startswith("cuda") else "")
    for n in (int(float(s)) for s in sizes.split(",") if s):
        for codec in args.codecs.split(","):
            for busy in (False,) if args.alone else (False, True):
                r = time_exchange(n, args.device, busy, codec=codec)
                r["busy"] = busy
                times.append(r)
                print(f"  {codec} {n / 1e6:7.0f}M on {args.device}{' (busy)' if busy else ''}: "
                      + describe(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": rows, "times": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
