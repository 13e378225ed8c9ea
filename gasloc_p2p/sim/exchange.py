"""In-memory pairwise exchanges for the simulator: exact, or quantized with references.

The quantized path is the one the daemon runs over gRPC (core PeerLink encode/commit), minus the
sockets; the exact path (codec "none") is for float64 equivalence checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gasloc_p2p.core.codecs import Encoded, get_codec
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.references import ReferenceTable


@dataclass
class Pending:
    """An exchange between snapshot and commit."""

    i: int
    j: int
    fragment: Fragment
    sent_i: Encoded | torch.Tensor
    sent_j: Encoded | torch.Tensor
    rounds_i: int = 0  # round counters at snapshot, for staleness
    rounds_j: int = 0


class Exchanger:
    """Computes both sides' corrections of pairwise exchanges among ``n`` workers."""

    def __init__(self, theta0: torch.Tensor, n: int, codec: str, capacity: int = 8) -> None:
        self.codec = None if codec == "none" else get_codec(codec)
        self.theta0 = theta0
        self.tables = [ReferenceTable(theta0, capacity=capacity) for _ in range(n)]
        self.elem_bytes = theta0.element_size()

    def begin(self, i: int, j: int, p_i: torch.Tensor, p_j: torch.Tensor,
              fragment: Fragment) -> Pending:
        """Snapshot (and encode) both public iterates ``p: [fragment.numel]``."""
        if self.codec is None:
            return Pending(i, j, fragment, p_i.clone(), p_j.clone())
        li, lj = self.tables[i].get(str(j)), self.tables[j].get(str(i))
        if li.version != lj.version:  # one side evicted the link: both restart from theta_0
            li.reset(self.theta0)
            lj.reset(self.theta0)
        return Pending(i, j, fragment, li.encode(p_i, fragment, self.codec),
                       lj.encode(p_j, fragment, self.codec))

    def payload_bytes(self, fragment: Fragment) -> int:
        """Bytes one side sends for this fragment, exactly as the wire payload carries them."""
        if self.codec is None:
            return fragment.numel * self.elem_bytes
        return self.codec.wire_bytes(fragment.numel)

    def commit(self, pend: Pending, w: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sides' corrections ``(c_i, c_j)``, with ``c_j = -c_i`` exactly."""
        if isinstance(pend.sent_i, torch.Tensor) and isinstance(pend.sent_j, torch.Tensor):
            c_i = (pend.sent_j - pend.sent_i).mul_(w)
            return c_i, -c_i
        assert isinstance(pend.sent_i, Encoded) and isinstance(pend.sent_j, Encoded)
        li = self.tables[pend.i].get(str(pend.j))
        lj = self.tables[pend.j].get(str(pend.i))
        c_i = li.commit(pend.sent_i, pend.sent_j, pend.fragment, w)
        c_j = lj.commit(pend.sent_j, pend.sent_i, pend.fragment, w)
        return c_i, c_j
