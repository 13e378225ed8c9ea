"""Reference schemes whose memory does not grow with the number of peers (issue 9).

Per-peer references (:mod:`gasloc_p2p.core.references`) cost two float32 model copies per link.
These schemes keep no per-peer state at all: a message is the public iterate itself,
quantized, ``m_i = Q(p_i + e_i)``, and both sides fold the two decoded messages into the same
correction ``c_i = -w (D(m_i) - D(m_j)) = -c_j`` (exact: one IEEE subtraction, negated by
swapping its operands, then the same multiplication), so the network mean is kept exactly.

- ``feedback``: ``e_i`` is one per-node error-feedback buffer (bfloat16, half a model copy):
  after encoding, ``e_i <- p_i + e_i - D(m_i)``. This is sigma-delta dithering of the state: over
  ``T`` messages the mean of what was sent is ``p`` up to ``e_0 - e_T``, so deterministic
  rounding leaves no consensus floor. ``e`` is local state: it is updated when the message is
  encoded, and a failed exchange perturbs the dither by at most one quantization step.
- ``plain``: no feedback buffer (``e = 0``): stateless, no memory at all.

Both need no link versions (never a reset) and no ``theta_0`` after initialisation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gasloc_p2p.core.codecs import Codec, Encoded
from gasloc_p2p.core.flat import Piece
from gasloc_p2p.core.references import Folder, LinkScheme, ReferenceScheme, Sender

REFERENCE_SCHEMES = ("links", "feedback", "plain")
FEEDBACK_DTYPE = torch.bfloat16


class NodeFeedback(ReferenceScheme):
    """Quantized public iterates with one per-node error-feedback buffer (or none)."""

    def __init__(self, like: torch.Tensor, feedback: bool = True) -> None:
        """like: ``[numel]`` parameters (device and size of the buffer)."""
        self.name = "feedback" if feedback else "plain"
        self.error = (torch.zeros(like.numel(), dtype=FEEDBACK_DTYPE, device=like.device)
                      if feedback else None)

    def sender(self, peer_id: str, reset: bool, chunk: int) -> Sender:
        return _FeedbackSender(self.error, chunk)

    def folder(self, peer_id: str, reset: bool, pinned: Iterable[str] = ()) -> Folder:
        return _DiffFolder()


class _FeedbackSender(Sender):
    def __init__(self, error: torch.Tensor | None, chunk: int) -> None:
        self.error = error
        self.decoded = (torch.empty(chunk, device=error.device) if error is not None
                        else None)

    def encode(self, pieces: list[Piece], x: torch.Tensor, codec: Codec, out: Encoded) -> None:
        e = self.error
        if e is None or self.decoded is None:
            codec.encode_into(x, out)
            return
        for start, length, o in pieces:
            x[o : o + length].add_(e[start : start + length])
        codec.encode_into(x, out)
        residual = x.sub_(codec.decode(out, self.decoded[: x.numel()]))
        for start, length, o in pieces:
            e[start : start + length].copy_(residual[o : o + length])


class _DiffFolder(Folder):
    def fold(self, pieces: list[Piece], mine: torch.Tensor, theirs: torch.Tensor) -> None:
        torch.sub(theirs, mine, out=mine)


def make_scheme(name: str, theta0: torch.Tensor, capacity: int) -> ReferenceScheme:
    """The scheme called ``name`` (one of :data:`REFERENCE_SCHEMES`) for a node.

    theta0: ``[numel]`` initial parameters (kept by reference by ``links``; the others only read
    its size and device). capacity: peers with references (``links`` only).
    """
    if name == "links":
        return LinkScheme(theta0, capacity)
    if name in ("feedback", "plain"):
        return NodeFeedback(theta0, feedback=name == "feedback")
    raise ValueError(f"unknown reference scheme {name!r}; choose one of {REFERENCE_SCHEMES}")
