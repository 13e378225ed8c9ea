"""Where a node's memory goes: one ``Trainer`` (the node's training loop) in one process, issue 9.

Builds the Llama of ``bench_swarm100m.py`` (``--layers`` x ``--width``, byte tokenizer), then
prints resident memory (VmRSS) and the bytes of live tensors (every tensor storage the garbage
collector can reach, counted once), both as multiples of the model's float32 size, after the
imports, after building, after a few steps, after a checkpoint written from another thread (as
the node does) and a few more steps, and after ``malloc_trim``. It runs twice, each in a fresh
process: with glibc's default allocator settings and with the node's
(``gasloc_p2p.node.runtime.allocator.tune``). Then it names the largest live tensors.

Then two figures of issue 22, printed against their targets:

- device bytes per parameter at rest in gossip mode, summed by each buffer's placement
  (:meth:`Trainer.placement`: parameters, gradients and AdamW on the training device; outer
  state, theta_0 and rollback copies on the host), with the defaults and with outer momentum,
  and at a checkpoint (written from host copies, one tensor at a time: no device bytes added);
- host memory to build a model from ``config.json`` (``--build CONFIG``, default a Llama-3.2-1B
  shape written on the spot): the peak resident set above the imports (VmHWM, a fresh process)
  as a multiple of the model's float32 size.

Run: ``nice -n 10 python -m benchmarks.bench_trainer_memory`` (``make bench-trainer-memory``;
about 3 min: the 20M-parameter model, then building the 1.24B one; ``--build ''`` skips it).
"""

from __future__ import annotations

import argparse
import gc
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024


def live_tensor_bytes() -> int:
    import torch

    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            s = o.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure(mode: str, layers: int, width: int, steps: int) -> None:
    from gasloc_p2p.node.runtime import allocator

    if mode == "tuned":
        allocator.tune()
    from benchmarks.bench_swarm100m import write_inputs
    from gasloc_p2p.core.async_state import AsyncConfig
    from gasloc_p2p.node.config import TrainConfig
    from gasloc_p2p.node.runtime import checkpoint
    from gasloc_p2p.node.runtime.lock import TrainingLock
    from gasloc_p2p.node.runtime.trainer import Trainer
    from gasloc_p2p.node.stats import TrainStats

    root = Path(tempfile.mkdtemp(prefix="trainer-memory-"))
    config, corpus, numel = write_inputs(root, layers, width)
    model = 4 * numel
    row: list[str] = []

    def mark(what: str) -> None:
        row.append(f"{what} {rss() / model:.1f}/{live_tensor_bytes() / model:.1f}")

    gc.collect()
    mark("imports")
    cfg = TrainConfig(model=str(config), data=str(corpus), tokenizer="byte", device="cpu",
                      seq_len=64, batch_size=2, eval_batches=2, warmup_steps=2)
    trainer = Trainer(cfg, AsyncConfig(), 1, TrainingLock(), TrainStats())
    trainer.load_data(5)
    mark("built")
    for _ in range(steps):
        trainer.step()
    mark(f"{steps} steps")
    write = threading.Thread(target=lambda: checkpoint.save_atomic(
        trainer.state_for_checkpoint(), root / "ckpt"))
    write.start()
    write.join()
    for _ in range(3):
        trainer.step()
    mark("checkpoint+3")
    allocator.trim()
    mark("trim")
    print(f"{mode:<8} {numel / 1e6:.1f}M  " + " | ".join(row)
          + f"  (arenas {allocator.arena_count()})", flush=True)
    if mode == "tuned":
        import torch

        owners = {"trainer." + k: v for k, v in vars(trainer).items()}
        owners.update({"state." + k: v for k, v in vars(trainer.state).items()})
        owners.update({"state.outer." + k: v for k, v in trainer.state.outer.state.items()})
        if trainer._good is not None:
            owners["_good[0] (rollback anchor)"] = trainer._good[0]
            owners.update({f"_good[1][{k}] (rollback outer {k})": v
                           for k, v in trainer._good[1].items()})
        names = {v.untyped_storage().data_ptr(): k for k, v in owners.items()
                 if isinstance(v, torch.Tensor)}
        grads = {p.grad.untyped_storage().data_ptr() for p in trainer.model.parameters()
                 if p.grad is not None}
        big = {}
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and o.untyped_storage().nbytes() >= model // 2:
                big[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        print("model-size tensors: " + ", ".join(
            f"{names.get(k, 'gradients' if k in grads else '?')} {n / model:.2f}"
            for k, n in big.items()))


LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
            "max_position_embeddings": 131072, "tie_word_embeddings": True,
            "rope_theta": 500000.0}


def placement(layers: int, width: int) -> None:
    """Device bytes per parameter by placement, at rest and at a checkpoint."""
    from benchmarks.bench_swarm100m import write_inputs
    from gasloc_p2p.core.async_state import AsyncConfig
    from gasloc_p2p.node.config import TrainConfig
    from gasloc_p2p.node.runtime.lock import TrainingLock
    from gasloc_p2p.node.runtime.trainer import Trainer
    from gasloc_p2p.node.stats import TrainStats

    root = Path(tempfile.mkdtemp(prefix="trainer-placement-"))
    config, corpus, numel = write_inputs(root, layers, width)
    cfg = TrainConfig(model=str(config), data=str(corpus), tokenizer="byte", device="cpu",
                      seq_len=64, batch_size=2, eval_batches=1, inner_steps=2)
    for label, outer in (("gossip defaults (eta 1, gamma 0)", AsyncConfig()),
                         ("gossip, eta 0.7, gamma 0.5", AsyncConfig(eta=0.7, gamma=0.5))):
        trainer = Trainer(cfg, outer, 1, TrainingLock(), TrainStats())
        trainer.load_data(5)
        for _ in range(2):  # through a round end: every buffer exists
            trainer.step()
        held = trainer.placement()
        device = sum(b.nbytes for b in held if b.where == "device") / numel
        host = sum(b.nbytes for b in held if b.where == "host") / numel
        with Allocations(numel // 100) as seen:
            trainer.state_for_checkpoint()  # what the writer thread gets
        extra = seen.device_bytes / numel
        print(f"{label:<34} device {device:5.2f} B/param at rest (target <= 16.5), "
              f"+{extra:.2f} at a checkpoint (target <= 17 in all); host {host:5.2f} B/param",
              flush=True)
        del trainer


def Allocations(least: int):  # noqa: N802 (a class, built where torch is imported)
    """A dispatch mode summing the bytes of every tensor of at least ``least`` elements that
    an op makes, except copies to the host (``_to_copy(device=cpu)``): on a CPU node, what
    the same code would allocate on the training device (a clone or deep copy counts)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Allocations(TorchDispatchMode):
        device_bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            out = func(*args, **(kwargs or {}))
            to_host = (func is torch.ops.aten._to_copy.default
                       and (kwargs or {}).get("device") == torch.device("cpu"))
            if isinstance(out, torch.Tensor) and out.numel() >= least and not to_host \
                    and func is not torch.ops.aten.detach.default:
                self.device_bytes += out.nbytes
            return out

    return _Allocations()


def build_peak(config: str) -> None:
    """One fresh process: the host memory building ``config`` and its flat parameter buffer
    takes (the node's start-up before the move to the device), over its fp32 size."""
    import json
    import os

    if not config:
        config = str(Path(tempfile.mkdtemp(prefix="build-1b-")) / "config.json")
        Path(config).write_text(json.dumps(LLAMA_1B))
    code = ("import re, time, torch, transformers\n"
            "from pathlib import Path\n"
            "from gasloc_p2p.model_spec import build\n"
            "from gasloc_p2p.node.config import TrainConfig\n"
            "import gasloc_p2p.hf as hf\n"
            "hf.transformers_module()\n"
            "field = lambda k: int(re.search(k + r':\\s+(\\d+)', "
            "Path('/proc/self/status').read_text())[1]) * 1024\n"
            "base = field('VmRSS'); t0 = time.monotonic()\n"
            f"cfg = TrainConfig(model={config!r})\n"
            "built = build(cfg.model, cfg.gpt(256), 0)\n"
            "from gasloc_p2p.core.flat import FlatParams\n"
            "numel = FlatParams(built.module).numel\n"
            "print(numel, base, field('VmHWM'), time.monotonic() - t0)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout.split()
    numel, base, peak, took = int(out[0]), int(out[1]), int(out[2]), float(out[3])
    print(f"build {config} and its flat buffer: {numel / 1e6:,.1f}M parameters in {took:.0f} s, "
          "peak host memory "
          f"{(peak - base) / 2**30:.2f} GiB above the imports = {(peak - base) / (4 * numel):.2f}"
          "x its float32 size (target <= 2.5)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--mode", choices=["default", "tuned"], help="one row (else both)")
    p.add_argument("--build", default=None, metavar="CONFIG",
                   help="config.json to build (default: a Llama-3.2-1B shape; '' skips)")
    args = p.parse_args()
    if args.mode:
        measure(args.mode, args.layers, args.width, args.steps)
        return 0
    placement(args.layers, args.width)
    if args.build != "":
        build_peak(args.build or "")
    print("resident/live-tensor memory as multiples of the fp32 model size, after each stage")
    for mode in ("default", "tuned"):
        subprocess.run([sys.executable, "-m", "benchmarks.bench_trainer_memory", "--mode", mode, "--layers", str(args.layers),
                        "--width", str(args.width), "--steps", str(args.steps)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
