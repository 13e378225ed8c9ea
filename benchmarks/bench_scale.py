"""Memory and tensor work of one node's exchanges at 1M, 10M and 100M parameters (issue 9).

For each size, with and without the update guard, a fresh child process (so peak RSS is its own) holds one
node: live parameters (the "model"), the outer state (anchor, momentum memory) and an
:class:`ExchangeEngine`; it runs exchanges of the whole vector with ``--peers`` distinct peers
(prepare, check of a peer payload, commit) and reports

- extra memory: (peak RSS during the exchanges - RSS with only the model allocated) / model
  bytes, i.e. everything the outer algorithm adds (theta_0, anchor, both payloads, scratch; no
  momentum memory at the default gamma 0), in model-size float32 equivalents (goal: <= 3). Of
  it, theta_0 (column θ0) is a bfloat16 copy, as the node keeps it (it only anchors the update
  guard). The peer's payload is held as
  received bytes (what the session's buffer holds) and counted; setup temporaries are not (the
  kernel's peak is reset after setup);
- time per phase, as a multiple of one memcpy of the fragment: ``copy_`` into an existing
  buffer and ``clone`` (a fresh copy, page faults included; the issue's "one copy of the
  model"). Goal: one side's prepare + check + commit <= 4 clones. Next to it, the count of
  full-size passes (kernels over the fragment, each counted by its largest tensor) per phase,
  which is what the time is made of; the kernels of one exchange go to stderr.

No gradients or optimizer state are allocated: they are the model's, not the outer algorithm's.
Run: ``python -m benchmarks.bench_scale [--sizes 1e6,1e7,1e8] [--schemes plain,plain+guard]``.
Timings on shared machines vary by ~30%: compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.flat import whole
from gasloc_p2p.core.wire import payload_digest
from gasloc_p2p.protocol.engine import ExchangeEngine, NoLock
from gasloc_p2p.protocol.guard import GuardRule, UpdateGuard


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak() -> None:
    """Restart the kernel's peak-RSS count (VmHWM) here, so setup temporaries are not in it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def best(fn: Callable[..., object], repeats: int, *args: object) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


_FREE_OPS = ("view", "slice", "as_strided", "detach", "alias", "_local_scalar_dense", "select",
             "unsqueeze", "expand", "empty", "lift_fresh", "t.default")


class PassCounter(TorchDispatchMode):
    """Counts full-size passes: every kernel that reads or writes tensors adds its largest
    tensor's element count (views and allocations are free); divided by the fragment size."""

    def __init__(self) -> None:
        super().__init__()
        self.elems = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        if not any(name.startswith(f) or name == f for f in _FREE_OPS):
            flat = [*args, *(kwargs or {}).values(), out]
            sizes = [t.numel() for t in flat if isinstance(t, torch.Tensor)]
            sizes += [t.numel() for a in flat if isinstance(a, (list, tuple)) for t in a
                      if isinstance(t, torch.Tensor)]
            top = max(sizes, default=0)
            self.elems += top
            self.by_op[name] = self.by_op.get(name, 0) + top
        return out


def count_passes(engine: ExchangeEngine, spec: CodecSpec, numel: int, raw: bytearray,
                 digest: bytes) -> dict[str, float]:
    """Full-size passes of one exchange per phase (and, for the report, per kernel)."""
    result: dict[str, float] = {}
    with PassCounter() as c:
        prep = engine.prepare("peer0", 0, spec)
    result["prepare_passes"], ops = c.elems / numel, dict(c.by_op)
    with PassCounter() as c:
        received = engine.check(spec, numel, raw, digest, prep)
    result["check_passes"], checks = c.elems / numel, dict(c.by_op)
    with PassCounter() as c:
        engine.commit(prep, received, 0.5)
    result["commit_passes"] = c.elems / numel
    for phase, table in (("prepare", ops), ("check", checks), ("commit", c.by_op)):
        print(f"# {phase} kernels (passes): " + ", ".join(
            f"{k} {v / numel:.2f}" for k, v in sorted(table.items(), key=lambda kv: -kv[1])
            if v / numel >= 0.01), file=sys.stderr)
    return result


def child(numel: int, scheme: str, peers: int, codec: str, device: str) -> dict[str, float]:
    torch.set_num_threads(1)
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    theta = torch.randn(numel, device=dev, generator=gen).mul_(0.02)  # the model
    base = rss_bytes()
    guarded = scheme.endswith("+guard")
    theta0 = theta.clone()
    state = AsyncGaslocState(theta, theta0, AsyncConfig())
    theta0 = theta0.to(torch.bfloat16)  # as the Trainer keeps it: the float32 copy is freed
    engine = ExchangeEngine(state, theta0, [whole(numel)], NoLock())
    if guarded:  # the daemon's default: check screens the pair (thresholds never hit here)
        engine.guard = UpdateGuard(GuardRule(trust_after=1, round_budget=1e30,
                                             block_budget=1e30))
        engine.guard.round_end({0: 1.0})
    spec = CodecSpec.parse(codec)
    drift = torch.randn(numel, device=dev, generator=gen).mul_(1e-3)
    theta.add_(drift)  # a local drift
    # The peer drifted from the same theta_0 along a shared direction plus its own noise (so
    # the guard's direction screen passes, as between honest nodes); the payload is its public
    # iterate itself.
    peer = drift.add_(torch.randn(numel, device=dev, generator=gen), alpha=1e-3)
    peer.add_(theta0.float())
    peer_payload = spec.codec().encode(peer)
    del drift, peer
    raw = bytearray(peer_payload.to_bytes())  # the peer's payload, as the session's buffer
    digest = payload_digest(raw)
    del peer_payload
    prep = engine.prepare("warm-up", 0, spec)
    engine.commit(prep, engine.check(spec, numel, raw, digest, prep),
                  0.5)  # page in torch's kernels: a fixed ~20 MB of code, not the algorithm's
    del prep
    reset_peak()  # from here: the node's state plus what exchanges allocate
    for k in range(peers):  # memory: one exchange with each peer
        prep = engine.prepare(f"peer{k}", 0, spec)
        engine.commit(prep, engine.check(spec, numel, raw, digest, prep), 0.5)
        del prep  # as the session drops it: never two of our payloads at once
    peak = peak_bytes()
    model_bytes = numel * 4
    # time: each phase next to the two copies it is compared with (the machine is shared)
    times: dict[str, list[float]] = {k: [] for k in ("prepare", "check", "commit", "copy",
                                                      "clone")}
    dst = torch.empty_like(theta)
    for k in range(5 if numel <= 10**7 else 3):
        times["copy"].append(best(dst.copy_, 1, theta))
        times["clone"].append(best(theta.clone, 1))
        t0 = time.perf_counter()
        prep = engine.prepare(f"peer{k % peers}", 0, spec)
        t1 = time.perf_counter()
        received = engine.check(spec, numel, raw, digest, prep)
        t2 = time.perf_counter()
        engine.commit(prep, received, 0.5)
        t3 = time.perf_counter()
        for name, dt in zip(("prepare", "check", "commit"), (t1 - t0, t2 - t1, t3 - t2),
                            strict=True):
            times[name].append(dt)
        del prep, received
    copy_s, clone_s = min(times.pop("copy")), min(times.pop("clone"))
    out = {"numel": numel, "extra_model_copies": (peak - base) / model_bytes,
           "theta0_copies": theta0.numel() * theta0.element_size() / model_bytes,
           "copy_s": copy_s, "clone_s": clone_s}
    for name, ts in times.items():
        out[f"{name}_s"] = min(ts)
    out.update(count_passes(engine, spec, numel, raw, digest))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1e6,1e7,1e8", help="parameter counts")
    p.add_argument("--schemes", default="plain,plain+guard",
                   help="plain, or plain+guard: with the update guard's screen in check (the "
                        "daemon's default)")
    p.add_argument("--peers", type=int, default=8, help="distinct peers exchanged with")
    p.add_argument("--codec", default="int8:1024")
    p.add_argument("--device", default="cpu", help="cpu, cuda (also run when available)")
    p.add_argument("--child", nargs=3, metavar=("NUMEL", "SCHEME", "DEVICE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        numel, scheme, device = int(args.child[0]), args.child[1], args.child[2]
        print(json.dumps(child(numel, scheme, args.peers, args.codec, device)))
        return 0
    devices = [args.device] + (["cuda"] if args.device == "cpu" and torch.cuda.is_available()
                               else [])
    print(f"one node, whole-vector exchanges with {args.peers} peers, codec {args.codec}, "
          "1 thread; extra = (peak RSS - model) / model bytes; times / memcpy")
    print(f"{'device':<6} {'params':>7} {'scheme':<9} {'extra':>6} {'θ0':>5} {'prepare':>15} "
          f"{'check':>15} {'commit':>15} {'total/clone':>11} {'total/copy_':>11} "
          f"{'passes p+c+c':>16}")
    failed = 0
    for device in devices:
        for size in (int(float(s)) for s in args.sizes.split(",")):
            for scheme in args.schemes.split(","):
                try:
                    r = run_child(size, scheme, device, args)
                except subprocess.CalledProcessError as exc:  # e.g. the engine on CUDA
                    last = (exc.stderr or "").strip().splitlines()[-1:]
                    print(f"{device:<6} {size / 1e6:6.0f}M {scheme:<9} failed: {last}")
                    failed += 1
                    continue
                total = r["prepare_s"] + r["check_s"] + r["commit_s"]
                cells = " ".join(f"{r[k + '_s']:7.3f}s {r[k + '_s'] / r['clone_s']:4.1f}x"
                                 for k in ("prepare", "check", "commit"))
                print(f"{device:<6} {size / 1e6:6.0f}M {scheme:<9} {r['extra_model_copies']:6.2f}"
                      f" {r['theta0_copies']:5.2f}"
                      f" {cells} {total / r['clone_s']:10.1f}x {total / r['copy_s']:10.1f}x "
                      f"{r['prepare_passes']:4.1f}+{r['check_passes']:.1f}+"
                      f"{r['commit_passes']:4.1f}",
                      flush=True)
    print("(per phase: seconds and multiple of one clone of the fragment; memcpy copy_ "
          "into an existing buffer is the unit of total/copy_; passes: kernels over the "
          "fragment, each counted by its largest tensor, / fragment size)")
    if failed:
        print(f"{failed} row(s) failed", file=sys.stderr)
    return 1 if failed else 0


def run_child(size: int, scheme: str, device: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.bench_scale", "--child", str(size), scheme, device,
           "--peers", str(args.peers), "--codec", args.codec]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


if __name__ == "__main__":
    sys.exit(main())
