"""What an :class:`~gasloc_p2p.protocol.session.ExchangeSession` asks its shell to do.

Each action but :class:`Send` and :class:`Done` names the session method the shell calls with
its result; :class:`Apply` must run to completion once started (it is the commit).
"""

from __future__ import annotations

from dataclasses import dataclass

from gasloc_p2p.core.codecs import CodecSpec, Encoded
from gasloc_p2p.core.links import Link
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.engine import Prepared


@dataclass(frozen=True)
class Outcome:
    """A committed exchange, as seen by one side."""

    peer_id: str
    fragment: int
    staleness: int  # round ends on both sides between snapshot and Ready
    weight: float
    correction_norm: float
    bytes_sent: int
    bytes_received: int
    numel: int  # elements of the fragment
    clip: float = 1.0  # the guard's factor already in ``weight`` (1: as is)
    clipped: bool = False  # the distance was beyond the guard's soft limit


@dataclass(frozen=True)
class Send:
    msg: pb.ExchangeMsg


@dataclass(frozen=True, eq=False)
class Prepare:
    """Run ``engine.prepare(peer_id, fragment, codec, link=link)``; then call ``prepared``."""

    peer_id: str
    fragment: int
    codec: CodecSpec
    link: Link | None = None  # a residual codec's link (core/links.py)


@dataclass(frozen=True)
class Admit:
    """Responder: may this node serve ``peer_id`` now? Call ``admitted`` or ``refused``."""

    peer_id: str


@dataclass(frozen=True, eq=False)
class SendPayload:
    """Stream ``payload`` as Chunks while reading goes on; call ``payload_sent`` on FlushPayload."""

    payload: bytes | bytearray | memoryview
    codec: CodecSpec


@dataclass(frozen=True, eq=False)
class Check:
    """Run ``engine.check`` (with ``prep``: also the bounded-update guard); then call
    ``checked`` (or ``check_failed`` on ValueError)."""

    codec: CodecSpec
    numel: int
    payload: bytearray | memoryview
    digest: bytes  # the SHA-256 the peer's signed Header announced
    prep: Prepared | None = None  # our half, for the guard
    seen_digest: bytes | None = None  # the SHA-256 of the bytes as they arrived (None: compute)


@dataclass(frozen=True)
class FlushPayload:
    """Wait (at most ``timeout_s``) until the whole payload is written; then ``payload_sent``."""

    timeout_s: float


@dataclass(frozen=True, eq=False)
class Apply:
    """Run ``engine.commit(prep, received, weight)`` and never interrupt it; then ``applied``."""

    prep: Prepared
    received: Encoded
    weight: float
    staleness: int


@dataclass(frozen=True)
class Done:
    outcome: Outcome


Action = Send | Prepare | Admit | SendPayload | Check | FlushPayload | Apply | Done
