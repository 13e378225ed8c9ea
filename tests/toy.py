"""A tiny float64 regression task with real AdamW inner steps, shared by the core tests."""

from __future__ import annotations

import torch
from torch import nn

from gasloc_p2p.core.flat import FlatParams

DIM_IN, DIM_OUT, SAMPLES, BATCH = 6, 3, 64, 8


class ToyWorker:
    """One worker: a linear model whose parameters live in row ``i`` of a shared buffer."""

    def __init__(self, i: int, buffer: torch.Tensor, seed: int = 0, sgd_lr: float | None = None):
        gen = torch.Generator().manual_seed(1000 + i)
        self.x = torch.randn(SAMPLES, DIM_IN, generator=gen, dtype=torch.float64)
        true_w = torch.randn(DIM_IN, DIM_OUT, generator=gen, dtype=torch.float64)
        self.y = self.x @ true_w + 0.1 * i  # workers disagree: non-iid targets
        self.model = nn.Linear(DIM_IN, DIM_OUT, dtype=torch.float64)
        self.flat = FlatParams(self.model, buffer)
        if sgd_lr is not None:
            self.opt: torch.optim.Optimizer = torch.optim.SGD(self.model.parameters(), lr=sgd_lr)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2, weight_decay=0.1)
        self.batches = torch.Generator().manual_seed(seed * 7919 + i)

    def loss(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        x, y = (self.x, self.y) if idx is None else (self.x[idx], self.y[idx])
        return ((self.model(x) - y) ** 2).mean()

    def inner(self, steps: int) -> None:
        for _ in range(steps):
            idx = torch.randint(0, SAMPLES, (BATCH,), generator=self.batches)
            self.opt.zero_grad(set_to_none=True)
            self.loss(idx).backward()
            self.opt.step()


def numel() -> int:
    return DIM_IN * DIM_OUT + DIM_OUT


def theta0(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return nn.utils.parameters_to_vector(nn.Linear(DIM_IN, DIM_OUT, dtype=torch.float64).parameters()).detach()


def workers(n: int, seed: int = 0, sgd_lr: float | None = None) -> tuple[torch.Tensor, list[ToyWorker]]:
    """``[n, numel]`` buffer initialised to theta_0 on every row, and its workers."""
    thetas = theta0(seed).repeat(n, 1)
    ws = [ToyWorker(i, thetas[i], seed, sgd_lr) for i in range(n)]
    for w in ws:
        w.flat.buffer.copy_(theta0(seed))
    return thetas, ws


ETA, GAMMA = 0.7, 0.6  # outer step of the reference runs


def run_diloco(n: int, rounds: int, H: int, seed: int = 0) -> list[torch.Tensor]:
    """Reference DiLoCo with torch's own Nesterov SGD; returns the global params per round."""
    thetas, ws = workers(n, seed)
    global_p = torch.nn.Parameter(theta0(seed).clone())
    outer = torch.optim.SGD([global_p], lr=ETA, momentum=GAMMA, nesterov=True)
    history = []
    for _ in range(rounds):
        for w in ws:
            w.flat.buffer.copy_(global_p.detach())
            w.inner(H)
        outer.zero_grad()
        global_p.grad = global_p.detach() - thetas.mean(dim=0)
        outer.step()
        history.append(global_p.detach().clone())
    return history
