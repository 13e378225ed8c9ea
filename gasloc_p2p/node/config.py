"""Node configuration: one frozen dataclass per subsystem, nested in :class:`NodeConfig`.

Every field is an environment variable (``GASLOC_FIELD_NAME``) and a key in its section of a
TOML file (``[gossip] codec = "int4"``), and, unless it is advanced tuning (timeouts, guard
thresholds, limits), a ``join`` flag (``--field-name``); field names are unique across
sections so the flat names cannot clash. :mod:`gasloc_p2p.node.settings` merges the sources
(flags > env > TOML > defaults); ``validate`` checks values and the relations between them,
with messages that name the setting to change. docs/configuration.md lists every field (it is
generated from these classes: ``python -m gasloc_p2p.node.settings --reference``). Times are
seconds, sizes bytes unless the name says otherwise (``_mbps`` = megabits per second).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.core.codecs import MAX_BLOCK_SIZE, PLAIN_CODECS, CodecSpec
from gasloc_p2p.core.compress import parse_codec
from gasloc_p2p.core.options import ConfigError as ConfigError  # part of this module's API
from gasloc_p2p.core.options import check_outer_step, need, opt
from gasloc_p2p.core.sparse import SparseSpec
from gasloc_p2p.core.wire import RESIDUAL_CODECS
from gasloc_p2p.node.config_network import (  # the sections live in three modules, one API
    DiscoveryConfig,
    NetworkConfig,
)
from gasloc_p2p.node.config_train import TrainConfig
from gasloc_p2p.protocol.guard import GuardRule
from gasloc_p2p.protocol.messages import MAX_CHUNK_BYTES

FRAGMENT_ORDERS = ("round-robin", "random")
ALGORITHMS = ("gasloc", "diloco", "streaming-diloco")
DILOCO_CODECS = ("fp32", "fp16", "int8", "int4", "fp4")
# join --help groups, in order; a field goes to its section's group unless it names another
HELP_GROUPS = ("network", "training", "data", "algorithm", "security", "observability")
SECTION_GROUPS = {"train": "training", "outer": "algorithm", "gossip": "algorithm",
                  "network": "network", "discovery": "network", "diloco": "algorithm",
                  "checkpoint": "training", "metrics": "observability"}


@dataclass(frozen=True)
class AlgorithmConfig(AsyncConfig):
    """The outer algorithm (TOML table ``[outer]``): which one, and the asynchronous GASLoC
    outer step of docs/algorithm.md section 2, whose fields and checks are the core's
    :class:`AsyncConfig` (the simulator uses the same).

    Defaults from the measurements in docs/results/ (121k parameters on CPU, n = 4, 1000 steps,
    3 seeds): plain averaging (eta 1, gamma 0) was never worse than outer momentum at equal
    effective step and significantly better at H = 50 and with a slow worker; ``--gamma``
    still turns it on (and only then is a momentum buffer allocated)."""

    algorithm: str = opt("gasloc", "gasloc: gossip (docs/algorithm.md section 2) | diloco: an "
                                   "all-reduce every H steps (Streaming DiLoCo with one fragment "
                                   "and no overlap) | streaming-diloco: one fragment of "
                                   "--fragments at a time, overlapped with --tau steps",
                         choices=ALGORITHMS)

    def async_config(self) -> AsyncConfig:
        return AsyncConfig(eta=self.eta, gamma=self.gamma, w=self.w, momentum=self.momentum)

    def validate(self) -> None:
        need(self.algorithm in ALGORITHMS, "algorithm", self.algorithm,
              f"choose one of {ALGORITHMS}")
        super().validate()


@dataclass(frozen=True)
class GossipConfig:
    """Gossip exchanges: codec, rate, fragments, limits and per-stage timeouts."""

    codec: str = opt("int8", f"payload codec: {' | '.join(PLAIN_CODECS)}, or for slow uplinks "
                             "half2 (half the parameters at 2 bits) or sign1 (1 bit each), "
                             "against a copy each pair of peers keeps: 8x fewer bytes than "
                             "int8; a pair's first exchange is int8")
    block_size: int = opt(1024, "quantization block, elements (int8/int4/fp4; half2 and sign1: "
                                "4096)", advanced=True)
    links: int = opt(4, "half2/sign1: peers this node keeps a link with (host memory: one "
                        "float32 copy of the model per link)", advanced=True)
    fragments: int = opt(1, "P: exchange one strided fragment of P per event (1: whole model); "
                            "streaming-diloco: fragments synced in turn")
    fragment_order: str = opt("round-robin", f"fragment choice: {' | '.join(FRAGMENT_ORDERS)}",
                              advanced=True)
    exchanges_per_round: float = opt(2.0, "mean exchanges this node starts per round (0: none)")
    key_exchanges_per_round: int = opt(8, "exchanges one key may start with this node per "
                                       "round of this node (or per 30 s once it stops "
                                       "training; 0: no limit)", advanced=True)
    max_inbound: int = opt(4, "inbound exchanges served at once; more are answered BUSY",
                           advanced=True)
    max_upload_mbps: float = opt(0.0, "cap on sent payload, megabits/s (0: no cap)",
                                 group="network")
    min_link_mbps: float = opt(10.0, "slowest link this node plans for: the deadlines of an "
                                     "exchange, a state download and a DiLoCo all-reduce grow "
                                     "by its own bytes' time at this rate (or at "
                                     "--max-upload-mbps, if lower; 0: fixed deadlines)",
                               group="network")
    chunk_bytes: int = opt(MAX_CHUNK_BYTES, "payload bytes per Chunk message (<= 1 MiB)",
                           advanced=True)
    busy_retries: int = opt(3, "other peers tried after a BUSY answer", advanced=True)
    connect_fanout: int = opt(3, "connect to this many random peers at once and exchange with "
                                 "the first that answers (dead records then cost no waiting)",
                              advanced=True)
    backoff_s: float = opt(10.0, "after a failed exchange, leave that peer alone this long "
                                 "(doubled after each further failure)", advanced=True)
    max_backoff_s: float = opt(300.0, "cap on the doubled backoff of a failing peer",
                               advanced=True)
    min_transfer_bps: float = opt(16384.0, "cut an exchange whose payload arrives slower than "
                                           "this many bytes/s after the grace (0: no minimum)",
                                  advanced=True)
    transfer_grace_s: float = opt(5.0, "grace before min_transfer_bps applies", advanced=True)
    header_timeout_s: float = opt(10.0, "wait for the peer's Header", advanced=True)
    chunk_timeout_s: float = opt(15.0, "wait for any one message during the transfer",
                                 advanced=True)
    commit_timeout_s: float = opt(15.0, "responder: wait for Commit after both Ready",
                                  advanced=True)
    exchange_timeout_s: float = opt(120.0, "deadline of a whole exchange", advanced=True)
    init_from_swarm: bool = opt(True, "with no checkpoint, start from a peer's state if any",
                                group="training")
    download_timeout_s: float = opt(60.0, "deadline of a state download", advanced=True)
    guard_factor: float = opt(4.0, "clip a peer's update whose RMS distance exceeds this many "
                              "times this node's own drift per round (0: no guard)",
                              advanced=True)
    guard_window: int = opt(16, "rounds of this node's own drift the guard's median covers",
                            advanced=True)
    guard_hard_factor: float = opt(16.0, "refuse (and back off) a peer whose RMS distance "
                                   "exceeds this many times this node's own drift (and twice "
                                   "its own path, and guard_hard_base times the RMS of "
                                   "theta_0)", advanced=True)
    guard_hard_base: float = opt(4.0, "the hard limit is at least this many times the RMS of "
                                 "theta_0", advanced=True)
    guard_round_budget: float = opt(4.0, "all exchanges of a round together move this node by "
                                    "at most this many own drifts", advanced=True)
    guard_newcomer_budget: float = opt(0.5, "exchanges with keys still earning their trust "
                                       "move this node by at most this many own drifts per "
                                       "round", advanced=True)
    guard_block_budget: float = opt(0.25, "of which those from one address block (/24, /48)",
                                    advanced=True)
    guard_newcomer_total: float = opt(1.0, "exchanges with keys still earning their trust move "
                                      "this node by at most this many own drifts over about "
                                      "guard_newcomer_rounds rounds", advanced=True)
    guard_newcomer_rounds: int = opt(64, "the window of guard_newcomer_total (a sum decaying by "
                                     "1/this per round)", advanced=True)
    guard_trust_after: int = opt(8, "a key's weight ramps to full over this many rounds of "
                                 "this node after its first committed exchange with it",
                                 advanced=True)
    guard_push_limit: float = opt(8.0, "what gossip moved this node by over its last rounds "
                                  "(a sum decaying by 1/32 a round, on sampled blocks) stays "
                                  "within this many own drifts (RMS; 0: no bound)",
                                  advanced=True)
    guard_push_back: float = opt(0.0, "what gossip moved this node by over its last "
                                 "guard_back_rounds rounds, "
                                 "back along the path of its own steps, stays within this "
                                 "share of that path (0: no bound; 0.25 holds a push towards "
                                 "where the node was, at a cost to clean swarms: "
                                 "docs/security.md)", advanced=True)
    guard_back_rounds: int = opt(32, "the window of guard_push_back: the path of this "
                                 "node's own steps over its last this many rounds (its "
                                 "progress grows with the window, its jitter about as the "
                                 "square root)", advanced=True)
    guard_loss_gate: float = opt(0.01, "take back, on this node's side, commits that raised "
                                 "the loss of a private held-out batch by more than this "
                                 "fraction of it (the rises of a round together; 0: off)",
                                 advanced=True)
    guard_loss_rise: float = opt(0.05, "roll back when the training loss's moving average "
                                 "stays this fraction above its recent best, and blame the "
                                 "keys that pushed it there (0: off)", advanced=True)
    guard_min_z: float = opt(4.0, "reject a peer whose displacement from theta_0 has a cosine "
                             "below this / sqrt(fragment size) with this node's (<0: off)",
                             advanced=True)
    guard_min_cosine: float = opt(-1.0, "also reject a cosine below this fixed value (-1: off)",
                                  advanced=True)
    guard_backoff_s: float = opt(300.0, "leave a peer whose update was implausible alone this "
                                 "long (both directions)", advanced=True)

    @property
    def codec_spec(self) -> CodecSpec:
        """What this node sends: ``codec`` with ``block_size`` (0 for fp32/fp16; half2 and
        sign1 their own, the block size their study measured)."""
        if self.codec in RESIDUAL_CODECS:
            return CodecSpec.of(self.codec)
        return CodecSpec.of(self.codec, self.block_size)

    def guard_rule(self) -> GuardRule:
        """The bounded-update guard's thresholds (factor 0: off)."""
        return GuardRule(
            factor=self.guard_factor, hard_factor=self.guard_hard_factor,
            hard_base=self.guard_hard_base, window=self.guard_window,
            round_budget=self.guard_round_budget, newcomer_budget=self.guard_newcomer_budget,
            newcomer_total=self.guard_newcomer_total, newcomer_rounds=self.guard_newcomer_rounds,
            block_budget=self.guard_block_budget, trust_after=self.guard_trust_after,
            min_z=self.guard_min_z, min_cosine=self.guard_min_cosine)

    def validate(self) -> None:
        need(self.codec in PLAIN_CODECS + tuple(RESIDUAL_CODECS), "codec", self.codec,
             f"choose one of {PLAIN_CODECS + tuple(sorted(RESIDUAL_CODECS))}")
        need(self.links >= 1, "links", self.links, "must be >= 1")
        need(2 <= self.block_size <= MAX_BLOCK_SIZE and self.block_size % 2 == 0, "block_size",
              self.block_size, f"must be an even number in [2, {MAX_BLOCK_SIZE}] (try 1024)")
        need(self.fragments >= 1, "fragments", self.fragments, "must be >= 1")
        need(4 <= self.guard_back_rounds <= 1024, "guard_back_rounds", self.guard_back_rounds,
             "must be in [4, 1024] rounds (a copy of the sampled blocks per round)")
        need(0 <= self.guard_push_back < 1, "guard_push_back", self.guard_push_back,
             "must be in [0, 1) (0: no bound)")
        need(self.guard_push_limit >= 0, "guard_push_limit", self.guard_push_limit,
             "must be >= 0 (0: no bound)")
        need(0 <= self.guard_loss_gate < 1, "guard_loss_gate", self.guard_loss_gate,
             "must be in [0, 1) (0.01: 1% of the loss a round; 0: off)")
        need(0 <= self.guard_loss_rise < 1, "guard_loss_rise", self.guard_loss_rise,
             "must be in [0, 1) (0.05: a 5% rise)")
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
        need(self.connect_fanout >= 1, "connect_fanout", self.connect_fanout, "must be >= 1")
        need(self.backoff_s >= 0, "backoff_s", self.backoff_s, "must be >= 0")
        need(self.max_backoff_s >= self.backoff_s, "max_backoff_s", self.max_backoff_s,
              f"must be >= backoff_s={self.backoff_s}")
        need(self.min_transfer_bps >= 0, "min_transfer_bps", self.min_transfer_bps,
              "must be >= 0 (0: no minimum)")
        need(self.transfer_grace_s >= 0, "transfer_grace_s", self.transfer_grace_s,
              "must be >= 0")
        need(self.guard_factor == 0 or self.guard_factor >= 1, "guard_factor", self.guard_factor,
             "must be 0 (off) or >= 1 (honest peers are about one drift apart)")
        need(self.guard_hard_factor >= self.guard_factor, "guard_hard_factor",
             self.guard_hard_factor, "must be >= guard_factor")
        need(self.guard_window >= 1, "guard_window", self.guard_window, "must be >= 1")
        need(self.guard_hard_base >= 0, "guard_hard_base", self.guard_hard_base,
             "must be >= 0")
        need(self.guard_trust_after >= 1, "guard_trust_after", self.guard_trust_after,
             "must be >= 1")
        need(self.guard_round_budget > 0, "guard_round_budget", self.guard_round_budget,
             "must be > 0")
        need(0 < self.guard_newcomer_budget <= self.guard_round_budget,
             "guard_newcomer_budget", self.guard_newcomer_budget,
             "must be in (0, guard_round_budget]")
        need(0 < self.guard_block_budget <= self.guard_newcomer_budget, "guard_block_budget",
             self.guard_block_budget, "must be in (0, guard_newcomer_budget]")
        need(self.guard_newcomer_total > 0, "guard_newcomer_total", self.guard_newcomer_total,
             "must be > 0")
        need(self.guard_newcomer_rounds >= 1, "guard_newcomer_rounds",
             self.guard_newcomer_rounds, "must be >= 1")
        need(-1 <= self.guard_min_cosine < 1, "guard_min_cosine", self.guard_min_cosine,
             "must be in [-1, 1) (-1: off)")
        need(math.isfinite(self.guard_min_z), "guard_min_z", self.guard_min_z,
             "must be a finite number (4: noise is accepted with probability about 3e-5; < 0: "
             "off)")
        need(self.guard_backoff_s >= 0, "guard_backoff_s", self.guard_backoff_s, "must be >= 0")
        for name in ("header_timeout_s", "chunk_timeout_s", "commit_timeout_s",
                     "download_timeout_s"):
            need(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        for name in ("header_timeout_s", "chunk_timeout_s", "commit_timeout_s"):
            need(getattr(self, name) < self.exchange_timeout_s, name, getattr(self, name),
                  f"must be shorter than exchange_timeout_s={self.exchange_timeout_s}")
        need(math.isfinite(self.min_link_mbps) and self.min_link_mbps >= 0, "min_link_mbps",
             self.min_link_mbps, "must be >= 0 megabits/s (0: fixed deadlines)")

    def transfer_s(self, nbytes: int) -> float:
        """Seconds ``nbytes`` (this node's own size of what it sends or fetches: never a
        peer's figure) take at the slowest rate this node plans for: ``min_link_mbps``, or the
        upload cap when lower; 0 with ``min_link_mbps`` 0."""
        if self.min_link_mbps <= 0:
            return 0.0
        rate = min(r for r in (self.min_link_mbps, self.max_upload_mbps) if r > 0)
        return nbytes * 8 / (rate * 1e6)

    def download_deadline_s(self, numel: int, buffers: int = 1) -> float:
        """The deadline of a state download for a model of ``numel`` parameters (this node's):
        ``download_timeout_s`` plus the largest state's time (parameters and the outer
        optimizer's ``buffers``, at least one, float32) on the slowest link."""
        return self.download_timeout_s + self.transfer_s(4 * numel * (1 + max(1, buffers)))


# An all-gather's messages a node plans for (memory, deadlines): its own and 8 members'. The
# group's real size is the leader's choice, capped by averaging.dht.gather_cap.
GATHER_PLANNED = 9


@dataclass(frozen=True)
class DilocoConfig:
    """The DiLoCo modes (``--algorithm diloco`` and ``streaming-diloco``, docs/algorithm.md
    section 3): every H inner steps (per fragment, staggered) the node all-reduces its outer
    gradient ``anchor - theta`` with the swarm (hivemind averaging on the node's DHT), then
    takes a Nesterov SGD step. A sync that finds no group applies the node's own outer gradient
    and training goes on."""

    diloco_eta: float = opt(0.7, "DiLoCo outer learning rate (Nesterov SGD)")
    diloco_gamma: float = opt(0.9, "DiLoCo outer momentum (Nesterov)")
    diloco_codec: str = opt("fp32", f"sync payload: {' | '.join(DILOCO_CODECS)} (an "
                                    "all-reduce, the project's codecs inside hivemind "
                                    "averaging; fp4 = E3M0), or sparse topkB:K / denseB (an "
                                    "all-gather with error feedback, SparseLoCo's; e.g. "
                                    "topk2:123: the top 3% of every 4096 values at 2 bits)")
    tau: int = opt(1, "streaming-diloco: inner steps a fragment's all-reduce overlaps before "
                      "it merges (0: blocking; must be < --inner-steps)")
    merge_alpha: float = opt(0.0, "streaming-diloco: weight of the local fragment when merging "
                                  "(theta_f <- a * local + (1 - a) * averaged)")
    target_group_size: int = opt(0, "peers per all-reduce group (0: every compatible peer the "
                                    "DHT lists, this node included)", advanced=True)
    min_group_size: int = opt(2, "smallest group that averages; a smaller one fails the round",
                              advanced=True)
    matchmaking_time_s: float = opt(5.0, "wait this long for late groupmates before averaging "
                                         "with those that joined", advanced=True)
    request_timeout_s: float = opt(3.0, "wait for a group leader's answer", advanced=True)
    averaging_timeout_s: float = opt(30.0, "give up finding a group after this long (the round "
                                           "then applies this node's own outer gradient)",
                                     advanced=True)
    allreduce_timeout_s: float = opt(120.0, "deadline of the all-reduce once a group formed",
                                     advanced=True)
    part_timeout_s: float = opt(5.0, "all-reduce: a groupmate silent this long is dropped (its "
                                     "share of the model stays unaveraged this round)",
                                advanced=True)

    def async_config(self) -> AsyncConfig:
        """The node state for DiLoCo: the "local" momentum form keeps ``m`` (zero at start;
        none at gamma 0), which is exactly the Nesterov buffer; the all-reduced gradient
        replaces the drift."""
        return AsyncConfig(eta=self.diloco_eta, gamma=self.diloco_gamma, momentum="local")

    def validate(self) -> None:
        check_outer_step(self.diloco_eta, self.diloco_gamma, "diloco_eta", "diloco_gamma")
        if self.diloco_codec not in DILOCO_CODECS:
            choose = f"choose one of {DILOCO_CODECS} or a sparse topkB:K / denseB"
            try:
                spec = self.sparse_spec()
            except ValueError as exc:
                detail = "" if str(exc) == "not a codec" else f" ({exc})"
                raise ConfigError(f"--diloco-codec={self.diloco_codec!r}: {choose}{detail}"
                                  ) from None
            need(spec is not None and spec.select != "randk", "diloco_codec", self.diloco_codec,
                 "randk needs a seed per sender, which the all-gather does not carry: use "
                 "topkB:K or denseB (the simulator has randk)")
        need(self.tau >= 0, "tau", self.tau, "must be >= 0")
        need(0.0 <= self.merge_alpha <= 1.0, "merge_alpha", self.merge_alpha, "must be in [0, 1]")
        need(self.min_group_size >= 2, "min_group_size", self.min_group_size, "must be >= 2")
        need(self.target_group_size == 0 or self.target_group_size >= self.min_group_size,
              "target_group_size", self.target_group_size,
              f"must be 0 (auto) or >= min_group_size={self.min_group_size}")
        for name in ("matchmaking_time_s", "request_timeout_s", "averaging_timeout_s",
                     "allreduce_timeout_s", "part_timeout_s"):
            need(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        need(self.part_timeout_s < self.allreduce_timeout_s, "part_timeout_s",
              self.part_timeout_s,
              f"must be shorter than allreduce_timeout_s={self.allreduce_timeout_s}")
        # hivemind: a leader's answer must come within the matchmaking window (else deadlocks
        # between two would-be leaders last longer), and the window must fit in the deadline.
        need(self.request_timeout_s < self.matchmaking_time_s, "request_timeout_s",
              self.request_timeout_s,
              f"must be shorter than matchmaking_time_s={self.matchmaking_time_s}")
        need(self.averaging_timeout_s > self.matchmaking_time_s, "averaging_timeout_s",
              self.averaging_timeout_s,
              f"must exceed matchmaking_time_s={self.matchmaking_time_s}")

    def sparse_spec(self) -> SparseSpec | None:
        """The sparse payload of ``--diloco-codec`` (syncs are all-gathers with error
        feedback), None for the all-reduce codecs; ValueError for a malformed one."""
        if self.diloco_codec in DILOCO_CODECS:
            return None
        spec = parse_codec(self.diloco_codec)  # ValueError for a malformed one
        if not isinstance(spec, SparseSpec):
            raise ValueError("not a codec")
        return spec

    def sync_upload_bytes(self, numel: int) -> int:
        """What this node uploads in one sync of ``numel`` parameters, at most: an
        all-reduce sends its parts and, as a reducer, the averaged parts (2 x the float32
        vector); an all-gather its message and the relayed ones (``GATHER_PLANNED``)."""
        sparse = self.sparse_spec()
        return 2 * 4 * numel if sparse is None else GATHER_PLANNED * sparse.wire_bytes(numel)


@dataclass(frozen=True)
class CheckpointConfig:
    """Atomic periodic checkpoints (write a temporary file, then rename)."""

    checkpoint_dir: str = opt("", "directory for checkpoints (empty: the node's state folder "
                                  "if it keeps its identity there, see auto_checkpoint)")
    checkpoint_interval_s: float = opt(300.0, "save every this many seconds")
    resume: bool = opt(True, "load the checkpoint in --checkpoint-dir at start if present")
    auto_checkpoint: bool = opt(True, "with no --checkpoint-dir, checkpoint in the node's "
                                      "state folder beside the identity it keeps there (one "
                                      "folder per model), so a restart resumes; false: none",
                                advanced=True)

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
    metrics_host: str = opt("", "listen address of /metrics (empty: the same as --host)",
                            advanced=True)

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
        layers = self.train.gpt().n_layer
        need(not self.train.builtin_model or self.gossip.fragments <= layers, "fragments",
             self.gossip.fragments, f"cannot exceed the model's --n-layer={layers}")
        need(self.gossip.chunk_bytes + 1024 <= self.network.max_message_bytes, "chunk_bytes",
              self.gossip.chunk_bytes,
              f"must leave 1 KiB of headroom under max_message_bytes="
              f"{self.network.max_message_bytes}")
        need(self.metrics.metrics_port <= 0 or self.metrics.metrics_port != self.network.port,
              "metrics_port", self.metrics.metrics_port, "must differ from --port")
        need(self.gossip.fragments == 1 or self.outer.algorithm != "diloco", "fragments",
              self.gossip.fragments, "--algorithm diloco all-reduces the whole model: use 1 "
              "(or --algorithm streaming-diloco)")
        need(self.outer.algorithm != "streaming-diloco"
             or self.diloco.tau < self.train.inner_steps, "tau", self.diloco.tau,
             f"must be shorter than --inner-steps={self.train.inner_steps} (a fragment's sync "
             "lands before its next one starts)")
        need(self.network.connect_timeout_s < self.gossip.exchange_timeout_s,
              "connect_timeout_s", self.network.connect_timeout_s,
              f"must be shorter than exchange_timeout_s={self.gossip.exchange_timeout_s}")
        problem = self.network.admission_problem(joining=bool(self.discovery.peers))
        if problem is not None:
            raise ConfigError(problem)
        return self


SECTIONS: tuple[str, ...] = tuple(f.name for f in fields(NodeConfig))
