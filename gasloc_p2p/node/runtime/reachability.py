"""Whether peers can dial this node: dial-back probes by several peers, re-checked forever.

A node asks a peer to dial its announced endpoint back (``Info`` with ``probe_endpoint``). One
failed dial-back proves little (the helper may be overloaded, firewalled outbound, or lying),
so a node calls itself unreachable only after ``probes_needed`` failed dial-backs in a row,
asked of distinct peers within one check where it knows enough of them (else over successive
checks); one success makes it reachable again. Checks keep running while it is unreachable, and
helpers are any known peers, unreachable ones included: two nodes that once lost each other
re-check and recover on their own (they used to stop checking when no reachable peer was left).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger(__name__)

# ask(peer_id) -> True: it dialed us back; False: it tried and failed; None: no answer
Ask = Callable[[str], Awaitable[bool | None]]


class Reachability:
    """The reachable flag and the probe policy; :meth:`check` runs one round of probes."""

    def __init__(self, probes_needed: int, reachable: bool = True,
                 rng: random.Random | None = None) -> None:
        self.probes_needed = probes_needed
        self.reachable = reachable
        self.failed_in_a_row = 0
        self.checks = 0
        self.rng = rng or random.Random()

    async def check(self, helpers: Sequence[str], ask: Ask) -> bool:
        """Probe via up to ``probes_needed`` distinct random ``helpers`` (stopping at the first
        success); returns the reachable flag afterwards."""
        self.checks += 1
        order = list(helpers)
        self.rng.shuffle(order)
        for peer_id in order[: self.probes_needed]:
            answer = await ask(peer_id)
            if answer is None:  # the helper did not answer: that teaches nothing about us
                continue
            self._record(peer_id, answer)
            if answer or not self.reachable:
                break
        return self.reachable

    def _record(self, peer_id: str, ok: bool) -> None:
        if ok:
            self.failed_in_a_row = 0
            if not self.reachable:
                self.reachable = True
                log.info("peer %s dialed this node back: accepting exchanges again", peer_id)
            return
        self.failed_in_a_row += 1
        if self.reachable and self.failed_in_a_row >= self.probes_needed:
            self.reachable = False
            log.warning("%d dial-backs in a row failed (last by %s): gossiping by dialing out "
                        "only (as --client-mode) and re-checking; check --announce-host or the "
                        "firewall", self.failed_in_a_row, peer_id)
