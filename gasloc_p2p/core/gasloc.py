"""GASLoC in synchronous rounds (ALGORITHM.md section 1), on stacked worker buffers.

Workers' flat parameters are the rows of one ``[n, numel]`` tensor. A round is:
inner phase (by the driver) -> proposal ``y = a + eta (theta' - a)`` -> gossip ``z = W y`` ->
acceleration. Two readings of the acceleration are kept (the paper's text is ambiguous):

- ``mixed`` (default): ``theta <- z + gamma (z - zprev)``, ``zprev <- z``;
- ``unmixed``: ``theta <- z + gamma (y - yprev)``, ``yprev <- y``.

Both memories start at the workers' initial parameters (``theta_0`` for every worker when
training; the pure-consensus toy starts each worker elsewhere).

Optional outer-momentum warm-up: the momentum of round ``t`` (counted from 0) is
``gamma * min(1, t / warmup_rounds)``, so the first round takes no momentum and ``gamma`` is
reached after ``warmup_rounds`` rounds; ``eta`` stays fixed (the effective step
``eta / (1 - gamma_t)`` ramps up with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gasloc_p2p.core.options import check_outer_step

VARIANTS = ("mixed", "unmixed")


@dataclass(frozen=True)
class OuterConfig:
    """Outer-update hyper-parameters.

    eta: outer learning rate (scales the local drift in the proposal).
    gamma: outer momentum (0 disables acceleration).
    variant: "mixed" or "unmixed" (see module docstring).
    warmup_rounds: rounds over which the momentum ramps linearly from 0 to gamma (0: off).
    """

    eta: float = 0.7
    gamma: float = 0.5
    variant: str = "mixed"
    warmup_rounds: int = 0

    def validate(self) -> None:
        check_outer_step(self.eta, self.gamma)
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {VARIANTS}")
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")

    def gamma_at(self, round_index: int) -> float:
        """Momentum of round ``round_index`` (0-based), with the warm-up applied."""
        if self.warmup_rounds <= 0 or round_index >= self.warmup_rounds:
            return self.gamma
        return self.gamma * round_index / self.warmup_rounds


def propose(anchor: torch.Tensor, theta: torch.Tensor, eta: float) -> torch.Tensor:
    """Proposal ``y = a + eta (theta - a)``; any shape, returns a new tensor."""
    return torch.lerp(anchor, theta, eta) if eta != 1.0 else theta.clone()


def mix(y: torch.Tensor, mixing: torch.Tensor) -> torch.Tensor:
    """Gossip ``z = W y`` for ``y: [n, numel]`` and a doubly stochastic ``W: [n, n]``."""
    return torch.mm(mixing.to(y.dtype), y)


def mix_pair_(y_i: torch.Tensor, y_j: torch.Tensor, w: float) -> None:
    """In-place pairwise mixing ``y_i -= w (y_i - y_j)``, ``y_j -= w (y_j - y_i)``.

    The two corrections are exact negatives of each other, so ``y_i + y_j`` is kept up to one
    rounding per element.
    """
    c = (y_j - y_i).mul_(w)
    y_i.add_(c)
    y_j.sub_(c)


class SyncGasloc:
    """The outer state of ``n`` workers in synchronous rounds (the momentum memory)."""

    def __init__(self, theta0: torch.Tensor, n: int, cfg: OuterConfig) -> None:
        """theta0: ``[numel]`` initial parameters shared by every worker, or ``[n, numel]``
        each worker's own (the momentum memory starts there)."""
        cfg.validate()
        self.cfg = cfg
        start = theta0.detach()
        # zprev or yprev, [n, numel]
        self.memory = start.clone() if start.dim() == 2 else start.reshape(1, -1).repeat(n, 1)
        if self.memory.shape[0] != n:
            raise ValueError(f"theta0 has {self.memory.shape[0]} rows for {n} workers")
        self.rounds = 0

    def outer_step(
        self, anchors: torch.Tensor, thetas: torch.Tensor, mixing: torch.Tensor
    ) -> torch.Tensor:
        """One round's outer update; writes the new parameters into ``thetas`` and returns it.

        anchors: ``[n, numel]`` parameters at the start of the round.
        thetas: ``[n, numel]`` parameters after each worker's inner steps (updated in place).
        mixing: ``[n, n]`` mixing matrix of this round.
        """
        y = propose(anchors, thetas, self.cfg.eta)
        return self.accelerate(y, mix(y, mixing), thetas)

    def accelerate(self, y: torch.Tensor, z: torch.Tensor, thetas: torch.Tensor) -> torch.Tensor:
        """Momentum step from proposals ``y`` and mixed iterates ``z`` (both ``[n, numel]``).

        Drivers that mix by other means (quantized pairwise exchanges) call this directly.
        """
        gamma = self.cfg.gamma_at(self.rounds)
        self.rounds += 1
        if self.cfg.variant == "mixed":
            torch.lerp(self.memory, z, 1.0 + gamma, out=thetas)  # z + gamma (z - zprev)
            self.memory.copy_(z)
        else:
            torch.add(z, y - self.memory, alpha=gamma, out=thetas)
            self.memory.copy_(y)
        return thetas
