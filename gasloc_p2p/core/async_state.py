"""GASLoC asynchronous node state (docs/algorithm.md, section 2): what one daemon node keeps.

State: live parameters ``theta`` (the model's flat buffer, trained by the inner optimizer),
anchor ``a`` (parameters at the start of the current round), and, only when ``gamma > 0``, the
momentum memory. The public iterate ``p = a + eta (theta - a)`` is what the node would propose
if its round ended now. A gossip exchange adds the same correction to ``a`` and ``theta``, so
the local drift ``theta - a`` is untouched and ``p`` moves by exactly the correction.

Round-end momentum forms:
- ``mixed`` (GASLoC's): ``z = p``; ``theta <- z + gamma (z - zprev)``; ``zprev <- z``.
- ``local`` (never extrapolates received corrections; DiLoCo's Nesterov step is this form with
  the all-reduced drift): ``d = a - theta``; ``m <- gamma m + d``; ``theta <- a - eta (d +
  gamma m)``.
In both, ``a <- theta`` afterwards. With ``gamma = 0`` both are ``theta <- p`` and no memory
exists (no model-sized buffer the algorithm never reads).

Staleness: an exchange during which more than :data:`MAX_STALENESS` round ends happened (both
sides together) applies its weight divided by ``1 + staleness - MAX_STALENESS``
(docs/results/staleness.md: the other policies measured no better).

Threading: the caller serialises ``apply_correction``, ``round_end`` and the inner optimizer step
(the daemon holds one lock around them); reading ``public_iterate`` takes a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.options import check_outer_step, need, opt

MOMENTUM_FORMS = ("mixed", "local")
MAX_STALENESS = 1  # round ends (both sides) an exchange may span at full weight


@dataclass(frozen=True)
class AsyncConfig:
    """eta: outer lr; gamma: outer momentum (0: none, no buffer); w: gossip weight (1/2 = exact
    pair average); momentum: the round-end form, "mixed" or "local" (module docstring)."""

    eta: float = opt(1.0, "outer learning rate (1: plain averaging of the drift)")
    gamma: float = opt(0.0, "outer momentum (0: none; docs/results: no gain at 121k params)")
    w: float = opt(0.5, "gossip weight (0.5 = exact pair average)", advanced=True)
    momentum: str = opt("mixed", "round-end momentum form", choices=MOMENTUM_FORMS,
                        advanced=True)

    def validate(self) -> None:
        check_outer_step(self.eta, self.gamma)
        need(0.0 < self.w <= 0.5, "w", self.w, "a pairwise gossip weight needs (0, 0.5]")
        need(self.momentum in MOMENTUM_FORMS, "momentum", self.momentum,
             f"choose one of {MOMENTUM_FORMS}")


def exchange_weight(w: float, staleness: int) -> float:
    """Gossip weight for an exchange spanning ``staleness`` round ends (sum over both sides).

    Both peers know both counts at commit time, so they compute the same weight and the
    corrections stay exact negatives.
    """
    if staleness <= MAX_STALENESS:
        return w
    return w / (1 + staleness - MAX_STALENESS)


class AsyncGaslocState:
    """One node's outer state. ``theta`` aliases the live parameters (not copied)."""

    def __init__(self, theta: torch.Tensor, theta0: torch.Tensor, cfg: AsyncConfig) -> None:
        """theta: ``[numel]`` live flat parameters; theta0: ``[numel]`` common initial values
        (the ``mixed`` memory starts there; read only when ``gamma > 0``)."""
        cfg.validate()
        if theta.shape != theta0.shape or theta.dim() != 1:
            raise ValueError("theta and theta0 must be 1-D tensors of the same size")
        self.cfg = cfg
        self.theta = theta
        self.anchor = theta.detach().clone()
        self.memory: torch.Tensor | None = self.initial_memory(theta0)
        self.rounds = 0  # round ends so far; an exchange records how many happen during it

    def initial_memory(self, theta0: torch.Tensor) -> torch.Tensor | None:
        """The momentum memory at start: ``zprev = theta_0`` (mixed) or ``m = 0`` (local);
        None when ``gamma = 0``."""
        if self.cfg.gamma == 0.0:
            return None
        if self.cfg.momentum == "mixed":
            return theta0.detach().to(self.theta.dtype, copy=True)
        return torch.zeros_like(self.theta)

    def public_iterate(self, fragment: Fragment | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Snapshot of ``p = a + eta (theta - a)`` (compact ``[fragment.numel]`` if given).

        ``out``: a reusable ``[numel]`` buffer for the whole-vector case.
        """
        if fragment is None:
            if out is not None:
                return torch.lerp(self.anchor, self.theta, self.cfg.eta, out=out)
            return torch.lerp(self.anchor, self.theta, self.cfg.eta)
        return torch.lerp(fragment.gather(self.anchor), fragment.gather(self.theta), self.cfg.eta)

    def correction_targets(self) -> list[tuple[torch.Tensor, float]]:
        """Buffers a gossip correction is added to, with its scale: anchor and live parameters
        (so ``p`` moves by it and the drift is untouched). Research forms (the simulator's
        A2CiD2) add their own."""
        return [(self.anchor, 1.0), (self.theta, 1.0)]

    def apply_correction(self, correction: torch.Tensor, fragment: Fragment | None = None) -> None:
        """Add a gossip correction to :meth:`correction_targets`."""
        for buf, scale in self.correction_targets():
            if fragment is None:
                buf.add_(correction, alpha=scale)
            else:
                fragment.add_(buf, correction, alpha=scale)

    def round_end(self) -> None:
        """Outer update at the end of this node's round of inner steps.

        A few fused passes over the buffers with no temporaries: the anchor is scratch space
        (it is reset to ``theta`` at the end anyway).
        """
        cfg, memory = self.cfg, self.memory
        with torch.no_grad():
            if memory is None:  # gamma 0: theta <- p (bit for bit the forms' value there)
                torch.lerp(self.anchor, self.theta, cfg.eta, out=self.theta)
            elif cfg.momentum == "mixed":
                z = self.anchor.lerp_(self.theta, cfg.eta)  # z = p, in the anchor's buffer
                # theta = z + gamma (z - zprev) = lerp(zprev, z, 1 + gamma)
                torch.lerp(memory, z, 1.0 + cfg.gamma, out=self.theta)
                self.memory, self.anchor = z, memory  # zprev <- z; reuse the old buffer
            else:
                # m <- gamma m + (a - theta);  theta <- lerp(a, theta, eta) - eta gamma m
                memory.mul_(cfg.gamma).add_(self.anchor).sub_(self.theta)
                torch.lerp(self.anchor, self.theta, cfg.eta, out=self.theta)
                self.theta.add_(memory, alpha=-cfg.eta * cfg.gamma)
            self.anchor.copy_(self.theta)
        self.rounds += 1
