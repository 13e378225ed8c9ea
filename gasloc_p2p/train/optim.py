"""The inner optimizer: AdamW with weight decay on the weight matrices only (by default).

Decaying biases and LayerNorm gains pulls them toward zero for no benefit: they are few, do not
overfit, and a LayerNorm gain of zero silences its layer. So the default follows GPT-2/nanoGPT
and decays only tensors of two or more dimensions (linear weights and embeddings);
``decay_vectors`` restores the older "decay everything" behaviour for comparisons.
"""

from __future__ import annotations

import weakref
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


def build_adamw(model: nn.Module, lr: float, cfg: AdamWConfig,
                in_backward: bool = False) -> torch.optim.AdamW | BackwardAdamW:
    """AdamW over ``model``'s trainable parameters, grouped by :func:`param_groups`. On a CUDA
    device fused, and with ``in_backward`` a :class:`BackwardAdamW` (buckets of parameters
    stepped as their gradients complete). On the CPU PyTorch's default (the single-tensor
    loop for CPU tensors): the simulator and the daemon take bit-identical steps there."""
    groups = param_groups(model, cfg)
    if next(model.parameters()).device.type != "cuda":
        return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas)
    if in_backward:
        return BackwardAdamW(groups, lr, cfg.betas)
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, fused=True)


def gradients_at_once(numel: int, largest: int, n_layer: int, in_backward: bool) -> int:
    """Gradient elements that exist at once in a step: all of them, or with AdamW stepped in
    the backward pass (:class:`BackwardAdamW`) about one layer's or the largest tensor's,
    plus the bucket of parameters still waiting for its last gradient."""
    if not in_backward:
        return numel
    return min(numel, max(largest, numel // max(n_layer, 1)) + BUCKET_ELEMS)


BUCKET_ELEMS = 1 << 24  # elements per bucket of BackwardAdamW: 64 MiB of float32 gradients


def _buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive parameters in buckets of at most :data:`BUCKET_ELEMS` elements (a larger
    parameter alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        if not out or size + p.numel() > BUCKET_ELEMS:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


class _States(dict):
    """The bucket optimizers' states as one mapping; ``clear`` clears them all."""

    def __init__(self, owner: BackwardAdamW) -> None:
        super().__init__({p: st for o in owner.optimizers for p, st in o.state.items()})
        self.owner = owner

    def clear(self) -> None:
        for o in self.owner.optimizers:
            o.state.clear()
        super().clear()


class BackwardAdamW:
    """AdamW stepping parameters as soon as their gradients are complete (a hook after
    gradient accumulation), then dropping those gradients: the whole set of gradients never
    exists at once, which takes 4 bytes per parameter off the backward pass's peak (the
    optimizer-in-backward of torchtune). Parameters step in buckets of consecutive ones (at
    most :data:`BUCKET_ELEMS` elements, one fused AdamW each) when the bucket's last gradient
    arrives: one optimizer call per bucket, not per parameter, whose Python a GPU step waits
    for (272 calls a step for a 135M Llama; a step of a 30-layer model took 2.6-2.8x the host
    time of one AdamW's step with an optimizer per parameter, 1.0-1.1x with buckets:
    ``make bench-optim``, docs/benchmarks.md). The same update
    as one AdamW over all parameters (AdamW is elementwise); for one micro-batch per step
    (gradient accumulation needs the whole gradient). ``state_dict`` and ``load_state_dict``
    use the format of one ``torch.optim.AdamW`` over the same groups: checkpoints move
    between devices."""

    def __init__(self, groups: list[dict[str, Any]], lr: float,
                 betas: tuple[float, float]) -> None:
        self.groups = groups
        self.lr, self.betas = lr, betas
        self.optimizers: list[torch.optim.AdamW] = []
        self._ready: list[list[int]] = []  # per bucket: gradients arrived in this backward
        self._firsts_at: list[int] = []  # each group's first bucket
        self.active = True  # False: backward passes leave the parameters alone (warm-up)
        for group in groups:
            self._firsts_at.append(len(self.optimizers))
            for bucket in _buckets(group["params"]):
                opt = torch.optim.AdamW(bucket, lr=lr, betas=betas,
                                        weight_decay=group["weight_decay"], fused=True)
                self.optimizers.append(opt)
                self._ready.append([0])
                hook = self._hook(opt, self._ready[-1], len(bucket))
                for p in bucket:
                    p.register_post_accumulate_grad_hook(hook)

    def _hook(self, opt: torch.optim.AdamW, ready: list[int], size: int) -> Any:
        """The hook of ``opt``'s parameters: the bucket steps when the last of its ``size``
        gradients arrived. It holds the owner and ``opt`` weakly: a parameter keeps its hooks
        where the garbage collector cannot see them (autograd's C++ side), so a strong
        reference would keep the optimizer, its state and the parameters alive for good once
        dropped (a GPU check measured 1.5 GiB of a 135M node left on the device)."""
        owner, ref = weakref.ref(self), weakref.ref(opt)

        def step(p: torch.Tensor) -> None:
            me, o = owner(), ref()
            if me is None or o is None or not me.active:
                return
            ready[0] += 1
            if ready[0] == size:
                ready[0] = 0
                o.step()
                o.zero_grad(set_to_none=True)
        return step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> _States:
        return _States(self)

    def step(self) -> None:
        """After the backward pass: a bucket whose parameters did not all get a gradient
        (a parameter the loss did not reach) steps the ones that did."""
        for o, ready in zip(self.optimizers, self._ready, strict=True):
            if ready[0]:
                ready[0] = 0
                o.step()
                o.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o, ready in zip(self.optimizers, self._ready, strict=True):
            ready[0] = 0
            o.zero_grad(set_to_none=set_to_none)

    def _whole(self) -> torch.optim.AdamW:
        """One AdamW over the same groups holding (sharing) the bucket optimizers' states."""
        whole = torch.optim.AdamW([{**g} for g in self.groups], lr=self.lr, betas=self.betas)
        for o in self.optimizers:
            for p, st in o.state.items():
                whole.state[p] = st
        for g, o in zip(whole.param_groups, self._firsts(), strict=True):
            g["lr"] = o.param_groups[0]["lr"]
        return whole

    def _firsts(self) -> list[torch.optim.AdamW]:
        return [self.optimizers[i] for i in self._firsts_at]

    def state_dict(self) -> dict[str, Any]:
        return self._whole().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        whole = self._whole()
        whole.load_state_dict(state_dict)  # checks the groups, moves the state to the device
        ends = [*self._firsts_at[1:], len(self.optimizers)]
        for g, first, end in zip(whole.param_groups, self._firsts_at, ends, strict=True):
            for opt in self.optimizers[first:end]:
                opt.state.clear()
                for p in opt.param_groups[0]["params"]:
                    if p in whole.state:
                        opt.state[p] = whole.state[p]
                opt.param_groups[0]["lr"] = g["lr"]
