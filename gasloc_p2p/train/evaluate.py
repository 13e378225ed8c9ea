"""Validation loss: the one number the simulator's curves and the daemon's metrics report."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gasloc_p2p.data import DataError


def evaluate(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]]) -> float:
    """Mean cross-entropy (nats per token) of ``model(x, y)`` over ``batches``.

    Each item is (x, y), LongTensor [B, T]. The mean is weighted by tokens, so a smaller last
    batch counts for what it holds. Runs in eval mode (no dropout: the number must not depend
    on an RNG) and restores the previous train/eval mode afterwards.
    """
    each = evaluate_each(model, batches)
    counts = [y.numel() for _, y in batches]
    return sum(v * n for v, n in zip(each, counts, strict=True)) / sum(counts)


@torch.no_grad()
def evaluate_each(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]]) -> list[float]:
    """The mean cross-entropy of each of ``batches`` (as :func:`evaluate`), with one read
    from the device for all of them."""
    if not batches:
        raise DataError("evaluate() needs at least one batch")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        losses = [model(x.to(device), y.to(device))[1].double() for x, y in batches]
    finally:
        model.train(was_training)
    return torch.stack(losses).tolist()  # one read at the end
