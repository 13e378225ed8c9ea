"""One arm of the GPU queue's throughput slices: a node's tokens/s and model FLOP utilisation.

A node's trainer (``gasloc_p2p.node.runtime.trainer``: the Hugging Face Llama with SDPA
attention and the chunked cross-entropy, AdamW stepped in the backward pass, bf16 autocast)
at one setting (``--compile``, micro-batch, sequence length), timed over ``steps`` steps after
``warmup`` (the compilation happens there). MFU: the model's FLOPs per token (6 N for the
parameters, 12 L d T for attention's products) times tokens/s, against a bf16 matrix product
measured on the spot (the card's reachable peak) and against the H100's 989 TFLOP/s.

Usage: python -m benchmarks.gpu_throughput --config JSON --out FILE
(JSON keys: model llama-135m | llama-1b | llama-tiny, micro_batch, seq_len, compile, steps,
warmup). On a machine without CUDA it runs on the CPU in float32 (the smoke size).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

H100_BF16_TFLOPS = 989.0  # dense, the data sheet
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
        "tie_word_embeddings": True}


def reachable_peak() -> float:
    """bf16 FLOP/s of an 8192^3 matrix product here (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0.0
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t0)


def model_flops_per_token(config: dict[str, Any], params: int, seq_len: int) -> float:
    """6 N + 12 L d T: the parameters' products forward and backward, and attention's."""
    layers, width = config["num_hidden_layers"], config["hidden_size"]
    return 6.0 * params + 12.0 * layers * width * seq_len


def measure(cfg: dict[str, Any], root: Path) -> dict[str, Any]:
    from benchmarks.gpu_check import LLAMA_1B, LLAMA_135M, trainer

    cuda = torch.cuda.is_available()
    config = {"llama-135m": LLAMA_135M, "llama-1b": LLAMA_1B, "llama-tiny": TINY}[cfg["model"]]
    (root / "config.json").write_text(json.dumps(config))
    corpus = root / "corpus.txt"
    corpus.write_text(Path(json.__file__).read_text() * 50)
    kw: dict[str, Any] = {"batch_size": cfg["micro_batch"] if cuda else 2,
                          "seq_len": cfg["seq_len"] if cuda else 32, "compile": cfg["compile"],
                          "activation_checkpointing": cfg["model"] == "llama-1b"}
    if not cuda:
        kw.update(device="cpu", precision="fp32")
    peak = reachable_peak()
    t_build = time.perf_counter()
    node = trainer(root / "config.json", corpus, **kw)
    node.warm_up()
    for _ in range(cfg["warmup"]):
        node.step()
    ready_s = time.perf_counter() - t_build
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, tokens0 = time.perf_counter(), node.stats.tokens
    for _ in range(cfg["steps"]):
        node.step()
    if cuda:
        torch.cuda.synchronize()
    rate = (node.stats.tokens - tokens0) / (time.perf_counter() - t0)
    flops = model_flops_per_token(config, node.flat.numel, kw["seq_len"]) * rate
    return {"tokens_per_s": rate, "params": node.flat.numel, "model_tflops": flops / 1e12,
            "mfu_reachable": flops / peak if peak else None,
            "mfu_h100_sheet": flops / (H100_BF16_TFLOPS * 1e12) if cuda else None,
            "reachable_tflops": peak / 1e12, "ready_s": round(ready_s, 1),
            "step_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "micro_batch": kw["batch_size"], "seq_len": kw["seq_len"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    cfg = json.loads(args.config)
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        row = measure(cfg, Path(tmp))
    print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
