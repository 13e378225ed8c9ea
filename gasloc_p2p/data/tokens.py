"""Tokenized in-memory corpora: train/validation splits, per-worker shards, fixed val batches."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gasloc_p2p.data.corpus import Corpus, DataError
from gasloc_p2p.data.tokenizers import Tokenizer


def _storage_dtype(vocab_size: int) -> torch.dtype:
    """Smallest dtype holding ids < vocab_size (uint8 / int16 / int32)."""
    if vocab_size <= 256:
        return torch.uint8
    return torch.int16 if vocab_size <= 2**15 else torch.int32


def _windows(tokens: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """Inputs and next-token targets, both LongTensor [len(starts), seq_len]."""
    w = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return w[:, :-1], w[:, 1:]


@dataclass(frozen=True, eq=False)
class Shard:
    """A worker's training tokens: ``ranges`` are [start, end) into ``TokenData.train``.

    ``tokens`` is their concatenation; sampled windows may span a range boundary.
    """

    worker: int
    tokens: Tensor
    ranges: tuple[tuple[int, int], ...]
    documents: tuple[str, ...]

    def batch(self, batch_size: int, seq_len: int,
              generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """B random windows: x, y LongTensor [B, T], y = x shifted by one token."""
        n = self.tokens.numel()
        if n < seq_len + 1:
            raise DataError(f"shard {self.worker} has {n} tokens, fewer than seq_len+1="
                            f"{seq_len + 1}; use fewer workers, a shorter seq_len or more data")
        starts = torch.randint(0, n - seq_len, (batch_size,), generator=generator)
        return _windows(self.tokens, starts, seq_len)


def _balanced_groups(sizes: Sequence[int], n: int) -> list[list[int]]:
    """Greedy largest-first assignment of items to n groups (each joins the lightest)."""
    groups: list[list[int]] = [[] for _ in range(n)]
    totals = [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = min(range(n), key=lambda g: (totals[g], g))
        groups[g].append(i)
        totals[g] += sizes[i]
    return groups


def _spans(parts: Sequence[Tensor]) -> tuple[tuple[int, int], ...]:
    """[start, end) of each part within their concatenation."""
    ends = list(itertools.accumulate(p.numel() for p in parts))
    return tuple(zip([0, *ends[:-1]], ends, strict=True))


@dataclass(frozen=True, eq=False)
class TokenData:
    """Tokenized corpus: ``train`` and ``val`` are 1-D id tensors (uint8/int16/int32).

    Each document's last ``val_fraction`` of tokens goes to ``val`` and is never in a shard.
    ``doc_train[i]`` / ``doc_val[i]`` are the [start, end) ranges of document ``doc_names[i]``.
    """

    tokenizer_name: str
    vocab_size: int
    train: Tensor
    val: Tensor
    doc_names: tuple[str, ...]
    doc_train: tuple[tuple[int, int], ...]
    doc_val: tuple[tuple[int, int], ...]

    @classmethod
    def build(cls, corpus: Corpus, tokenizer: Tokenizer, val_fraction: float = 0.05) -> TokenData:
        """Tokenize every document and split off the tail of each as validation."""
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
        dtype = _storage_dtype(tokenizer.vocab_size)
        ids = [tokenizer.encode(d.text).to(dtype) for d in corpus.documents]
        cuts = [t.numel() - math.ceil(t.numel() * val_fraction) for t in ids]
        train = [t[:c] for t, c in zip(ids, cuts, strict=True)]
        val = [t[c:] for t, c in zip(ids, cuts, strict=True)]
        return cls(tokenizer.name, tokenizer.vocab_size, torch.cat(train), torch.cat(val),
                   tuple(d.name for d in corpus.documents), _spans(train), _spans(val))

    def fingerprint(self) -> str:
        """sha256 hex of the tokenizer name and both splits: equal on nodes with equal data."""
        digest = hashlib.sha256(self.tokenizer_name.encode())
        for part in (self.train, self.val):
            digest.update(part.numel().to_bytes(8, "little"))
            digest.update(part.contiguous().numpy().tobytes())
        return digest.hexdigest()

    def shards(self, n: int, iid: bool, seed: int, chunk_tokens: int = 4096) -> list[Shard]:
        """Disjoint training shards covering all of ``train``, one per worker.

        iid: ``train`` is cut into contiguous chunks of about ``chunk_tokens`` (at least n
        chunks), shuffled with ``seed`` and dealt round-robin. Non-iid: whole documents, grouped
        largest-first onto the lightest worker, then worker labels permuted with ``seed``. If
        n exceeds the number of documents, every document is first cut into
        ceil(n / documents) equal contiguous pieces, so each worker still sees few documents.
        """
        if n < 1:
            raise DataError(f"number of shards must be >= 1, got {n}")
        gen = torch.Generator().manual_seed(seed)
        pieces: list[tuple[tuple[int, int], str]] = []  # ((start, end), document or "")
        if iid:
            total = self.train.numel()
            k = max(n, math.ceil(total / chunk_tokens))
            bounds = [total * i // k for i in range(k + 1)]
            pieces = [((bounds[i], bounds[i + 1]), "") for i in range(k)]
            order = torch.randperm(k, generator=gen).tolist()
            groups = [order[w::n] for w in range(n)]
        else:
            per_doc = math.ceil(n / len(self.doc_names))
            for name, (a, b) in zip(self.doc_names, self.doc_train, strict=True):
                cuts = [a + (b - a) * j // per_doc for j in range(per_doc + 1)]
                pieces += [((cuts[j], cuts[j + 1]), name) for j in range(per_doc)]
            groups = _balanced_groups([b - a for (a, b), _ in pieces], n)
            groups = [groups[w] for w in torch.randperm(n, generator=gen).tolist()]
        return [self._shard(w, sorted(pieces[i] for i in g)) for w, g in enumerate(groups)]

    def _shard(self, worker: int, pieces: list[tuple[tuple[int, int], str]]) -> Shard:
        ranges = tuple(r for r, _ in pieces if r[1] > r[0])
        if not ranges:
            raise DataError(f"shard {worker} is empty: too many workers for "
                            f"{self.train.numel()} training tokens")
        tokens = torch.cat([self.train[a:b] for a, b in ranges])
        docs = tuple(dict.fromkeys(name for _, name in pieces if name))
        return Shard(worker, tokens, ranges, docs)

    def val_batches(self, batch_size: int, seq_len: int,
                    max_batches: int) -> list[tuple[Tensor, Tensor]]:
        """A fixed evaluation set, identical on every node (no RNG involved).

        Up to ``max_batches * batch_size`` windows of ``seq_len`` tokens, evenly spaced over
        all of ``val`` (a window may span two documents); each item is (x, y), LongTensor
        [b, T] with b <= batch_size (only the last batch may be smaller)."""
        span = self.val.numel() - seq_len - 1
        if span < 0:
            raise DataError(f"validation split has {self.val.numel()} tokens, fewer than "
                            f"seq_len+1={seq_len + 1}; use more data or a larger val_fraction")
        count = min(max_batches * batch_size, span // seq_len + 1)
        starts = torch.arange(count) * span // max(count - 1, 1)
        x, y = _windows(self.val, starts, seq_len)
        return list(zip(x.split(batch_size), y.split(batch_size), strict=True))
