"""``gasloc-node export``: a node's checkpoint as a Hugging Face model directory.

The checkpoint records the node's training flags and tokenizer; the model is rebuilt from them
(its fingerprint must equal the checkpoint's), its parameters are replaced by the checkpoint's,
and it is written with ``save_pretrained`` (config.json + safetensors shards, plus
tokenizer.json when the node used a BPE or Hugging Face tokenizer). The built-in GPT is written
as the equivalent ``GPT2LMHeadModel``. ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it.

``--which local`` exports this node's live parameters; ``--which average`` the mean of the
parameters of every checkpoint given (several ``--checkpoint-dir``: the network average of
those nodes; with one directory it equals ``local``).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gasloc_p2p.core.flat import FlatParams
from gasloc_p2p.data import BPETokenizer
from gasloc_p2p.node.config import TrainConfig
from gasloc_p2p.node.runtime import checkpoint

WHICH = ("local", "average")


class ExportError(RuntimeError):
    """The checkpoints cannot be exported; the message says why and what to do."""


def add_export_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory",
                       description="Write a node checkpoint as a Hugging Face model directory "
                                   "(config.json + model.safetensors, tokenizer if any) that "
                                   "transformers' AutoModelForCausalLM.from_pretrained loads. "
                                   "Needs the 'hf' extra: pip install 'gasloc_p2p[hf]'.")
    p.add_argument("--checkpoint-dir", nargs="+", default=[], metavar="DIR",
                   help="a node's --checkpoint-dir (several: see --which average; none: the "
                        "checkpoint a node kept on this machine, if it is the only one)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--which", choices=WHICH, default="local",
                   help="local: the node's parameters | average: the mean over all the "
                        "checkpoints given")
    p.set_defaults(func=run_export)


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote: the directory, its files and what the model holds."""

    path: Path
    which: str
    steps: tuple[int, ...]  # of the checkpoints exported (one each)
    parameters: int

    def files(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir() if p.is_file())

    def summary(self) -> str:
        """One line: what was written, where, its size and parameter count."""
        files = self.files()
        size = sum(p.stat().st_size for p in files)
        what = (f"the node's parameters at step {self.steps[0]}" if self.which == "local"
                else f"the average of {len(self.steps)} checkpoints (steps "
                     f"{', '.join(map(str, self.steps))})")
        return (f"exported {what} to {self.path}: {self.parameters / 1e6:,.2f}M parameters, "
                f"{len(files)} files, {size / 1e6:,.1f} MB ({', '.join(p.name for p in files)})")


def run_export(args: argparse.Namespace) -> int:
    try:
        done = export(args.checkpoint_dir or [_the_kept_checkpoint()], args.out, args.which)
    except (ExportError, ImportError, ValueError) as exc:
        print(f"gasloc-node export: error: {exc}", file=sys.stderr)
        return 2
    print(done.summary())
    return 0


def _the_kept_checkpoint() -> str:
    """The one checkpoint folder nodes kept on this machine (state_dir.kept_checkpoints), or
    ExportError naming them."""
    from gasloc_p2p.node.state_dir import kept_checkpoints, nodes_home

    kept = kept_checkpoints()
    if len(kept) == 1:
        return str(kept[0])
    if not kept:
        raise ExportError(f"no checkpoint kept on this machine (under {nodes_home()}): give "
                          "--checkpoint-dir DIR")
    shown = ", ".join(str(p) for p in kept[:4]) + (", ..." if len(kept) > 4 else "")
    raise ExportError(f"{len(kept)} checkpoints kept on this machine: give --checkpoint-dir, "
                      f"one of (newest first): {shown}")


def _load_all(dirs: list[str]) -> list[dict[str, Any]]:
    found = []
    for d in dirs:
        ckpt = checkpoint.load(d)
        if ckpt is None:
            raise ExportError(f"no checkpoint in {d} (expected {checkpoint.checkpoint_path(d)})")
        if "train_config" not in ckpt:
            raise ExportError(f"{d}: checkpoint predates export support (no training flags)")
        found.append(ckpt)
    if len({c["fingerprint"] for c in found}) > 1:
        raise ExportError("the checkpoints belong to different models (fingerprints differ)")
    return found


def _tokenizer(doc: dict[str, Any]) -> tuple[int, BPETokenizer | None]:
    if "json" in doc:
        tok = BPETokenizer.from_json(doc["json"], doc.get("eos_id"))
        return tok.vocab_size, tok
    return 256, None  # byte tokens: no tokenizer file to write


def export(dirs: list[str], out: str, which: str = "local") -> Exported:
    """Export the checkpoint(s) in ``dirs`` to ``out``; returns what was written."""
    from gasloc_p2p import hf
    from gasloc_p2p.node.runtime.trainer import build_node_model

    hf.transformers_module()  # fail early with the extra's name
    if which not in WHICH:
        raise ExportError(f"--which {which!r}: choose one of {WHICH}")
    if which == "local" and len(dirs) != 1:
        raise ExportError("--which local takes one --checkpoint-dir (several: --which average)")
    ckpts = _load_all(list(dirs))
    cfg = TrainConfig(**ckpts[0]["train_config"])
    vocab, tok = _tokenizer(ckpts[0]["tokenizer"])
    built = build_node_model(cfg, vocab)
    name = tok.name if tok is not None else "byte"
    fingerprint = hashlib.sha256(f"{built.fingerprint}/{name}".encode()).hexdigest()
    if fingerprint != ckpts[0]["fingerprint"]:
        raise ExportError(f"--model {cfg.model} now builds another model than the checkpoint's "
                          "(its config or weights changed)")
    flat = FlatParams(built.module)
    with torch.no_grad():  # a running sum: one model-sized buffer, the checkpoints mapped
        flat.buffer.copy_(ckpts[0]["theta"])
        for c in ckpts[1:]:
            flat.buffer.add_(c["theta"].float())
        if len(ckpts) > 1:
            flat.buffer.div_(len(ckpts))
    path = hf.save(built.module, out, tok.to_json() if tok else None,
                   tok.eos_id if tok else None)
    return Exported(path, which, tuple(int(c.get("step", 0)) for c in ckpts), flat.numel)
