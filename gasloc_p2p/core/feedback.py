"""Reference schemes whose memory does not grow with the number of peers (issue 9).

Per-peer references (:mod:`gasloc_p2p.core.references`) cost two float32 model copies per link.
These schemes keep no per-peer state at all: a message is the public iterate itself,
quantized, ``m_i = Q(p_i + e_i)``, and both sides fold the two decoded messages into the same
correction ``c_i = -w (D(m_i) - D(m_j)) = -c_j`` (exact: one IEEE subtraction, negated by
swapping its operands, then the same multiplication), so the network mean is kept exactly.

- ``feedback``: ``e_i`` is one per-node error-feedback buffer: after encoding,
  ``e_i <- p_i + e_i - D(m_i)``. This is sigma-delta dithering of the state: over ``T``
  messages the mean of what was sent is ``p`` up to ``e_0 - e_T``, so deterministic rounding
  leaves no consensus floor. ``e`` is stored per fragment (compact), itself quantized (int8 with
  one float32 scale per 64 elements: 0.27 of a float32 model copy; its own rounding is 1/254 of
  the largest residual of a 64-element block). ``e`` is local state: it is updated when the
  message is encoded, and a failed exchange perturbs the dither by at most one quantization step.
- ``plain``: no feedback buffer (``e = 0``): stateless, no memory at all.

Both need no link versions (never a reset) and no ``theta_0`` after initialisation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gasloc_p2p.core.codecs import Codec, CodecSpec, Encoded
from gasloc_p2p.core.flat import Fragment, Piece
from gasloc_p2p.core.references import Folder, LinkScheme, ReferenceScheme, Sender

REFERENCE_SCHEMES = ("links", "feedback", "plain")
REFERENCE_CHOICES = ("auto", *REFERENCE_SCHEMES)  # auto: see resolve_references
FEEDBACK_SPEC = CodecSpec("int8", 64)  # how e is stored; chunks must be multiples of 64


class NodeFeedback(ReferenceScheme):
    """Quantized public iterates with one per-node error-feedback buffer (or none)."""

    def __init__(self, like: torch.Tensor, feedback: bool = True) -> None:
        """like: ``[numel]`` parameters (the device of the buffers)."""
        self.name = "feedback" if feedback else "plain"
        self.feedback = feedback
        self.device = like.device
        self.errors: dict[int, Encoded] = {}  # by fragment index, allocated at first use

    def sender(self, peer_id: str, reset: bool, chunk: int, fragment: Fragment) -> Sender:
        if not self.feedback:
            return _FeedbackSender(None, chunk)
        error = self.errors.get(fragment.index)
        if error is None or error.numel != fragment.numel:
            error = self.errors[fragment.index] = _zeros(fragment.numel, self.device)
        return _FeedbackSender(error, chunk)

    def folder(self, peer_id: str, reset: bool, pinned: Iterable[str] = ()) -> Folder:
        return _DiffFolder()


def _zeros(numel: int, device: torch.device) -> Encoded:
    """An int8 Encoded that decodes to zeros."""
    spec = FEEDBACK_SPEC
    n_blocks = -(-numel // spec.block_size)
    return Encoded(spec.name, numel, spec.block_size,
                   torch.zeros(numel, dtype=torch.uint8, device=device),
                   torch.zeros(n_blocks, dtype=torch.float32, device=device))


class _FeedbackSender(Sender):
    def __init__(self, error: Encoded | None, chunk: int) -> None:
        self.error = error
        self.codec = FEEDBACK_SPEC.codec()
        self.scratch = (torch.empty(chunk, device=error.data.device) if error is not None
                        else None)

    def encode(self, pos: int, pieces: list[Piece], x: torch.Tensor, codec: Codec,
               out: Encoded) -> None:
        if self.error is None or self.scratch is None:
            codec.encode_into(x, out)
            return
        n = x.numel()
        error = self.error.view(pos, n)
        x.add_(self.codec.decode(error, self.scratch[:n]))
        codec.encode_residual_into(x, out)  # x is now the residual x - D(m)
        self.codec.encode_into(x, error)


class _DiffFolder(Folder):
    def fold(self, pieces: list[Piece], mine: torch.Tensor, theirs: torch.Tensor) -> None:
        torch.sub(theirs, mine, out=mine)


def resolve_references(name: str, codec: str) -> str:
    """The scheme a node uses: ``auto`` is ``plain`` for every codec (``codec`` is kept so the
    choice can depend on it again). Measured at 1000 steps, n = 8, 3 seeds
    (docs/results/references.md, references-int4.md): at int8 the three schemes tie in loss
    (plain -0.016 +- 0.098 against feedback) and plain keeps workers closer (consensus 0.127
    against 0.212) with no buffer and the fewest passes per exchange; at int4 ``feedback``'s
    dither costs loss (+0.113 +- 0.098 against plain) and ``links`` gains a non-significant
    0.091 at 2 float32 model copies per peer. Nodes of a run resolve alike; a mismatch is
    refused in the exchange header."""
    del codec
    return "plain" if name == "auto" else name


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
