"""Per-peer references with error feedback for quantized gossip (ALGORITHM.md section 4).

For each recent peer ``j`` node ``i`` keeps ``ref_out`` (= ref(i->j), the reconstruction of its
public iterate that ``j`` holds) and ``ref_in`` (= ref(j->i)). Both sides hold the pair
bit-identically: ``i``'s ``ref_out`` is ``j``'s ``ref_in`` and vice versa, because both add the
same decoded message to the same starting value. An exchange sends ``Q(p - ref_out)``; the
residual stays local and goes out next time. The mixing correction is computed from the two
references, so ``c_i = -c_j`` exactly and the network mean is kept despite quantization.

Nothing changes until ``commit``: a failed exchange leaves the link as it was. The ``version``
counts commits; two sides that disagree on it (one committed, the other did not, or one evicted
the link) reset the link to ``theta_0`` before exchanging.

Memory: two float32 vectors per link, ``2 * capacity`` model copies in all. :class:`LinkScheme`
is this as a :class:`ReferenceScheme` (the interface the exchange engine drives chunk by
chunk); :mod:`gasloc_p2p.core.feedback` has the per-node schemes whose memory does not grow
with the number of peers.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Iterable

import torch

from gasloc_p2p.core.codecs import Codec, Encoded
from gasloc_p2p.core.flat import Fragment, Piece


class PeerLink:
    """References shared with one peer, over the full flat parameter vector."""

    def __init__(self, theta0: torch.Tensor) -> None:
        self.ref_out = theta0.detach().clone()
        self.ref_in = theta0.detach().clone()
        self.version = 0

    def reset(self, theta0: torch.Tensor) -> None:
        self.ref_out.copy_(theta0)
        self.ref_in.copy_(theta0)
        self.version = 0

    def encode(self, public: torch.Tensor, fragment: Fragment, codec: Codec) -> Encoded:
        """``Q(p - ref_out)`` on one fragment; ``public`` is compact ``[fragment.numel]``."""
        return codec.encode(public - fragment.gather(self.ref_out))

    def commit(self, sent: Encoded, received: Encoded, fragment: Fragment, w: float) -> torch.Tensor:
        """Fold both messages into the references; return this side's correction ``c``.

        ``c = -w (ref_out - ref_in)`` over the fragment, compact ``[fragment.numel]``. The peer
        computes the exact negative. ``w = 0`` (a dropped exchange) still updates references,
        which both sides then agree on, and returns zeros.
        """
        if sent.numel != fragment.numel or received.numel != fragment.numel:
            raise ValueError(
                f"message size {sent.numel}/{received.numel} != fragment size {fragment.numel}"
            )
        fragment.add_(self.ref_out, decode(sent))
        fragment.add_(self.ref_in, decode(received))
        self.version += 1
        diff = fragment.gather(self.ref_in).sub_(fragment.gather(self.ref_out))
        return diff.mul_(w)


def decode(enc: Encoded) -> torch.Tensor:
    """Decode a message with the codec named in it (float32 ``[numel]``)."""
    return enc.spec.codec().decode(enc)


class ReferenceTable:
    """A bounded LRU of peer links; an evicted peer restarts from ``theta_0``."""

    def __init__(self, theta0: torch.Tensor, capacity: int = 8) -> None:
        """theta0 is kept by reference (not copied): the caller must never modify it."""
        if capacity < 1:
            raise ValueError("reference capacity must be >= 1 peer")
        self.theta0 = theta0.detach()
        self.capacity = capacity
        self._links: OrderedDict[str, PeerLink] = OrderedDict()

    def get(self, peer_id: str) -> PeerLink:
        link = self._links.get(peer_id)
        if link is None:
            if len(self._links) >= self.capacity:
                _, evicted = self._links.popitem(last=False)
                evicted.reset(self.theta0)  # reuse its memory
                link = evicted
            else:
                link = PeerLink(self.theta0)
            self._links[peer_id] = link
        self._links.move_to_end(peer_id)
        return link

    def version(self, peer_id: str) -> int:
        link = self._links.get(peer_id)
        return link.version if link is not None else 0

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self._links

    def __len__(self) -> int:
        return len(self._links)


class Sender(abc.ABC):
    """One exchange's outgoing side: turns snapshot chunks into the message."""

    @abc.abstractmethod
    def encode(self, pos: int, pieces: list[Piece], x: torch.Tensor, codec: Codec,
               out: Encoded) -> None:
        """``x``: the public iterate of the compact chunk at ``pos`` (clobbered); encode it
        into ``out``."""


class Folder(abc.ABC):
    """One exchange's commit: folds both decoded messages, chunk by chunk."""

    @abc.abstractmethod
    def fold(self, pieces: list[Piece], mine: torch.Tensor, theirs: torch.Tensor) -> None:
        """Decoded chunks of our message and the peer's; leave ``c / w`` in ``mine``.

        Must be exactly antisymmetric: the peer, folding (theirs, mine), gets ``-mine``.
        """

    def done(self) -> None:  # noqa: B027 (optional hook)
        """All chunks folded."""


class ReferenceScheme(abc.ABC):
    """What both sides of a link must agree on to encode and fold messages identically."""

    name: str

    def version(self, peer_id: str) -> int:
        """Commits on the link with ``peer_id`` (0 for schemes without per-peer state)."""
        return 0

    def __contains__(self, peer_id: str) -> bool:
        return False

    @abc.abstractmethod
    def sender(self, peer_id: str, reset: bool, chunk: int, fragment: Fragment) -> Sender: ...

    @abc.abstractmethod
    def folder(self, peer_id: str, reset: bool, pinned: Iterable[str] = ()) -> Folder: ...


class LinkScheme(ReferenceTable, ReferenceScheme):
    """Per-peer references (a :class:`ReferenceTable`): exact CHOCO-style error feedback."""

    name = "links"

    def sender(self, peer_id: str, reset: bool, chunk: int, fragment: Fragment) -> Sender:
        known = peer_id in self and not reset  # only a commit creates a link
        return _LinkSender(self.get(peer_id).ref_out if known else self.theta0)

    def folder(self, peer_id: str, reset: bool, pinned: Iterable[str] = ()) -> Folder:
        for other in pinned:  # in flight: creating this link must not evict theirs
            if other != peer_id and other in self:
                self.get(other)
        link = self.get(peer_id)
        if reset:
            link.reset(self.theta0)
        return _LinkFolder(link)


class _LinkSender(Sender):
    def __init__(self, ref_out: torch.Tensor) -> None:
        self.ref_out = ref_out

    def encode(self, pos: int, pieces: list[Piece], x: torch.Tensor, codec: Codec,
               out: Encoded) -> None:
        for start, length, o in pieces:
            x[o : o + length].sub_(self.ref_out[start : start + length])
        codec.encode_into(x, out)


class _LinkFolder(Folder):
    def __init__(self, link: PeerLink) -> None:
        self.link = link

    def fold(self, pieces: list[Piece], mine: torch.Tensor, theirs: torch.Tensor) -> None:
        out, inn = self.link.ref_out, self.link.ref_in
        for start, length, o in pieces:
            ref_out, ref_in = out[start : start + length], inn[start : start + length]
            ref_out.add_(mine[o : o + length])
            ref_in.add_(theirs[o : o + length])
            torch.sub(ref_in, ref_out, out=mine[o : o + length])

    def done(self) -> None:
        self.link.version += 1
