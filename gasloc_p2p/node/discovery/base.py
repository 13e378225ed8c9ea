"""Peer discovery: a small seam with an in-memory implementation and a hivemind DHT one.

Each node announces a :class:`PeerInfo` under the run-scoped key ``gasloc/{run_id}/peers`` with
its peer id as subkey and an expiration (TTL) that the node refreshes periodically; listing
reads the whole key (``latest=True``). Records are signed by their owner and checked on every
read (:mod:`gasloc_p2p.node.discovery.records`): a discovery given the node's key
(:meth:`Discovery.use_identity`) announces under the key's peer id. hivemind's DHT runs in a child process and its calls
block on a pipe, so :class:`HivemindDiscovery` makes every call from a worker thread with a
bounded wait: the event loop never blocks on the DHT.
"""

from __future__ import annotations

import abc
import logging
import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gasloc_p2p.protocol.auth import Signer, Verifier
from gasloc_p2p.protocol.certs import MAX_CERT_BYTES
from gasloc_p2p.protocol.membership import RevocationList

log = logging.getLogger(__name__)
MAX_RELAYS = 4  # relays one record may name
_PEER_ID = re.compile(r"^g1[a-z2-7]{16,64}$")


def run_key(run_id: str) -> str:
    return f"gasloc/{run_id}/peers"


def revocation_key(run_id: str) -> str:
    """Where a closed swarm's owner publishes its revocation list (subkey: the owner, hex)."""
    return f"gasloc/{run_id}/revoked"


@dataclass(frozen=True)
class PeerInfo:
    """What a node announces. ``endpoint`` is its gRPC ``host:port``, ``cert`` the TLS
    certificate (DER) it serves there, which names its peer id."""

    peer_id: str
    endpoint: str
    protocol_version: int
    fingerprint: str
    step: int = 0
    tokens_per_s: float = 0.0
    reachable: bool = True
    codecs: tuple[str, ...] = field(default_factory=tuple)
    algorithm: str = "gasloc"  # --algorithm: gasloc and diloco nodes never train together
    cert: bytes = field(default=b"", repr=False)
    # a node nobody can dial (behind a router): the peers that relay for it (peer ids; it
    # holds a Listen call open at each, gasloc_p2p.node.transport.circuits)
    relays: tuple[str, ...] = ()

    @property
    def relayed(self) -> bool:
        """Reachable only through a relay (behind a router, listening at one)."""
        return not self.reachable and bool(self.relays)

    def to_value(self) -> dict[str, Any]:
        """The DHT value (msgpack-friendly; the peer id is the subkey)."""
        value = asdict(self)
        del value["peer_id"]
        value["codecs"] = list(self.codecs)
        value["relays"] = list(self.relays)
        return value

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> PeerInfo | None:
        """Parse an announcement; None if it is malformed (another program, older format)."""
        try:
            return cls(peer_id=str(peer_id), endpoint=str(value["endpoint"]),
                       protocol_version=int(value["protocol_version"]),
                       fingerprint=str(value["fingerprint"]), step=int(value["step"]),
                       tokens_per_s=float(value["tokens_per_s"]),
                       reachable=bool(value["reachable"]),
                       codecs=tuple(str(c) for c in value["codecs"]),
                       algorithm=str(value.get("algorithm", "gasloc")),
                       cert=_cert(value.get("cert", b"")),
                       relays=_relays(value.get("relays", [])))
        except (KeyError, TypeError, ValueError):
            return None


def _relays(value: Any) -> tuple[str, ...]:
    if (not isinstance(value, list) or len(value) > MAX_RELAYS
            or not all(isinstance(v, str) and _PEER_ID.match(v) for v in value)):
        raise ValueError("malformed relays")
    return tuple(value)


def _cert(value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) > MAX_CERT_BYTES:
        raise ValueError("malformed certificate")
    return value


class Discovery(abc.ABC):
    """Where nodes of one run find each other. ``stop`` is safe to call twice."""

    peer_id: str
    dht_peer_id: str = ""  # the DHT's own (libp2p) id, for bootstrap multiaddrs; "" in memory
    signer: Signer | None = None
    max_ttl_s: float = 60.0

    def use_identity(self, signer: Signer, max_ttl_s: float) -> None:
        """Before :meth:`start`: announce as ``signer``'s peer id (records signed with it) and
        accept records that expire at most ``max_ttl_s`` ahead."""
        self.signer, self.peer_id, self.max_ttl_s = signer, signer.peer_id, max_ttl_s

    @property
    def verifier(self) -> Verifier:
        """Checks records with this node's swarm key (none without an identity)."""
        return self.signer if self.signer is not None else Verifier()

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def announce(self, info: PeerInfo, ttl_s: float) -> None:
        """Publish (or refresh) this node's entry; it expires after ``ttl_s`` seconds."""

    @abc.abstractmethod
    async def peers(self) -> list[PeerInfo]:
        """Every live entry of the run, this node's own included."""

    async def serve_manifest(self, text: str) -> None:  # noqa: B027
        """Answer other nodes' requests for this node's run manifest with ``text``."""

    async def ask_manifest(self, dht_peer_id: str) -> str:
        """The run manifest the node with DHT id ``dht_peer_id`` serves ("" if none)."""
        return ""

    async def revocations(self) -> RevocationList | None:
        """The newest revocation list this swarm's owner signed that the DHT holds (None:
        none, or not a closed swarm)."""
        return None

    async def publish_revocations(self, rl: RevocationList) -> None:  # noqa: B027
        """Store ``rl`` (until its signed expiry); nodes re-publish the newest they know."""

    @abc.abstractmethod
    async def visible_addrs(self) -> list[str]:
        """Addresses other nodes can bootstrap from (multiaddrs for the DHT)."""

    @abc.abstractmethod
    async def stop(self) -> None: ...

    def averaging_backend(self) -> Any | None:
        """The running ``hivemind.DHT`` that hivemind averaging (``--algorithm diloco``) can
        share, or None when this discovery runs none (in-memory: inject an averager)."""
        return None


class CompatibilityFilter:
    """Keeps peers this node can exchange with; logs each incompatible peer once."""

    def __init__(self, protocol_version: int, fingerprint: str, self_id: str,
                 algorithm: str = "gasloc") -> None:
        self.protocol_version = protocol_version
        self.fingerprint = fingerprint
        self.self_id = self_id
        self.algorithm = algorithm
        self._logged: set[str] = set()

    def __call__(self, peers: Sequence[PeerInfo]) -> list[PeerInfo]:
        out = []
        for p in peers:
            if p.peer_id == self.self_id:
                continue
            why = self.incompatibility(p)
            if why is None:
                out.append(p)
            elif p.peer_id not in self._logged:
                if len(self._logged) >= 1024:  # ids are cheap to mint: bound the memory
                    self._logged.clear()
                self._logged.add(p.peer_id)
                log.warning("ignoring peer %s at %s: %s", p.peer_id, p.endpoint, why)
        return out

    def incompatibility(self, p: PeerInfo) -> str | None:
        if p.protocol_version != self.protocol_version:
            return (f"it speaks protocol {p.protocol_version}, this node "
                    f"{self.protocol_version} (upgrade the older one)")
        if p.fingerprint != self.fingerprint:
            return (f"its model fingerprint {p.fingerprint[:12]} differs from "
                    f"{self.fingerprint[:12]} (same --seed and model flags needed)")
        if p.algorithm != self.algorithm:
            return (f"it runs --algorithm {p.algorithm}, this node {self.algorithm} (use the "
                    "same algorithm, or another --run-id to run both side by side)")
        return None


class InMemoryRegistry:
    """A process-local stand-in for the DHT, shared by :class:`InMemoryDiscovery` objects:
    ``entries[key][subkey] = (value, expiration)`` with ``time.monotonic()`` expirations. Like
    a DHT without validators it stores anything (tests write forged records into it); readers
    check the signatures."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, tuple[Any, float]]] = {}


class InMemoryDiscovery(Discovery):
    """Discovery through an :class:`InMemoryRegistry` (tests, single-process swarms)."""

    def __init__(self, registry: InMemoryRegistry, run_id: str, peer_id: str) -> None:
        self.registry = registry
        self.key = run_key(run_id)
        self.revoked_key = revocation_key(run_id)
        self.peer_id = peer_id

    async def start(self) -> None:
        self.registry.entries.setdefault(self.key, {})

    async def announce(self, info: PeerInfo, ttl_s: float) -> None:
        from gasloc_p2p.node.discovery.records import signed_value  # records imports PeerInfo

        assert self.signer is not None, "use_identity first: records are signed"
        expires = time.monotonic() + ttl_s
        self.registry.entries[self.key][info.peer_id] = (
            signed_value(self.key, info, self.signer, expires), expires)

    async def peers(self) -> list[PeerInfo]:
        from gasloc_p2p.node.discovery.records import verify_record

        now = time.monotonic()
        found = [verify_record(self.key, sub, value, exp, self.verifier, now, self.max_ttl_s)
                 for sub, (value, exp) in self.registry.entries.get(self.key, {}).items()
                 if exp > now]
        return [info for info in found if info is not None]

    async def serve_manifest(self, text: str) -> None:
        self.registry.entries.setdefault("manifests", {})[self.peer_id] = (text, math.inf)

    async def ask_manifest(self, dht_peer_id: str) -> str:
        return str(self.registry.entries.get("manifests", {}).get(dht_peer_id, ("", 0))[0])

    async def revocations(self) -> RevocationList | None:
        admission = self.verifier.admission
        if admission is None:
            return None
        value, _ = self.registry.entries.get(self.revoked_key, {}).get(
            admission.owner.hex(), (None, 0.0))
        return RevocationList.from_value(value, admission.owner)

    async def publish_revocations(self, rl: RevocationList) -> None:
        self.registry.entries.setdefault(self.revoked_key, {})[rl.owner.hex()] = (
            rl.to_value(), time.monotonic() + 3600.0)

    async def visible_addrs(self) -> list[str]:
        return [f"/memory/{self.peer_id}"]

    async def stop(self) -> None:
        self.registry.entries.get(self.key, {}).pop(self.peer_id, None)
