"""A small decoder-only transformer (nanoGPT-like), built deterministically from a seed.

The default :class:`GPTConfig` (vocab 256 bytes, 4 layers, width 128, 4 heads, context 128)
has exactly 842,496 parameters (~0.84M): token embedding 32,768 + position embedding 16,384
+ 4 blocks x 198,272 + final LayerNorm 256. The lm head is tied to the token embedding.

Parameter names are ``tok_emb.weight``, ``pos_emb.weight``, ``blocks.{l}.…`` and ``ln_f.…``;
:func:`layer_index` maps a name to its transformer layer (``None`` outside the blocks).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# Bump when the parameter layout or the init scheme changes: old fingerprints become invalid.
_FINGERPRINT_FORMAT = 1
_INIT_STD = 0.02
_LAYER_RE = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\.")


@dataclass(frozen=True)
class GPTConfig:
    """Architecture of :class:`GPT`. ``seq_len`` is the maximum context in tokens."""

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    dropout: float = 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` with the offending field and a fix if the config is unusable."""
        for field in ("vocab_size", "seq_len", "n_layer", "n_embd", "n_head"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{field} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}; "
                f"e.g. use n_embd={self.n_head * max(1, round(self.n_embd / self.n_head))}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: [B, T, C] -> [B, T, C]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # [B, T, C] -> [B, H, T, C/H]
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise GELU MLP with 4x expansion: [B, T, C] -> [B, T, C]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer over token ids. Build it with :func:`build_model`.

    Constructing ``GPT(cfg)`` directly leaves the default PyTorch init (from the global RNG);
    :func:`build_model` replaces it with the seeded, machine-independent init.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.checkpointing = False  # recompute each block's activations in backward

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Next-token logits and optional loss.

        Args:
            idx: token ids, LongTensor [B, T] with T <= cfg.seq_len.
            targets: next-token ids, LongTensor [B, T], or None.
        Returns:
            logits [B, T, vocab_size] and the mean cross-entropy in nats per token (scalar),
            or None when ``targets`` is None.
        """
        _, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        # Tied head: logits reuse the token embedding, so there is no separate head parameter.
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        """Number of distinct parameters (the tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())


def layer_index(param_name: str) -> int | None:
    """Transformer layer of a parameter name (``blocks.3.mlp.fc.weight`` -> 3).

    Also understands Hugging Face layouts (``model.layers.{l}.`` and ``transformer.h.{l}.``)
    and wrapper prefixes (``module.``, ``_orig_mod.``). Returns None for embeddings and the
    final norm.
    """
    match = _LAYER_RE.search(param_name)
    return int(match.group(1)) if match else None


def _init_std(name: str, cfg: GPTConfig) -> float | None:
    """Init std for a weight matrix; None means LayerNorm weight (ones) or bias (zeros)."""
    if name.endswith(".bias") or ".ln" in f".{name}":
        return None
    if name.endswith("proj.weight"):
        # GPT-2: scale residual-path projections so the residual stream stays O(1) with depth.
        return _INIT_STD / math.sqrt(2 * cfg.n_layer)
    return _INIT_STD


def portable_normal(numel: int, gen: torch.Generator, terms: int = 12) -> Tensor:
    """Approximately N(0, 1) float64 values [numel], independent of the CPU's vector kernels.

    ``torch.randn`` is not: its float32 kernel gives other bits on AVX2 than on generic CPUs
    (checked with ATEN_CPU_CAPABILITY; ARM uses the generic path). Here the only random source
    is ``randint`` (integer Mersenne Twister draws); the Irwin-Hall sum of ``terms`` uniforms is
    exact in integers and then scaled with correctly rounded float64 arithmetic. The result is
    bounded by +-6 (for 12 terms), like a truncated normal. (:func:`fill_portable_normal_`
    writes the same bits into a tensor in bounded memory.)
    """
    out = torch.empty(numel, dtype=torch.float64)
    fill_portable_normal_(out, gen, 1.0, terms)
    return out


_INIT_CHUNK = 1 << 22  # elements per draw and per conversion (bounded host memory)
_INIT_WORKERS = 16  # blocks in flight at most: 64 MiB of scratch each


def fill_portable_normal_(param: Tensor, gen: torch.Generator, std: float,
                          terms: int = 12) -> None:
    """``param`` (any shape, on the host) <- ``portable_normal(param.numel(), gen) * std``,
    bit for bit, in about 4 bytes of extra host memory per element: the ``terms`` rows of
    draws come one after the other from the generator (the order one ``(terms, numel)`` draw
    fills them in), each in chunks, summed into an int32 total (``terms * 2^24`` fits), which
    is scaled chunk by chunk into ``param``. (A single ``(terms, numel)`` draw in int64 took
    152 bytes per element: 40 GB for a 128k-vocabulary embedding.)"""
    bits, numel = 24, param.numel()
    total = torch.zeros(numel, dtype=torch.int32)
    for _ in range(terms):
        for s in range(0, numel, _INIT_CHUNK):
            e = min(numel, s + _INIT_CHUNK)
            total[s:e] += torch.randint(0, 1 << bits, (e - s,), generator=gen,
                                        dtype=torch.int32)
    mean = terms * ((1 << bits) - 1) / 2
    scale = (1 << bits) * math.sqrt(terms / 12)
    flat = param.view(-1)
    for s in range(0, numel, _INIT_CHUNK):
        e = min(numel, s + _INIT_CHUNK)
        flat[s:e].copy_((total[s:e].double() - mean) / scale * std)


def fill_keyed_normal_(param: Tensor, key: str, std: float, terms: int = 12,
                       workers: int | None = None) -> None:
    """``param`` (any shape, on the host) <- portable N(0, std) values that depend only on
    ``key`` (e.g. the run's seed and the parameter's name) and ``param``'s size, bit for bit
    on any machine and for any number of ``workers``.

    The same Irwin-Hall draw as :func:`fill_portable_normal_`, but each block of
    ``_INIT_CHUNK`` elements has its own Mersenne Twister, seeded from the SHA-256 of
    ``key`` and the block's index, so the blocks are drawn in parallel on the host's cores
    (``workers``: default ``torch.get_num_threads()``, at most 16: each block in flight
    holds 64 MiB of scratch). One generator for a whole model is
    serial: 52 s of a 1.2B Llama's 71 s build on a 2-core host, its 14.8 billion draws
    one after the other."""
    bits, numel = 24, param.numel()
    mean = terms * ((1 << bits) - 1) / 2
    scale = (1 << bits) * math.sqrt(terms / 12)
    flat = param.view(-1)

    def block(start: int) -> None:
        end = min(numel, start + _INIT_CHUNK)
        name = f"{key}/{start // _INIT_CHUNK}".encode()
        gen = torch.Generator().manual_seed(
            int.from_bytes(hashlib.sha256(name).digest()[:8], "little") >> 1)
        total = torch.zeros(end - start, dtype=torch.int32)
        draw = torch.empty_like(total)
        for _ in range(terms):
            total += torch.randint(0, 1 << bits, (end - start,), generator=gen,
                                   dtype=torch.int32, out=draw)
        with torch.no_grad():  # grad mode is per thread: a parameter's slice in a worker
            flat[start:end].copy_(total.double().sub_(mean).div_(scale).mul_(std))

    starts = range(0, numel, _INIT_CHUNK)
    count = min(len(starts), workers or min(torch.get_num_threads(), _INIT_WORKERS))
    if count <= 1:
        for start in starts:
            block(start)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(count) as pool:  # torch's kernels let go of the GIL
        list(pool.map(block, starts))


def build_model(cfg: GPTConfig, seed: int, dtype: torch.dtype = torch.float32) -> GPT:
    """A :class:`GPT` on CPU whose parameters depend only on ``(cfg, seed)``, bit for bit.

    Weights are N(0, 0.02) (residual projections 0.02 / sqrt(2 n_layer)), biases 0,
    LayerNorm gains 1. Values come from a local ``torch.Generator`` in parameter
    registration order via :func:`portable_normal`, then are cast to ``dtype``; the global
    RNG is neither used nor advanced. Takes about 0.2 s for the default config.
    """
    cfg.validate()
    # PyTorch's default init draws from the global RNG: restore it. (A meta-device build
    # would avoid the work but its first use imports ~800 modules, about 2 s.)
    with torch.random.fork_rng(devices=[]):
        model = GPT(cfg)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = _init_std(name, cfg)
            if std is None:
                param.fill_(1.0 if name.endswith(".weight") else 0.0)
            else:
                fill_portable_normal_(param, gen, std)
    return model.to(dtype=dtype)


def model_fingerprint(model: nn.Module, cfg: GPTConfig, seed: int) -> str:
    """sha256 hex identifying the architecture, parameter layout, dtypes and init seed.

    Peers with equal fingerprints can exchange parameters. Parameter values are not hashed
    (they change during training); ``cfg.dropout`` is not hashed either (it is a training
    setting that peers may choose independently).
    """
    arch = {k: v for k, v in asdict(cfg).items() if k != "dropout"}
    params = [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]
    doc: dict[str, Any] = {
        "format": _FINGERPRINT_FORMAT,
        "class": type(model).__name__,
        "config": arch,
        "params": params,
        "seed": seed,
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()
