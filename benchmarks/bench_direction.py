"""How aligned are two honest nodes' displacements from theta_0? The guard's direction test, measured.

Usage: python -m benchmarks.bench_direction [--layers 14] [--width 768] [--steps 8]
                                             [--seq-len 64] [--batch-size 2]

Two copies of one Llama (byte vocabulary, theta_0 from ``--seed``; the 99.5M-parameter config
of bench_swarm100m.py by default) train side by side in this process with AdamW (lr 6e-4),
each on its own half of a corpus of real text (standard-library sources), like two honest
nodes between their first exchanges. After each step it prints, over the whole flat vector of
``n`` parameters: the cosine of the two displacements from theta_0 and its z-score
``cos * sqrt(n)``; the cosine of node A's displacement with a sign-flipped copy of B's and with
fresh random noise (bench_byzantine.py's attacks, which the size test does not catch); and whether
the guard's direction test accepts each under the old fixed rule (cosine >= 0.05) and the
current one (cosine >= --guard-min-z / sqrt(n), default 4 / sqrt(n)).
"""

from __future__ import annotations

import argparse
import importlib
import math
import time
from pathlib import Path

import torch

from gasloc_p2p.protocol.guard import GuardRule

OLD = GuardRule(min_z=-1, min_cosine=0.05)  # the fixed rule before this one
NEW = GuardRule()


def corpus() -> bytes:
    return "".join(Path(importlib.import_module(m).__file__ or "").read_text()
                   for m in ("argparse", "typing", "inspect", "dataclasses", "difflib")).encode()


def batches(text: bytes, half: int, seq: int, batch: int, seed: int):
    """Random windows of ``seq + 1`` bytes from one half of ``text``, forever."""
    part = text[: len(text) // 2] if half == 0 else text[len(text) // 2:]
    data = torch.tensor(list(part), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        yield torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(x.dot(y)) / max(float(x.norm()) * float(y.norm()), 1e-30)


def verdict(cos: float, n: int) -> str:
    return "/".join("accept" if cos >= r.min_direction(n) else "REJECT" for r in (OLD, NEW))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, args.width // 64)
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.width,
                      intermediate_size=args.width * 8 // 3, num_hidden_layers=args.layers,
                      num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=256)
    torch.manual_seed(args.seed)
    models = [LlamaForCausalLM(cfg)]
    models.append(LlamaForCausalLM(cfg))
    models[1].load_state_dict(models[0].state_dict())  # one theta_0
    theta0 = flat(models[0])
    n = theta0.numel()
    opts = [torch.optim.AdamW(m.parameters(), lr=6e-4, weight_decay=0.1) for m in models]
    text = corpus()
    data = [batches(text, i, args.seq_len, args.batch_size, args.seed + 1 + i) for i in (0, 1)]
    gen = torch.Generator().manual_seed(args.seed + 9)  # fresh noise per step
    print(f"Llama {args.layers} x {args.width}: n = {n:,} parameters; threshold old 0.05, "
          f"new {NEW.min_direction(n):.2g} (= {NEW.min_z:g} / sqrt(n)); seq {args.seq_len} x "
          f"batch {args.batch_size}, AdamW lr 6e-4; verdicts old/new", flush=True)
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        for model, opt, it in zip(models, opts, data, strict=True):
            tokens = next(it)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        a, b = flat(models[0]) - theta0, flat(models[1]) - theta0
        honest, flip, rand = cosine(a, b), cosine(a, -b), cosine(a, torch.randn(n, generator=gen))
        print(f"step {step}: honest cos {honest:.4f} (z {honest * math.sqrt(n):.0f}) "
              f"{verdict(honest, n)}; sign-flipped {flip:.4f} {verdict(flip, n)}; random "
              f"{rand:.2e} (z {rand * math.sqrt(n):.2f}) {verdict(rand, n)}; "
              f"{time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
