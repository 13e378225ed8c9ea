"""DiLoCo's outer step: Nesterov SGD on the mean outer gradient (docs/algorithm.md section 3).

Every ``H`` inner steps all workers all-reduce ``outer_grad = anchor - mean(theta')`` and apply
``buf <- gamma buf + g``; ``anchor <- anchor - eta (g + gamma buf)``, i.e.
``torch.optim.SGD(lr=eta, momentum=gamma, nesterov=True)`` (dampening 0), then every worker
restarts from the new anchor. Each worker keeps its own inner AdamW state.
"""

from __future__ import annotations

import torch

from gasloc_p2p.core.options import check_outer_step


class NesterovOuter:
    """Nesterov momentum SGD on a flat buffer (the DiLoCo outer optimizer).

    Works on any slice of the parameters: Streaming DiLoCo keeps one per fragment.
    """

    def __init__(self, numel: int, eta: float = 0.7, gamma: float = 0.9,
                 dtype: torch.dtype = torch.float32, buf: torch.Tensor | None = None) -> None:
        """``buf``: an existing ``[numel]`` momentum buffer to update in place (on its device);
        by default a zeroed one on the host, and none at all when ``gamma`` is 0 (plain SGD on
        the outer gradient: ``eta 1`` is averaging)."""
        check_outer_step(eta, gamma)
        self.eta = eta
        self.gamma = gamma
        self.buf = buf if buf is not None or gamma == 0.0 else torch.zeros(numel, dtype=dtype)

    def step_(self, anchor: torch.Tensor, outer_grad: torch.Tensor) -> torch.Tensor:
        """Update ``anchor`` in place with the outer gradient ``[numel]`` (moved to the
        anchor's device: an averaged gradient arrives on the host); returns ``anchor``."""
        outer_grad = outer_grad.to(anchor.device, anchor.dtype)
        if self.buf is None:
            return anchor.sub_(outer_grad, alpha=self.eta)
        self.buf.mul_(self.gamma).add_(outer_grad)
        anchor.sub_(outer_grad + self.gamma * self.buf, alpha=self.eta)
        return anchor


def outer_gradient(anchor: torch.Tensor, thetas: torch.Tensor) -> torch.Tensor:
    """``anchor - mean_i theta_i`` for ``anchor: [numel]``, ``thetas: [n, numel]``."""
    return anchor - thetas.mean(dim=0)
