"""``--model``: a built-in GPT preset, a Hugging Face ``config.json``, a local pretrained
directory or a hub name, built into a module with the :class:`gasloc_p2p.model.GPT` interface
and a fingerprint covering the architecture and ``theta_0``.

Built-in presets (``gpt`` takes ``--n-layer/--n-embd/--n-head`` from the flags):

==========  ======  =====  =====  ======================================
name        layers  width  heads  parameters (vocab 256, context 128)
==========  ======  =====  =====  ======================================
gpt-mini    2       64     2      0.12M
gpt-small   4       128    4      0.84M (the flags' defaults)
gpt-base    6       256    8      4.8M
gpt-large   12      768    12     85M
==========  ======  =====  =====  ======================================
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gasloc_p2p.model import GPT, GPTConfig, build_model, model_fingerprint

PRESETS: dict[str, tuple[int, int, int]] = {  # name -> (n_layer, n_embd, n_head)
    "gpt-mini": (2, 64, 2),
    "gpt-small": (4, 128, 4),
    "gpt-base": (6, 256, 8),
    "gpt-large": (12, 768, 12),
}
BUILTIN = ("gpt", *PRESETS)
_HASH_CHUNK = 1 << 22  # elements hashed per host copy (device models: bounded host memory)


@dataclass(frozen=True)
class ModelSource:
    """What ``--model`` names: ``kind`` is gpt | config | pretrained | hub."""

    kind: str
    where: str

    @classmethod
    def parse(cls, text: str) -> ModelSource:
        if text in BUILTIN:
            return cls("gpt", text)
        path = Path(text).expanduser()
        if path.is_file():
            return cls("config", str(path))
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"--model {text!r}: directory without config.json")
            weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
            return cls("pretrained" if weights else "config", str(path))
        if text.endswith(".json") or text.startswith((".", "/")):
            raise ValueError(f"--model {text!r}: no such file or directory")
        return cls("hub", text)  # e.g. "HuggingFaceTB/SmolLM2-135M": transformers downloads it


@dataclass(frozen=True)
class BuiltModel:
    """A module (``forward(idx, targets) -> (logits, loss)``) and what identifies it."""

    module: nn.Module
    fingerprint: str
    n_layer: int
    max_seq_len: int
    vocab_size: int
    description: str


def gpt_config(preset: str, base: GPTConfig) -> GPTConfig:
    """``base`` (from the flags) with a preset's depth, width and heads."""
    if preset == "gpt":
        return base
    n_layer, n_embd, n_head = PRESETS[preset]
    return replace(base, n_layer=n_layer, n_embd=n_embd, n_head=n_head)


def theta_digest(module: nn.Module) -> str:
    """sha256 hex of every parameter's bytes in registration order (copied to host in chunks)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, p in module.named_parameters():
            digest.update(name.encode())
            flat = p.detach().reshape(-1)
            for start in range(0, flat.numel(), _HASH_CHUNK):
                part = flat[start:start + _HASH_CHUNK].to("cpu", torch.float32).contiguous()
                digest.update(part.numpy().tobytes())
    return digest.hexdigest()


def _fingerprint(arch: dict[str, Any], module: nn.Module) -> str:
    params = [[n, list(p.shape), str(p.dtype)] for n, p in module.named_parameters()]
    doc = {"arch": arch, "params": params, "theta0": theta_digest(module)}
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def skeleton(spec: str, base: GPTConfig) -> nn.Module:
    """The module :func:`build` gives for ``spec``, on the meta device: its names and shapes,
    no values and no storage (a rank of a sharded node, which gets its rows from rank 0)."""
    source = ModelSource.parse(spec)
    if source.kind == "gpt":
        with torch.device("meta"):
            return GPT(gpt_config(source.where, base))
    from gasloc_p2p import hf

    tf = hf.transformers_module()
    config = (hf.read_config(source.where) if source.kind == "config"
              else tf.AutoConfig.from_pretrained(source.where))
    with torch.device("meta"):
        return hf.HFCausalLM(tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def build(spec: str, base: GPTConfig, seed: int) -> BuiltModel:
    """The model ``--model spec`` names, on CPU in float32 (move it to the device after).

    ``base`` carries the flags (vocabulary from the tokenizer, context length) for the built-in
    GPT; a Hugging Face model keeps its own config (its vocabulary must hold the tokenizer's).
    """
    source = ModelSource.parse(spec)
    if source.kind == "gpt":
        cfg = gpt_config(source.where, base)
        model = build_model(cfg, seed)
        arch: dict[str, Any] = {"builtin": model_fingerprint(model, cfg, seed)}
        return BuiltModel(model, _fingerprint(arch, model), cfg.n_layer, cfg.seq_len,
                          cfg.vocab_size, f"{source.where} {cfg.n_layer}x{cfg.n_embd}")
    from gasloc_p2p import hf  # transformers only when asked for

    if source.kind == "config":
        module = hf.from_config(hf.read_config(source.where), seed)
    else:
        module = hf.from_pretrained(source.where)
    config = module.config
    doc = json.loads(config.to_json_string(use_diff=False))
    for key in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        doc.pop(key, None)
    arch = {"hf": doc, "seed": seed}
    layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 1))
    ctx = int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0)
              or 1 << 30)
    name = getattr(config, "model_type", "hf")
    return BuiltModel(module, _fingerprint(arch, module), layers, ctx,
                      int(config.vocab_size), f"{name} ({source.kind}: {source.where})")
