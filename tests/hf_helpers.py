"""Tiny Hugging Face artifacts built inside the tests (nothing is downloaded): a Llama config,
a BPE tokenizer directory, and JSON Lines / Parquet corpora of real text."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.02)


def documents(count: int = 300, size: int = 1500) -> list[str]:
    """Real text (standard-library sources), cut into ``count`` documents of ``size`` chars."""
    text = "".join(Path(importlib.import_module(m).__file__ or "").read_text()
                   for m in ("argparse", "typing", "inspect", "dataclasses"))
    return [text[(i * size) % (len(text) - size):][:size] for i in range(count)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    with path.open("w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text",
                  row_group_size: int = 64) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path,
                   row_group_size=row_group_size)
    return path


def write_tokenizer(directory: Path, docs: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE with an ``<|endoftext|>`` token, saved as ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory


def write_llama_config(directory: Path, vocab_size: int = 320, **overrides: object) -> Path:
    """``config.json`` of a 2-layer, width-32 Llama (about 30k parameters)."""
    from transformers import LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    LlamaConfig(vocab_size=vocab_size, **{**LLAMA, **overrides}).save_pretrained(directory)
    return directory / "config.json"
