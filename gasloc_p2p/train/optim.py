"""The inner optimizer: AdamW with weight decay on the weight matrices only (by default).

Decaying biases and LayerNorm gains pulls them toward zero for no benefit: they are few, do not
overfit, and a LayerNorm gain of zero silences its layer. So the default follows GPT-2/nanoGPT
and decays only tensors of two or more dimensions (linear weights and embeddings);
``decay_vectors`` restores the older "decay everything" behaviour for comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyperparameters other than the learning rate (the schedule owns that).

    ``betas`` are (0.9, 0.95) rather than PyTorch's (0.9, 0.999): the shorter second-moment
    memory reacts faster to the loss spikes of small-batch language-model training.
    """

    weight_decay: float = 0.1
    decay_vectors: bool = False
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self) -> None:
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")


def param_groups(model: nn.Module, cfg: AdamWConfig) -> list[dict[str, Any]]:
    """Parameter groups in a fixed order: decayed first, then the undecayed (if any).

    The order and count are part of a checkpoint's optimizer state, so they depend only on
    the architecture and ``cfg.decay_vectors``; empty groups are left out.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if cfg.decay_vectors or p.dim() >= 2]
    keep = [p for p in params if not (cfg.decay_vectors or p.dim() >= 2)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": keep, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_adamw(model: nn.Module, lr: float, cfg: AdamWConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters, grouped by :func:`param_groups`; fused
    (one kernel for all parameters) where they live on a CUDA device. On the CPU the default
    for-each implementation: the simulator and the daemon take bit-identical steps there."""
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(param_groups(model, cfg), lr=lr, betas=cfg.betas,
                             fused=fused or None)
