"""Where a node's memory goes: one ``Trainer`` (the node's training loop) in one process, issue 9.

Builds the Llama of ``bench_swarm100m.py`` (``--layers`` x ``--width``, byte tokenizer), then
prints resident memory (VmRSS) and the bytes of live tensors (every tensor storage the garbage
collector can reach, counted once), both as multiples of the model's float32 size, after the
imports, after building, after a few steps, after a checkpoint written from another thread (as
the node does) and a few more steps, and after ``malloc_trim``. It runs twice, each in a fresh
process: with glibc's default allocator settings and with the node's
(``gasloc_p2p.node.runtime.allocator.tune``). Then it names the largest live tensors.

Run: ``nice -n 10 python -m benchmarks.bench_trainer_memory`` (``make bench-trainer-memory``;
about 1 min for the default 20M-parameter model).
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
        if trainer._good is not None:
            owners.update({"_good[0] (rollback anchor)": trainer._good[0],
                           "_good[1] (rollback memory)": trainer._good[1]})
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--mode", choices=["default", "tuned"], help="one row (else both)")
    args = p.parse_args()
    if args.mode:
        measure(args.mode, args.layers, args.width, args.steps)
        return 0
    print("resident/live-tensor memory as multiples of the fp32 model size, after each stage")
    for mode in ("default", "tuned"):
        subprocess.run([sys.executable, "-m", "benchmarks.bench_trainer_memory", "--mode", mode, "--layers", str(args.layers),
                        "--width", str(args.width), "--steps", str(args.steps)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
