"""One inner step, the same for every simulated worker and for the daemon.

The simulator and the daemon used to carry their own copies of this loop, and they drifted (a
different schedule floor, weight decay on different tensors), so a simulated result said less
about the daemon than it seemed to. Now both drive an :class:`InnerLoop`: the driver decides
*which* batch and *when* (the simulator's event queue, the daemon's thread under its training
lock) and keeps the step counter; this object decides *how* one step is taken. The later
additions (device placement, bf16 autocast, gradient accumulation) belong in :meth:`step`, so
both drivers get them at once.
"""

from __future__ import annotations

from torch import Tensor, nn

from gasloc_p2p.train.optim import AdamWConfig, build_adamw
from gasloc_p2p.train.schedule import LRSchedule


class InnerLoop:
    """A model with its own AdamW state and learning-rate schedule.

    ``model(x, y)`` must return ``(logits, loss)`` with a scalar loss, as
    :class:`gasloc_p2p.model.GPT` does. The optimizer state stays private to this worker or
    node: it is never exchanged (ALGORITHM.md section 1), only checkpointed.
    """

    def __init__(self, model: nn.Module, schedule: LRSchedule,
                 adamw: AdamWConfig | None = None) -> None:
        self.model = model
        self.schedule = schedule
        self.adamw = adamw if adamw is not None else AdamWConfig()
        self.optimizer = build_adamw(model, schedule.lr, self.adamw)

    def step(self, x: Tensor, y: Tensor, step: int) -> Tensor:
        """Take inner step number ``step`` (0-based, sets the learning rate) on one batch.

        ``x``, ``y``: LongTensor [B, T], ``y`` the next tokens of ``x``. Returns the batch's
        training loss as a detached scalar tensor; converting it to a float (a device sync)
        is left to the caller.
        """
        lr = self.schedule.at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        _, loss = self.model(x, y)
        if loss is None:
            raise ValueError("the model returned no loss: call it with targets")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()
