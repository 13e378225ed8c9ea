"""The node's outer algorithms by ``--algorithm`` name: adding a mode adds one entry here."""

from __future__ import annotations

from collections.abc import Callable

from gasloc_p2p.node.modes.base import Mode
from gasloc_p2p.node.modes.diloco import DilocoMode
from gasloc_p2p.node.modes.gossip import GossipMode

MODES: dict[str, Callable[[], Mode]] = {
    GossipMode.name: GossipMode,
    "diloco": lambda: DilocoMode("diloco"),
    "streaming-diloco": lambda: DilocoMode("streaming-diloco"),
}


def make_mode(algorithm: str) -> Mode:
    """A fresh mode for ``algorithm`` (``cfg.outer.algorithm``); ValueError if unknown."""
    try:
        return MODES[algorithm]()
    except KeyError:
        raise ValueError(f"unknown --algorithm {algorithm!r}: one of "
                         f"{', '.join(sorted(MODES))}") from None
