"""Validation loss: the one number the simulator's curves and the daemon's metrics report."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gasloc_p2p.data import DataError


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]]) -> float:
    """Mean cross-entropy (nats per token) of ``model(x, y)`` over ``batches``.

    Each item is (x, y), LongTensor [B, T]. The mean is weighted by tokens, so a smaller last
    batch counts for what it holds. Runs in eval mode (no dropout: the number must not depend
    on an RNG) and restores the previous train/eval mode afterwards.
    """
    if not batches:
        raise DataError("evaluate() needs at least one batch")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        total, count = torch.zeros((), dtype=torch.float64, device=device), 0
        for x, y in batches:
            _, loss = model(x.to(device), y.to(device))
            total += loss.double() * y.numel()  # summed on the device: one read at the end
            count += y.numel()
    finally:
        model.train(was_training)
    return float(total) / count
