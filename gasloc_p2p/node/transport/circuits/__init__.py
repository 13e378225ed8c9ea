"""Relayed connections for nodes nobody can dial: a reachable node relays (:mod:`.hub`),
callers and listeners reach it over gRPC (:mod:`.client`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, Protocol


async def cancel_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until each has ended (their errors are dropped)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


class Peer(Protocol):
    """What the transport reads of a peer's record (discovery's PeerInfo)."""

    @property
    def peer_id(self) -> str: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def cert(self) -> bytes: ...
    @property
    def reachable(self) -> bool: ...
    @property
    def relayed(self) -> bool: ...
    @property
    def relays(self) -> tuple[str, ...]: ...
