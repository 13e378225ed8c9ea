"""JSON Lines and Parquet corpora, streamed: never loaded whole into memory.

Rows are read lazily by Hugging Face ``datasets`` (``streaming=True`` on local files: no
download, no Arrow cache on disk), one text field per row is tokenized and documents are packed
end to end (an end-of-text id between them when the tokenizer has one) into windows of
``seq_len + 1`` tokens. Memory is bounded by the reader's block, one document and the shuffle
buffer of :data:`SHUFFLE_WINDOWS` windows, whatever the file size.

Validation: every :data:`VAL_EVERY`-th document from the start of the stream (0, 20, 40, ...)
until the fixed evaluation set is full. These documents are never trained on, and the set is
the same on every node with the same files, field, tokenizer and sizes;
:func:`validation_description` names it (with a hash) for the Info RPC.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gasloc_p2p.data.corpus import Corpus, DataError, Document
from gasloc_p2p.data.tokenizers import Tokenizer

STREAM_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
VAL_EVERY = 20  # every 20th document (5%) is held out until the validation set is full
SHUFFLE_WINDOWS = 1024  # windows held for random sampling (per-node order)
_SAMPLE_CHARS = 4_000_000  # text that trains a --tokenizer bpe on a stream


def stream_files(data: str) -> tuple[str, list[str]] | None:
    """``("json" | "parquet", files)`` if ``data`` names JSON Lines or Parquet files (a file,
    a glob, or a directory holding such files), else None (text data)."""
    path = Path(data).expanduser()
    if any(ch in data for ch in "*?["):
        files = sorted(p for p in glob.glob(os.path.expanduser(data), recursive=True)
                       if Path(p).is_file())
    elif path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix in STREAM_SUFFIXES)
    else:
        files = [str(path)]
    kinds = {STREAM_SUFFIXES.get(Path(f).suffix) for f in files}
    if not files or None in kinds:
        return None
    if len(kinds) != 1:
        raise DataError(f"--data {data!r} mixes JSON Lines and Parquet files: use one kind")
    return kinds.pop() or "", files


def _load_dataset() -> Any:
    try:
        from datasets import load_dataset
    except ImportError as exc:
        raise DataError("JSON Lines / Parquet data needs Hugging Face datasets: "
                        "pip install 'gasloc_p2p[hf]'") from exc
    return load_dataset


class DocumentStream:
    """The text field of every row of ``files``, in file then row order, read lazily."""

    def __init__(self, kind: str, files: list[str], field: str) -> None:
        self.kind, self.files, self.field = kind, files, field

    def __iter__(self) -> Iterator[str]:
        ds = _load_dataset()(self.kind, data_files=self.files, split="train", streaming=True)
        if ds.column_names is not None and self.field not in ds.column_names:
            raise DataError(f"--data-field {self.field!r} is not a column of {self.files[0]}; "
                            f"columns: {', '.join(ds.column_names)}")
        for row in ds.select_columns([self.field]):
            text = row[self.field]
            if isinstance(text, str) and text:
                yield text

    def sample(self, max_chars: int = _SAMPLE_CHARS) -> Corpus:
        """The first documents, up to about ``max_chars`` characters (to train a BPE)."""
        docs, total = [], 0
        for i, text in enumerate(self):
            docs.append(Document(f"{i:09d}", text))
            total += len(text)
            if total >= max_chars:
                break
        if not docs:
            raise DataError(f"{self.files[0]}: no non-empty {self.field!r} values")
        return Corpus(tuple(docs))


def _encode(tokenizer: Tokenizer, text: str) -> Tensor:
    ids = tokenizer.encode(text).to(torch.int32)
    if tokenizer.eos_id is not None:
        ids = torch.cat([ids, torch.tensor([tokenizer.eos_id], dtype=torch.int32)])
    return ids


def _pack(docs: Iterator[Tensor], width: int) -> Iterator[Tensor]:
    """Consecutive windows of ``width`` tokens (int32) over the concatenated documents."""
    pending: list[Tensor] = []
    have = 0
    for ids in docs:
        pending.append(ids)
        have += ids.numel()
        if have < width:
            continue
        flat = torch.cat(pending)
        n = flat.numel() // width
        yield from flat[: n * width].view(n, width).clone().unbind(0)
        rest = flat[n * width:]
        pending, have = [rest.clone()], rest.numel()


class StreamData:
    """A streamed corpus: the validation windows (in memory) and the training stream."""

    def __init__(self, docs: DocumentStream, tokenizer: Tokenizer, seq_len: int,
                 val_windows: int) -> None:
        self.docs, self.tokenizer, self.seq_len = docs, tokenizer, seq_len
        self.val, self.val_last_doc = self._validation(val_windows)

    def _is_val(self, i: int) -> bool:
        return i % VAL_EVERY == 0 and i <= self.val_last_doc

    def _validation(self, count: int) -> tuple[Tensor, int]:
        width = self.seq_len + 1
        chosen: list[Tensor] = []
        have, last = 0, -1
        for i, text in enumerate(self.docs):
            if i % VAL_EVERY:
                continue
            chosen.append(_encode(self.tokenizer, text))
            have, last = have + chosen[-1].numel(), i
            if have >= count * width:
                break
        if have < width:
            raise DataError(f"{self.docs.files[0]}: the validation documents hold {have} "
                            f"tokens, fewer than --seq-len+1={width}; use more data")
        n = min(count, have // width)
        return torch.cat(chosen)[: n * width].view(n, width), last

    def val_batches(self, batch_size: int) -> list[tuple[Tensor, Tensor]]:
        """The fixed evaluation set: (x, y) LongTensor [b, seq_len] batches."""
        w = self.val.long()
        return list(zip(w[:, :-1].split(batch_size), w[:, 1:].split(batch_size), strict=True))

    def description(self) -> str:
        """What the validation set is, with a hash of its tokens (equal on every node)."""
        digest = hashlib.sha256(self.tokenizer.name.encode())
        digest.update(self.val.contiguous().numpy().tobytes())
        names = ",".join(Path(f).name for f in self.docs.files[:3])
        more = f"+{len(self.docs.files) - 3}" if len(self.docs.files) > 3 else ""
        return (f"{self.docs.kind}:{names}{more} field={self.docs.field} "
                f"tokenizer={self.tokenizer.name} windows={self.val.shape[0]}x{self.seq_len} "
                f"sha256={digest.hexdigest()[:16]}")

    def train_windows(self, shard: tuple[int, int] | None = None) -> Iterator[Tensor]:
        """Training windows (int32 [seq_len + 1]) forever: epoch after epoch over the stream,
        skipping the validation documents; ``shard`` (K, N) keeps every N-th document."""
        k, n = shard or (0, 1)
        while True:
            seen = [0]
            yield from _pack(self._train_docs(k, n, seen), self.seq_len + 1)
            if seen[0] == 0:
                raise DataError(f"{self.docs.files[0]}: no training documents left for shard "
                                f"{k}/{n} after the validation set; use more data")

    def _train_docs(self, k: int, n: int, seen: list[int]) -> Iterator[Tensor]:
        j = 0
        for i, text in enumerate(self.docs):
            if self._is_val(i):
                continue
            if j % n == k:
                seen[0] += 1
                yield _encode(self.tokenizer, text)
            j += 1


class StreamShard:
    """Random batches from a window stream: a shuffle buffer drawn with the caller's generator.

    Same interface as :class:`gasloc_p2p.data.tokens.Shard`; the order depends only on the
    stream and the generator's seed (deterministic per node)."""

    def __init__(self, windows: Iterator[Tensor], seq_len: int,
                 capacity: int = SHUFFLE_WINDOWS) -> None:
        self.windows, self.seq_len, self.capacity = windows, seq_len, capacity
        self.buffer: list[Tensor] = []

    def batch(self, batch_size: int, seq_len: int,
              generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """x, y LongTensor [B, T]: B windows drawn from the buffer, each replaced from the stream."""
        if seq_len != self.seq_len:
            raise DataError(f"stream packed for seq_len={self.seq_len}, asked for {seq_len}")
        while len(self.buffer) < self.capacity:
            nxt = next(self.windows, None)
            if nxt is None:
                break
            self.buffer.append(nxt)
        picks = []
        for _ in range(batch_size):
            i = int(torch.randint(0, len(self.buffer), (1,), generator=generator))
            picks.append(self.buffer[i])
            nxt = next(self.windows, None)
            if nxt is not None:
                self.buffer[i] = nxt
        w = torch.stack(picks).long()
        return w[:, :-1], w[:, 1:]
