"""NoLoCo's outer step (Kolehmainen et al., arXiv 2506.10911), from its public description.

After ``H`` local steps each replica ``i`` forms a group with one random peer and, with its outer
parameters ``phi_i`` (the round's start), its local outer gradient ``Delta_i = phi_i - theta_i'``
and a per-replica momentum ``delta_i`` (zero at start), takes a modified Nesterov step:

    delta_i <- alpha delta_i - beta mean_group(Delta) - gamma (phi_i - mean_group(phi))
    phi_i   <- phi_i + delta_i,   theta_i <- phi_i

The last term pulls replicas together; with a group of two it is the pairwise gossip correction
``gamma / 2 (phi_j - phi_i)``, which is why :meth:`NolocoOuter.step_` takes it as an argument
(a driver may compute it through quantized references). With ``alpha = 0, beta = gamma = 1``
every pair ends at its mean of ``theta'``: plain pairwise averaging of the trained models.
Names here follow the paper; the simulator maps ``alpha`` to ``--gamma`` (the outer momentum of
every algorithm), ``beta`` to ``--eta`` and ``gamma`` to ``--consensus``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gasloc_p2p.core.options import check_outer_step


@dataclass(frozen=True)
class NolocoConfig:
    """alpha: momentum; beta: outer learning rate; gamma: pull toward the group mean."""

    alpha: float = 0.5
    beta: float = 0.7
    gamma: float = 0.5

    def validate(self) -> None:
        check_outer_step(self.beta, self.alpha, "eta", "gamma")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"--consensus={self.gamma!r}: the pull toward the group mean "
                             "needs [0, 1]")


class NolocoOuter:
    """The outer state of ``n`` replicas: outer parameters ``phi`` and momenta ``delta``."""

    def __init__(self, theta0: torch.Tensor, n: int, cfg: NolocoConfig) -> None:
        """theta0: ``[numel]`` initial parameters shared by every replica."""
        cfg.validate()
        self.cfg = cfg
        self.phi = theta0.detach().reshape(1, -1).repeat(n, 1)  # [n, numel]
        self.delta = torch.zeros_like(self.phi)

    def step_(self, i: int, group_outer_grad: torch.Tensor, phi_gap: torch.Tensor) -> torch.Tensor:
        """Replica ``i``'s outer step; returns its new ``phi_i`` (a view of ``self.phi``).

        group_outer_grad: ``mean_group(Delta)``, ``[numel]``.
        phi_gap: ``phi_i - mean_group(phi)``, ``[numel]`` (zero for a replica alone).
        """
        c = self.cfg
        self.delta[i].mul_(c.alpha).sub_(group_outer_grad, alpha=c.beta).sub_(phi_gap,
                                                                              alpha=c.gamma)
        return self.phi[i].add_(self.delta[i])


def exact_round_(outer: NolocoOuter, thetas: torch.Tensor,
                 groups: list[tuple[int, ...]]) -> None:
    """One round with exact (unquantized) group means; writes the new ``phi`` into ``thetas``.

    thetas: ``[n, numel]`` parameters after the inner steps; ``groups`` partition the replicas
    (a replica missing from every group is alone).
    """
    n = thetas.shape[0]
    grads = outer.phi - thetas
    alone = set(range(n)) - {k for g in groups for k in g}
    updates: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for group in [*groups, *((k,) for k in sorted(alone))]:
        idx = list(group)
        g_mean, p_mean = grads[idx].mean(dim=0), outer.phi[idx].mean(dim=0)
        updates += [(k, g_mean, outer.phi[k] - p_mean) for k in idx]
    for k, g_mean, gap in updates:  # every mean is taken before any phi moves
        outer.step_(k, g_mean, gap)
    thetas.copy_(outer.phi)
