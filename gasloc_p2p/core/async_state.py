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
- ``acid`` (A2CiD2, Nabli, Belilovsky and Oyallon, NeurIPS 2023, read for rounds as its time
  unit; gamma must be 0): a second copy ``x~`` (the memory) takes every gossip correction
  scaled by ``acid_beta / w`` (A2CiD2's ``x~_i += beta~ (x_j - x_i)`` when ``w`` is the pair
  average's 1/2) and every round's outer step; at each round end, after the step, ``x`` and
  ``x~`` mix for one round of ``d/dt x = r (x~ - x)``, ``d/dt x~ = r (x - x~)`` (``r`` =
  ``acid_rate``): both move toward their mean by ``(1 - exp(-2 r)) / 2`` of their difference.
  On a well-connected graph (``acid_beta`` = 1/2, see
  :func:`gasloc_p2p.core.topology.acid_parameters`) ``x~`` equals ``x`` and this is plain
  gossip; on a sparse one ``x~`` runs ahead of the consensus and pulls ``x`` along.
In all, ``a <- theta`` afterwards.

Threading: the caller serialises ``apply_correction``, ``round_end`` and the inner optimizer step
(the daemon holds one lock around them); reading ``public_iterate`` takes a snapshot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.options import check_outer_step, need, opt

MOMENTUM_FORMS = ("mixed", "local", "acid")
STALENESS_POLICIES = ("drop", "downweight", "keep")


@dataclass(frozen=True)
class AsyncConfig:
    """eta: outer lr; gamma: outer momentum; w: gossip weight (1/2 = exact pair average);
    momentum: "mixed" | "local" | "acid" (acid_rate, acid_beta: its mixing rate per round and
    its gossip step); staleness_policy and max_staleness: what to do with an exchange
    during which more than ``max_staleness`` round ends happened (on either side)."""

    eta: float = opt(0.7, "outer learning rate")
    gamma: float = opt(0.5, "outer momentum")
    w: float = opt(0.5, "gossip weight (0.5 = exact pair average)")
    momentum: str = opt("mixed", "momentum form", choices=MOMENTUM_FORMS)
    staleness_policy: str = opt("downweight", "stale exchanges", choices=STALENESS_POLICIES)
    max_staleness: int = opt(1, "round ends (both sides) an exchange may span at full weight")
    acid_rate: float = opt(0.0, "momentum acid: mixing rate of x and x~ per round (A2CiD2's "
                                "eta, in rounds; see core.topology.acid_parameters)")
    acid_beta: float = opt(0.5, "momentum acid: x~'s step toward a gossip partner (A2CiD2's "
                                "alpha~; 1/2 with any acid_rate is plain gossip)")

    def validate(self) -> None:
        check_outer_step(self.eta, self.gamma)
        if self.momentum == "acid":
            need(self.gamma == 0.0, "gamma", self.gamma,
                 "momentum acid has no outer momentum: set gamma 0")
            need(0.0 <= self.acid_rate <= 100.0, "acid_rate", self.acid_rate,
                 "need a mixing rate in [0, 100] per round")
            need(0.0 < self.acid_beta <= 100.0, "acid_beta", self.acid_beta,
                 "need a step in (0, 100]")
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
        if cfg.momentum in ("mixed", "acid"):
            self.memory = theta0.detach().clone()  # zprev; acid: x~
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

    def correction_targets(self) -> list[tuple[torch.Tensor, float]]:
        """Buffers a gossip correction is added to, with its scale: anchor and live parameters
        (so ``p`` moves by it and the drift is untouched) and, for acid, ``x~``."""
        targets = [(self.anchor, 1.0), (self.theta, 1.0)]
        if self.cfg.momentum == "acid":
            targets.append((self.memory, self.cfg.acid_beta / self.cfg.w))
        return targets

    def apply_correction(self, correction: torch.Tensor, fragment: Fragment | None = None) -> None:
        """Add a gossip correction to :meth:`correction_targets`."""
        for buf, scale in self.correction_targets():
            if fragment is None:
                buf.add_(correction, alpha=scale)
            else:
                fragment.add_(buf, correction, alpha=scale)

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
            elif cfg.momentum == "acid":
                # x~ takes the outer step too: x~ += eta (theta - a); x = p
                self.memory.add_(self.theta, alpha=cfg.eta).sub_(self.anchor, alpha=cfg.eta)
                x = self.anchor.lerp_(self.theta, cfg.eta)
                k = -0.5 * math.expm1(-2.0 * cfg.acid_rate)  # (1 - exp(-2 r)) / 2
                torch.lerp(x, self.memory, k, out=self.theta)  # x + k (x~ - x)
                self.memory.lerp_(x, k)  # x~ + k (x - x~)
            else:
                # m <- gamma m + (a - theta);  theta <- lerp(a, theta, eta) - eta gamma m
                self.memory.mul_(cfg.gamma).add_(self.anchor).sub_(self.theta)
                torch.lerp(self.anchor, self.theta, cfg.eta, out=self.theta)
                self.theta.add_(self.memory, alpha=-cfg.eta * cfg.gamma)
            self.anchor.copy_(self.theta)
        self.rounds += 1
