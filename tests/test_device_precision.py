"""Device, precision, gradient accumulation and compile in the shared InnerLoop; codecs and the
outer state on the training device. The CUDA tests run when a GPU is present and are skipped
with a reason otherwise (the build machines have none)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CODEC_NAMES, CodecSpec
from gasloc_p2p.core.flat import FlatParams, whole
from gasloc_p2p.core.wire import Encoded
from gasloc_p2p.model import GPTConfig, build_model
from gasloc_p2p.node.config import ConfigError, NodeConfig, TrainConfig
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.protocol.engine import ExchangeEngine
from gasloc_p2p.train import InnerLoop, LRSchedule, StepConfig, resolve_device

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_embd=32, n_head=2)
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="no CUDA device on this machine (the CI boxes are CPU-only)")


def _batch(b: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(0, 256, (b, 17), generator=torch.Generator().manual_seed(seed))
    return w[:, :-1], w[:, 1:]


def _loop(device: str = "cpu", **how: object) -> InnerLoop:
    model = build_model(TINY, 0).to(device)
    FlatParams(model)
    return InnerLoop(model, LRSchedule(1e-3), how=StepConfig(**how))  # type: ignore[arg-type]


def test_grad_accum_matches_one_full_batch_step():
    full, accum = _loop(), _loop(grad_accum=4)
    x, y = _batch(8)
    l1, l2 = full.step(x, y, 0), accum.step(x, y, 0)
    assert abs(float(l1) - float(l2)) < 1e-5
    for a, b in zip(full.model.parameters(), accum.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="grad_accum=3"):
        _loop(grad_accum=3).step(x, y, 0)


def test_bf16_autocast_keeps_fp32_master_weights_on_cpu():
    loop = _loop(precision="bf16")
    x, y = _batch()
    losses = [float(loop.step(x, y, s)) for s in range(5)]
    assert all(p.dtype == torch.float32 for p in loop.model.parameters())
    assert losses[-1] < losses[0] and all(map(lambda v: v == v, losses))
    ref = _loop()
    assert abs(float(ref.step(x, y, 0)) - losses[0]) < 0.05  # bf16 forward, same loss nearly


def test_device_and_precision_flags_are_validated():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ({"device": "tpu"}, {"precision": "fp8"}, {"grad_accum": 0}):
        with pytest.raises(ConfigError, match=f"--{next(iter(bad)).replace('_', '-')}="):
            NodeConfig(train=dataclasses.replace(TrainConfig(), **bad)).validate()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^--device cuda:0: CUDA is not available"):
            resolve_device("cuda:0")
    else:
        with pytest.raises(ValueError, match="^--device cuda:99: this machine has"):
            resolve_device("cuda:99")


def test_compile_flag_wraps_the_forward_and_shares_parameters():
    loop = _loop(compile=True)
    assert loop.forward is not loop.model
    with pytest.raises(ValueError, match="precision"):
        StepConfig(precision="fp16")


def _compiling_trainer(tmp_path):
    """A tiny node's trainer with ``--compile`` (its warm-up not run yet)."""
    from gasloc_p2p.node.runtime.trainer import Trainer
    from gasloc_p2p.node.stats import TrainStats

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    cfg = TrainConfig(n_layer=1, n_embd=32, n_head=2, seq_len=16, batch_size=2, compile=True,
                      data=str(corpus), tokenizer="byte")
    node = Trainer(cfg, AsyncConfig(), 1, TrainingLock(), TrainStats())
    node.load_data(0)
    return node


def test_a_compile_that_cannot_build_is_one_line_naming_the_flag(tmp_path):
    """torch.compile fails at the first call (no C compiler, an unsupported op) with a
    message dozens of lines long: the node's warm-up says so in one line naming --compile,
    and the parameters have not moved."""
    node = _compiling_trainer(tmp_path)
    before = node.flat.buffer.clone()

    def broken(*_: object) -> None:
        raise RuntimeError("InductorError: CppCompileError: C++ compile error\n" + "x\n" * 50)

    node.inner.forward = broken  # type: ignore[assignment]
    with pytest.raises(ConfigError) as info:
        node.warm_up()
    text = str(info.value)
    assert text.startswith("--compile: torch.compile could not build the model on cpu "
                           "(RuntimeError: InductorError: CppCompileError")
    assert "\n" not in text and text.endswith("run without --compile")
    assert torch.equal(node.flat.buffer, before)


@NO_CUDA
def test_bf16_autocast_step_on_cuda():
    loop = _loop("cuda", precision="bf16")
    x, y = _batch()
    loss = loop.step(x, y, 0)
    assert loss.device.type == "cuda" and torch.isfinite(loss)
    assert all(p.dtype == torch.float32 and p.is_cuda for p in loop.model.parameters())


@NO_CUDA
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_codecs_on_cuda_are_bit_identical_to_cpu(name):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    codec = CodecSpec.of(name, 256).codec()
    cpu, gpu = codec.encode(x), codec.encode(x.cuda())
    assert gpu.data.is_cuda and cpu.to_bytes() == gpu.to_bytes()  # only bytes reach the host
    back = Encoded.from_bytes(name, x.numel(), cpu.block_size, cpu.to_bytes())
    assert torch.equal(codec.decode(back), codec.decode(back, torch.empty(10_000,
                                                                           device="cuda")).cpu())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NO_CUDA)])
def test_two_node_exchange_on_device_is_antisymmetric(device):
    """Two engines whose models live on ``device`` run one exchange; the corrections are exact
    opposites and every buffer stays on the device (only payload bytes reach the host)."""
    spec = CodecSpec.of("int8", 256)
    engines, states = [], []
    for seed in (0, 1):
        model = build_model(TINY, 0).to(device)
        flat = FlatParams(model)
        theta0 = flat.buffer.detach().clone()
        noise = torch.randn(flat.numel, generator=torch.Generator().manual_seed(seed))
        flat.buffer.add_(noise.to(device))
        state = AsyncGaslocState(flat.buffer, theta0, AsyncConfig())
        states.append(state)
        engines.append(ExchangeEngine(state, theta0, [whole(flat.numel)], TrainingLock()))
    before = [s.theta.clone() for s in states]
    a = engines[0].prepare("B", 0, spec)
    b = engines[1].prepare("A", 0, spec)
    got_b = engines[0].check(spec, b.encoded.numel, b.payload, b.digest)
    got_a = engines[1].check(spec, a.encoded.numel, a.payload, a.digest)
    norms = engines[0].commit(a, got_b, 0.5), engines[1].commit(b, got_a, 0.5)
    assert norms[0] == norms[1] > 0  # c_i = -c_j, bit for bit
    da, db = states[0].theta - before[0], states[1].theta - before[1]
    assert da.device.type == device and a.encoded.data.device.type == "cpu"  # wire bytes
    torch.testing.assert_close(da, -db, atol=1e-6, rtol=0)  # theta + c rounds per element


def test_running_out_of_memory_in_the_compile_warm_up_is_not_blamed_on_compile(tmp_path):
    """The warm-up's forward can run out of device memory: that is the shape's fault, not the
    compiler's, so it reaches the node's out-of-memory line (tests/test_plan.py), not the
    --compile one."""
    node = _compiling_trainer(tmp_path)

    def too_big(*_: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    node.inner.forward = too_big  # type: ignore[assignment]
    with pytest.raises(torch.OutOfMemoryError):
        node.warm_up()
