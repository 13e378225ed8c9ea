"""Streaming DiLoCo (ALGORITHM.md section 3): fragments, staggered syncs, overlap, merge.

Parameters are split into fragments; fragment ``f`` syncs every ``H`` steps at a staggered
offset. A sync started at step ``t`` all-reduces the fragment's (optionally 4-bit) outer
gradients, applies a Nesterov outer step to the shared global copy, and lands ``tau`` inner
steps later as ``theta_f <- alpha * local + (1 - alpha) * global``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gasloc_p2p.core.codecs import parse_optional
from gasloc_p2p.core.diloco import NesterovOuter
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.options import check_outer_step


@dataclass(frozen=True)
class StreamingConfig:
    """H: steps between syncs of one fragment; tau: overlap in inner steps (0 = blocking);
    alpha: weight of the local copy in the merge; codec: codec of outer gradients ("none" sends
    them unquantized in the buffer's dtype)."""

    H: int = 10
    tau: int = 1
    alpha: float = 0.0
    eta: float = 0.7
    gamma: float = 0.9
    codec: str = "fp4"

    def validate(self) -> None:
        if self.H < 1 or self.tau < 0 or self.tau >= self.H:
            raise ValueError(f"need H >= 1 and 0 <= tau < H, got H={self.H} tau={self.tau}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha} must be in [0, 1]")
        check_outer_step(self.eta, self.gamma)
        parse_optional(self.codec)  # ValueError for an unknown codec


class StreamingDiloco:
    """The shared outer state of ``n`` lock-step workers, one Nesterov optimizer per fragment."""

    def __init__(self, theta0: torch.Tensor, fragments: Sequence[Fragment],
                 cfg: StreamingConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.fragments = list(fragments)
        self.global_params = theta0.detach().clone()
        self.outer = [NesterovOuter(f.numel, cfg.eta, cfg.gamma, theta0.dtype) for f in fragments]
        spec = parse_optional(cfg.codec)
        self.codec = spec.codec() if spec is not None else None
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}  # fragment -> (land step, global)

    def offset(self, f: int) -> int:
        """Staggered phase of fragment ``f`` within the period ``H``."""
        return (f * self.cfg.H) // len(self.fragments)

    def due(self, step: int) -> list[int]:
        """Fragments whose sync starts after inner step ``step`` (1-based count of steps done)."""
        return [f for f in range(len(self.fragments))
                if step > self.offset(f) and (step - self.offset(f)) % self.cfg.H == 0]

    def begin(self, f: int, step: int, thetas: torch.Tensor) -> int:
        """Start fragment ``f``'s sync from ``thetas: [n, numel]``; returns bytes per worker sent."""
        frag = self.fragments[f]
        anchor = frag.gather(self.global_params)
        grads = torch.zeros_like(anchor)
        nbytes = 0
        for row in thetas:  # each worker quantizes its own outer gradient, the sum is in fp32
            delta = anchor - frag.gather(row)
            if self.codec is None:  # exact ("none"): for equivalence tests in float64
                grads.add_(delta)
                nbytes = delta.numel() * delta.element_size()
                continue
            enc = self.codec.encode(delta)
            grads.add_(self.codec.decode(enc).to(grads.dtype))
            nbytes = enc.nbytes
        grads.div_(thetas.shape[0])
        new_global = self.outer[f].step_(anchor, grads)
        frag.copy_(self.global_params, new_global)
        self.pending[f] = (step + self.cfg.tau, new_global)
        return nbytes

    def land(self, step: int, thetas: torch.Tensor) -> list[int]:
        """Merge every sync whose overlap ends at ``step`` into ``thetas`` in place."""
        landed = [f for f, (at, _) in self.pending.items() if at == step]
        for f in landed:
            _, new_global = self.pending.pop(f)
            frag = self.fragments[f]
            for row in thetas:
                merged = torch.lerp(new_global, frag.gather(row), self.cfg.alpha)
                frag.copy_(row, merged)
        return landed
