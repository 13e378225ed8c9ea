"""Simulated workers: real tiny-GPT replicas whose parameters are rows of one buffer.

All workers' flat parameters live in ``thetas: [n, numel]``, so outer updates, mixing and
consensus distance are whole-tensor ops. Each worker keeps its own AdamW state, data shard and
batch generator; the data is loaded once and shared read-only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gasloc_p2p.core.flat import FlatParams
from gasloc_p2p.data import BPETokenizer, ByteTokenizer, TokenData, evaluate, load_corpus
from gasloc_p2p.model import GPT, GPTConfig, build_model
from gasloc_p2p.sim.config import SimConfig


def lr_at(step: int, base_lr: float, warmup: int, total: int) -> float:
    """Linear warmup then cosine decay to 10% of ``base_lr``; ``step`` counts from 0."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Worker:
    index: int
    model: GPT
    opt: torch.optim.AdamW
    shard_batch: object
    gen: torch.Generator
    steps: int = 0


class Swarm:
    """n workers sharing data; ``thetas`` rows are their live flat parameters."""

    def __init__(self, cfg: SimConfig, data: TokenData | None = None) -> None:
        self.cfg = cfg
        dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
        self.data = data if data is not None else load_token_data(cfg.data, cfg.tokenizer)
        self.gpt = GPTConfig(vocab_size=self.data.vocab_size, seq_len=cfg.seq_len,
                             n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head)
        base = build_model(self.gpt, cfg.seed, dtype)
        self.flat0 = FlatParams(base)  # theta_0, and the eval model's buffer
        self.theta0 = self.flat0.buffer.detach().clone()
        self.eval_model = base
        n = cfg.workers
        self.thetas = self.theta0.repeat(n, 1)
        shards = self.data.shards(n, cfg.iid, cfg.seed)
        self.workers: list[Worker] = []
        for i in range(n):
            model = build_model(self.gpt, cfg.seed, dtype)
            FlatParams(model, self.thetas[i])
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                    weight_decay=cfg.weight_decay)
            gen = torch.Generator().manual_seed(cfg.seed * 100_003 + i)
            self.workers.append(Worker(i, model, opt, shards[i].batch, gen))
        self.val = self.data.val_batches(cfg.batch_size * 2, cfg.seq_len, cfg.eval_batches)
        self.spans = self.flat0.spans

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len

    def inner_step(self, i: int) -> float:
        """One AdamW step of worker ``i`` on its shard; returns the training loss."""
        w = self.workers[i]
        cfg = self.cfg
        for group in w.opt.param_groups:
            group["lr"] = lr_at(w.steps, cfg.lr, cfg.warmup_steps, cfg.steps)
        x, y = w.shard_batch(cfg.batch_size, cfg.seq_len, w.gen)  # type: ignore[operator]
        w.opt.zero_grad(set_to_none=True)
        _, loss = w.model(x, y)
        assert loss is not None
        loss.backward()
        w.opt.step()
        w.steps += 1
        return float(loss.detach())

    def eval_params(self, flat: torch.Tensor) -> float:
        """Validation loss of the model with flat parameters ``flat: [numel]``."""
        self.flat0.buffer.copy_(flat)
        return evaluate(self.eval_model, self.val)

    def evaluate(self) -> dict[str, float]:
        """Network-average model's loss, worst worker's loss, and consensus distance."""
        mean = self.thetas.mean(dim=0)
        out = {"val_loss": self.eval_params(mean),
               "consensus": float(((self.thetas - mean) ** 2).sum(dim=1).mean())}
        if self.cfg.eval_workers and self.cfg.workers > 1:
            out["worst_val_loss"] = max(self.eval_params(row) for row in self.thetas)
        else:
            out["worst_val_loss"] = out["val_loss"]
        return out


_DATA_CACHE: dict[tuple[str | None, str], TokenData] = {}


def load_token_data(data: str | None, tokenizer: str = "byte") -> TokenData:
    """Tokenized corpus, cached per process (several runs of a comparison share it)."""
    key = (data, tokenizer)
    if key not in _DATA_CACHE:
        corpus = load_corpus(data)
        tok: ByteTokenizer | BPETokenizer = (
            ByteTokenizer() if tokenizer == "byte" else BPETokenizer.train(corpus))
        _DATA_CACHE[key] = TokenData.build(corpus, tok)
    return _DATA_CACHE[key]
