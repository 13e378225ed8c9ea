"""A2CiD2's continuous momentum on the node state: a research form of the simulator only.

A2CiD2 (Nabli, Belilovsky and Oyallon, NeurIPS 2023), read with rounds as its time unit: a
second copy ``x~`` takes every gossip correction scaled by ``beta / w`` (A2CiD2's
``x~_i += beta~ (x_j - x_i)`` when ``w`` is the pair average's 1/2) and every round's outer
step; at each round end, after the step, ``x`` and ``x~`` mix for one round of
``d/dt x = r (x~ - x)``, ``d/dt x~ = r (x - x~)`` (``r``: the rate): both move toward their
mean by ``(1 - exp(-2 r)) / 2`` of their difference. On a well-connected graph (``beta`` = 1/2,
see :func:`gasloc_p2p.core.topology.acid_parameters`) ``x~`` equals ``x`` and this is plain
gossip; on a sparse one ``x~`` runs ahead of the consensus and pulls ``x`` along.
docs/results/acid.md: a tie with plain gossip at n = 16 on a ring, so the daemon does not carry
it; it has no outer momentum (gamma 0).
"""

from __future__ import annotations

import math

import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState


class AcidState(AsyncGaslocState):
    """:class:`AsyncGaslocState` with A2CiD2's ``x~`` beside it (``cfg.gamma`` must be 0: its
    outer optimizer, plain averaging, keeps no state; this class's round end replaces it)."""

    def __init__(self, theta: torch.Tensor, theta0: torch.Tensor, cfg: AsyncConfig,
                 rate: float, beta: float) -> None:
        if cfg.gamma != 0.0:
            raise ValueError("momentum acid has no outer momentum: set gamma 0")
        if not (0.0 <= rate <= 100.0 and 0.0 < beta <= 100.0):
            raise ValueError(f"acid rate {rate} must be in [0, 100], beta {beta} in (0, 100]")
        super().__init__(theta, theta0, cfg, keep_anchor=True)
        self.rate, self.beta = rate, beta
        self.xtilde = theta0.detach().to(theta.dtype, copy=True)  # x~ [numel], theta's device

    def correction_targets(self) -> list[tuple[torch.Tensor, float]]:
        return [*super().correction_targets(), (self.xtilde, self.beta / self.cfg.w)]

    def reset_outer(self) -> None:
        """``x~`` restarts at the public iterate too (the consensus toy's own point)."""
        super().reset_outer()
        self.public_iterate(out=self.xtilde)

    def round_end(self) -> None:
        cfg, xt, anchor = self.cfg, self.xtilde, self.anchor
        assert anchor is not None
        with torch.no_grad():
            # x~ takes the outer step too: x~ += eta (theta - a); x = p
            xt.add_(self.theta, alpha=cfg.eta).sub_(anchor, alpha=cfg.eta)
            x = anchor.lerp_(self.theta, cfg.eta)
            k = -0.5 * math.expm1(-2.0 * self.rate)  # (1 - exp(-2 r)) / 2
            torch.lerp(x, xt, k, out=self.theta)  # x + k (x~ - x)
            xt.lerp_(x, k)  # x~ + k (x - x~)
            anchor.copy_(self.theta)
        self.rounds += 1
