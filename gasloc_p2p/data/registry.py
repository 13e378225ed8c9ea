"""A corpus any offline machine builds the same way: the text files of installed packages.

``gasloc-node corpus --out DIR`` (``make corpus``) takes the source and documentation files
(Python, C and C++ sources and headers, Markdown, reST, plain text) of a fixed list of installed distributions, in a fixed order, up
to ``--size-mb`` of text; holds out whole files for validation (those whose name hashes to 0
modulo ``--val-every``); trains a byte-level BPE tokenizer on the training files; and writes

- ``manifest.json``: every distribution with its version, files and bytes, and the SHA-256 of
  the whole corpus (each file's name and contents, in order): the same packages at the same
  versions give the same hash on any machine, and a different hash says what differs;
- ``tokenizer.json``, ``train.bin`` and ``val.bin`` (token ids, int16 up to a 32,768-entry
  vocabulary, else int32, native order) and ``meta.json`` (sizes, dtypes, hashes).

:func:`load` memory-maps the token files (nothing is read until a batch needs it), so a
simulation or a node uses a corpus larger than its RAM would comfortably hold (``--data DIR``).
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gasloc_p2p.data.corpus import Corpus, DataError, Document
from gasloc_p2p.data.tokenizers import BPETokenizer, ByteTokenizer
from gasloc_p2p.data.tokens import TokenData

KIND = "gasloc-token-corpus"
SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt", ".h", ".hpp", ".cuh", ".c", ".cc", ".cpp", ".pyx",
            ".pxd")
# Pinned by the project (pyproject.toml, its extras) or installed with them (torch's sympy and
# networkx, hivemind's scipy, datasets' pandas); those installed are used, in this order.
PACKAGES = ("torch", "transformers", "numpy", "sympy", "scipy", "pandas", "matplotlib",
            "networkx", "datasets", "pyarrow", "hivemind", "mypy", "grpcio-tools", "protobuf",
            "cryptography", "tokenizers", "pip", "setuptools")
MAX_FILE_BYTES = 4 << 20  # larger files are generated data more than text


@dataclass(frozen=True)
class Source:
    """One file of the corpus: ``name`` (distribution/path) and where it lies."""

    name: str
    path: Path


def sources(packages: Sequence[str], size_bytes: int) -> tuple[list[Source], list[dict]]:
    """The files, in order, until ``size_bytes`` of them; and per distribution its version,
    files and bytes. DataError naming a requested distribution that is not installed."""
    chosen: list[Source] = []
    listing: list[dict] = []
    total = 0
    for name in packages:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise DataError(f"--packages: {name!r} is not installed here") from None
        files, nbytes = 0, 0
        for rel in sorted(dist.files or (), key=str):
            if total >= size_bytes:
                break
            if rel.suffix not in SUFFIXES or "__pycache__" in rel.parts:
                continue
            path = Path(str(rel.locate()))
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if not 0 < size <= MAX_FILE_BYTES:
                continue
            chosen.append(Source(f"{dist.metadata['Name']}/{rel}", path))
            files, nbytes, total = files + 1, nbytes + size, total + size
        if files:
            listing.append({"name": dist.metadata["Name"], "version": dist.version,
                            "files": files, "bytes": nbytes})
        if total >= size_bytes:
            break
    if total < size_bytes:
        raise DataError(f"the packages hold {total / 1e6:.1f} MB of text, fewer than "
                        f"--size-mb {size_bytes / 1e6:g}: name more with --packages")
    return chosen, listing


def is_validation(name: str, every: int) -> bool:
    """A held-out file: its name's SHA-256 is 0 modulo ``every``."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") % every == 0


def build(out: Path, packages: Sequence[str] = PACKAGES, size_mb: float = 200.0,
          vocab_size: int = 16384, val_every: int = 50, tokenizer_kind: str = "bpe") -> dict:
    """Write the corpus to ``out`` (see the module docstring); returns ``meta.json``'s dict.
    ``tokenizer_kind`` "byte": UTF-8 bytes as tokens (vocabulary 256, uint8 files, no
    tokenizer.json), for the small models of the simulator's CPU rungs."""
    chosen, listing = sources([p for p in packages if _installed(p)] if packages is PACKAGES
                              else packages, int(size_mb * 1e6))
    corpus_hash = hashlib.sha256()
    train_docs: list[Document] = []
    val_docs: list[Document] = []
    for src in chosen:
        text = src.path.read_text(encoding="utf-8", errors="replace")
        corpus_hash.update(src.name.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
        (val_docs if is_validation(src.name, val_every) else train_docs).append(
            Document(src.name, text))
    if not train_docs or not val_docs:
        raise DataError("the corpus needs files on both sides of the split: raise --size-mb "
                        "or lower --val-every")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer: BPETokenizer | ByteTokenizer
    dtype: type
    if tokenizer_kind == "byte":
        tokenizer, dtype, tok_hash = ByteTokenizer(), np.uint8, ""
    else:
        tokenizer = BPETokenizer.train(Corpus(tuple(train_docs)), vocab_size)
        (out / "tokenizer.json").write_text(tokenizer.to_json())
        tok_hash = hashlib.sha256(tokenizer.to_json().encode()).hexdigest()
        dtype = np.int16 if tokenizer.vocab_size <= 1 << 15 else np.int32
    counts = {split: _write_tokens(out / f"{split}.bin", tokenizer, docs, dtype)
              for split, docs in (("train", train_docs), ("val", val_docs))}
    manifest = {"packages": listing, "suffixes": list(SUFFIXES), "size_mb": size_mb,
                "val_every": val_every, "files": len(chosen),
                "validation_files": len(val_docs),
                "bytes": sum(item["bytes"] for item in listing),
                "sha256": corpus_hash.hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    meta = {"kind": KIND, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
            "dtype": np.dtype(dtype).name, "train_tokens": counts["train"],
            "val_tokens": counts["val"], "corpus_sha256": manifest["sha256"],
            "tokenizer_sha256": tok_hash}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _write_tokens(path: Path, tokenizer: BPETokenizer | ByteTokenizer, docs: list[Document],
                  dtype: type) -> int:
    """Every document's ids, one after another, appended to ``path``; returns how many."""
    count = 0
    with path.open("wb") as f:
        for batch in _batches(docs, 256):
            if isinstance(tokenizer, ByteTokenizer):
                encoded = [np.frombuffer(d.text.encode("utf-8"), dtype=np.uint8) for d in batch]
            else:
                encoded = [np.asarray(ids, dtype=dtype)
                           for ids in tokenizer.encode_batch([d.text for d in batch])]
            for ids in encoded:
                ids.astype(dtype, copy=False).tofile(f)
                count += len(ids)
    return count


def _batches(items: list[Document], size: int) -> Iterator[list[Document]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def is_built(path: str | None) -> bool:
    """Whether ``--data path`` names a corpus this module built."""
    return path is not None and (Path(path) / "meta.json").is_file() and json.loads(
        (Path(path) / "meta.json").read_text()).get("kind") == KIND


def load(path: str) -> tuple[TokenData, BPETokenizer | ByteTokenizer]:
    """The built corpus at ``path``, its token files memory-mapped, and its tokenizer; a
    DataError naming the file that is missing or does not match ``meta.json``."""
    root = Path(path)
    meta = json.loads((root / "meta.json").read_text())
    tokenizer: BPETokenizer | ByteTokenizer = (
        ByteTokenizer() if meta["tokenizer"] == ByteTokenizer().name
        else BPETokenizer.from_dir(str(root / "tokenizer.json")))
    if tokenizer.name != meta["tokenizer"]:
        raise DataError(f"--data {path}: tokenizer.json is not the one meta.json names")
    parts = {}
    for split in ("train", "val"):
        file, count = root / f"{split}.bin", int(meta[f"{split}_tokens"])
        width = np.dtype(meta["dtype"]).itemsize
        if not file.is_file() or file.stat().st_size != count * width:
            raise DataError(f"--data {path}: {file.name} does not hold the {count} tokens "
                            "meta.json says (rebuild it with gasloc-node corpus)")
        dtype = {"uint8": torch.uint8, "int16": torch.int16}.get(meta["dtype"], torch.int32)
        parts[split] = torch.from_file(str(file), shared=False, size=count, dtype=dtype)
    spans = (0, parts["train"].numel()), (0, parts["val"].numel())
    data = TokenData(tokenizer.name, tokenizer.vocab_size, parts["train"], parts["val"],
                     ("corpus",), (spans[0],), (spans[1],))
    return data, tokenizer


def add_corpus_parser(sub: Any) -> None:
    p = sub.add_parser(
        "corpus", help="build a tokenized text corpus from installed packages (offline)",
        description="Build a corpus any offline machine builds the same way: the source and "
                    "documentation files of installed packages, a BPE tokenizer trained on "
                    "them, memory-mapped token files and a manifest with the corpus's SHA-256. "
                    "Use it with --data DIR (gasloc-node sim).")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--size-mb", type=float, default=200.0, help="megabytes of text to take")
    p.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary size")
    p.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe",
                   help="bpe (trained here) or byte (UTF-8 bytes, vocabulary 256)")
    p.add_argument("--val-every", type=int, default=50,
                   help="one file in this many held out for validation (by name hash)")
    p.add_argument("--packages", default=",".join(PACKAGES),
                   help="installed distributions to read, in order (default: those of these "
                        "that are installed)")
    p.set_defaults(func=run_corpus)


def run_corpus(args: argparse.Namespace) -> int:
    problems = [(args.size_mb > 0, "--size-mb must be > 0"),
                (256 < args.vocab <= 1 << 20, "--vocab must be in (256, 1048576]"),
                (args.val_every >= 2, "--val-every must be >= 2")]
    for ok, message in problems:
        if not ok:
            print(f"gasloc-node corpus: {message}", file=sys.stderr)
            return 2
    names = tuple(n for n in args.packages.split(",") if n)
    t0 = time.monotonic()
    try:
        meta = build(Path(args.out), PACKAGES if names == PACKAGES else names, args.size_mb,
                     args.vocab, args.val_every, args.tokenizer)
    except DataError as exc:
        print(f"gasloc-node corpus: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {meta['train_tokens']:,} training and {meta['val_tokens']:,} "
          f"validation tokens, vocabulary {meta['vocab_size']}, corpus sha256 "
          f"{meta['corpus_sha256'][:16]}..., in {time.monotonic() - t0:.0f} s")
    return 0
