"""``gasloc-node plan``: its model-sized buffers against what a CPU node actually holds."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import subprocess

import pytest

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.node.config import NodeConfig
from gasloc_p2p.node.config_train import TrainConfig
from gasloc_p2p.node.plan import bytes_per_param, model_buffers, model_shape, plan, report
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.trainer import Trainer
from gasloc_p2p.node.stats import TrainStats

TINY = TrainConfig(n_layer=2, n_embd=16, n_head=2, seq_len=16, batch_size=2, inner_steps=2)


@pytest.mark.parametrize(("outer", "keep_anchor"), [
    (AsyncConfig(), False),                      # defaults: eta 1, gamma 0: no outer buffers
    (AsyncConfig(eta=0.7, gamma=0.5), False),    # anchor and mixed momentum's zprev
    (AsyncConfig(gamma=0.5, momentum="local"), False),  # anchor and the Nesterov buffer
    (AsyncConfig(), True),                       # a DiLoCo mode keeps the anchor
])
def test_plan_buffers_are_what_a_node_holds(outer, keep_anchor):
    trainer = Trainer(TINY, outer, 1, TrainingLock(), TrainStats(), keep_anchor=keep_anchor)
    trainer.load_data(0)
    for _ in range(2):  # through a round end: gradients, moments, the rollback copy exist
        trainer.step()
    held = {(b.name, b.where): b.nbytes for b in trainer.placement()}
    planned = {(b.name, b.where): b.nbytes
               for b in model_buffers(trainer.flat.numel, outer, keep_anchor, "cpu")}
    assert held == planned
    # the built-in model's plan counts the parameters the node built
    assert model_shape("gpt", TINY, trainer.data.tokenizer.vocab_size).numel == trainer.flat.numel


def test_device_bytes_per_param_in_gossip_mode():
    """The issue's target, by placement: 16 B/param at rest (parameters, gradients, AdamW)."""
    shape = model_shape("gpt", TrainConfig(n_layer=2, n_embd=64, n_head=2), 256)
    for gamma in (0.0, 0.5):
        cfg = NodeConfig()
        cfg = dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, gamma=gamma,
                                                                 eta=0.7))
        names = ("parameters", "gradients (during a step)", "adamw moments", "anchor",
                 "outer zprev", "theta_0 (bfloat16)", "rollback copy", "rollback zprev")
        assert bytes_per_param(plan(cfg, "cpu", shape), "device", names) == 16.0
        # on CUDA AdamW steps in the backward pass, in buckets of up to 2^24 elements: a
        # model smaller than a bucket holds all its gradients at once, a larger one a layer's
        # and a bucket's
        assert bytes_per_param(plan(cfg, "cuda", shape), "device", names) == 16.0
        big = model_shape("gpt", TrainConfig(n_layer=24, n_embd=1024, n_head=16), 256)
        assert 12.0 < bytes_per_param(plan(cfg, "cuda", big), "device", names) < 12.5


@pytest.mark.parametrize(("codec", "per_chunk_element"), [
    ("int8", 6), ("int4", 20), ("fp4", 20), ("sign1", None), ("half2", None)])
def test_an_exchange_on_a_gpu_holds_chunk_staging_where_its_payloads_stream(codec,
                                                                           per_chunk_element):
    """Codecs with a room in protocol/payloads stream on a GPU: chunk staging (int8's kernels
    6 bytes an element of a chunk, the eager passes 20), nothing payload-sized; the residual
    codecs keep both payloads there from the check to the commit."""
    from gasloc_p2p.protocol.engine import ON_DEVICE_CHUNK

    shape = model_shape("gpt", TrainConfig(n_layer=24, n_embd=1024, n_head=16), 256)
    cfg = NodeConfig()
    cfg = dataclasses.replace(cfg, gossip=dataclasses.replace(cfg.gossip, codec=codec))
    held = {b.name: b.nbytes for b in plan(cfg, "cuda", shape)["buffers"] if b.where == "device"}
    chunk = min(shape.numel, ON_DEVICE_CHUNK)
    if per_chunk_element is None:
        wire = CodecSpec.of(codec).codec().wire_bytes(shape.numel)
        assert held["exchange: both payloads + scratch"] == 2 * wire + 8 * chunk
        assert "exchange: chunk staging" not in held
    else:
        assert held["exchange: chunk staging"] == per_chunk_element * chunk
        assert "exchange: both payloads + scratch" not in held


def test_a_rank_of_a_ddp_node_holds_all_gradients_and_its_share_of_the_activations():
    """Under DDP (several ranks) AdamW does not step in the backward pass: a GPU holds every
    gradient (DDP's buckets); each rank runs 1/K of the micro-batch."""
    shape = model_shape("gpt", TrainConfig(n_layer=2, n_embd=64, n_head=2), 256)
    cfg = NodeConfig()
    one, two = (plan(dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, batch_size=8, nproc_per_node=k)), "cuda", shape) for k in (1, 2))
    grads = ("gradients (during a step)",)
    big = model_shape("gpt", TrainConfig(n_layer=24, n_embd=1024, n_head=16), 256)
    one_big, two_big = (plan(dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, batch_size=8, nproc_per_node=k)), "cuda", big) for k in (1, 2))
    assert bytes_per_param(two_big, "device", grads) == 4.0 > bytes_per_param(
        one_big, "device", grads)  # (a model below one bucket holds them all either way)
    acts = ("activations (estimate)",)
    assert bytes_per_param(two, "device", acts) * 2 == bytes_per_param(one, "device", acts)
    assert two["ranks"] == 2 and "per GPU of 2" in report(two, None)
    split = run_plan("--model", "gpt", "--micro-batch", "3", "--nproc-per-node", "2")
    assert split.returncode == 2 and "--nproc-per-node=2" in split.stderr


def test_a_rank_of_a_sharded_node_holds_its_rows_and_rank_0_a_full_copy_on_the_host():
    """FSDP2 over K ranks: parameters, gradients and moments are 16/K bytes per parameter on
    each GPU (plus the layers gathered for compute); rank 0 keeps the full parameters on the
    host, and its exchange runs there."""
    shape = model_shape("gpt", TrainConfig(n_layer=2, n_embd=64, n_head=2), 256)
    cfg = NodeConfig()
    plans = {k: plan(dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, batch_size=8, nproc_per_node=k, sharding=sharding)), "cuda", shape)
        for k, sharding in ((2, "ddp"), (4, "fsdp"))}
    rows = ("parameters (a rank's rows)", "gradients (a rank's rows)",
            "adamw moments (a rank's rows)")
    assert bytes_per_param(plans[4], "device", rows) == pytest.approx(16 / 4, rel=0.01)
    assert bytes_per_param(plans[2], "device", rows) == 0  # DDP: the whole model per GPU
    assert bytes_per_param(plans[4], "host", ("parameters, full copy (rank 0)",)) == 4.0
    assert not [b for b in plans[4]["buffers"] if b.name.startswith("exchange")
                and b.where == "device"]
    assert "per GPU of 4 (FSDP2: each holds 1/4 of the model)" in report(plans[4], None)
    # a checkpoint's host copies: the AdamW state only where it is not written by each rank
    saved = {k: next(b for b in p["transients"] if b.name.startswith("checkpoint")) for k, p in
             plans.items()}
    assert saved[2].nbytes - saved[4].nbytes == 8 * shape.numel


def run_plan(*args: str) -> subprocess.CompletedProcess[str]:
    """``gasloc-node plan ARGS`` in this process (the command line's own parser and
    handler; a process per call spent seconds on imports)."""
    from gasloc_p2p.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", *args])
        except SystemExit as exc:  # argparse's errors
            code = int(exc.code or 0)
    return subprocess.CompletedProcess(["plan", *args], code, out.getvalue(), err.getvalue())


def test_plan_llama_1b_on_a_24gb_card(tmp_path):
    """The Llama-3.2-1B shape, bf16, activation checkpointing, micro-batch 1 x 2048, int8
    payloads: the plan fits 24 GiB (docs/results/gpu.md has what an H200 measured); at 1 x
    8192 it does not."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
              "vocab_size": 128256, "max_position_embeddings": 131072,
              "tie_word_embeddings": True, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ("--model", str(tmp_path / "config.json"), "--device-memory", "24GiB")
    full = run_plan(*model, "--precision", "bf16", "--micro-batch", "1", "--seq-len", "2048")
    assert full.returncode == 0, full.stdout + full.stderr
    assert "1,235.8M parameters" in full.stdout and "fits in 24.0 GiB" in full.stdout
    total = float(full.stdout.split("device total ")[1].split(" GiB")[0])
    assert 23.1 <= total <= 24.0  # an H200: 23.20 GiB with an exchange (docs/results/gpu.md)
    long = run_plan(*model, "--precision", "bf16", "--micro-batch", "1", "--seq-len", "8192",
                    "--no-activation-checkpointing")
    assert long.returncode == 1 and "does NOT fit in 24.0 GiB" in long.stdout, long.stdout
    check_a_plan_that_does_not_fit(long.stdout, model)
    # the network line: an int8 exchange of 1.2B parameters is 1.24 GB, 993 s at 10 Mbit/s
    # (the time the node's deadlines add: docs/running.md); an fp32 DiLoCo sync 8 x as much
    payload = CodecSpec.parse("int8").codec().wire_bytes(1_235_814_400)
    assert (f"network at 10 Mbit/s (--min-link-mbps): an exchange sends one int8 payload of "
            f"{payload / 1e9:,.2f} GB (and receives one): {payload * 8 / 1e7:,.0f} s"
            ) in full.stdout, full.stdout
    sync = run_plan(*model, "--algorithm", "diloco", "--min-link-mbps", "100")
    assert (f"a sync uploads up to {8 * 1_235_814_400 / 1e9:,.2f} GB (an all-reduce of the "
            f"fp32 vector): {8 * 1_235_814_400 * 8 / 1e8:,.0f} s") in sync.stdout, sync.stdout


def check_a_plan_that_does_not_fit(out: str, model: tuple[str, ...]) -> None:
    """A plan that does not fit says by how much, what it assumed, and which one change makes
    it fit: each change it names, planned, fits."""
    lines = out.splitlines()
    assert lines[1] == ("assumed: --precision bf16 --micro-batch 1 --seq-len 8192 "
                        "--no-activation-checkpointing, on a GPU (--cpu: a CPU node)"), out
    total = float(out.split("device total ")[1].split(" GiB")[0])
    short = float(out.split("of device memory: ")[1].split(" GiB short")[0])
    assert short == pytest.approx(total - 24.0, abs=0.01)
    suggested = [line for line in lines if line.startswith("it fits with ")]
    assert len(suggested) == 1, out
    changes = [c.split(" (")[0].split() for c in suggested[0].removeprefix(
        "it fits with ").split("; or ")]
    assert ["--seq-len", "1024"] in changes, changes  # 2048 does not fit: the largest that does
    for change in changes:
        done = run_plan(*model, "--precision", "bf16", "--micro-batch", "1", "--seq-len", "8192",
                        "--no-activation-checkpointing", *change)
        assert done.returncode == 0 and "fits in 24.0 GiB" in done.stdout, (change, done.stdout)


def test_plan_refuses_bad_input_in_one_line():
    for flag, value in (("--device-memory", "24XB"), ("--micro-batch", "0"),
                        ("--seq-len", "x")):
        done = run_plan("--model", "gpt", flag, value)
        assert done.returncode == 2
        assert done.stderr.strip().count("\n") == 0 and flag in done.stderr, done.stderr


def test_plan_counts_a_diloco_nodes_averaging_and_error_feedback():
    """A DiLoCo node holds hivemind's shared vector on the host; with a sparse payload its
    error feedback (4 B/param) and the all-gather's messages instead; a bad payload is one
    line naming --diloco-codec."""
    shape = model_shape("gpt", TrainConfig(n_layer=2, n_embd=64, n_head=2), 256)
    for codec in ("fp32", "topk2:123"):
        cfg = NodeConfig()
        cfg = dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, algorithm="diloco"),
                                  diloco=dataclasses.replace(cfg.diloco, diloco_codec=codec))
        held = {b.name: b for b in plan(cfg, "cuda", shape)["buffers"]}
        assert not any(name.startswith("exchange") for name in held)  # no gossip
        if codec == "fp32":
            assert held["averaging: the shared outer gradient"].nbytes == 4 * shape.numel
        else:
            ef = held["error feedback (sparse payload)"]
            assert ef.nbytes == 4 * shape.numel and ef.where == "host"
            message = held["averaging: the message and 8 members' (all-gather)"].nbytes
            assert 0 < message < 9 * 0.02 * 4 * shape.numel  # 3% at 2 bits + indices, x 9
    done = run_plan("--model", "gpt", "--algorithm", "diloco", "--diloco-codec", "topk2:123")
    assert done.returncode == 0 and "error feedback (sparse payload)" in done.stdout
    bad = run_plan("--model", "gpt", "--algorithm", "diloco", "--diloco-codec", "randk2:9")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--diloco-codec='randk2:9'" in bad.stderr


_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 "
        "GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 22.41 "
        "GiB memory in use. Of the allocated memory 21.90 GiB is allocated by PyTorch, and "
        "123.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory "
        "is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def test_a_device_out_of_memory_in_training_is_one_line_with_the_plan_that_fits(tmp_path,
                                                                                caplog):
    """torch's out-of-memory error (hundreds of characters, a traceback under it) stops the
    trainer with one line: what it asked for and had, a `gasloc-node plan` command for this
    node's shape that runs as printed, and only the flags that would lower the need."""
    import threading

    import torch

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    cfg = dataclasses.replace(TINY, data=str(corpus), tokenizer="byte", precision="bf16")
    node = Trainer(cfg, AsyncConfig(), 1, TrainingLock(), TrainStats())
    node.load_data(0)
    real = node.inner.step

    def step(*args, **kw):
        if node.stats.step == 3:
            raise torch.OutOfMemoryError(_OOM)
        return real(*args, **kw)

    node.inner.step = step  # type: ignore[method-assign]
    with caplog.at_level("DEBUG"):
        node.run(threading.Event())
    error = node.stats.error
    assert node.finished.is_set() and "\n" not in error
    assert error.startswith("the device ran out of memory at step 3 (it asked for 2.00 GiB "
                            "with 1.20 GiB free of 23.65 GiB); `gasloc-node plan --model gpt "
                            "--micro-batch 2 --seq-len 16 --precision bf16 --device-memory "
                            "SIZE` says what fits; lower --batch-size"), error
    assert "add --activation-checkpointing" in error and "--precision bf16," not in error
    assert not any(r.exc_info for r in caplog.records)  # no traceback
    command = error.split("`")[1].split()[1:]
    assert command[0] == "plan"
    done = run_plan(*[a if a != "SIZE" else "24GiB" for a in command[1:]])
    assert done.returncode == 0 and "fits in 24.0 GiB" in done.stdout, done.stderr


def test_a_device_out_of_memory_at_start_is_one_line_and_exit_2(monkeypatch, capsys):
    """Building the node's model on a device too small for it: `gasloc-node join` prints one
    line naming the plan command, exits 2 (the flags ask for too much), and is not taken for
    a --compile failure when it happens in the compile's warm-up."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from gasloc_p2p.node import cli_node, daemon
    from gasloc_p2p.node.config import NodeConfig

    class TooBig:
        def __init__(self, *_: object, **__: object) -> None:
            pass

        async def __aenter__(self) -> None:
            raise torch.OutOfMemoryError(_OOM)

        async def __aexit__(self, *_: object) -> None:
            return None

        def request_stop(self) -> None:
            pass

    monkeypatch.setattr(daemon, "Node", TooBig)
    cfg = dataclasses.replace(NodeConfig(), train=dataclasses.replace(TINY, compile=True))
    with ThreadPoolExecutor(2) as pool:
        code = asyncio.run(cli_node._join(cfg, pool))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("gasloc-node join: error: the device ran out of memory at start "
                          "(it asked for 2.00 GiB with 1.20 GiB free of 23.65 GiB)"), err
    assert "drop --compile" in err and "--precision bf16" in err


def test_a_node_says_what_it_builds_and_refuses_what_host_memory_cannot_hold(
        corpus, monkeypatch, caplog):
    """Before building its model a node logs its size and host memory (the plan's figures),
    and refuses one that needs more than the machine has, before building anything."""
    import logging

    from gasloc_p2p.node import daemon
    from gasloc_p2p.node.config import ConfigError
    from gasloc_p2p.node.discovery.base import InMemoryDiscovery, InMemoryRegistry
    from tests.daemon_helpers import tiny_config
    from tests.node_helpers import run

    monkeypatch.setattr(daemon, "available_host_memory", lambda: 64 << 30)
    huge = tiny_config(corpus, n_layer=48, n_embd=8192, n_head=64)  # 38.7B parameters
    node = daemon.Node(huge, InMemoryDiscovery(InMemoryRegistry(), "gasloc", "a"))
    with pytest.raises(ConfigError, match=r"^--model gpt: building it needs about [\d.]+ GiB of "
                                          r"host memory and this machine has 64\.0 GiB "
                                          r"available .*: choose a smaller model \(--n-layer"):
        run(node.start(), timeout_s=60)
    assert node.trainer is None  # refused before the build
    with caplog.at_level(logging.INFO, logger="gasloc_p2p.node.daemon"):
        daemon.Node(tiny_config(corpus))._before_build("cpu", 256)
    assert "building the model gpt on cpu: 0.1M parameters; host memory about" in caplog.text
    assert "(64.0 GiB available)" in caplog.text
