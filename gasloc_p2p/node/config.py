"""Node configuration: one frozen dataclass per subsystem, nested in :class:`NodeConfig`.

Every field is also a CLI flag (``--field-name``), an environment variable (``GASLOC_FIELD_NAME``)
and a key in its section of a TOML file (``[gossip] codec = "int4"``); field names are unique
across sections so the flat names cannot clash. :mod:`gasloc_p2p.node.settings` merges the
sources (flags > env > TOML > defaults); ``validate`` checks values and the relations between
them, with messages that name the flag to change. Times are seconds, sizes bytes unless the name
says otherwise (``_mbps`` = megabits per second).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.core.codecs import CODEC_NAMES, MAX_BLOCK_SIZE, CodecSpec
from gasloc_p2p.core.options import ConfigError, check_outer_step, need, opt
from gasloc_p2p.model import GPTConfig
from gasloc_p2p.protocol.guard import GuardRule
from gasloc_p2p.protocol.messages import MAX_CHUNK_BYTES

FRAGMENT_ORDERS = ("round-robin", "random")
ALGORITHMS = ("gasloc", "diloco")
DILOCO_CODECS = ("fp32", "fp16", "int8")


@dataclass(frozen=True)
class TrainConfig:
    """The model, the data and the inner optimizer (AdamW, warmup then cosine decay)."""

    data: str = opt("", "text file, directory of *.txt or glob; empty: Shakespeare (downloaded)")
    shard: str = opt("", "train on shard K of N of the corpus, as 'K/N' (empty: all of it)")
    seed: int = opt(0, "model init seed, the same on every node of a run (gives theta_0)")
    data_seed: int = opt(-1, "seed of this node's batch sampling; -1: derived from its peer id")
    n_layer: int = opt(4, "transformer layers")
    n_embd: int = opt(128, "model width")
    n_head: int = opt(4, "attention heads")
    seq_len: int = opt(128, "context length, tokens")
    batch_size: int = opt(16, "sequences per inner step")
    lr: float = opt(3e-3, "peak inner AdamW learning rate")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of --lr")
    warmup_steps: int = opt(100, "linear warmup, inner steps")
    lr_horizon_steps: int = opt(20000, "cosine decay length, inner steps (then constant)")
    weight_decay: float = opt(0.1, "AdamW weight decay")
    decay_vectors: bool = opt(False, "weight decay also on biases and LayerNorm gains "
                                     "(default: weight matrices and embeddings only)")
    inner_steps: int = opt(20, "H: inner steps per round of this node")
    torch_threads: int = opt(1, "torch intra-op threads for training")
    max_steps: int = opt(0, "stop after this many inner steps (0: run until stopped)")
    max_time_s: float = opt(0.0, "stop after this many seconds (0: run until stopped)")
    eval_interval_steps: int = opt(100, "validation loss every this many inner steps")
    eval_batches: int = opt(8, "held-out batches per validation (fixed, same on every node)")
    max_rollbacks: int = opt(3, "non-finite losses rolled back to the last good anchor before "
                             "the node gives up and stops")

    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab_size=256, seq_len=self.seq_len, n_layer=self.n_layer,
                         n_embd=self.n_embd, n_head=self.n_head)

    def shard_spec(self) -> tuple[int, int] | None:
        """(K, N) from ``--shard K/N``, or None."""
        if not self.shard:
            return None
        try:
            k, n = (int(x) for x in self.shard.split("/"))
        except ValueError:
            raise ConfigError(f"--shard={self.shard!r}: expected K/N such as 0/4") from None
        need(n >= 1 and 0 <= k < n, "shard", self.shard, "needs 0 <= K < N")
        return k, n

    def validate(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size", "inner_steps",
                     "torch_threads", "eval_interval_steps", "eval_batches", "lr_horizon_steps"):
            need(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        need(self.n_embd % self.n_head == 0, "n_embd", self.n_embd,
              f"must be divisible by --n-head={self.n_head}")
        need(0 < self.lr < 1, "lr", self.lr, "needs 0 < lr < 1 (try 3e-3)")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "needs [0, 1]")
        need(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        need(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        need(self.max_steps >= 0, "max_steps", self.max_steps, "must be >= 0 (0: no limit)")
        need(self.max_time_s >= 0, "max_time_s", self.max_time_s, "must be >= 0 (0: no limit)")
        self.shard_spec()


@dataclass(frozen=True)
class AlgorithmConfig(AsyncConfig):
    """The outer algorithm (TOML table ``[outer]``): which one, and the asynchronous GASLoC
    outer step of ALGORITHM.md section 2, whose fields and checks are the core's
    :class:`AsyncConfig` (the simulator uses the same)."""

    algorithm: str = opt("gasloc", "gasloc: gossip, ALGORITHM.md section 2 | diloco: the DiLoCo "
                                   "baseline, an all-reduce every H steps (see [diloco])",
                         choices=ALGORITHMS)

    def async_config(self) -> AsyncConfig:
        return AsyncConfig(eta=self.eta, gamma=self.gamma, w=self.w, momentum=self.momentum,
                           staleness_policy=self.staleness_policy,
                           max_staleness=self.max_staleness)

    def validate(self) -> None:
        need(self.algorithm in ALGORITHMS, "algorithm", self.algorithm,
              f"choose one of {ALGORITHMS}")
        super().validate()


@dataclass(frozen=True)
class GossipConfig:
    """Gossip exchanges: codec, rate, fragments, limits and per-stage timeouts."""

    codec: str = opt("int8", f"payload codec: {' | '.join(CODEC_NAMES)}")
    block_size: int = opt(1024, "quantization block, elements (int8/int4/fp4)")
    fragments: int = opt(1, "P: exchange one strided fragment of P per event (1: whole model)")
    fragment_order: str = opt("round-robin", f"fragment choice: {' | '.join(FRAGMENT_ORDERS)}")
    exchanges_per_round: float = opt(2.0, "mean exchanges this node starts per round (0: none)")
    max_inbound: int = opt(4, "inbound exchanges served at once; more are answered BUSY")
    max_upload_mbps: float = opt(0.0, "cap on sent payload, megabits/s (0: no cap)")
    reference_capacity: int = opt(8, "peers whose quantization references are kept (LRU)")
    chunk_bytes: int = opt(MAX_CHUNK_BYTES, "payload bytes per Chunk message (<= 1 MiB)")
    busy_retries: int = opt(3, "other peers tried after a BUSY answer")
    backoff_s: float = opt(10.0, "after a failed exchange, leave that peer alone this long")
    header_timeout_s: float = opt(10.0, "wait for the peer's Header")
    chunk_timeout_s: float = opt(15.0, "wait for any one message during the transfer")
    commit_timeout_s: float = opt(15.0, "responder: wait for Commit after both Ready")
    exchange_timeout_s: float = opt(120.0, "deadline of a whole exchange")
    init_from_swarm: bool = opt(True, "with no checkpoint, start from a peer's state if any")
    download_timeout_s: float = opt(60.0, "deadline of a state download")
    guard_factor: float = opt(8.0, "reject a peer's update whose RMS distance exceeds this many "
                              "times the median of recent accepted ones (0: no guard)")
    guard_window: int = opt(32, "accepted exchanges per fragment the guard's median covers")
    guard_warmup: int = opt(8, "accepted exchanges per fragment before the median rule applies")
    guard_warmup_factor: float = opt(4.0, "warm-up limit: this many times the node's own scale "
                                     "(RMS of p - theta_0, at least RMS of theta_0)")
    guard_min_cosine: float = opt(0.05, "reject a peer whose displacement from theta_0 has a "
                                  "lower cosine with this node's (-1: off)")
    guard_backoff_s: float = opt(300.0, "leave a peer whose update was implausible alone this "
                                 "long (both directions)")

    @property
    def codec_spec(self) -> CodecSpec:
        """What this node sends: ``codec`` with ``block_size`` (0 for fp32/fp16)."""
        return CodecSpec.of(self.codec, self.block_size)

    def guard_rule(self) -> GuardRule:
        """The bounded-update guard's thresholds (factor 0: off)."""
        return GuardRule(self.guard_factor, self.guard_window, self.guard_warmup,
                         self.guard_warmup_factor, min_cosine=self.guard_min_cosine)

    def validate(self) -> None:
        need(self.codec in CODEC_NAMES, "codec", self.codec, f"choose one of {CODEC_NAMES}")
        need(2 <= self.block_size <= MAX_BLOCK_SIZE and self.block_size % 2 == 0, "block_size",
              self.block_size, f"must be an even number in [2, {MAX_BLOCK_SIZE}] (try 1024)")
        need(self.fragments >= 1, "fragments", self.fragments, "must be >= 1")
        need(self.fragment_order in FRAGMENT_ORDERS, "fragment_order", self.fragment_order,
              f"choose one of {FRAGMENT_ORDERS}")
        need(self.exchanges_per_round >= 0, "exchanges_per_round", self.exchanges_per_round,
              "must be >= 0 (0 disables outbound gossip)")
        need(self.max_inbound >= 1, "max_inbound", self.max_inbound, "must be >= 1")
        need(self.max_upload_mbps >= 0, "max_upload_mbps", self.max_upload_mbps,
              "must be >= 0 (0: no cap)")
        need(1024 <= self.chunk_bytes <= MAX_CHUNK_BYTES, "chunk_bytes", self.chunk_bytes,
              f"must be in [1024, {MAX_CHUNK_BYTES}]")
        need(self.busy_retries >= 0, "busy_retries", self.busy_retries, "must be >= 0")
        need(self.backoff_s >= 0, "backoff_s", self.backoff_s, "must be >= 0")
        need(self.guard_factor == 0 or self.guard_factor >= 2, "guard_factor", self.guard_factor,
             "must be 0 (off) or >= 2 (honest distances vary by about 2x)")
        need(self.guard_window >= 1 and 0 <= self.guard_warmup <= self.guard_window,
             "guard_warmup", self.guard_warmup, f"must be in [0, --guard-window="
             f"{self.guard_window}]")
        need(self.guard_warmup_factor > 0, "guard_warmup_factor", self.guard_warmup_factor,
             "must be > 0")
        need(-1 <= self.guard_min_cosine < 1, "guard_min_cosine", self.guard_min_cosine,
             "must be in [-1, 1) (-1: off)")
        need(self.guard_backoff_s >= 0, "guard_backoff_s", self.guard_backoff_s, "must be >= 0")
        # An inbound exchange pins its peer's references: eviction must find an unpinned one.
        need(self.reference_capacity > self.max_inbound + 1, "reference_capacity",
              self.reference_capacity, f"must exceed --max-inbound + 1 = {self.max_inbound + 1}")
        for name in ("header_timeout_s", "chunk_timeout_s", "commit_timeout_s",
                     "download_timeout_s"):
            need(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        for name in ("header_timeout_s", "chunk_timeout_s", "commit_timeout_s"):
            need(getattr(self, name) < self.exchange_timeout_s, name, getattr(self, name),
                  f"must be shorter than --exchange-timeout-s={self.exchange_timeout_s}")


@dataclass(frozen=True)
class NetworkConfig:
    """The gRPC server and channels."""

    host: str = opt("0.0.0.0", "listen address for gRPC and the DHT")
    port: int = opt(0, "gRPC port (0: any free port)")
    announce_host: str = opt("", "address peers should dial (empty: guessed from --host/DHT)")
    client_mode: bool = opt(False, "behind NAT: do not accept exchanges, only dial out")
    max_message_bytes: int = opt(MAX_CHUNK_BYTES + 64 * 1024, "gRPC message size limit")
    keepalive_time_s: float = opt(20.0, "HTTP/2 keepalive ping interval")
    keepalive_timeout_s: float = opt(10.0, "close a connection whose ping is unanswered this long")
    connect_timeout_s: float = opt(5.0, "wait for a TCP/HTTP2 connection to a peer")
    info_timeout_s: float = opt(5.0, "deadline of a unary Info call")
    stop_grace_s: float = opt(3.0, "on stop, let running RPCs finish this long")
    max_channels: int = opt(32, "cached client channels to peers (LRU)")
    reachability_interval_s: float = opt(
        60.0, "ask a random peer to dial this node back this often (0: never); if it cannot, "
        "the node gossips by dialing out only, as with --client-mode")

    def validate(self) -> None:
        need(0 <= self.port < 65536, "port", self.port, "must be in [0, 65535] (0: any)")
        need(self.max_message_bytes >= MAX_CHUNK_BYTES + 1024, "max_message_bytes",
              self.max_message_bytes, f"must be >= 1 MiB + 1 KiB = {MAX_CHUNK_BYTES + 1024}")
        for name in ("keepalive_time_s", "keepalive_timeout_s", "connect_timeout_s",
                     "info_timeout_s", "stop_grace_s"):
            need(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        need(self.keepalive_timeout_s < self.keepalive_time_s, "keepalive_timeout_s",
              self.keepalive_timeout_s,
              f"must be shorter than --keepalive-time-s={self.keepalive_time_s}")
        need(self.max_channels >= 1, "max_channels", self.max_channels, "must be >= 1")
        need(self.reachability_interval_s >= 0, "reachability_interval_s",
              self.reachability_interval_s, "must be >= 0 seconds (0: no checks)")


@dataclass(frozen=True)
class DiscoveryConfig:
    """hivemind DHT discovery: run-scoped announcements with a TTL."""

    run_id: str = opt("gasloc", "run name; only nodes with the same run id gossip")
    peers: tuple[str, ...] = opt((), "bootstrap multiaddrs of running nodes (empty: new swarm)",
                                 metavar="MADDR")
    dht_port: int = opt(0, "DHT (libp2p) TCP port (0: any free port)")
    announce_interval_s: float = opt(5.0, "re-announce this node every this many seconds")
    announce_ttl_s: float = opt(20.0, "an announcement expires after this many seconds")
    refresh_interval_s: float = opt(3.0, "re-read the peer list every this many seconds")
    dht_timeout_s: float = opt(10.0, "deadline of one DHT get/store")
    dht_start_timeout_s: float = opt(60.0, "deadline of DHT start-up and bootstrap")

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


@dataclass(frozen=True)
class DilocoConfig:
    """The DiLoCo baseline (``--algorithm diloco``, ALGORITHM.md section 3): every H inner steps
    the node all-reduces its outer gradient ``anchor - theta`` with the swarm (hivemind
    averaging on the node's DHT), then takes a Nesterov SGD step. A round that finds no group
    applies the node's own outer gradient and training goes on."""

    diloco_eta: float = opt(0.7, "DiLoCo outer learning rate (Nesterov SGD)")
    diloco_gamma: float = opt(0.9, "DiLoCo outer momentum (Nesterov)")
    diloco_codec: str = opt("fp32", f"all-reduce payload: {' | '.join(DILOCO_CODECS)} "
                                    "(hivemind compression)")
    target_group_size: int = opt(0, "peers per all-reduce group (0: every compatible peer the "
                                    "DHT lists, this node included)")
    min_group_size: int = opt(2, "smallest group that averages; a smaller one fails the round")
    matchmaking_time_s: float = opt(5.0, "wait this long for late groupmates before averaging "
                                         "with those that joined")
    request_timeout_s: float = opt(3.0, "wait for a group leader's answer")
    averaging_timeout_s: float = opt(30.0, "give up finding a group after this long (the round "
                                           "then applies this node's own outer gradient)")
    allreduce_timeout_s: float = opt(120.0, "deadline of the all-reduce once a group formed")
    part_timeout_s: float = opt(5.0, "all-reduce: a groupmate silent this long is dropped (its "
                                     "share of the model stays unaveraged this round)")

    def async_config(self) -> AsyncConfig:
        """The node state for DiLoCo: the "local" momentum form keeps ``m`` (zero at start),
        which is exactly the Nesterov buffer; the all-reduced gradient replaces the drift."""
        return AsyncConfig(eta=self.diloco_eta, gamma=self.diloco_gamma, momentum="local")

    def validate(self) -> None:
        check_outer_step(self.diloco_eta, self.diloco_gamma, "diloco_eta", "diloco_gamma")
        need(self.diloco_codec in DILOCO_CODECS, "diloco_codec", self.diloco_codec,
              f"choose one of {DILOCO_CODECS}")
        need(self.min_group_size >= 2, "min_group_size", self.min_group_size, "must be >= 2")
        need(self.target_group_size == 0 or self.target_group_size >= self.min_group_size,
              "target_group_size", self.target_group_size,
              f"must be 0 (auto) or >= --min-group-size={self.min_group_size}")
        for name in ("matchmaking_time_s", "request_timeout_s", "averaging_timeout_s",
                     "allreduce_timeout_s", "part_timeout_s"):
            need(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        need(self.part_timeout_s < self.allreduce_timeout_s, "part_timeout_s",
              self.part_timeout_s,
              f"must be shorter than --allreduce-timeout-s={self.allreduce_timeout_s}")
        # hivemind: a leader's answer must come within the matchmaking window (else deadlocks
        # between two would-be leaders last longer), and the window must fit in the deadline.
        need(self.request_timeout_s < self.matchmaking_time_s, "request_timeout_s",
              self.request_timeout_s,
              f"must be shorter than --matchmaking-time-s={self.matchmaking_time_s}")
        need(self.averaging_timeout_s > self.matchmaking_time_s, "averaging_timeout_s",
              self.averaging_timeout_s,
              f"must exceed --matchmaking-time-s={self.matchmaking_time_s}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Atomic periodic checkpoints (write a temporary file, then rename)."""

    checkpoint_dir: str = opt("", "directory for checkpoints (empty: no checkpoints)")
    checkpoint_interval_s: float = opt(300.0, "save every this many seconds")
    resume: bool = opt(True, "load the checkpoint in --checkpoint-dir at start if present")

    def validate(self) -> None:
        need(self.checkpoint_interval_s > 0, "checkpoint_interval_s",
              self.checkpoint_interval_s, "must be > 0 seconds")


@dataclass(frozen=True)
class MetricsConfig:
    """Progress logging and the Prometheus endpoint (the log level is a flag of the top-level
    command). Metric names and labels: :mod:`gasloc_p2p.node.observability.metrics`."""

    log_interval_s: float = opt(10.0, "one progress line every this many seconds")
    metrics_port: int = opt(0, "Prometheus /metrics HTTP port (0: any free port, printed at "
                               "start; -1: no metrics endpoint)")
    metrics_host: str = opt("", "listen address of /metrics (empty: the same as --host)")

    def validate(self) -> None:
        need(self.log_interval_s > 0, "log_interval_s", self.log_interval_s, "must be > 0")
        need(-1 <= self.metrics_port < 65536, "metrics_port", self.metrics_port,
              "must be in [0, 65535] (0: any free port) or -1 to disable /metrics")
        need(self.metrics_host.strip() == self.metrics_host and " " not in self.metrics_host,
              "metrics_host", self.metrics_host, "must be an address such as 127.0.0.1 or "
              "0.0.0.0, or empty for --host")


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node needs; sections are the TOML tables of the same name."""

    train: TrainConfig = field(default_factory=TrainConfig)
    outer: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self) -> NodeConfig:
        """Check every section and the cross-section relations; return self."""
        for f in fields(self):
            getattr(self, f.name).validate()
        layers = self.train.n_layer
        need(self.gossip.fragments <= layers, "fragments", self.gossip.fragments,
              f"cannot exceed the model's --n-layer={layers}")
        need(self.gossip.chunk_bytes + 1024 <= self.network.max_message_bytes, "chunk_bytes",
              self.gossip.chunk_bytes,
              f"must leave 1 KiB of headroom under --max-message-bytes="
              f"{self.network.max_message_bytes}")
        need(self.metrics.metrics_port <= 0 or self.metrics.metrics_port != self.network.port,
              "metrics_port", self.metrics.metrics_port, "must differ from --port")
        need(self.gossip.fragments == 1 or self.outer.algorithm != "diloco", "fragments",
              self.gossip.fragments, "--algorithm diloco all-reduces the whole model: use 1")
        need(self.network.connect_timeout_s < self.gossip.exchange_timeout_s,
              "connect_timeout_s", self.network.connect_timeout_s,
              f"must be shorter than --exchange-timeout-s={self.gossip.exchange_timeout_s}")
        return self


SECTIONS: tuple[str, ...] = tuple(f.name for f in fields(NodeConfig))
