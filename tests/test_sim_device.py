"""The simulator on a device, in bfloat16, and with Hugging Face models (issue 25, part 1).

All workers train in one process on ``--device`` (the same inner loop and exchange code as the
daemon), with ``--precision bf16`` autocast, and a ``--model`` config.json in place of the
built-in GPT. The CPU tests check that the settings take effect; the CUDA test checks that a
GPU run follows the CPU run of the same seeds (skipped with a reason without a GPU).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from gasloc_p2p.core.options import ConfigError
from gasloc_p2p.sim.clock import Clock
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.gossip import run_gossip
from gasloc_p2p.sim.workers import SimWorkers, load_token_data

TINY = SimConfig(workers=2, steps=12, H=4, n_layer=1, n_embd=32, n_head=2, seq_len=32,
                 batch_size=4, eval_every=4, eval_batches=2, warmup_steps=2, threads=1)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 64,
         "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="no CUDA device on this machine (the CI boxes are CPU-only)")


@pytest.fixture(scope="module")
def data():
    return load_token_data(None)


def trained(cfg: SimConfig, data) -> tuple[SimWorkers, dict[str, float]]:
    sim = SimWorkers(cfg, data)
    run_gossip(sim, Clock(cfg.workers), lambda now: None)
    return sim, sim.evaluate()


def test_bf16_autocast_takes_effect_and_tracks_fp32(data):
    short = dataclasses.replace(TINY, steps=8)
    _, fp32 = trained(short, data)
    sim, bf16 = trained(dataclasses.replace(short, precision="bf16"), data)
    assert sim.workers[0].inner.how.precision == "bf16"
    assert sim.thetas.dtype == torch.float32  # the parameters stay float32
    assert bf16["val_loss"] != fp32["val_loss"]  # autocast changed the arithmetic
    assert abs(bf16["val_loss"] - fp32["val_loss"]) < 0.05


def test_a_hugging_face_llama_trains_in_the_simulator(data, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    cfg = dataclasses.replace(TINY, model=str(tmp_path / "config.json"), steps=16)
    sim, got = trained(cfg, data)
    assert any(".layers.1." in s.name for s in sim.spans)  # the Llama's parameters
    first = SimWorkers(cfg, data).evaluate()["val_loss"]
    assert got["val_loss"] < first - 0.3, (first, got)
    assert got["consensus"] > 0  # the workers trained apart and gossiped


def test_a_model_whose_vocabulary_is_too_small_is_one_line(data, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "vocab_size": 100}))
    with pytest.raises(ValueError, match="vocabulary 100 is smaller than the tokenizer's 256"):
        SimWorkers(dataclasses.replace(TINY, model=str(tmp_path / "config.json")), data)


def test_bad_device_and_precision_settings_are_refused():
    with pytest.raises(ConfigError, match="--precision must be fp32 or bf16"):
        dataclasses.replace(TINY, precision="fp16").validate()
    with pytest.raises(ConfigError, match="--precision bf16 needs --dtype float32"):
        dataclasses.replace(TINY, precision="bf16", dtype="float64", codec="none").validate()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            SimWorkers(dataclasses.replace(TINY, device="cuda"), load_token_data(None))


@NO_CUDA
def test_a_gpu_simulation_follows_the_cpu_one(data):
    _, cpu = trained(TINY, data)
    sim, gpu = trained(dataclasses.replace(TINY, device="cuda"), data)
    assert sim.thetas.is_cuda
    assert abs(gpu["val_loss"] - cpu["val_loss"]) < 0.02, (cpu, gpu)
