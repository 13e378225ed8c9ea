"""Which downloaded state a joining node adopts: never one donor's word, nor a few colluders'.

A peer's announced step is self-declared, so it does not choose the donor (a fake record
announcing a huge step would otherwise hand every joining node its state). The node downloads
from up to a handful of donors, measures each state on a private random sample of coordinates
(:class:`Sampler`, drawn here: a donor cannot know where it is looked at) and adopts a state
only when at least three donors (all of them, if fewer answer) agree pairwise: the RMS of
their difference is at most ``AGREEMENT_TOL`` times the *smaller* of their displacements from
``theta_0``. Honest nodes of one swarm are far closer to each other than to ``theta_0``; a
poisoned state is not close to them, and a donor can only shrink the tolerance it is judged
by, never widen it (the rule before took the larger displacement: a far poisoned state widened
its own tolerance). Of the agreeing group the node adopts the state with the lowest loss on
its own validation batches (measured here for every donor that answered: announced figures
never rank a state), and none if that loss is more than ``LOSS_MARGIN`` above the best state
any donor served (:func:`pick`): two colluders that serve the honest state plus a push inside
the agreement tolerance agree with an honest donor, and were adopted (issue 39) although their
state's loss here was 5.55 against the honest donor's 2.43.

Before keeping it, the node evaluates the state on its own validation batches: a loss above
``theta_0``'s, or implausibly far above what its donor announces for the same validation set,
sends it back to ``theta_0`` (:func:`implausible_loss`; only the chosen donor's own figure:
colluders that announced a low loss once sent an honest state back to ``theta_0``). A state that starts
from ``theta_0`` is then protected by the bounded updates while gossip brings it in.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from dataclasses import dataclass

import torch

from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb

AGREEMENT_TOL = 0.5
MAX_ABS_VALUE = 1e6  # as the exchange engine's limit on decoded values
SKETCH_SIZE = 1 << 16  # sampled coordinates: RMS estimates within about 1%
NEED_AGREEING = 3
LOSS_FACTOR, LOSS_SLACK = 1.2, 0.05  # a state's loss here vs the donors' announced median
LOSS_MARGIN = 0.02  # the adopted state's loss here at most this far above the best donor's
_CHUNK = 1 << 24  # elements per pass over a full vector (bounded temporaries)


@dataclass(eq=False)
class Candidate:
    """One donor's downloaded state: public iterate and its outer optimizer's buffers by name
    (none at gamma 0), float32 ``[numel]`` each; ``params`` None (and ``outer`` empty) once
    dropped to save host memory (the sample stays). ``sketch`` (float64 ``[SKETCH_SIZE]``) and
    ``displacement`` (RMS from ``theta_0``) come from :meth:`Sampler.measure`;
    ``announced_loss`` is the donor's own validation loss when its validation set is this
    node's (else NaN)."""

    peer_id: str
    step: int
    params: torch.Tensor | None
    outer: dict[str, torch.Tensor]
    meta: pb.StateMeta
    sketch: torch.Tensor | None = None
    displacement: float = math.nan
    announced_loss: float = math.nan
    own_loss: float = math.nan  # its validation loss on this node's batches (NaN: unknown)


def problem(c: Candidate, numel: int) -> str:
    """Why a downloaded state is unusable on its own ("" if it is fine)."""
    for name, t in (("params", c.params), *((f"outer {k}", v) for k, v in c.outer.items())):
        if t is None:
            continue
        if t.shape != (numel,):
            return f"{name} has {t.numel()} values, this model {numel}"
        hi, lo = float(t.amax()), float(t.amin())
        if not (math.isfinite(hi) and math.isfinite(lo)):
            return f"{name} holds NaN or Inf"
        if max(hi, -lo) > MAX_ABS_VALUE:
            return f"{name} holds values up to {max(hi, -lo):.3g}"
    return ""


def rms(t: torch.Tensor) -> float:
    return float(t.double().norm()) / math.sqrt(max(t.numel(), 1))


class Sampler:
    """A private random sample of ``numel`` coordinates (drawn from the OS's randomness, so no
    donor can predict it) and ``theta_0`` there."""

    def __init__(self, theta0: torch.Tensor, size: int = SKETCH_SIZE) -> None:
        numel = theta0.numel()
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        self.index = (torch.randperm(numel, generator=gen)[:size] if numel <= size
                      else torch.randint(numel, (size,), generator=gen))
        self.theta0 = theta0

    def measure(self, c: Candidate) -> None:
        """Set ``c.sketch`` and ``c.displacement`` (one pass over its full vector)."""
        assert c.params is not None
        c.sketch = c.params[self.index].double()
        total = 0.0
        for start in range(0, c.params.numel(), _CHUNK):
            part = self.theta0[start:start + _CHUNK].to("cpu", torch.float64)
            total += float((c.params[start:start + _CHUNK].double() - part).square().sum())
        c.displacement = math.sqrt(total / max(c.params.numel(), 1))


def distance(a: Candidate, b: Candidate) -> float:
    """The sampled RMS distance of two measured candidates."""
    assert a.sketch is not None and b.sketch is not None
    return rms(a.sketch - b.sketch)


def agree(a: Candidate, b: Candidate, tol: float = AGREEMENT_TOL) -> bool:
    """Whether two measured donors' states are close relative to the smaller progress."""
    return distance(a, b) <= tol * min(a.displacement, b.displacement)


def needed(answered: int) -> int:
    """Donors that must agree when ``answered`` gave a usable state: three, or all of them
    when fewer answered (one alone is adopted unverified, after the loss check)."""
    return min(NEED_AGREEING, answered)


def choose(cands: list[Candidate], need: int) -> tuple[Candidate, list[Candidate]] | None:
    """The medoid of the largest group of at least ``need`` candidates that pairwise agree
    (of equal groups, the tightest), and that group; None if there is none. The donor order
    does not matter."""
    for size in range(len(cands), max(need, 1) - 1, -1):
        groups = [g for g in itertools.combinations(cands, size)
                  if all(agree(a, b) for a, b in itertools.combinations(g, 2))]
        if groups:
            group = min(groups, key=_spread)
            medoid = min(group, key=lambda c: sum(distance(c, o) for o in group))
            return medoid, list(group)
    return None


def pick(group: list[Candidate], answered: list[Candidate]
         ) -> tuple[Candidate | None, str]:
    """The state of ``group`` (donors that agree) to adopt: the one with the lowest loss on
    this node's batches; None, with the reason, if that loss is more than ``LOSS_MARGIN``
    above the best of every donor that ``answered`` (or unknown while another's is known)."""
    def loss(c: Candidate) -> float:
        return c.own_loss if math.isfinite(c.own_loss) else math.inf

    chosen = min(group, key=loss)
    best = min(answered, key=loss)
    if loss(best) == math.inf or loss(chosen) <= (1 + LOSS_MARGIN) * loss(best):
        return chosen, ""
    return None, (f"the agreeing donors' best state has validation loss {loss(chosen):.4f} "
                  f"here, more than {LOSS_MARGIN:.0%} above {loss(best):.4f} of "
                  f"another donor's")


def _spread(group: tuple[Candidate, ...]) -> float:
    return sum(distance(a, b) for a, b in itertools.combinations(group, 2))


def implausible_loss(loss: float, start_loss: float, announced: list[float]) -> str:
    """Why a state whose validation loss here is ``loss`` is refused ("" if it is not):
    not finite, above ``theta_0``'s loss here (``start_loss``), or above ``LOSS_FACTOR``
    times the median of what its group's donors announce (NaN entries: another validation
    set) plus ``LOSS_SLACK``."""
    if not math.isfinite(loss):
        return f"its validation loss here is {loss}"
    if loss > start_loss:
        return f"its validation loss here {loss:.4f} is above theta_0's {start_loss:.4f}"
    said = [x for x in announced if math.isfinite(x)]
    if said:
        limit = LOSS_FACTOR * statistics.median(said) + LOSS_SLACK
        if loss > limit:
            return (f"its validation loss here {loss:.4f} is far above what its donors "
                    f"announce (median {statistics.median(said):.4f})")
    return ""
