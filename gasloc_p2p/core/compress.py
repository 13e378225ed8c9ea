"""Compression schemes over the sparse payloads (:mod:`gasloc_p2p.core.sparse`), issue 24.

Gossip (a pairwise exchange of public iterates ``p_i``, ``p_j``). Each side sends
``m_i = C(p_i - r)`` against a reference ``r`` both sides hold bit-identically, and both fold
the two decoded messages into one correction (docs/algorithm.md, section 4):

    c_i = w (D(m_j) - D(m_i)),   c_j = w (D(m_i) - D(m_j)) = -c_i   (bit for bit)

so a committed exchange keeps the pair's sum whatever the compression lost. What the message
leaves out is never lost for good: the state still holds it and sends it another time.

- reference ``theta0`` (:func:`gossip_message` with ``theta0``): the initial parameters, which
  every node holds. No state. With ``randk`` both sides draw the same positions from a shared
  seed, so the correction averages exactly the sent coordinates; with ``topk`` the supports
  differ and a coordinate only one side sent is pulled towards the reference there.
- reference ``link`` (:class:`LinkReference`): one vector per pair of peers, starting at
  ``theta0``, which both update by the mean of the two decoded messages: after an exchange at
  ``w = 1/2`` each side's residual ``p - r`` is exactly what its message left out (CHOCO-gossip
  per link: an implicit error feedback). Costs one model copy per link.

DiLoCo (an all-gather of outer gradients): :class:`ErrorFeedback`, SparseLoCo's per-node
accumulator ``e <- beta e + delta``; send ``m = C(e)``; ``e <- e - D(m)``. Every node applies
the mean of the same decoded messages, so replicas stay identical; what a message left out
waits in ``e`` (on the host, like the rest of the outer state) and is sent later.
"""

from __future__ import annotations

import torch

from gasloc_p2p.core import sparse
from gasloc_p2p.core.bitpack import seeded_hash
from gasloc_p2p.core.codecs import CodecSpec, parse_optional
from gasloc_p2p.core.modulo import ModuloSpec
from gasloc_p2p.core.sparse import SELECTIONS, SparsePayload, SparseSpec

REFERENCES = ("theta0", "link")
PayloadSpec = CodecSpec | SparseSpec | ModuloSpec


def parse_codec(text: str) -> PayloadSpec | None:
    """A payload spec from its text: ``none`` (exact, simulator only), a block codec
    (``int8:1024``, ``fp32``, ...) or a sparse one (``topk2:41``, ``randk8:123``, ``dense2``).
    ValueError for anything else."""
    if text.startswith(SELECTIONS):
        return SparseSpec.parse(text)
    if text.startswith("mod"):
        return ModuloSpec.parse(text)
    return parse_optional(text)


def exchange_seed(*parts: int) -> int:
    """A 32-bit seed for randk positions from integers both sides know (a run seed, the
    pair, an exchange counter): the same on every peer."""
    seed = 0
    for part in parts:
        seed = int(seeded_hash(seed ^ (part & ((1 << 64) - 1)), 1)[0])
    return seed


def gossip_message(spec: SparseSpec, p: torch.Tensor, reference: torch.Tensor,
                   seed: int) -> SparsePayload:
    """This side's message: ``C(p - reference)`` (both float [numel], same device)."""
    return sparse.encode(spec, p.float() - reference.float(), seed)


def pair_correction(mine: SparsePayload, theirs: SparsePayload, w: float) -> torch.Tensor:
    """``w (D(theirs) - D(mine))``: dense float32 [numel]. The other side computes the same
    expression with the operands swapped, which is the exact negative (IEEE subtraction and
    multiplication are sign-symmetric)."""
    if (mine.spec, mine.numel) != (theirs.spec, theirs.numel):
        raise ValueError(f"messages differ: {mine.spec}/{mine.numel} and "
                         f"{theirs.spec}/{theirs.numel}")
    return sparse.decode(theirs).sub_(sparse.decode(mine)).mul_(w)


class LinkReference:
    """The reference one pair of peers shares (float32 [numel], on ``device``), starting at
    ``theta0``; both sides hold it bit for bit and update it identically."""

    def __init__(self, theta0: torch.Tensor, device: torch.device | str | None = None) -> None:
        self.ref = theta0.detach().to(device or theta0.device, torch.float32, copy=True)
        self.exchanges = 0

    def update(self, a: SparsePayload, b: SparsePayload) -> None:
        """After an exchange of ``a`` and ``b`` (either order: addition commutes bit for bit):
        ``r <- r + (D(a) + D(b)) / 2``."""
        self.ref.add_(sparse.decode(a).add_(sparse.decode(b)).mul_(0.5))
        self.exchanges += 1


class ErrorFeedback:
    """SparseLoCo's accumulator for one node and one fragment: float32 [numel] on ``device``
    (the host, like the rest of the outer state), allocated only by schemes that use it."""

    def __init__(self, spec: SparseSpec, numel: int, beta: float = 1.0,
                 device: torch.device | str = "cpu") -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"error-feedback decay beta must be in [0, 1], got {beta}")
        self.spec, self.beta = spec, beta
        self.error = torch.zeros(numel, dtype=torch.float32, device=device)

    def compress(self, delta: torch.Tensor, seed: int = 0) -> SparsePayload:
        """Accumulate ``delta`` (float [numel]) and return the message; what it leaves out
        stays in the accumulator."""
        if self.beta != 1.0:
            self.error.mul_(self.beta)
        self.error.add_(delta.to(self.error.device, torch.float32))
        msg = sparse.encode(self.spec, self.error, seed)
        pos = sparse.positions(msg)
        self.error.index_put_((pos,), self.error[pos] - sparse.values(msg))
        return msg


def mean_of(messages: list[SparsePayload]) -> torch.Tensor:
    """The mean of the decoded messages (float32 [numel]), summed in list order: every node of
    an all-gather that sorts the messages the same way (e.g. by peer) gets the same bits."""
    if not messages:
        raise ValueError("no messages to average")
    total = sparse.decode(messages[0])
    for msg in messages[1:]:
        total.index_put_((sparse.positions(msg),), sparse.values(msg), accumulate=True)
    return total.div_(len(messages))
