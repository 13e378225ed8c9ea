"""Link references: what two peers hold in common so that gossip can send residuals (issue 40).

A residual payload (``half2``, ``sign1``) is not a parameter vector: it is ``Q(p - r)``, the
sender's public iterate less a reference ``r`` both ends of the link hold bit for bit, and decodes to
``r + D(m)``. The pair's correction is unchanged, ``w (D(m_j) - D(m_i))`` (the reference
cancels), so the pair's sum is kept exactly as with plain payloads. After every exchange both
ends move the reference to the middle of what was sent, ``r <- r + (D(m_i) + D(m_j)) / 2``
(CHOCO-gossip's public copy, one per pair): as the copy catches up, the residual shrinks and a
1-bit code of it loses little (docs/results/home-links-8.md). IEEE addition commutes, so both
ends compute the same bits from the same two messages in either order.

A link starts with a plain exchange (int8) whose two decoded messages seed ``r`` at their
middle, and carries a 32-byte state both ends chain over every exchange they commit:
``H(domain, state, the two payload digests, smaller first)``. Each residual exchange names the
state it was encoded against; an end that holds another (it missed a commit the other made, it
evicted the link, it restarted) refuses, the sender drops its side, and the pair's next
exchange seeds a new one (overwriting the other side's). So a link is never used out of step, and nothing a peer sends sizes it: a reference is
exactly our own fragment's size.

:class:`LinkCache` holds the references in host memory, at most ``capacity`` of them (least
recently used evicted first; ``gasloc-node plan`` counts ``capacity`` fragment-sized float32
copies). Pure tensors and bytes, no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

LINK_DOMAIN = b"gasloc/link/v1"
POSITIONS_DOMAIN = b"gasloc/link-positions/v1"
STATE_BYTES = 32
CHUNK = 1 << 20  # elements per pass of a host update: temporaries stay in cache


def position_seed(state: bytes) -> int:
    """The 32-bit seed of a seeded codec's positions (``half2``) for an exchange against a link
    at ``state``: both ends derive it, and it is new for every exchange (the state chains
    each commit's payloads)."""
    return int.from_bytes(hashlib.sha256(POSITIONS_DOMAIN + state).digest()[:4], "little")


def seed_state(digest_a: bytes, digest_b: bytes) -> bytes:
    """The state of a link seeded by an exchange of payloads with these digests."""
    return next_state(b"", digest_a, digest_b)


def next_state(state: bytes, digest_a: bytes, digest_b: bytes) -> bytes:
    """The state after an exchange of payloads with these digests (either order)."""
    low, high = sorted((digest_a, digest_b))
    return hashlib.sha256(LINK_DOMAIN + len(state).to_bytes(1, "little") + state + low
                          + high).digest()


Decode = Callable[[int, int, torch.Tensor], torch.Tensor]  # (pos, n, out) -> decoded chunk


@dataclass(eq=False)
class Link:
    """One pair's reference on one fragment: ``ref`` float32 [fragment numel] in host memory,
    the chained ``state``, and how many exchanges it has seen."""

    peer_id: str
    fragment: int
    ref: torch.Tensor
    state: bytes
    exchanges: int = 0

    def fold(self, mine: Decode, theirs: Decode, seed: bool, state: bytes) -> None:
        """Both decoded messages into the reference, chunk by chunk: ``r <- (a + b) / 2``
        (``seed``) or ``r <- r + (a + b) / 2``; then the new ``state``."""
        numel = self.ref.numel()
        a = torch.empty(min(CHUNK, numel))
        b = torch.empty_like(a)
        for pos in range(0, numel, CHUNK):
            n = min(CHUNK, numel - pos)
            mid = mine(pos, n, a[:n]).add_(theirs(pos, n, b[:n])).mul_(0.5)
            if seed:
                self.ref[pos : pos + n].copy_(mid)
            else:
                self.ref[pos : pos + n].add_(mid)
        self.state = state
        self.exchanges = 1 if seed else self.exchanges + 1


class LinkCache:
    """At most ``capacity`` links, least recently used evicted first; references in host
    memory (pinned with ``pin``, so a device copies chunks of them asynchronously)."""

    def __init__(self, capacity: int, pin: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"a link cache holds at least one link, got {capacity}")
        self.capacity, self.pin = capacity, pin
        self._links: OrderedDict[tuple[str, int], Link] = OrderedDict()

    def __len__(self) -> int:
        return len(self._links)

    def get(self, peer_id: str, fragment: int) -> Link | None:
        """The link with ``peer_id`` on ``fragment`` (now the most recently used), or None."""
        key = (peer_id, fragment)
        link = self._links.get(key)
        if link is not None:
            self._links.move_to_end(key)
        return link

    def state(self, peer_id: str, fragment: int) -> bytes:
        """The link's state, or empty bytes where there is none (does not count as a use)."""
        link = self._links.get((peer_id, fragment))
        return b"" if link is None else link.state

    def drop(self, peer_id: str, fragment: int) -> bool:
        """Forget the link (out of step with the peer's); whether there was one."""
        return self._links.pop((peer_id, fragment), None) is not None

    def slot(self, peer_id: str, fragment: int, numel: int) -> Link:
        """A link to be seeded: the existing one, else a new one, the least recently used
        evicted when the cache is full. Its reference is uninitialised until
        :meth:`Link.fold` with ``seed``. An evicted link's memory is not reused: an exchange
        in flight may still hold it (it folds into a link no longer kept; the peer's next
        residual payload against it is refused and the pair seeds again)."""
        key = (peer_id, fragment)
        link = self._links.pop(key, None)
        if link is None:
            if len(self._links) >= self.capacity:
                self._links.popitem(last=False)
            ref = torch.empty(numel, dtype=torch.float32, pin_memory=self.pin)
            link = Link(peer_id, fragment, ref, b"")
        self._links[key] = link
        return link

    @staticmethod
    def nbytes(capacity: int, numel: int) -> int:
        """Host bytes of ``capacity`` links on fragments of ``numel`` elements (for plan)."""
        return capacity * numel * 4
