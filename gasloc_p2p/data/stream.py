"""JSON Lines and Parquet corpora, streamed: never loaded whole into memory.

Rows are read lazily: JSON Lines by Hugging Face ``datasets`` (``streaming=True`` on local
files: no download, no Arrow cache on disk), Parquet by pyarrow in small batches of the text
column (``DocumentStream._parquet_rows``); one text field per row is tokenized and documents are packed
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
import logging
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
_SAMPLE_CHARS = 4_000_000
PARQUET_ROWS = 64  # rows decoded at a time
PARQUET_BUFFER_BYTES = 1 << 20  # read buffer per column chunk  # text that trains a --tokenizer bpe on a stream


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
        import datasets
    except ImportError as exc:
        raise DataError("JSON Lines / Parquet data needs Hugging Face datasets: "
                        "pip install 'gasloc_p2p[hf]'") from exc
    # its reading errors come back as exceptions, which become one DataError line; its own
    # logged copy of them would be a second, differently worded line
    datasets.logging.set_verbosity(logging.CRITICAL)
    return datasets.load_dataset


_KIND_NAMES = {"json": "JSON Lines", "parquet": "Parquet", "hub": "a Hugging Face dataset"}


class DocumentStream:
    """The text field of every row of ``files``, in file then row order, read lazily. A file
    that cannot be read raises :class:`DataError` naming ``--data`` and the file. Kind
    ``hub``: ``files`` is one ``hf:NAME[:CONFIG][@SPLIT]``, streamed with ``datasets``; its
    training order is the node's own (:meth:`training`, from ``seed``)."""

    def __init__(self, kind: str, files: list[str], field: str, seed: int = 0) -> None:
        self.kind, self.files, self.field, self.seed = kind, files, field, seed

    def training(self, epoch: int) -> Iterator[str]:
        """The documents in training order: the stream's own, or for a hub dataset this
        node's (its shards and a buffer shuffled with the node's seed and the epoch)."""
        if self.kind != "hub":
            return iter(self)
        return self._guarded(self.files[0], self._hub_rows(self.files[0], seed=self.seed + epoch))

    def _guarded(self, name: str, rows: Iterator[str]) -> Iterator[str]:
        try:
            yield from rows
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - any reader failure: one line, the source
            raise self._unreadable(name, exc) from None

    def _hub_rows(self, name: str, seed: int | None = None) -> Iterator[str]:
        from gasloc_p2p.data.sources import HubSpec, hub_problem, identity_seed

        spec = HubSpec.parse(name)
        why = hub_problem(spec.name)
        if why is not None:  # at once, not after the hub client's retries
            raise DataError(f"--data {name!r}: {why}; check this machine's network (or "
                            "HF_ENDPOINT), or pass a local copy of the data")
        try:
            ds = _load_dataset()(spec.name, spec.config, split=spec.split, streaming=True)
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - offline, no such dataset, no such split
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"--data {name!r}: cannot open it ({text}); check the name and "
                            "this machine's access to the Hugging Face hub") from None
        if ds.column_names is not None and self.field not in ds.column_names:
            raise DataError(f"--data-field {self.field!r} is not a column of {name}; "
                            f"columns: {', '.join(ds.column_names)}")
        if seed is not None:
            ds = ds.shuffle(seed=identity_seed(seed), buffer_size=SHUFFLE_WINDOWS)
        for row in ds.select_columns([self.field]):
            text = row[self.field]
            if isinstance(text, str) and text:
                yield text

    def __iter__(self) -> Iterator[str]:
        if self.kind == "hub":
            yield from self._guarded(self.files[0], self._hub_rows(self.files[0]))
            return
        for name in self.files:
            rows = self._parquet_rows(name) if self.kind == "parquet" else self._json_rows(name)
            try:
                yield from rows
            except DataError:
                raise
            except Exception as exc:  # noqa: BLE001 - any reader failure: one line, the file
                raise self._unreadable(name, exc) from None

    def _unreadable(self, name: str, exc: BaseException) -> DataError:
        if self.kind == "hub":
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return DataError(f"--data {name!r}: cannot read it ({text})")
        if not Path(name).is_file():
            return DataError(f"--data {name!r}: no such file (it went away)")
        if isinstance(exc, RuntimeError) and isinstance(exc.__cause__, StopIteration):
            return DataError(f"--data {name!r}: the file holds no rows")
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return DataError(f"--data {name!r}: cannot read it as {_KIND_NAMES[self.kind]} "
                         f"({text})")

    def _json_rows(self, name: str) -> Iterator[str]:
        ds = _load_dataset()("json", data_files=[name], split="train", streaming=True)
        if ds.column_names is not None and self.field not in ds.column_names:
            raise DataError(f"--data-field {self.field!r} is not a column of {name}; "
                            f"columns: {', '.join(ds.column_names)}")
        for row in ds.select_columns([self.field]):
            text = row[self.field]
            if isinstance(text, str) and text:
                yield text

    def _parquet_rows(self, name: str) -> Iterator[str]:
        """Parquet read with pyarrow directly: the text column only, :data:`PARQUET_ROWS` rows
        at a time, no pre-buffering of whole row groups, one thread. Through ``datasets``'
        streaming reader the resident memory grew with the file (by 440 MB for a 100 MB file,
        609 MB for 300 MB); this way it stayed flat (59 MB for both, benchmarks/bench_data.py)."""
        _load_dataset()  # the same extra as JSON Lines (it brings pyarrow)
        import pyarrow.parquet as pq

        f = pq.ParquetFile(name, pre_buffer=False, buffer_size=PARQUET_BUFFER_BYTES)
        if self.field not in f.schema_arrow.names:
            raise DataError(f"--data-field {self.field!r} is not a column of {name}; "
                            f"columns: {', '.join(f.schema_arrow.names)}")
        for batch in f.iter_batches(batch_size=PARQUET_ROWS, columns=[self.field],
                                    use_threads=False):
            for text in batch.column(0).to_pylist():
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
            raise DataError(f"--data {self.files[0]!r}: no non-empty --data-field "
                            f"{self.field!r} values")
        return Corpus(tuple(docs))


def _encode(tokenizer: Tokenizer, text: str) -> Tensor:
    ids = tokenizer.encode(text).to(torch.int32)
    if tokenizer.eos_id is not None:
        ids = torch.cat([ids, torch.tensor([tokenizer.eos_id], dtype=torch.int32)])
    return ids


class StreamData:
    """A streamed corpus: the validation windows (in memory) and the training stream."""

    def __init__(self, docs: DocumentStream, tokenizer: Tokenizer, seq_len: int,
                 val_windows: int) -> None:
        self.docs, self.tokenizer, self.seq_len = docs, tokenizer, seq_len
        self.val_texts: set[bytes] = set()  # digests of the validation documents
        self.val, self.val_last_doc = self._validation(val_windows)

    def _is_val(self, i: int, text: str = "") -> bool:
        """Whether the ``i``-th document read (``text``) is a validation one: by position in
        the stream's own order, by content in a node's own order (a hub dataset)."""
        if self.docs.kind == "hub":
            return hashlib.sha1(text.encode()).digest() in self.val_texts
        return i % VAL_EVERY == 0 and i <= self.val_last_doc

    def _validation(self, count: int) -> tuple[Tensor, int]:
        width = self.seq_len + 1
        chosen: list[Tensor] = []
        have, last = 0, -1
        for i, text in enumerate(self.docs):
            if i % VAL_EVERY:
                continue
            self.val_texts.add(hashlib.sha1(text.encode()).digest())
            chosen.append(_encode(self.tokenizer, text))
            have, last = have + chosen[-1].numel(), i
            if have >= count * width:
                break
        if have < width:
            raise DataError(f"--data {self.docs.files[0]!r}: the validation documents hold "
                            f"{have} tokens, fewer than --seq-len+1={width}; use more data")
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

    def train_windows(self, shard: tuple[int, int] | None = None,
                      position: dict[str, Any] | None = None) -> WindowStream:
        """Training windows (int32 [seq_len + 1]) forever: epoch after epoch over the stream,
        skipping the validation documents; ``shard`` (K, N) keeps every N-th document.
        ``position``: a :meth:`WindowStream.position` to continue from (a resumed node)."""
        return WindowStream(self, shard or (0, 1), position)


class WindowStream:
    """Documents packed end to end into windows, with a position a checkpoint can hold.

    The position is where the next window comes from: the epoch, the documents of the stream
    read in it, the training documents met (for the shard's every-N-th rule), the tokens
    left over from the last document and the windows cut but not handed out yet. Resuming reads
    the first documents again without tokenizing them, then continues exactly.
    """

    def __init__(self, data: StreamData, shard: tuple[int, int],
                 position: dict[str, Any] | None = None) -> None:
        self.data, (self.k, self.n) = data, shard
        self.width = data.seq_len + 1
        p = position or {}
        self.epoch, self.row = int(p.get("epoch", 0)), int(p.get("row", 0))
        self.met, self.seen = int(p.get("met", 0)), int(p.get("seen", 0))
        self.pending: Tensor = p.get("pending", torch.empty(0, dtype=torch.int32))
        self.ready: list[Tensor] = list(p.get("ready", []))
        if self.pending.dtype != torch.int32 or self.pending.dim() != 1 or any(
                w.shape != (self.width,) for w in self.ready):
            raise DataError("the saved stream position does not fit --seq-len; start the "
                            "data afresh (another --checkpoint-dir)")
        self._rows: Iterator[str] | None = None

    def position(self) -> dict[str, Any]:
        """Integers and int32 tensors (a checkpoint's ``weights_only`` load accepts them);
        cheap: the tensors are never modified, so they are shared, not copied."""
        return {"epoch": self.epoch, "row": self.row, "met": self.met, "seen": self.seen,
                "pending": self.pending, "ready": list(self.ready)}

    def __iter__(self) -> WindowStream:
        return self

    def __next__(self) -> Tensor:
        while not self.ready:
            self._read_document()
        return self.ready.pop(0)

    def _open(self) -> Iterator[str]:
        rows = self.data.docs.training(self.epoch)
        for _ in range(self.row):  # read again, not tokenized
            if next(rows, None) is None:
                break
        return rows

    def _read_document(self) -> None:
        if self._rows is None:
            self._rows = self._open()
        for text in self._rows:
            i = self.row
            self.row += 1
            if self.data._is_val(i, text):
                continue
            self.met += 1
            if (self.met - 1) % self.n != self.k:
                continue
            self.seen += 1
            flat = torch.cat([self.pending, _encode(self.data.tokenizer, text)])
            cut = flat.numel() // self.width * self.width
            self.ready = list(flat[:cut].view(-1, self.width).clone().unbind(0))
            self.pending = flat[cut:].clone()
            return
        if self.seen == 0:
            raise DataError(f"--data {self.data.docs.files[0]!r}: no training documents left "
                            f"for --shard {self.k}/{self.n} after the validation set; use more "
                            "data")
        self.epoch, self.row, self.met, self.seen, self._rows = self.epoch + 1, 0, 0, 0, None


class StreamShard:
    """Random batches from a window stream: a shuffle buffer drawn with the caller's generator.

    Same interface as :class:`gasloc_p2p.data.tokens.Shard`; the order depends only on the
    stream and the generator's seed (deterministic per node)."""

    def __init__(self, windows: WindowStream, seq_len: int,
                 capacity: int = SHUFFLE_WINDOWS) -> None:
        self.windows, self.seq_len, self.capacity = windows, seq_len, capacity
        self.buffer: list[Tensor] = []

    def position(self) -> dict[str, Any]:
        """Where the batches are: the stream's position and the shuffle buffer (with the
        sampling generator's state, the batches a resumed node draws are the ones it would
        have drawn)."""
        return {"stream": self.windows.position(), "buffer": list(self.buffer)}

    def restore(self, position: dict[str, Any]) -> None:
        """Continue from a :meth:`position` of a shard of the same data and flags."""
        buffer = list(position["buffer"])
        if len(buffer) > self.capacity or any(w.shape != (self.seq_len + 1,) for w in buffer):
            raise DataError("the saved shuffle buffer does not fit --seq-len")
        self.windows = WindowStream(self.windows.data, (self.windows.k, self.windows.n),
                                    position["stream"])
        self.buffer = buffer

    def batch(self, batch_size: int, seq_len: int,
              generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """x, y LongTensor [B, T]: B windows drawn from the buffer, each replaced from the stream."""
        if seq_len != self.seq_len:
            raise DataError(f"stream packed for seq_len={self.seq_len}, asked for {seq_len}")
        self._fill()
        picks = []
        for _ in range(batch_size):
            i = int(torch.randint(0, len(self.buffer), (1,), generator=generator))
            picks.append(self.buffer[i])
            nxt = next(self.windows, None)
            if nxt is not None:
                self.buffer[i] = nxt
        w = torch.stack(picks).long()
        return w[:, :-1], w[:, 1:]

    def _fill(self) -> None:
        """Top the buffer up from the stream, in stream order."""
        while len(self.buffer) < self.capacity:
            nxt = next(self.windows, None)
            if nxt is None:
                break
            self.buffer.append(nxt)

    def peek(self, batch_size: int, seq_len: int,
             generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """B windows drawn from the buffer like :meth:`batch`, none replaced: the batches
        this node trains on next are the ones it would have drawn (the buffer is filled in
        stream order either way)."""
        if seq_len != self.seq_len:
            raise DataError(f"stream packed for seq_len={self.seq_len}, asked for {seq_len}")
        self._fill()
        if not self.buffer:
            raise DataError("the stream has no windows to draw from")
        picks = [self.buffer[int(torch.randint(0, len(self.buffer), (1,), generator=generator))]
                 for _ in range(batch_size)]
        w = torch.stack(picks).long()
        return w[:, :-1], w[:, 1:]
