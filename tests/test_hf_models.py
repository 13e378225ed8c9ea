"""Hugging Face models: --model parsing, seeded theta_0 across processes, layer indices,
pretrained directories, the missing-extra error, and export loaded back by transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gasloc_p2p import hf
from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.model import GPTConfig, build_model, layer_index
from gasloc_p2p.model_spec import PRESETS, ModelSource, build, theta_digest
from gasloc_p2p.node.config import TrainConfig
from gasloc_p2p.node.export import ExportError, export
from gasloc_p2p.node.runtime import checkpoint
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.trainer import Trainer
from gasloc_p2p.node.stats import TrainStats
from tests.hf_helpers import LLAMA, documents, write_jsonl, write_llama_config, write_tokenizer

transformers = pytest.importorskip("transformers")
BASE = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_embd=32, n_head=2)


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    docs = documents(120)
    return {"config": write_llama_config(root / "tiny-llama"),
            "tok": write_tokenizer(root / "tok", docs),
            "jsonl": write_jsonl(root / "corpus.jsonl", docs)}


def test_model_source_names_presets_configs_directories_and_hub(hf_files, tmp_path):
    assert ModelSource.parse("gpt").kind == "gpt" and set(PRESETS) <= {"gpt-mini", "gpt-small",
                                                                        "gpt-base", "gpt-large"}
    assert ModelSource.parse(str(hf_files["config"])).kind == "config"
    assert ModelSource.parse(str(hf_files["config"].parent)).kind == "config"  # no weights
    assert ModelSource.parse("HuggingFaceTB/SmolLM2-135M").kind == "hub"
    with pytest.raises(ValueError, match="no such file"):
        ModelSource.parse(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_skipping_the_architectures_random_matrices_changes_no_value(kind, monkeypatch):
    """from_config leaves out the architecture's own random fills of matrices (it redraws
    them all): the model is the one built with them, every parameter and buffer bit for bit,
    for a Llama, a GPT-2 (biases, a position table) and a Qwen2 (biased projections)."""
    import contextlib

    tiny = {"llama": tf_config("LlamaConfig", **LLAMA),
            "gpt2": tf_config("GPT2Config", n_embd=32, n_layer=2, n_head=4, n_positions=64),
            "qwen2": tf_config("Qwen2Config", **LLAMA)}[kind]
    fast = hf.from_config(tiny, 5)
    skipped: list[str] = []
    real = hf._NoRandomMatrices.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        target = args[0] if args else (kwargs or {}).get("tensor")  # nn.init: a keyword
        if getattr(func, "__name__", "") in hf._NoRandomMatrices.SKIP and target.dim() >= 2:
            skipped.append(func.__name__)
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(hf._NoRandomMatrices, "__torch_function__", counting)
    hf.from_config(tiny, 5)
    assert skipped  # it did leave fills out
    monkeypatch.setattr(hf, "_NoRandomMatrices", contextlib.nullcontext)
    slow = hf.from_config(tiny, 5)
    got, want = fast.state_dict(), slow.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), kind
    ones = [k for k, v in got.items() if v.dim() == 1 and torch.all(v == 1)]
    assert ones  # the norms' gains kept their init


def tf_config(name: str, **kw: object):
    return getattr(transformers, name)(vocab_size=300, **kw)


_THETA0 = """
import sys
from gasloc_p2p.model import GPTConfig
from gasloc_p2p.model_spec import build, theta_digest
b = build(sys.argv[1], GPTConfig(vocab_size=256, seq_len=32), int(sys.argv[2]))
print(b.fingerprint, theta_digest(b.module))
"""


def test_hf_config_gives_the_same_theta0_in_every_process(hf_files):
    procs = [subprocess.Popen([sys.executable, "-c", _THETA0, str(hf_files["config"]), "7"],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs) and len(outs[0]) == 2
    assert outs[0] == outs[1]  # fingerprint and every parameter byte
    here = build(str(hf_files["config"]), BASE, 7)
    assert [here.fingerprint, theta_digest(here.module)] == outs[0]
    other = build(str(hf_files["config"]), BASE, 8)  # another seed: another theta_0
    assert other.fingerprint != here.fingerprint
    assert theta_digest(other.module) != theta_digest(here.module)


def test_fingerprint_covers_architecture_and_theta0(hf_files, tmp_path):
    a = build(str(hf_files["config"]), BASE, 1)
    wider = write_llama_config(tmp_path / "wider", hidden_size=64, intermediate_size=128)
    assert build(str(wider), BASE, 1).fingerprint != a.fingerprint
    assert build("gpt", BASE, 1).fingerprint == build("gpt", BASE, 1).fingerprint
    assert build("gpt", BASE, 1).fingerprint != build("gpt-mini", BASE, 1).fingerprint


def test_llama_parameters_map_to_layers(hf_files):
    built = build(str(hf_files["config"]), BASE, 0)
    layers = {n: layer_index(n) for n, _ in built.module.named_parameters()}
    assert layers["hf.model.layers.1.mlp.up_proj.weight"] == 1
    assert layers["hf.model.embed_tokens.weight"] is None and built.n_layer == 2
    assert {v for v in layers.values() if v is not None} == {0, 1}


def test_pretrained_directory_loads_its_weights(hf_files, tmp_path):
    built = build(str(hf_files["config"]), BASE, 3)
    built.module.hf.save_pretrained(tmp_path / "pre")
    assert ModelSource.parse(str(tmp_path / "pre")).kind == "pretrained"
    loaded = build(str(tmp_path / "pre"), BASE, 99)  # the seed does not matter: weights do
    assert theta_digest(loaded.module) == theta_digest(built.module)


def test_missing_transformers_names_the_extra(monkeypatch, hf_files):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'gasloc_p2p\[hf\]'"):
        build(str(hf_files["config"]), BASE, 0)


def _trainer(hf_files, tmp_path, **kw) -> Trainer:
    cfg = TrainConfig(model=str(hf_files["config"]), data=str(hf_files["jsonl"]),
                      tokenizer=str(hf_files["tok"]), device="cpu", seq_len=32, batch_size=4,
                      eval_batches=2, warmup_steps=2, **kw)
    trainer = Trainer(cfg, AsyncConfig(), 1, TrainingLock(), TrainStats())
    trainer.load_data(5)
    return trainer


def test_export_of_a_trained_llama_loads_with_the_same_loss(hf_files, tmp_path, monkeypatch,
                                                            capsys):
    trainer = _trainer(hf_files, tmp_path)
    for _ in range(3):
        trainer.step()
    checkpoint.save_atomic(trainer.state_for_checkpoint(), tmp_path / "ckpt")
    out = export([str(tmp_path / "ckpt")], str(tmp_path / "out")).path
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x, y = trainer.val[0]
    with torch.no_grad():
        logits = model(input_ids=x).logits
        theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        _, ours = trainer.model.eval()(x, y)
    assert abs(float(theirs) - float(ours)) < 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.encode("def f(x):\n") == trainer.data.tokenizer.encode("def f(x):\n").tolist()
    monkeypatch.setattr(hf, "SHARD_SIZE", "40KB")  # shards, written one after the other
    twice = export([str(tmp_path / "ckpt")] * 2, str(tmp_path / "avg"), "average").path
    assert len(list(twice.glob("model-*.safetensors"))) > 1
    averaged = transformers.AutoModelForCausalLM.from_pretrained(twice)
    assert all(torch.equal(a, b) for a, b in zip(averaged.state_dict().values(),
                                                  model.state_dict().values(), strict=True))
    from gasloc_p2p.cli import main

    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "config.json").is_file()
    files = sorted(p for p in (tmp_path / "cli").iterdir())
    size_mb = sum(p.stat().st_size for p in files) / 1e6
    params = sum(p.numel() for p in trainer.model.parameters()) / 1e6
    assert capsys.readouterr().out == (  # one line: what, where, parameters, files, size
        f"exported the node's parameters at step 3 to {tmp_path / 'cli'}: {params:,.2f}M "
        f"parameters, {len(files)} files, {size_mb:,.1f} MB ({', '.join(p.name for p in files)})"
        "\n")
    assert "tokenizer.json" in [p.name for p in files]
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), str(tmp_path / "ckpt"),
                 "--which", "average", "--out", str(tmp_path / "cli-avg")]) == 0
    assert capsys.readouterr().out.startswith(
        f"exported the average of 2 checkpoints (steps 3, 3) to {tmp_path / 'cli-avg'}: ")
    assert main(["export", "--checkpoint-dir", str(tmp_path / "nothing"),
                 "--out", str(tmp_path / "cli2")]) == 2
    with pytest.raises(ExportError, match="no checkpoint"):
        export([str(tmp_path / "nothing")], str(tmp_path / "x"))

    # no --checkpoint-dir: the one a node kept in this machine's state folder
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    nodes = tmp_path / "xdg" / "gasloc_p2p" / "nodes"
    capsys.readouterr()
    assert main(["export", "--out", str(tmp_path / "kept0")]) == 2
    assert capsys.readouterr().err == (f"gasloc-node export: error: no checkpoint kept on this "
                                       f"machine (under {tmp_path / 'xdg'}/gasloc_p2p/nodes): "
                                       "give --checkpoint-dir DIR\n")
    shutil.copytree(tmp_path / "ckpt", nodes / "r1" / "checkpoint-identity-0123")
    (nodes / "r2" / "checkpoint-identity-4567").mkdir(parents=True)  # none written in it
    assert main(["export", "--out", str(tmp_path / "kept1")]) == 0
    assert (tmp_path / "kept1" / "config.json").is_file()
    capsys.readouterr()
    shutil.copytree(tmp_path / "ckpt", nodes / "r2" / "checkpoint-identity-4567",
                    dirs_exist_ok=True)
    newer = (nodes / "r2" / "checkpoint-identity-4567" / "node.pt").stat().st_mtime + 60
    os.utime(nodes / "r2" / "checkpoint-identity-4567" / "node.pt", (newer, newer))
    assert main(["export", "--out", str(tmp_path / "kept2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gasloc-node export: error: 2 checkpoints kept on this machine: give "
                          "--checkpoint-dir, one of (newest first): ") and err.count("\n") == 1
    assert f"{nodes / 'r2' / 'checkpoint-identity-4567'}, {nodes / 'r1'}" in err


def test_builtin_gpt_exports_as_gpt2_with_equal_logits(tmp_path):
    from gasloc_p2p import hf

    model = build_model(BASE, 4).eval()
    hf.save(model, tmp_path / "gpt2")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    assert json.loads((tmp_path / "gpt2" / "config.json").read_text())["model_type"] == "gpt2"
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, model(x)[0], atol=1e-5,
                                   rtol=1e-5)


def test_the_config_names_the_missing_extra_before_start(monkeypatch, hf_files):
    from gasloc_p2p.node import config as config_mod
    from gasloc_p2p.node import config_train

    monkeypatch.setattr(config_train, "find_spec", lambda name: None)
    cases = [{"model": str(hf_files["config"])}, {"data": str(hf_files["jsonl"])},
             {"tokenizer": str(hf_files["tok"])}]
    for kw in cases:
        flag = next(iter(kw))
        with pytest.raises(config_mod.ConfigError,
                           match=rf"--{flag}=.*pip install 'gasloc_p2p\[hf\]'"):
            config_mod.TrainConfig(**kw).validate()
    config_mod.TrainConfig(model="gpt-mini").validate()  # built-in models need no extra


def test_a_resumed_trainer_continues_its_stream(hf_files, tmp_path):
    """A node restarted from its checkpoint draws the batches the running node draws next (its
    streamed corpus does not restart from the first document)."""
    trainer = _trainer(hf_files, tmp_path)
    for _ in range(3):
        trainer.step()
    checkpoint.save_atomic(trainer.state_for_checkpoint(), tmp_path / "ckpt")
    cfg = trainer.cfg
    ahead = [trainer.shard.batch(cfg.batch_size, cfg.seq_len, trainer.generator)[0]
             for _ in range(4)]
    resumed = _trainer(hf_files, tmp_path)
    saved = checkpoint.load(tmp_path / "ckpt")
    assert saved is not None and saved["data"]["stream"]["row"] > 0
    resumed.restore(saved)
    assert resumed.shard.windows.row == saved["data"]["stream"]["row"]  # not from the start
    assert len(resumed.shard.buffer) == len(saved["data"]["buffer"]) > 0
    assert all(torch.equal(a, resumed.shard.batch(cfg.batch_size, cfg.seq_len,
                                                  resumed.generator)[0]) for a in ahead)


@pytest.mark.parametrize("vocab", [320, 40_000])  # 40k: the loss in token chunks too
def test_activation_checkpointing_recomputes_layers_with_equal_gradients(tmp_path, vocab):
    """--activation-checkpointing wraps each decoder layer: fewer tensors are kept for the
    backward pass and the gradients are the same, bit for bit."""
    from gasloc_p2p.node.runtime.trainer import set_activation_checkpointing

    config = write_llama_config(tmp_path / "cfg", vocab_size=vocab)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    grads, kept = [], []
    for on in (False, True):
        model = build(str(config), BASE, 0).module
        set_activation_checkpointing(model, on)
        saved: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t, saved=saved: saved.append(t.numel()) or t, lambda t: t):
            _, loss = model(x, x)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
        kept.append(sum(saved))
    # (at 40k the kept tensors are mostly references to the head's weight, no new memory)
    assert kept[1] < kept[0] * (0.5 if vocab < 1000 else 1), kept
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
