"""Why a push along a batch gradient does what a random push of the same size cannot (issue
39's ``ascent`` attack), measured on one process training the red team's tiny model.

Usage: PYTHONPATH=. python -m benchmarks.probe_curvature [--rounds 40] [--every 5] [--k 1.9]

Trains the tiny model of ``bench_redteam`` alone (AdamW, the node's defaults: lr 3e-3 with
100 warm-up steps, betas 0.9/0.95, weight decay 0.1, rounds of 10 steps) and every
``--every`` rounds pushes a copy of it by ``k`` of its own drifts (the RMS of what the round's
steps moved it by: the guard's unit; 1.9 is a trusted key's push of 3.8 drifts at weight 0.5)
along four directions, printing what each does to the loss on 8 held-out batches:

- the gradient of 2 batches the attacker draws itself, unit RMS (the ``ascent`` attack):
  the rise measured, and its first-order estimate ``c . m`` along the node's AdamW moment
  ``m`` (what a budget on the first-order rise would charge);
- the same, clamped per coordinate at one step bound (the sum of the round's learning rates:
  the most an AdamW coordinate moves in a round, about): what a per-coordinate limit leaves;
- a random direction of the same RMS (the ``member-push`` attack's direction);
- and, for scale, what the round's own steps lowered the loss by, measured and to first order
  (``-d . m``).

Measured 2026-11-28 (docs/security.md, "A push aimed at the curvature"): the batch-gradient
push raised the loss by 2-13 nats where the random one moved it by 0.00x; ``c . m`` was within
+/-0.2 of 0 (the batch gradient is mostly its batch's noise, which lies where the loss curves
most: second order, not first), and clamping at one step bound per coordinate left 1.2-5
nats. One process, one thread: about a minute.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from benchmarks.swarm_eval import TINY
from benchmarks.tools.redteam import Ascent, unit
from gasloc_p2p.core.flat import FlatParams
from gasloc_p2p.model import build_model
from gasloc_p2p.node.runtime.trainer import load_data
from gasloc_p2p.node.settings import build_config
from gasloc_p2p.train import evaluate

LR, WARMUP, H = 3e-3, 100, 10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--k", type=float, default=1.9, help="the push, in own drifts")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = build_config(argparse.Namespace(**TINY), environ={})
    model = build_model(cfg.train.gpt(), cfg.train.seed)
    flat = FlatParams(model)
    params = list(model.parameters())
    data = load_data(cfg.train, args.seed)
    bs, seq = cfg.train.batch_size, cfg.train.seq_len
    gen = torch.Generator().manual_seed(args.seed)
    held = [data.train.batch(bs, seq, torch.Generator().manual_seed(1000 + i))
            for i in range(8)]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    ascent = Ascent(batches=2, seed=4242)
    noise = torch.Generator().manual_seed(99)

    def loss_with(push: torch.Tensor | None = None) -> float:
        """The held-out loss of the model moved by ``push`` (unmoved after)."""
        if push is None:
            return evaluate(model, held)
        keep = flat.buffer.clone()
        with torch.no_grad():
            flat.buffer.add_(push)
        try:
            return evaluate(model, held)
        finally:
            with torch.no_grad():
                flat.buffer.copy_(keep)

    print("| round | loss | own descent: measured / first order | batch-gradient push: rise "
          "/ first order c.m | clamped at one step bound: rise | random push: rise |")
    print("|---|---|---|---|---|---|")
    step = 0
    for r in range(1, args.rounds + 1):
        start, before = flat.buffer.clone(), loss_with()
        bound = 0.0
        for _ in range(H):
            lr = LR * min(1.0, (step + 1) / WARMUP)
            bound += lr
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = data.train.batch(bs, seq, gen)
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        if r % args.every:
            continue
        moved = flat.buffer.detach() - start
        now = loss_with()
        m = torch.cat([opt.state[q]["exp_avg"].reshape(-1) for q in params])
        size = args.k * float(moved.pow(2).mean().sqrt())
        push = size * ascent._direction(flat.buffer.detach().clone())
        random = size * unit(torch.randn(flat.numel, generator=noise))
        print(f"| {r} | {now:.3f} | {before - now:+.4f} / {float(-(moved @ m)):+.4f} | "
              f"{loss_with(push) - now:+.3f} / {float(push @ m):+.3f} | "
              f"{loss_with(push.clamp(-bound, bound)) - now:+.3f} | "
              f"{loss_with(random) - now:+.4f} |", flush=True)
    order(model, params, held, push, loss_with)


def order(model: torch.nn.Module, params: Sequence[torch.Tensor],
          held: Sequence[tuple[torch.Tensor, torch.Tensor]], push: torch.Tensor,
          loss_with: Callable[[torch.Tensor | None], float]) -> None:
    """The last push at fractions of its size: the rise measured against its first-order
    estimate along the gradient of the held-out batches themselves (first order where the
    two agree, curvature where the rise outgrows it); and where the push's mass lies."""
    model.zero_grad(set_to_none=True)
    for x, y in held:
        _, loss = model(x, y)
        (loss / len(held)).backward()
    g = torch.cat([q.grad.reshape(-1) for q in params])  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    now = loss_with(None)
    print("\n| fraction of the push | rise | first order along the held-out gradient |")
    print("|---|---|---|")
    for f in (0.01, 0.03, 0.1, 0.3, 1.0):
        print(f"| {f:g} | {loss_with(f * push) - now:+.4f} | {float(f * push @ g):+.4f} |")
    mass, at = [], 0
    for name, q in model.named_parameters():
        mass.append((float(push[at:at + q.numel()].pow(2).sum() / push.pow(2).sum()), name))
        at += q.numel()
    print("the push's squared mass, largest parameters: " + ", ".join(
        f"{name} {share:.0%}" for share, name in sorted(mass, reverse=True)[:3]))


if __name__ == "__main__":
    main()
