"""``--data`` / ``--tokenizer`` / ``--data-field`` to a node's batches and validation set."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from gasloc_p2p.data.corpus import load_corpus
from gasloc_p2p.data.sources import fetch_url, is_hub, is_url
from gasloc_p2p.data.stream import DocumentStream, StreamData, StreamShard, stream_files
from gasloc_p2p.data.tokenizers import Tokenizer, load_tokenizer
from gasloc_p2p.data.tokens import TokenData


class Batches(Protocol):
    """Where a worker's training batches come from (:class:`Shard` or :class:`StreamShard`)."""

    def batch(self, batch_size: int, seq_len: int,
              generator: torch.Generator) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True, eq=False)
class TrainingData:
    """One node's data: its batches, the validation batches (identical on every node of a run
    with the same data flags) and a description of that validation set with its hash."""

    tokenizer: Tokenizer
    train: Batches
    val: list[tuple[Tensor, Tensor]]
    validation_set: str


def load_training_data(data: str, tokenizer: str = "byte", field: str = "text", *,
                       seq_len: int, batch_size: int, eval_batches: int,
                       shard: tuple[int, int] | None = None, seed: int = 0,
                       bpe_vocab_size: int = 4096, data_sha256: str = "") -> TrainingData:
    """Text files (in memory, ``data`` empty: Shakespeare), JSON Lines / Parquet (streamed),
    a URL of either (downloaded once, checked against ``data_sha256`` when given) or a Hugging
    Face dataset ``hf:NAME[:CONFIG][@SPLIT]`` (streamed, in an order of this node's ``seed``).

    ``shard`` (K, N) keeps the K-th of N parts of the training data (text: chunks dealt with
    ``seed``; streams: every N-th document); None trains on all of it.
    """
    if is_url(data):
        data = str(fetch_url(data, data_sha256))
    found = ("hub", [data]) if is_hub(data) else stream_files(data) if data else None
    if found is None:
        corpus = load_corpus(data or None)
        tok = load_tokenizer(tokenizer, corpus, bpe_vocab_size)
        tokens = TokenData.build(corpus, tok)
        k, n = shard or (0, 1)
        part = tokens.shards(n, iid=True, seed=seed)[k]
        val = tokens.val_batches(batch_size, seq_len, eval_batches)
        digest = hashlib.sha256(tok.name.encode())
        for x, y in val:
            digest.update(x.numpy().tobytes() + y[:, -1:].numpy().tobytes())
        desc = (f"text:{data or 'shakespeare'} tokenizer={tok.name} batches={len(val)}x"
                f"{batch_size}x{seq_len} sha256={digest.hexdigest()[:16]}")
        return TrainingData(tok, part, val, desc)
    kind, files = found
    docs = DocumentStream(kind, files, field, seed=seed)
    tok = load_tokenizer(tokenizer, docs.sample() if tokenizer == "bpe" else None,
                         bpe_vocab_size)
    stream = StreamData(docs, tok, seq_len, eval_batches * batch_size)
    train = StreamShard(stream.train_windows(shard), seq_len)
    return TrainingData(tok, train, stream.val_batches(batch_size), stream.description())
