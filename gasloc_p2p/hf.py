"""Hugging Face causal LMs: built from a config with a seeded init, loaded, and exported.

``transformers`` is an optional extra (``pip install 'gasloc_p2p[hf]'``), imported only inside
these functions. A model built from a ``config.json`` gets the same ``theta_0`` on every node
without any download: every weight matrix and embedding (>= 2-D) is redrawn from ``seed`` with
the machine-independent :func:`gasloc_p2p.model.fill_keyed_normal_` (keyed by the seed and
the parameter's name, drawn on all the host's cores; std: the config's
``initializer_range``), and the 1-D tensors (norm gains, biases) keep the constant values the
architecture's own init gives them, drawn under a seeded, forked RNG.

The built-in :class:`gasloc_p2p.model.GPT` maps exactly onto ``GPT2LMHeadModel`` (same
pre-LayerNorm blocks, exact GELU, tied head), which is how :func:`export_gpt` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from gasloc_p2p.model import GPT, GPTConfig, fill_keyed_normal_

EXTRA_HINT = "pip install 'gasloc_p2p[hf]'"


def transformers_module() -> Any:
    """``transformers``, or ImportError with a one-line fix naming the missing extra."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"Hugging Face models need the 'hf' extra: {EXTRA_HINT}") from exc
    return transformers


CHUNKED_LOSS_VOCAB = 32768  # from this vocabulary on, the loss is computed in token chunks
LOSS_CHUNK_TOKENS = 512


class HFCausalLM(nn.Module):
    """Adapter giving a Hugging Face causal LM the :class:`GPT` ``forward`` signature.

    Parameter names are ``hf.<the model's names>`` (``hf.model.layers.{l}.…`` for Llama);
    :func:`gasloc_p2p.model.layer_index` maps them to layers. With a large vocabulary (at least
    :data:`CHUNKED_LOSS_VOCAB`) the training loss never materialises the full logits: float32
    logits of 4096 tokens over 128k entries are 2 GB, twice with their gradient; the head and
    the cross-entropy run on :data:`LOSS_CHUNK_TOKENS` tokens at a time, each recomputed in
    the backward pass (:func:`chunked_cross_entropy`)."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf: Any = hf_model

    @property
    def config(self) -> Any:
        return self.hf.config

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """idx, targets: LongTensor [B, T] (targets already shifted); logits [B, T, V] (empty
        when the loss was computed in chunks: nothing reads them then)."""
        hf: Any = self.hf
        head = hf.get_output_embeddings()
        chunked = (targets is not None and isinstance(head, nn.Linear)
                   and head.out_features >= CHUNKED_LOSS_VOCAB
                   and not getattr(self.config, "final_logit_softcapping", None))
        if not chunked:
            logits: Tensor = self.hf(input_ids=idx, use_cache=False).logits
            if targets is None:
                return logits, None
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                   targets.reshape(-1))
            return logits, loss
        assert targets is not None
        hidden = hf.base_model(input_ids=idx, use_cache=False).last_hidden_state
        loss = chunked_cross_entropy(hidden, head, targets, LOSS_CHUNK_TOKENS)
        return hidden.new_empty(0), loss


def chunked_cross_entropy(hidden: Tensor, head: nn.Linear, targets: Tensor,
                          chunk: int) -> Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``targets`` ([B, T, H], [B, T]), ``chunk``
    tokens at a time; each chunk's logits are recomputed in the backward pass, so at most one
    chunk of logits (and its gradient) exists at once."""
    h = hidden.reshape(-1, hidden.size(-1))
    t = targets.reshape(-1)
    total = h.new_zeros((), dtype=torch.float32)
    for s in range(0, t.numel(), chunk):
        total = total + checkpoint(_loss_sum, h[s : s + chunk], head.weight, head.bias,
                                   t[s : s + chunk], use_reentrant=False)
    return total / t.numel()


def _loss_sum(h: Tensor, weight: Tensor, bias: Tensor | None, t: Tensor) -> Tensor:
    return F.cross_entropy(F.linear(h, weight, bias).float(), t, reduction="sum")


def read_config(path: str | Path) -> Any:
    """A ``PreTrainedConfig`` from a ``config.json`` file (or a directory holding one)."""
    tf = transformers_module()
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    doc = json.loads(file.read_text())
    if "model_type" not in doc:
        raise ValueError(f"{file}: no 'model_type' (is it a Hugging Face config.json?)")
    return tf.AutoConfig.for_model(**doc)


class _NoRandomMatrices(TorchFunctionMode):
    """While a model is constructed: random fills of tensors of 2 or more dimensions do
    nothing (:func:`from_config` redraws every one of them), the rest runs as written. The
    architecture's own init of a 1.2B Llama drew every matrix twice (torch's default in each
    ``nn.Linear``, then the model's), one serial generator: 17 s on a 16-core host."""

    # by name: a Tensor's own fills and torch.nn.init's (a mode sees the outermost call only)
    SKIP = frozenset({"normal_", "uniform_", "random_", "exponential_", "geometric_",
                      "cauchy_", "log_normal_", "kaiming_uniform_", "kaiming_normal_",
                      "xavier_uniform_", "xavier_normal_", "trunc_normal_", "orthogonal_",
                      "sparse_"})

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        target = args[0] if args else (kwargs or {}).get("tensor")
        if (getattr(func, "__name__", "") in self.SKIP and isinstance(target, Tensor)
                and target.dim() >= 2):
            return target
        return func(*args, **(kwargs or {}))


def from_config(config: Any, seed: int) -> HFCausalLM:
    """A randomly initialised causal LM whose parameters depend only on (config, seed)."""
    tf = transformers_module()
    with torch.random.fork_rng(devices=[]), _NoRandomMatrices():
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                fill_keyed_normal_(param, f"{seed}/{name}", std)
    return HFCausalLM(model)


def from_pretrained(name: str) -> HFCausalLM:
    """A pretrained causal LM: a local directory (safetensors) or a hub name (needs network)."""
    tf = transformers_module()
    return HFCausalLM(tf.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32))


def gpt2_config(cfg: GPTConfig) -> Any:
    """The ``GPT2Config`` equal to the built-in GPT's architecture."""
    tf = transformers_module()
    return tf.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.n_embd,
                         n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu",
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                         # GPT-2's own 50256 lies outside this vocabulary; save() sets the
                         # tokenizer's end-of-text id where it has one
                         bos_token_id=None, eos_token_id=None)


def gpt2_state_dict(model: GPT) -> dict[str, Tensor]:
    """The built-in GPT's parameters under GPT-2 names (GPT-2's Conv1D weights are [in, out])."""
    out: dict[str, Tensor] = {"transformer.wte.weight": model.tok_emb.weight,
                              "transformer.wpe.weight": model.pos_emb.weight,
                              "transformer.ln_f.weight": model.ln_f.weight,
                              "transformer.ln_f.bias": model.ln_f.bias}
    for i, b in enumerate(model.blocks):
        pre = f"transformer.h.{i}."
        block: Any = b
        pairs: dict[str, nn.Module] = {
            "ln_1": block.ln1, "ln_2": block.ln2, "attn.c_attn": block.attn.qkv,
            "attn.c_proj": block.attn.proj, "mlp.c_fc": block.mlp.fc,
            "mlp.c_proj": block.mlp.proj}
        for name, mod in pairs.items():
            weight, bias = mod.weight, mod.bias
            assert isinstance(weight, Tensor) and isinstance(bias, Tensor)
            out[pre + name + ".weight"] = weight.t() if isinstance(mod, nn.Linear) else weight
            out[pre + name + ".bias"] = bias
    return {k: v.detach().float().contiguous().cpu() for k, v in out.items()}


def as_hf_model(model: nn.Module) -> nn.Module:
    """A ``transformers`` model holding ``model``'s current parameters (a copy for the GPT)."""
    if isinstance(model, HFCausalLM):
        hf_model: nn.Module = model.hf
        return hf_model
    if not isinstance(model, GPT):
        raise TypeError(f"cannot export {type(model).__name__}")
    tf = transformers_module()
    hf: Any = tf.GPT2LMHeadModel(gpt2_config(model.cfg))
    missing, unexpected = hf.load_state_dict(gpt2_state_dict(model), strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):  # the head is tied to wte
        raise RuntimeError(f"GPT-2 mapping: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf.eval()


SHARD_SIZE = "2GB"  # per safetensors file of an export


def save(model: nn.Module, out: str | Path, tokenizer_json: str | None = None,
         eos_id: int | None = None) -> Path:
    """Write ``model`` as a Hugging Face directory (config.json + safetensors shards of at most
    :data:`SHARD_SIZE`, written one after the other, and tokenizer files when
    ``tokenizer_json`` is given) that ``from_pretrained`` loads."""
    tf = transformers_module()
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    hf_model: Any = as_hf_model(model)
    if eos_id is not None and isinstance(model, GPT):
        for conf in (hf_model.config, getattr(hf_model, "generation_config", None)):
            if conf is not None:
                conf.eos_token_id = conf.bos_token_id = eos_id
    hf_model.save_pretrained(target, safe_serialization=True, max_shard_size=SHARD_SIZE)
    if tokenizer_json is not None:
        from tokenizers import Tokenizer

        tok = tf.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
        if eos_id is not None:
            tok.eos_token = tok.convert_ids_to_tokens(eos_id)
        tok.save_pretrained(target)
    return target
