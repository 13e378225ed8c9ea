"""GASLoC asynchronous node state (ALGORITHM.md section 2): what one daemon node keeps.

State: live parameters ``theta`` (the model's flat buffer, trained by the inner optimizer),
anchor ``a`` (parameters at the start of the current round), and the momentum memory.
The public iterate ``p = a + eta (theta - a)`` is what the node would propose if its round ended
now. A gossip exchange adds the same correction to ``a`` and ``theta``, so the local drift
``theta - a`` is untouched and ``p`` moves by exactly the correction.

Round-end momentum forms:
- ``mixed`` (the paper's): ``z = p``; ``theta <- z + gamma (z - zprev)``; ``zprev <- z``.
- ``local`` (our proposal; never extrapolates received corrections): ``d = a - theta``;
  ``m <- gamma m + d``; ``theta <- a - eta (d + gamma m)``.
In both, ``a <- theta`` afterwards.

Threading: the caller serialises ``apply_correction``, ``round_end`` and the inner optimizer step
(the daemon holds one lock around them); reading ``public_iterate`` takes a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.options import check_outer_step, need, opt

MOMENTUM_FORMS = ("mixed", "local")
STALENESS_POLICIES = ("drop", "downweight", "keep")


@dataclass(frozen=True)
class AsyncConfig:
    """eta: outer lr; gamma: outer momentum; w: gossip weight (1/2 = exact pair average);
    momentum: "mixed" | "local"; staleness_policy and max_staleness: what to do with an exchange
    during which more than ``max_staleness`` round ends happened (on either side)."""

    eta: float = opt(0.7, "outer learning rate")
    gamma: float = opt(0.5, "outer momentum")
    w: float = opt(0.5, "gossip weight (0.5 = exact pair average)")
    momentum: str = opt("mixed", "momentum form", choices=MOMENTUM_FORMS)
    staleness_policy: str = opt("downweight", "stale exchanges", choices=STALENESS_POLICIES)
    max_staleness: int = opt(1, "round ends (both sides) an exchange may span at full weight")

    def validate(self) -> None:
        check_outer_step(self.eta, self.gamma)
        need(0.0 < self.w <= 0.5, "w", self.w, "a pairwise gossip weight needs (0, 0.5]")
        need(self.momentum in MOMENTUM_FORMS, "momentum", self.momentum,
             f"choose one of {MOMENTUM_FORMS}")
        need(self.staleness_policy in STALENESS_POLICIES, "staleness_policy",
             self.staleness_policy, f"choose one of {STALENESS_POLICIES}")
        need(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0")


def exchange_weight(cfg: AsyncConfig, staleness: int) -> float:
    """Gossip weight for an exchange spanning ``staleness`` round ends (sum over both sides).

    Both peers know both counts at commit time, so they compute the same weight and the
    corrections stay exact negatives. Returns 0.0 when the exchange must be dropped.
    """
    if staleness <= cfg.max_staleness or cfg.staleness_policy == "keep":
        return cfg.w
    if cfg.staleness_policy == "drop":
        return 0.0
    return cfg.w / (1 + staleness - cfg.max_staleness)


class AsyncGaslocState:
    """One node's outer state. ``theta`` aliases the live parameters (not copied)."""

    def __init__(self, theta: torch.Tensor, theta0: torch.Tensor, cfg: AsyncConfig) -> None:
        """theta: ``[numel]`` live flat parameters; theta0: ``[numel]`` common initial values."""
        cfg.validate()
        if theta.shape != theta0.shape or theta.dim() != 1:
            raise ValueError("theta and theta0 must be 1-D tensors of the same size")
        self.cfg = cfg
        self.theta = theta
        self.anchor = theta.detach().clone()
        if cfg.momentum == "mixed":
            self.memory = theta0.detach().clone()  # zprev
        else:
            self.memory = torch.zeros_like(theta)  # m
        self.rounds = 0  # round ends so far; an exchange records how many happen during it

    def public_iterate(self, fragment: Fragment | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Snapshot of ``p = a + eta (theta - a)`` (compact ``[fragment.numel]`` if given).

        ``out``: a reusable ``[numel]`` buffer for the whole-vector case; a fresh 400 MB
        tensor per snapshot costs more in page faults than the arithmetic.
        """
        if fragment is None:
            if out is not None:
                return torch.lerp(self.anchor, self.theta, self.cfg.eta, out=out)
            return torch.lerp(self.anchor, self.theta, self.cfg.eta)
        return torch.lerp(fragment.gather(self.anchor), fragment.gather(self.theta), self.cfg.eta)

    def apply_correction(self, correction: torch.Tensor, fragment: Fragment | None = None) -> None:
        """Add a gossip correction to both anchor and live parameters (``p`` moves by it)."""
        if fragment is None:
            self.anchor.add_(correction)
            self.theta.add_(correction)
        else:
            fragment.add_(self.anchor, correction)
            fragment.add_(self.theta, correction)

    def round_end(self) -> None:
        """Outer update at the end of this node's round of inner steps.

        Written as three or four fused passes over the buffers with no temporaries: the anchor
        is scratch space (it is reset to ``theta`` at the end anyway).
        """
        cfg = self.cfg
        with torch.no_grad():
            if cfg.momentum == "mixed":
                z = self.anchor.lerp_(self.theta, cfg.eta)  # z = p, in the anchor's buffer
                # theta = z + gamma (z - zprev) = lerp(zprev, z, 1 + gamma)
                torch.lerp(self.memory, z, 1.0 + cfg.gamma, out=self.theta)
                self.memory, self.anchor = z, self.memory  # zprev <- z; reuse the old buffer
            else:
                # m <- gamma m + (a - theta);  theta <- lerp(a, theta, eta) - eta gamma m
                self.memory.mul_(cfg.gamma).add_(self.anchor).sub_(self.theta)
                torch.lerp(self.anchor, self.theta, cfg.eta, out=self.theta)
                self.theta.add_(self.memory, alpha=-cfg.eta * cfg.gamma)
            self.anchor.copy_(self.theta)
        self.rounds += 1
