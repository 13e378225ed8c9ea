"""Node configuration: the training section (see :mod:`gasloc_p2p.node.config`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from gasloc_p2p.core.options import ConfigError, need, opt
from gasloc_p2p.data.corpus import DataError, check_data_path
from gasloc_p2p.data.sources import is_hub, is_remote
from gasloc_p2p.data.stream import stream_files
from gasloc_p2p.model import GPTConfig
from gasloc_p2p.model_spec import BUILTIN, PRESETS, ModelSource, gpt_config

SHARDINGS = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")
DEVICE_RE = re.compile(r"cpu|mps|cuda(:\d+)?")


@dataclass(frozen=True)
class TrainConfig:
    """The model, the data and the inner optimizer (AdamW, warmup then cosine decay)."""

    model: str = opt("gpt", "gpt (sized by --n-layer/--n-embd/--n-head) | a preset "
                            f"({' | '.join(PRESETS)}) | a Hugging Face config.json (random init "
                            "from --seed) | a local model directory (pretrained safetensors) | "
                            "a hub name (needs network); HF models need 'gasloc_p2p[hf]'")
    data: str = opt("", "text file, directory of *.txt, glob, JSON Lines / Parquet files "
                        "(streamed), an http(s) URL of one (downloaded once), or a Hugging "
                        "Face dataset hf:NAME[:CONFIG][@SPLIT] (streamed); empty: Shakespeare "
                        "(downloaded)", group="data")
    data_field: str = opt("text", "the text column of JSON Lines / Parquet rows", group="data")
    data_sha256: str = opt("", "sha256 the data's bytes must have (a run manifest sets it for "
                               "files and URLs)", advanced=True)
    tokenizer: str = opt("byte", "byte | bpe (trained on the data) | a local tokenizer.json or "
                                 "Hugging Face tokenizer directory", group="data")
    device: str = opt("auto", "auto (cuda when present) | cpu | cuda | cuda:N | mps")
    precision: str = opt("fp32", "fp32 | bf16 (autocast forward; fp32 master weights and outer "
                                 "state)", choices=PRECISIONS)
    grad_accum: int = opt(1, "micro-batches of --batch-size per inner step")
    nproc_per_node: int = opt(1, "ranks of this node (one per GPU; processes on a CPU): one "
                                 "identity, each micro-batch split over the ranks (see --sharding); "
                                 "docs/multi-gpu.md")
    sharding: str = opt("ddp", "how a node of several ranks holds the model: ddp (each rank "
                               "all of it) | fsdp (each rank 1/K of the parameters, gradients "
                               "and AdamW state: a model larger than one GPU)",
                        choices=SHARDINGS)
    compile: bool = opt(False, "torch.compile the model's forward (warmed up before the node "
                               "accepts exchanges)")
    activation_checkpointing: bool = opt(False, "recompute each layer's activations in the "
                                                "backward pass (less memory, ~30% more compute)")
    shard: str = opt("", "train on shard K of N of the corpus, as 'K/N' (empty: all of it)", group="data")
    seed: int = opt(0, "model init seed, the same on every node of a run (gives theta_0)")
    data_seed: int = opt(-1, "seed of this node's batch sampling; -1: derived from its peer id", advanced=True)
    n_layer: int = opt(4, "transformer layers")
    n_embd: int = opt(128, "model width")
    n_head: int = opt(4, "attention heads")
    seq_len: int = opt(128, "context length, tokens")
    batch_size: int = opt(16, "sequences per micro-batch (an inner step: --grad-accum of them)")
    lr: float = opt(3e-3, "peak inner AdamW learning rate")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of --lr", advanced=True)
    warmup_steps: int = opt(100, "linear warmup, inner steps")
    lr_horizon_steps: int = opt(20000, "cosine decay length, inner steps (then constant)", advanced=True)
    weight_decay: float = opt(0.1, "AdamW weight decay", advanced=True)
    decay_vectors: bool = opt(False, "weight decay also on biases and LayerNorm gains "
                                     "(default: weight matrices and embeddings only)", advanced=True)
    inner_steps: int = opt(20, "H: inner steps per round of this node")
    torch_threads: int = opt(1, "torch intra-op threads for training")
    max_steps: int = opt(0, "stop after this many inner steps (0: run until stopped)")
    max_time_s: float = opt(0.0, "stop after this many seconds (0: run until stopped)")
    eval_interval_steps: int = opt(100, "validation loss every this many inner steps")
    eval_batches: int = opt(8, "held-out batches per validation (fixed, same on every node)", advanced=True)
    max_rollbacks: int = opt(3, "non-finite losses rolled back to the last good anchor before "
                             "the node gives up and stops", advanced=True)

    def gpt(self, vocab_size: int = 256) -> GPTConfig:
        """The built-in GPT's config (a preset's depth, width and heads if --model names one)."""
        base = GPTConfig(vocab_size=vocab_size, seq_len=self.seq_len, n_layer=self.n_layer,
                         n_embd=self.n_embd, n_head=self.n_head)
        return gpt_config(self.model, base) if self.model in BUILTIN else base

    @property
    def builtin_model(self) -> bool:
        return self.model in BUILTIN

    def shard_spec(self) -> tuple[int, int] | None:
        """(K, N) from ``--shard K/N``, or None."""
        if not self.shard:
            return None
        try:
            k, n = (int(x) for x in self.shard.split("/"))
        except ValueError:
            raise ConfigError(f"--shard={self.shard!r}: expected K/N such as 0/4") from None
        need(n >= 1 and 0 <= k < n, "shard", self.shard, "needs 0 <= K < N")
        return k, n

    def validate(self) -> None:
        need(bool(self.model), "model", self.model, f"a preset ({' | '.join(BUILTIN)}) or a path")
        need(self.device == "auto" or DEVICE_RE.fullmatch(self.device) is not None, "device",
             self.device, "choose auto, cpu, cuda, cuda:N or mps")
        need(self.precision in PRECISIONS, "precision", self.precision,
             f"choose one of {PRECISIONS}")
        need(bool(self.tokenizer), "tokenizer", self.tokenizer, "byte, bpe or a path")
        self._check_sources()
        need(bool(self.data_field), "data_field", self.data_field, "name a column, e.g. text")
        for name in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size", "inner_steps",
                     "grad_accum", "nproc_per_node",
                     "torch_threads", "eval_interval_steps", "eval_batches", "lr_horizon_steps"):
            need(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        need(self.n_embd % self.n_head == 0, "n_embd", self.n_embd,
              f"must be divisible by --n-head={self.n_head}")
        need(self.nproc_per_node == 1 or self.device in ("auto", "cpu", "cuda"), "device",
             self.device, f"a node of --nproc-per-node={self.nproc_per_node} ranks runs on "
             "cpu or cuda (each rank takes GPU LOCAL_RANK): use --device cuda or auto")
        need(self.sharding in SHARDINGS, "sharding", self.sharding,
             f"choose one of {SHARDINGS}")
        need(self.batch_size % self.nproc_per_node == 0, "batch_size", self.batch_size,
             f"must split over --nproc-per-node={self.nproc_per_node} ranks (a multiple of it)")
        need(0 < self.lr < 1, "lr", self.lr, "needs 0 < lr < 1 (try 3e-3)")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "needs [0, 1]")
        need(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        need(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        need(self.max_steps >= 0, "max_steps", self.max_steps, "must be >= 0 (0: no limit)")
        need(self.max_time_s >= 0, "max_time_s", self.max_time_s, "must be >= 0 (0: no limit)")
        self.shard_spec()


    def _check_sources(self) -> None:
        """Paths exist and the optional extras they need are installed (before any start-up)."""
        hint = "needs the 'hf' extra: pip install 'gasloc_p2p[hf]'"
        if not self.builtin_model:
            try:
                ModelSource.parse(self.model)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            need(find_spec("transformers") is not None, "model", self.model, hint)
        if self.tokenizer not in ("byte", "bpe"):
            need(Path(self.tokenizer).expanduser().exists(), "tokenizer", self.tokenizer,
                 "no such file or directory (byte, bpe or a tokenizer.json / directory)")
            need(find_spec("tokenizers") is not None, "tokenizer", self.tokenizer, hint)
        try:
            if self.data and not is_remote(self.data):
                check_data_path(self.data)
            streamed = bool(self.data) and (is_hub(self.data) or (
                not is_remote(self.data) and stream_files(self.data) is not None))
        except DataError as exc:
            raise ConfigError(str(exc)) from None
        need(not streamed or find_spec("datasets") is not None, "data", self.data, hint)


def out_of_memory(train: TrainConfig, exc: BaseException, when: str) -> str:
    """One line for a node whose device ran out of memory ``when`` (e.g. "at step 12"): what
    torch tried and had, the plan command for this shape, and the flags that lower the
    need (only those not set already)."""
    text = str(exc)
    tried = re.search(r"Tried to allocate ([\d.]+ \w+)", text)
    free = re.search(r"total capacity of ([\d.]+ \w+) of which ([\d.]+ \w+) is free", text)
    what = (f"it asked for {tried[1]}" if tried else text.split(".")[0][:120])
    if free:
        what += f" with {free[2]} free of {free[1]}"
    fixes = ["lower --batch-size (a higher --grad-accum keeps the run's batch)"]
    if not train.activation_checkpointing:
        fixes.append("add --activation-checkpointing")
    if train.precision == "fp32":
        fixes.append("--precision bf16")
    if train.compile:
        fixes.append("drop --compile (its step held more at 1B)")
    shape = [f"--model {train.model}", f"--micro-batch {train.batch_size}",
             f"--seq-len {train.seq_len}"]
    shape += ["--precision bf16"] if train.precision == "bf16" else []
    shape += ["--activation-checkpointing"] if train.activation_checkpointing else []
    if train.nproc_per_node > 1:
        shape += [f"--nproc-per-node {train.nproc_per_node}", f"--sharding {train.sharding}"]
    return (f"the device ran out of memory {when} ({what}); `gasloc-node plan "
            f"{' '.join(shape)} --device-memory SIZE` says what fits; {', '.join(fixes)}")
