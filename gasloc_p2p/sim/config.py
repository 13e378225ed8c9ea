"""Simulator configuration: one frozen dataclass, validated with actionable messages."""

from __future__ import annotations

from dataclasses import dataclass

from gasloc_p2p.core.codecs import CODEC_NAMES, CodecSpec, parse_optional
from gasloc_p2p.core.topology import GRAPHS, MATCHINGS

ALGORITHMS = ("gasloc", "diloco", "streaming-diloco", "gossip-sgd", "local")
MODES = ("sync", "async")
# Outer momentum defaults per algorithm (ALGORITHM.md: DiLoCo 0.9; GASLoC 1-peer at most ~0.5-0.7)
DEFAULT_GAMMA = {"gasloc": 0.5, "diloco": 0.9, "streaming-diloco": 0.9, "gossip-sgd": 0.0,
                 "local": 0.0}


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Times are simulated seconds; bandwidths in megabits per second."""

    algorithm: str = "gasloc"
    mode: str = "sync"
    workers: int = 4
    steps: int = 200  # inner steps per worker (equal-token budget)
    H: int = 10  # inner steps per round
    H_per_worker: tuple[int, ...] = ()  # overrides H per worker when given
    graph: str = "complete"
    matching: str = "1-peer"
    eta: float = 0.7
    gamma: float | None = None  # None: the algorithm's default (DEFAULT_GAMMA)
    w: float | None = None  # None: 1/2 for matchings, exact average for complete "all"
    variant: str = "mixed"  # sync gasloc: mixed | unmixed
    momentum: str = "mixed"  # async gasloc: mixed | local
    staleness_policy: str = "downweight"
    max_staleness: int = 1
    exchanges_per_round: float = 2.0  # async gossip rate per worker
    codec: str = "int8"  # a CodecSpec ("int8", "int4:256", ...) or "none": exact, unquantized
    fragments: int = 1
    tau: int = 1
    alpha: float = 0.0
    # model and data
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    seq_len: int = 64
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    data: str | None = None
    tokenizer: str = "byte"  # byte | bpe (trained locally, 4096 tokens)
    iid: bool = True
    seed: int = 0
    dtype: str = "float32"
    threads: int = 1
    # timing model
    step_time_s: float = 0.05
    bandwidth_mbps: float = 100.0
    latency_s: float = 0.02
    slow_workers: int = 0
    slow_link_factor: float = 1.0  # the slow workers' bandwidth is divided by this
    slow_compute_factor: float = 1.0  # ... and their step time multiplied by this
    aligned: bool = False  # async: exchanges only at synchronized round ends (testing)
    eval_every: int = 20  # steps per worker between evaluations
    eval_batches: int = 4
    eval_workers: bool = True  # also evaluate each worker (worst-worker loss); costs n evals

    @property
    def codec_spec(self) -> CodecSpec | None:
        """The exchanges' codec; None for "none" (exact float exchange, no references)."""
        return parse_optional(self.codec)

    @property
    def outer_gamma(self) -> float:
        return DEFAULT_GAMMA[self.algorithm] if self.gamma is None else self.gamma

    def h_of(self, worker: int) -> int:
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
            (self.graph in GRAPHS, f"unknown graph {self.graph!r}; choose from {GRAPHS}"),
            (self.matching in MATCHINGS, f"unknown matching {self.matching!r}; {MATCHINGS}"),
            (_parses(self.codec),
             f"unknown codec {self.codec!r}; choose none or one of {CODEC_NAMES}"),
            (self.dtype in ("float32", "float64"), "--dtype must be float32 or float64"),
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
            (self.exchanges_per_round > 0, "--exchanges-per-round must be > 0"),
            (self.eval_every >= 1 and self.eval_batches >= 1, "eval settings must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def compute_factor(self, worker: int) -> float:
        return self.slow_compute_factor if worker < self.slow_workers else 1.0

    def bandwidth_bytes_s(self, worker: int) -> float:
        bw = self.bandwidth_mbps * 1e6 / 8
        return bw / self.slow_link_factor if worker < self.slow_workers else bw


def _parses(codec: str) -> bool:
    try:
        parse_optional(codec)
    except ValueError:
        return False
    return True
