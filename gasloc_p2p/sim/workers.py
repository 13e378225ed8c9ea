"""Simulated workers: real tiny-GPT replicas whose parameters are rows of one buffer.

All workers' flat parameters live in ``thetas: [n, numel]``, so outer updates, mixing and
consensus distance are whole-tensor ops. Each worker keeps its own inner loop (the daemon's
:class:`~gasloc_p2p.train.InnerLoop`: AdamW state and schedule), data shard and batch generator;
the data is loaded once and shared read-only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gasloc_p2p.core.flat import FlatParams
from gasloc_p2p.data import BPETokenizer, ByteTokenizer, Shard, TokenData, load_corpus, registry
from gasloc_p2p.model import GPTConfig, build_model
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.train import AdamWConfig, InnerLoop, LRSchedule, evaluate
from gasloc_p2p.train.inner import StepConfig, resolve_device


def worker_data_seed(seed: int, worker: int) -> int:
    """Seed of simulated worker ``worker``'s batch sampling in a run seeded ``seed``.

    A daemon started with ``--seed seed --shard worker/n --data-seed`` set to this value, on
    the same corpus, draws exactly the batches this worker draws in an i.i.d. run
    (``tests/test_train_equivalence.py`` relies on it).
    """
    return seed * 100_003 + worker


def inner_settings(cfg: SimConfig) -> tuple[LRSchedule, AdamWConfig]:
    """The simulator's inner schedule and optimizer: the cosine spans the whole run."""
    schedule = LRSchedule(lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                          min_lr_ratio=cfg.min_lr_ratio, horizon_steps=cfg.steps)
    return schedule, AdamWConfig(weight_decay=cfg.weight_decay, decay_vectors=cfg.decay_vectors)


@dataclass
class Worker:
    """One simulated worker: its inner loop, data shard, batch RNG and step count."""

    index: int
    inner: InnerLoop
    shard: Shard
    gen: torch.Generator
    steps: int = 0


class SimWorkers:
    """n workers sharing data; ``thetas`` rows are their live flat parameters."""

    def __init__(self, cfg: SimConfig, data: TokenData | None = None) -> None:
        self.cfg = cfg
        dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
        self.device = resolve_device(cfg.device)
        self.data = data if data is not None else load_token_data(cfg.data, cfg.tokenizer)
        self.gpt = GPTConfig(vocab_size=self.data.vocab_size, seq_len=cfg.seq_len,
                             n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head)
        base = self._build(dtype)
        self.flat0 = FlatParams(base)  # theta_0, and the eval model's buffer
        self.theta0 = self.flat0.buffer.detach().clone()
        self.eval_model = base
        n = cfg.workers
        self.thetas = self.theta0.repeat(n, 1)
        shards = self.data.shards(n, cfg.iid, cfg.seed)
        schedule, adamw = inner_settings(cfg)
        self.workers: list[Worker] = []
        how = StepConfig(cfg.precision)
        for i in range(n):
            model = self._build(dtype)
            FlatParams(model, self.thetas[i])
            gen = torch.Generator().manual_seed(worker_data_seed(cfg.seed, i))
            self.workers.append(Worker(i, InnerLoop(model, schedule, adamw, how), shards[i],
                                       gen))
        self.val = self.data.val_batches(cfg.batch_size * 2, cfg.seq_len, cfg.eval_batches)
        self.trace_val = self.val[:max(1, cfg.trace_batches)]
        self.spans = self.flat0.spans

    def _build(self, dtype: torch.dtype) -> torch.nn.Module:
        """A replica at theta_0 on the simulator's device: the built-in GPT, or the
        ``--model`` Hugging Face config with the node's seeded init (the same theta_0 a node
        of this run starts from)."""
        if not self.cfg.model:
            return build_model(self.gpt, self.cfg.seed, dtype).to(self.device)
        from gasloc_p2p import hf

        config = hf.read_config(self.cfg.model)
        vocab = int(getattr(config, "vocab_size", 0))
        if vocab < self.data.vocab_size:
            raise ValueError(f"--model {self.cfg.model}: vocabulary {vocab} is smaller than "
                             f"the tokenizer's {self.data.vocab_size}")
        return hf.from_config(config, self.cfg.seed).to(dtype).to(self.device)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len

    def inner_step(self, i: int) -> float:
        """One AdamW step of worker ``i`` on its shard; returns the training loss."""
        w = self.workers[i]
        x, y = w.shard.batch(self.cfg.batch_size, self.cfg.seq_len, w.gen)
        loss = w.inner.step(x, y, w.steps)
        w.steps += 1
        return float(loss)

    def eval_params(self, flat: torch.Tensor) -> float:
        """Validation loss of the model with flat parameters ``flat: [numel]``."""
        self.flat0.buffer.copy_(flat)
        return evaluate(self.eval_model, self.val)

    def trace_loss(self) -> float:
        """Quick loss of the network-average model on the first ``trace_batches`` batches."""
        self.flat0.buffer.copy_(self.thetas.mean(dim=0))
        return evaluate(self.eval_model, self.trace_val)

    def mean_steps(self) -> float:
        """Inner steps taken, averaged over the workers."""
        return sum(w.steps for w in self.workers) / self.cfg.workers

    def finished(self) -> bool:
        """The equal-token budget is spent: every worker took ``steps`` steps (budget "each"),
        or all of them ``workers * steps`` together (budget "total")."""
        done = [w.steps for w in self.workers]
        if self.cfg.budget == "total":
            return sum(done) >= self.cfg.steps * self.cfg.workers
        return min(done) >= self.cfg.steps

    def round_steps(self) -> list[int]:
        """Inner steps each worker takes this round: its ``H_i``, clipped to the budget."""
        if self.cfg.budget == "total":
            return [self.cfg.h_of(i) for i in range(self.cfg.workers)]
        return [min(self.cfg.h_of(i), self.cfg.steps - w.steps)
                for i, w in enumerate(self.workers)]

    def consensus(self) -> float:
        """Consensus distance: the mean over workers of ``||theta_i - mean||^2``. In float64,
        where the mean of identical float32 replicas is exact: replicas that agree (DiLoCo
        after a sync, everyone at theta_0) read 0, not float32 rounding (about 1e-12)."""
        t = self.thetas.double()
        return float(((t - t.mean(dim=0)) ** 2).sum(dim=1).mean())

    def evaluate(self) -> dict[str, float]:
        """Network-average model's loss, worst worker's loss, and consensus distance."""
        out = {"val_loss": self.eval_params(self.thetas.mean(dim=0)),
               "consensus": self.consensus()}
        if self.cfg.eval_workers and self.cfg.workers > 1:
            out["worst_val_loss"] = max(self.eval_params(row) for row in self.thetas)
        else:
            out["worst_val_loss"] = out["val_loss"]
        return out


_DATA_CACHE: dict[tuple[str | None, str], TokenData] = {}


def load_token_data(data: str | None, tokenizer: str = "byte") -> TokenData:
    """Tokenized corpus, cached per process (several runs of a comparison share it)."""
    key = (data, tokenizer)
    if key not in _DATA_CACHE and registry.is_built(data):  # gasloc-node corpus: its tokenizer
        assert data is not None
        _DATA_CACHE[key] = registry.load(data)[0]
    if key not in _DATA_CACHE:
        corpus = load_corpus(data)
        tok: ByteTokenizer | BPETokenizer = (
            ByteTokenizer() if tokenizer == "byte" else BPETokenizer.train(corpus))
        _DATA_CACHE[key] = TokenData.build(corpus, tok)
    return _DATA_CACHE[key]
