"""Tokenizers: UTF-8 bytes, a BPE trained locally, or a local Hugging Face tokenizer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from gasloc_p2p.data.corpus import Corpus, DataError


class Tokenizer(Protocol):
    """Text <-> ids: ``encode`` gives a 1-D integer tensor of ids in [0, vocab_size).

    ``name`` identifies the vocabulary exactly (peers compare it)."""

    name: str
    vocab_size: int
    eos_id: int | None  # appended after each document when packing a stream (None: nothing)

    def encode(self, text: str) -> Tensor: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train or download."""

    name = "byte"
    vocab_size = 256
    eos_id: int | None = None

    def encode(self, text: str) -> Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE trained locally with Hugging Face ``tokenizers`` (imported lazily)."""

    def __init__(self, hf_tokenizer: Any, eos_id: int | None = None) -> None:
        self._tok = hf_tokenizer
        self.vocab_size: int = hf_tokenizer.get_vocab_size()
        self.eos_id = eos_id
        digest = hashlib.sha256(hf_tokenizer.to_str().encode()).hexdigest()
        self.name = f"bpe{self.vocab_size}-{digest[:16]}"

    def to_json(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text (for checkpoints and export)."""
        return str(self._tok.to_str())

    @classmethod
    def from_json(cls, text: str, eos_id: int | None = None) -> BPETokenizer:
        """Rebuild from :meth:`to_json` text."""
        return cls(_tokenizers().Tokenizer.from_str(text), eos_id)

    @classmethod
    def from_dir(cls, path: str) -> BPETokenizer:
        """A local ``tokenizer.json`` file or a Hugging Face tokenizer directory holding one.

        The end-of-text id comes from ``tokenizer_config.json``'s ``eos_token`` when present,
        else from a few usual names (``</s>``, ``<|endoftext|>``, ``<eos>``)."""
        where = Path(path).expanduser()
        file = where / "tokenizer.json" if where.is_dir() else where
        if not file.is_file():
            raise DataError(f"--tokenizer {path!r}: no tokenizer.json there; give byte, bpe, a "
                            "tokenizer.json file or a directory holding one")
        tok = _tokenizers().Tokenizer.from_file(str(file))
        return cls(tok, _eos_id(tok, file.parent / "tokenizer_config.json"))

    @classmethod
    def train(cls, corpus: Corpus, vocab_size: int = 4096) -> BPETokenizer:
        """Train on all of ``corpus`` (1-5 s for 5 MB); deterministic for equal input."""
        lib = _tokenizers()
        decoders, models, pre_tokenizers, trainers = (
            lib.decoders, lib.models, lib.pre_tokenizers, lib.trainers)
        tok = lib.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([d.text for d in corpus.documents], trainer)
        return cls(tok)

    def encode(self, text: str) -> Tensor:
        return torch.tensor(self._tok.encode(text).ids, dtype=torch.int32)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text (the library's threads do the work)."""
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids]))


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise DataError("BPE needs the 'tokenizers' package: pip install 'gasloc_p2p[bpe]'"
                        " (or use the default byte tokenizer)") from exc
    return tokenizers


def _eos_id(tok: Any, config: Path) -> int | None:
    names = ["</s>", "<|endoftext|>", "<eos>"]
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        found = tok.token_to_id(name)
        if found is not None:
            return int(found)
    return None


def load_tokenizer(spec: str, sample: Corpus | None = None,
                   bpe_vocab_size: int = 4096) -> Tokenizer:
    """``--tokenizer``: ``byte``, ``bpe`` (trained on ``sample``, deterministic) or a local
    ``tokenizer.json`` / tokenizer directory."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        if sample is None:
            raise DataError("--tokenizer bpe needs text to train on")
        return BPETokenizer.train(sample, bpe_vocab_size)
    return BPETokenizer.from_dir(spec)
