"""One inner step, the same for every simulated worker and for the daemon.

The simulator and the daemon used to carry their own copies of this loop, and they drifted (a
different schedule floor, weight decay on different tensors), so a simulated result said less
about the daemon than it seemed to. Now both drive an :class:`InnerLoop`: the driver decides
*which* batch and *when* (the simulator's event queue, the daemon's thread under its training
lock) and keeps the step counter; this object decides *how* one step is taken: on which device,
in which precision (bf16 autocast around the forward pass, the parameters, gradients and AdamW
state stay float32), in how many micro-batches, and with or without ``torch.compile``; both
drivers get these at once.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gasloc_p2p.train.optim import AdamWConfig, build_adamw
from gasloc_p2p.train.schedule import LRSchedule

PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class StepConfig:
    """How a step runs: ``precision`` fp32 | bf16 (autocast), ``grad_accum`` micro-batches
    per step (the batch is split along its first dimension), ``compile`` the forward."""

    precision: str = "fp32"
    grad_accum: int = 1
    compile: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")


def resolve_device(name: str) -> torch.device:
    """``auto`` (cuda when available, else cpu) or a torch device name (cpu, cuda:1, mps)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (try --device "
                         "cpu, or PyTorch's CUDA build)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA "
                         "device(s), numbered from 0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: MPS is not available on this machine (try --device "
                         "cpu)")
    return device


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class InnerLoop:
    """A model with its own AdamW state and learning-rate schedule.

    ``model(x, y)`` must return ``(logits, loss)`` with a scalar loss, as
    :class:`gasloc_p2p.model.GPT` does. The optimizer state stays private to this worker or
    node: it is never exchanged (docs/algorithm.md section 1), only checkpointed.
    """

    def __init__(self, model: nn.Module, schedule: LRSchedule,
                 adamw: AdamWConfig | None = None, how: StepConfig | None = None,
                 data_parallel: bool = False, sharded: bool = False) -> None:
        """``data_parallel``: this process is one rank of a multi-rank node (the process
        group is initialised): the forward runs through ``DistributedDataParallel``, which
        averages the gradients over the ranks in the backward pass (construction is a
        collective: every rank builds its loop at the same time). ``sharded``: the model is
        sharded over the ranks already (FSDP2: its backward reduce-scatters the gradients)."""
        self.model = model
        self.schedule = schedule
        self.adamw = adamw if adamw is not None else AdamWConfig()
        self.how = how if how is not None else StepConfig()
        # on CUDA with one micro-batch: each parameter stepped in the backward pass (not
        # under DDP: a parameter's gradient is complete only when its bucket is reduced)
        self.optimizer = build_adamw(model, schedule.lr, self.adamw,
                                     in_backward=self.how.grad_accum == 1 and not data_parallel
                                     and not sharded)
        self.device = model_device(model)
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        wrapped: nn.Module = model
        if data_parallel:
            # the buffers (rotary tables, masks) are the same on every rank by construction;
            # the gradients live in DDP's buckets (no second copy of them)
            ddp = nn.parallel.DistributedDataParallel
            quiet: dict[str, Any] = {"forward_sync_buffers" if "forward_sync_buffers" in
                                     inspect.signature(ddp.__init__).parameters
                                     else "broadcast_buffers": False}
            wrapped = self.ddp = ddp(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True, **quiet)
        # The compiled wrapper shares the model's parameters (and so the flat buffer).
        self.forward: Callable[..., tuple[Tensor, Tensor | None]] = (
            torch.compile(wrapped) if self.how.compile else wrapped)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """bf16 autocast on the model's device for ``precision="bf16"``, else nothing.

        Autocast's weight cache is off: it keeps the bfloat16 copy of every weight it cast
        until the forward pass ends, which with activation checkpointing is a copy of every
        layer's weights no backward pass needs (2 bytes per parameter: 0.10 GiB per layer
        of the Llama-3.2-1B shape, measured on an H100, docs/results/gpu.md). Each weight is
        cast where it is used instead (once per forward in these models), with the same
        values."""
        if self.how.precision != "bf16":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                              cache_enabled=False)

    def step(self, x: Tensor, y: Tensor, step: int) -> Tensor:
        """Take inner step number ``step`` (0-based, sets the learning rate) on one batch.

        ``x``, ``y``: LongTensor [B, T] (any device: moved to the model's), ``y`` the next
        tokens of ``x``; with ``grad_accum`` K, B splits into K micro-batches whose mean loss
        gradients add up to the full batch's. Returns the batch's mean training loss as a
        detached scalar tensor on the device; converting it to a float (a device sync) is left
        to the caller.
        """
        lr = self.schedule.at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        k = self.how.grad_accum
        if k == 1:  # the common path, kept exactly as the simulator/daemon equivalence pins it
            with self.autocast():
                _, loss = self.forward(x, y)
            if loss is None:
                raise ValueError("the model returned no loss: call it with targets")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)  # gradients live from backward to step
            return loss.detach()
        if x.shape[0] % k:
            raise ValueError(f"batch of {x.shape[0]} does not split into grad_accum={k} parts")
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
            # under DDP the gradients are averaged once, in the last micro-batch's backward
            quiet = self.ddp.no_sync() if self.ddp is not None and i < k - 1 \
                else contextlib.nullcontext()
            with quiet:
                with self.autocast():
                    _, loss = self.forward(xm, ym)
                if loss is None:
                    raise ValueError("the model returned no loss: call it with targets")
                (loss / k).backward()
            total += loss.detach() / k
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total
