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
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from gasloc_p2p.core.codecs import Codec, Encoded
from gasloc_p2p.core.flat import Fragment


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
        if capacity < 1:
            raise ValueError("reference capacity must be >= 1 peer")
        self.theta0 = theta0.detach().clone()
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
