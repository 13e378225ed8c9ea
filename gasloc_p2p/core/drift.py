"""A node's own drift per round, measured on a fixed sample of coordinates (pure torch).

The bounded-update guard (:mod:`gasloc_p2p.protocol.guard`) sets every limit in units of what
the node's *own* inner steps moved it over a round, gossip excluded: a quantity no peer can
move. Measuring it over the whole model would need a model-sized copy; a fixed random sample
of ``samples`` coordinates per fragment estimates its RMS to about ``1 / sqrt(2 samples)``
(1% at the default 4096) at the cost of two gathers of a few thousand elements per step, on
the training device, with no host synchronisation until the round end reads one float per
fragment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gasloc_p2p.core.flat import Fragment

SAMPLES = 4096  # coordinates per fragment


class DriftProbe:
    """Sums the inner steps' moves of ``theta`` at sampled coordinates, round by round.

    Call :meth:`before_step` and :meth:`after_step` around every optimizer step (under the
    same lock as the step, so no gossip correction falls between the two), and
    :meth:`round_end` at the end of each round.
    """

    def __init__(self, theta: torch.Tensor, fragments: Sequence[Fragment],
                 samples: int = SAMPLES, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        picks: list[torch.Tensor] = []
        owner: list[torch.Tensor] = []
        for f in fragments:
            k = min(samples, f.numel)
            local = torch.randperm(f.numel, generator=gen)[:k].sort().values
            picks.append(_flat_positions(f, local))
            owner.append(torch.full((k,), len(owner), dtype=torch.long))
        self.theta = theta
        self.indices = [f.index for f in fragments]
        self._idx = torch.cat(picks).to(theta.device)
        self._owner = torch.cat(owner).to(theta.device)
        self._counts = torch.tensor([float(p.numel()) for p in picks], device=theta.device)
        self._moved = torch.zeros(self._idx.numel(), device=theta.device)
        self._before: torch.Tensor | None = None
        # how the sample is read where ``theta`` is not the model's (a sharded node's ranks)
        self.read: Callable[[], torch.Tensor] | None = None

    @property
    def positions(self) -> torch.Tensor:
        """The sampled coordinates' positions in ``theta``."""
        return self._idx

    def read_with(self, read: Callable[[], torch.Tensor], device: torch.device) -> None:
        """Read the sample with ``read()`` (float32 values at :attr:`positions`, on
        ``device``) instead of from ``theta``; before the first step."""
        self.read = read
        self._owner, self._counts = self._owner.to(device), self._counts.to(device)
        self._moved = self._moved.to(device)

    def _values(self) -> torch.Tensor:
        if self.read is not None:
            return self.read()
        return self.theta.detach().index_select(0, self._idx).float()

    def before_step(self) -> None:
        self._before = self._values()

    def after_step(self) -> None:
        if self._before is None:
            return
        after = self._values()
        self._moved.add_(after).sub_(self._before)
        self._before = None

    def round_end(self) -> dict[int, float]:
        """Each fragment's RMS drift over the round now ending (one read); starts the next."""
        squares = torch.zeros_like(self._counts).index_add_(0, self._owner,
                                                            self._moved.square())
        rms = squares.div_(self._counts).sqrt_().to("cpu").tolist()
        self._moved.zero_()
        return dict(zip(self.indices, rms, strict=True))


def _flat_positions(fragment: Fragment, local: torch.Tensor) -> torch.Tensor:
    """Positions in the flat buffer of ``fragment``'s compact positions ``local`` (sorted)."""
    starts = torch.tensor([s for s, _ in fragment.ranges], dtype=torch.long)
    ends = torch.cumsum(torch.tensor([n for _, n in fragment.ranges], dtype=torch.long), 0)
    which = torch.searchsorted(ends, local, right=True)
    offset = local - (ends[which] - torch.tensor([n for _, n in fragment.ranges])[which])
    return starts[which] + offset
