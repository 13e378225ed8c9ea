"""Which downloaded state a joining node adopts: never one donor's word alone.

A peer's announced step is self-declared, so it does not choose the donor (a fake record
announcing a huge step would otherwise hand every joining node its state). The node downloads
from donors in random order and adopts a state only once two donors agree: the RMS of their
difference is at most ``tol`` times the larger RMS displacement from ``theta_0`` (honest nodes
of one swarm are near consensus, far closer to each other than to ``theta_0``; a poisoned state
is not). With a single compatible peer there is nothing to compare: its state is adopted if it
is finite and bounded, and the log says it is unverified. Otherwise, donors that disagree mean
starting from ``theta_0``: bounded updates then protect the node while gossip brings it in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb

AGREEMENT_TOL = 0.5
MAX_ABS_VALUE = 1e6  # as the exchange engine's limit on decoded values


@dataclass(frozen=True, eq=False)
class Candidate:
    """One donor's downloaded state: public iterate and outer memory (None: the donor keeps
    none), float32 ``[numel]``."""

    peer_id: str
    step: int
    params: torch.Tensor
    memory: torch.Tensor | None
    meta: pb.StateMeta


def problem(c: Candidate, numel: int) -> str:
    """Why a downloaded state is unusable on its own ("" if it is fine)."""
    for name, t in (("params", c.params), ("memory", c.memory)):
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
    return float(t.norm()) / math.sqrt(max(t.numel(), 1))


def agree(a: Candidate, b: Candidate, theta0: torch.Tensor, tol: float = AGREEMENT_TOL) -> bool:
    """Whether two donors' public iterates are close relative to their progress."""
    theta0 = theta0.to(a.params.device, torch.float32)  # downloads are on the host
    scale = max(rms(a.params - theta0), rms(b.params - theta0))
    return rms(a.params - b.params) <= tol * scale


def choose(states: list[Candidate], theta0: torch.Tensor) -> Candidate | None:
    """The state to adopt among ``states``: the later of the first agreeing pair, or None."""
    for i, a in enumerate(states):
        for b in states[i + 1:]:
            if agree(a, b, theta0):
                return a if a.step >= b.step else b
    return None
