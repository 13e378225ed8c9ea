"""The host time of a training step with AdamW stepped in the backward pass (issue 22).

On a GPU the node steps AdamW inside the backward pass (``train.optim.BackwardAdamW``: the
gradients never all exist). A step of a small model there is host-bound: the GPU waits for
Python to issue the next kernel, so the optimizer's Python per call counts. This times, on a
CPU (the host's share is what is measured), a forward, backward and AdamW step of a 30-layer
GPT with tiny widths (364 parameters, the op count of a 135M Llama's step, not its FLOPs):
one fused AdamW over all parameters, BackwardAdamW's buckets, and one optimizer per
parameter (what BackwardAdamW did before the buckets). Best of 3 runs of 30 steps each,
side by side.

Run: ``python -m benchmarks.bench_optim``.
"""

from __future__ import annotations

import sys
import time

import torch

from gasloc_p2p.model import GPT, GPTConfig
from gasloc_p2p.train import optim
from gasloc_p2p.train.optim import AdamWConfig, BackwardAdamW, param_groups


def _timed(model: GPT, opt: object, x: torch.Tensor, steps: int = 30) -> float:
    def one() -> None:
        model(x, x)[1].backward()
        opt.step()  # type: ignore[attr-defined]
        opt.zero_grad()  # type: ignore[attr-defined]

    for _ in range(3):
        one()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            one()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def main() -> int:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=30, n_embd=32, n_head=2)
    x = torch.randint(0, 64, (1, 16))
    whole_model, bucket_model, per_model = GPT(cfg), GPT(cfg), GPT(cfg)
    whole = torch.optim.AdamW(param_groups(whole_model, AdamWConfig()), lr=1e-2, fused=True)
    buckets = BackwardAdamW(param_groups(bucket_model, AdamWConfig()), 1e-2, (0.9, 0.95))
    default = optim.BUCKET_ELEMS
    optim.BUCKET_ELEMS = 1  # every parameter its own bucket
    try:
        per = BackwardAdamW(param_groups(per_model, AdamWConfig()), 1e-2, (0.9, 0.95))
    finally:
        optim.BUCKET_ELEMS = default
    n = len(list(whole_model.parameters()))
    print(f"30-layer GPT, {n} parameters; forward + backward + AdamW, ms per step (1 thread)")
    for _ in range(2):
        w, b, p = (_timed(whole_model, whole, x), _timed(bucket_model, buckets, x),
                   _timed(per_model, per, x))
        print(f"  one fused AdamW {w * 1e3:6.1f}   BackwardAdamW, {len(buckets.optimizers)} "
              f"buckets {b * 1e3:6.1f} ({b / w:.2f}x)   one optimizer per parameter "
              f"{p * 1e3:6.1f} ({p / w:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
