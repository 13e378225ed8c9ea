"""Node configuration: the network and discovery sections (see :mod:`gasloc_p2p.node.config`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from gasloc_p2p.core.options import ConfigError, need, opt
from gasloc_p2p.protocol.auth import read_swarm_key
from gasloc_p2p.protocol.membership import read_invitation, read_key_file
from gasloc_p2p.protocol.messages import MAX_CHUNK_BYTES


@dataclass(frozen=True)
class NetworkConfig:
    """The gRPC server and channels."""

    host: str = opt("0.0.0.0", "listen address for gRPC and the DHT")
    port: int = opt(0, "gRPC port (0: any free port)")
    announce_host: str = opt("", "address peers should dial (empty: guessed from --host/DHT)")
    client_mode: bool = opt(False, "behind a router (NAT): dial out only, and take exchanges "
                                   "through a reachable peer that relays (--relay)")
    max_message_bytes: int = opt(MAX_CHUNK_BYTES + 64 * 1024, "gRPC message size limit", advanced=True)
    keepalive_time_s: float = opt(20.0, "HTTP/2 keepalive ping interval", advanced=True)
    keepalive_timeout_s: float = opt(10.0, "close a connection whose ping is unanswered this long", advanced=True)
    connect_timeout_s: float = opt(5.0, "wait for a TCP/HTTP2 connection to a peer", advanced=True)
    info_timeout_s: float = opt(5.0, "deadline of a unary Info call", advanced=True)
    stop_grace_s: float = opt(3.0, "on stop, let running RPCs finish this long", advanced=True)
    stop_deadline_s: float = opt(120.0, "a stop (signal or limit) still running after this "
                                 "long writes every thread's stack to stderr and exits 1 (0: "
                                 "no deadline; raise it if a final checkpoint takes longer)", advanced=True)
    max_channels: int = opt(32, "cached client channels to peers (LRU)", advanced=True)
    reachability_interval_s: float = opt(
        60.0, "ask a random peer to dial this node back this often (0: never); if it cannot, "
        "the node gossips by dialing out only, as with --client-mode", advanced=True)
    reachability_probes: int = opt(3, "unreachable only after this many dial-backs by distinct "
                                      "peers failed in a row (and none succeeded)", advanced=True)
    swarm_key: str = opt("", "file with the swarm's shared secret (>= 16 bytes): without it "
                             "nobody can exchange, download state or publish accepted records",
                         group="security")
    invitation: str = opt("", "invitation file from the swarm's owner (`gasloc-node invite`): "
                              "this node's membership, and its key if the owner made it",
                          group="security")
    owner_key: str = opt("", "this node owns the swarm: file with the owner's ed25519 key "
                             "(created if missing; `gasloc-node invite` signs invitations with "
                             "it). Default for a node that starts a closed swarm: "
                             "$XDG_DATA_HOME/gasloc_p2p/owner.key", group="security")
    open_swarm: bool = opt(False, "an open swarm: any key may join (no invitation or swarm "
                                  "key); strangers can then exchange and download the model",
                           flag="--open", group="security")
    identity_file: str = opt("", "file with this node's ed25519 key, created if missing, so "
                                 "its peer id survives restarts (empty: a new key at each start)",
                             group="security")
    auth_skew_s: float = opt(120.0, "accept signed requests whose time is this close to ours", advanced=True)
    preauth_streams: int = opt(8, "calls waiting for their first message (an Exchange: a "
                                  "valid Header); a new one displaces the oldest of the "
                                  "address block holding the most", advanced=True)
    preauth_timeout_s: float = opt(3.0, "a new connection must send a byte and finish its TLS "
                                        "handshake, and a new call send its first message (an "
                                        "Exchange: a valid Header), within this", advanced=True)
    max_connections: int = opt(256, "inbound connections held at once; when full, a "
                                    "newcomer from a less busy address block (/24, /48) "
                                    "displaces one of the busiest block's", advanced=True)
    connections_per_block: int = opt(32, "inbound connections held at once from one address "
                                         "block (/24, /48)", advanced=True)
    max_streams_per_connection: int = opt(16, "calls one inbound connection may carry at "
                                              "once (HTTP/2 SETTINGS)", advanced=True)
    relay: bool = opt(True, "relay the exchanges of nodes behind routers (--client-mode) "
                            "with each other: it costs this node their bytes, up and down "
                            "(at most --relay-connections at once)", advanced=True)
    relay_connections: int = opt(32, "relayed connections at once (a quarter of them per "
                                     "caller's address block)", advanced=True)
    relay_listeners: int = opt(64, "nodes behind routers waiting for callers here at once",
                               advanced=True)
    relay_mb: int = opt(1024, "bytes each way one relayed connection may carry, in MiB",
                        advanced=True)
    relay_minutes: float = opt(30.0, "how long one relayed connection may last", advanced=True)
    hole_punch: bool = opt(True, "open direct connections with peers behind routers by TCP "
                                 "hole punching (both dial at once); their relayed path "
                                 "stays where it fails", advanced=True)
    max_downloads: int = opt(2, "DownloadState requests served at once; more are answered BUSY", advanced=True)

    def validate(self) -> None:
        need(0 <= self.port < 65536, "port", self.port, "must be in [0, 65535] (0: any)")
        need(self.relay_mb >= 1, "relay_mb", self.relay_mb, "must be >= 1")
        need(self.relay_minutes > 0, "relay_minutes", self.relay_minutes, "must be > 0")
        need(self.relay_connections >= 1, "relay_connections", self.relay_connections,
             "must be >= 1")
        need(self.relay_listeners >= 1, "relay_listeners", self.relay_listeners, "must be >= 1")
        need(self.max_message_bytes >= MAX_CHUNK_BYTES + 1024, "max_message_bytes",
              self.max_message_bytes, f"must be >= 1 MiB + 1 KiB = {MAX_CHUNK_BYTES + 1024}")
        for name in ("keepalive_time_s", "keepalive_timeout_s", "connect_timeout_s",
                     "info_timeout_s", "stop_grace_s", "preauth_timeout_s"):
            need(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        need(self.keepalive_timeout_s < self.keepalive_time_s, "keepalive_timeout_s",
              self.keepalive_timeout_s,
              f"must be shorter than --keepalive-time-s={self.keepalive_time_s}")
        need(self.stop_deadline_s == 0 or self.stop_deadline_s > self.stop_grace_s,
             "stop_deadline_s", self.stop_deadline_s,
             f"must be 0 (none) or longer than --stop-grace-s={self.stop_grace_s}")
        need(self.max_channels >= 1, "max_channels", self.max_channels, "must be >= 1")
        need(self.reachability_interval_s >= 0, "reachability_interval_s",
              self.reachability_interval_s, "must be >= 0 seconds (0: no checks)")
        for name in ("reachability_probes", "preauth_streams", "max_downloads",
                     "max_connections", "connections_per_block", "max_streams_per_connection"):
            need(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        need(self.connections_per_block <= self.max_connections, "connections_per_block",
             self.connections_per_block,
             f"must be at most --max-connections={self.max_connections}")
        need(self.auth_skew_s > 0, "auth_skew_s", self.auth_skew_s, "must be > 0 seconds")
        if self.swarm_key:
            try:
                read_swarm_key(self.swarm_key)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--swarm-key={self.swarm_key}: {exc}") from None
        if self.invitation:
            try:
                invitation = read_invitation(self.invitation)[0]
            except (OSError, ValueError) as exc:
                why = str(exc).removeprefix(f"{self.invitation}: ")
                raise ConfigError(f"--invitation={self.invitation}: {why}") from None
            if not invitation.expires > time.time():
                until = time.strftime("%Y-%m-%d %H:%M", time.localtime(invitation.expires))
                raise ConfigError(f"--invitation={self.invitation}: expired on {until}; ask "
                                  "the swarm's owner for a new one (`gasloc-node invite`)")
        if self.owner_key and Path(self.owner_key).exists():
            try:
                read_key_file(self.owner_key)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--owner-key={self.owner_key}: {exc}") from None
        if self.identity_file:
            path = Path(self.identity_file)
            size = path.stat().st_size if path.is_file() else None
            need(size in (None, 32) and path.parent.is_dir() and not path.is_dir(),
                 "identity_file", self.identity_file, "must be a 32-byte key file, or a new "
                 "file in an existing directory (it is then created)")

    def admission_problem(self, joining: bool) -> str | None:
        """Why this node cannot take part as configured (None: it can). A node that joins
        (``joining``: bootstrap peers given) needs a credential of the swarm unless
        ``--open``; a node that starts a swarm owns it."""
        creds = [f for f in ("swarm_key", "invitation", "owner_key") if getattr(self, f)]
        if self.open_swarm and (self.invitation or self.owner_key):
            return ("--open contradicts --invitation/--owner-key (an open swarm has no "
                    "members list)")
        if self.invitation and self.owner_key:
            return "give --invitation (a member) or --owner-key (the owner), not both"
        if joining and not creds and not self.open_swarm:
            return ("the swarm is closed: pass --invitation FILE from its owner (they run "
                    "`gasloc-node invite --out FILE` and send it to you privately), or "
                    "--swarm-key FILE, or --open if the swarm is open")
        return None

    def swarm_secret(self) -> bytes:
        """The shared secret of --swarm-key (empty: an open swarm)."""
        return read_swarm_key(self.swarm_key) if self.swarm_key else b""


@dataclass(frozen=True)
class DiscoveryConfig:
    """hivemind DHT discovery: run-scoped announcements with a TTL."""

    run_id: str = opt("gasloc", "run name; only nodes with the same run id gossip")
    peers: tuple[str, ...] = opt((), "bootstrap multiaddrs of running nodes (empty: new swarm)",
                                 metavar="MADDR")
    dht_port: int = opt(0, "DHT (libp2p) TCP port (0: any free port)")
    announce_interval_s: float = opt(5.0, "re-announce this node every this many seconds", advanced=True)
    announce_ttl_s: float = opt(20.0, "an announcement expires after this many seconds", advanced=True)
    refresh_interval_s: float = opt(3.0, "re-read the peer list every this many seconds", advanced=True)
    dht_timeout_s: float = opt(10.0, "deadline of one DHT get/store", advanced=True)
    dht_start_timeout_s: float = opt(60.0, "deadline of DHT start-up and bootstrap", advanced=True)

    def validate(self) -> None:
        need(bool(self.run_id) and "/" not in self.run_id, "run_id", self.run_id,
              "must be a non-empty name without '/'")
        need(0 <= self.dht_port < 65536, "dht_port", self.dht_port, "must be in [0, 65535]")
        for name in ("announce_interval_s", "refresh_interval_s", "dht_timeout_s",
                     "dht_start_timeout_s"):
            need(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        need(self.announce_ttl_s > self.announce_interval_s, "announce_ttl_s",
              self.announce_ttl_s,
              f"must exceed --announce-interval-s={self.announce_interval_s}, or the node "
              "vanishes between refreshes")
        for peer in self.peers:
            need(peer.startswith("/"), "peers", peer, PEERS_HINT)


PEERS_HINT = ("each peer is a multiaddr such as /ip4/1.2.3.4/tcp/31337/p2p/Qm... (the line a "
              "running node prints)")


def check_bootstrap_peers(peers: tuple[str, ...]) -> None:
    """ConfigError unless every peer parses as a libp2p multiaddr with a peer id (the DHT
    would otherwise fail seconds later with a less helpful message)."""
    for peer in peers:
        problem = multiaddr_problem(peer)
        need(problem is None, "peers", peer, f"{problem}; {PEERS_HINT}")


def multiaddr_problem(text: str) -> str | None:
    """Why ``text`` is not a bootstrap multiaddr (with a ``/p2p/`` peer id), or None."""
    if not text.startswith("/"):
        return "not a multiaddr"
    from hivemind.utils.multiaddr import Multiaddr  # heavy: only when peers are given

    try:
        addr = Multiaddr(text)
    except Exception as exc:  # noqa: BLE001 - the parser raises several types
        return f"not a valid multiaddr ({str(exc).split(': ', 1)[-1]})"
    if "p2p" not in [p.name for p in addr.protocols()]:
        return "no /p2p/<peer id> part"
    return None
