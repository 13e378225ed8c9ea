"""A node on a CUDA device: where its buffers live, the exchange's stream ordering, the outer
step against the CPU's (issue 22). Skipped with a reason where no GPU is present; ``make
gpu-check`` runs them (with ``CUBLAS_WORKSPACE_CONFIG`` set, so cuBLAS repeats itself)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.flat import whole
from gasloc_p2p.node.config_train import TrainConfig
from gasloc_p2p.node.plan import model_buffers, model_shape
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.trainer import Trainer
from gasloc_p2p.node.stats import TrainStats
from gasloc_p2p.protocol.engine import ExchangeEngine, NoLock
from gasloc_p2p.train.optim import gradients_at_once

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine (make gpu-check runs "
                                       "these where there is one)")

CFG = TrainConfig(n_layer=2, n_embd=128, n_head=4, seq_len=64, batch_size=4, inner_steps=3,
                  device="cuda", seed=5)
OUTER = AsyncConfig(eta=0.7, gamma=0.5)  # every outer buffer exists
SPEC = CodecSpec.parse("int8")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local text (offline): a few standard-library modules' source."""
    path = tmp_path_factory.mktemp("cuda") / "corpus.txt"
    path.write_text("\n".join(Path(m.__file__).read_text() for m in (contextlib, threading)))
    return str(path)


def trainer(corpus: str) -> Trainer:
    t = Trainer(dataclasses.replace(CFG, data=corpus, tokenizer="byte"), OUTER, 1,
                TrainingLock(), TrainStats())
    t.load_data(7)
    return t


def test_outer_state_lives_pinned_on_the_host_and_the_plan_counts_it(corpus):
    node = trainer(corpus)
    for _ in range(CFG.inner_steps):  # through a round end: every buffer exists
        node.step()
    torch.cuda.synchronize()
    st = node.state
    assert node.flat.buffer.device.type == "cuda"
    assert st.outer.state and node._good is not None and node._good[1]
    for name, t in (("anchor", st.anchor), *st.outer.state.items(), ("theta_0", node.theta0),
                    ("rollback", node._good[0]), *node._good[1].items()):
        assert t is not None and t.device.type == "cpu" and t.is_pinned(), name
    held = {(b.name, b.where): b.nbytes for b in node.placement()}
    shape = model_shape("gpt", node.cfg, node.data.tokenizer.vocab_size)
    grads = gradients_at_once(shape.numel, shape.largest, shape.n_layer, True)
    assert held == {(b.name, b.where): b.nbytes
                    for b in model_buffers(node.flat.numel, OUTER, False, "cuda", grads)}
    # what the GPU holds at rest: parameters and AdamW (12 B/param; gradients are freed
    # after each step) and a constant (cuBLAS workspaces, batches: 68 MB on an H100)
    held_now = torch.cuda.memory_allocated()
    assert 12 * node.flat.numel <= held_now <= 12.5 * node.flat.numel + (96 << 20), \
        (held_now, node.flat.numel)
    engine = ExchangeEngine(st, node.theta0, node.fragments, node.lock)
    prep = engine.prepare("peer", 0, SPEC)
    assert prep.encoded.data.is_pinned() and prep.encoded.scales.is_pinned()
    assert isinstance(engine.payload_buffer(1024), memoryview)


class RecordingLock:
    """The node's lock, noting the trainer's step count at each exchange phase's hold."""

    def __init__(self, node: Trainer) -> None:
        self.node, self.at = node, []

    @contextlib.contextmanager
    def urgent(self, writes: bool = True) -> Iterator[None]:
        with self.node.lock.urgent(writes):
            self.at.append(self.node.stats.step)
            yield


def peer_payload(node: Trainer) -> tuple[bytes, int]:
    """A peer's payload a little away from this node's parameters (a CPU engine's)."""
    gen = torch.Generator().manual_seed(11)
    theta = node.flat.buffer.cpu() + 0.01 * torch.randn(node.flat.numel, generator=gen)
    peer = ExchangeEngine(AsyncGaslocState(theta, theta, AsyncConfig()), node.theta0,
                          [whole(node.flat.numel)], NoLock())
    prep = peer.prepare("me", 0, SPEC)
    return bytes(prep.payload), prep.digest


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Math attention and deterministic kernels: two runs of the same steps agree bit for bit."""
    flags = (torch.backends.cuda.flash_sdp_enabled(),
             torch.backends.cuda.mem_efficient_sdp_enabled())
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.backends.cuda.enable_flash_sdp(flags[0])
        torch.backends.cuda.enable_mem_efficient_sdp(flags[1])
        torch.use_deterministic_algorithms(False)


def test_an_exchange_committed_while_training_runs_equals_the_serial_sequence(corpus):
    """Training queues kernels on the default stream from its thread while the exchange's run
    on the engine's stream (prepare and commit under the lock, the check outside it). The
    result must equal the same sequence done serially: the prepare and the commit land
    between the same steps, nothing else may leak across the streams."""
    steps = 12
    with deterministic():
        live = trainer(corpus)
        payload, digest = peer_payload(live)
        lock = RecordingLock(live)
        engine = ExchangeEngine(live.state, live.theta0, live.fragments, lock)
        done = threading.Event()

        def train() -> None:
            for _ in range(steps):
                live.step()
            done.set()

        worker = threading.Thread(target=train)
        worker.start()
        deadline = time.monotonic() + 120
        while live.stats.step < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        prep = engine.prepare("peer", 0, SPEC)
        got = engine.check(SPEC, live.flat.numel, bytearray(payload), digest, prep)
        engine.commit(prep, got, 0.5)
        worker.join(timeout=300)
        assert done.is_set()
        torch.cuda.synchronize()
        at = lock.at
        assert len(at) == 2 and 2 <= at[0] <= at[1] <= steps

        serial = trainer(corpus)
        engine = ExchangeEngine(serial.state, serial.theta0, serial.fragments, NoLock())
        while serial.stats.step < at[0]:
            serial.step()
        prep = engine.prepare("peer", 0, SPEC)
        while serial.stats.step < at[1]:
            serial.step()
        engine.commit(prep, engine.check(SPEC, serial.flat.numel, bytearray(payload), digest,
                                         prep), 0.5)
        while serial.stats.step < steps:
            serial.step()
        torch.cuda.synchronize()
    assert torch.equal(live.flat.buffer, serial.flat.buffer)
    assert torch.equal(live.state.anchor, serial.state.anchor)
    assert live.state.outer.state.keys() == serial.state.outer.state.keys()
    for name, buf in live.state.outer.state.items():
        assert torch.equal(buf, serial.state.outer.state[name]), name


@pytest.mark.parametrize("outer", [AsyncConfig(), AsyncConfig(eta=0.7),
                                   AsyncConfig(eta=0.7, gamma=0.5),
                                   AsyncConfig(eta=0.7, gamma=0.7, momentum="local")])
def test_the_outer_step_on_cuda_equals_the_cpus(outer):
    """The same round ends (parameters on CUDA, outer state on the pinned host; and all on
    the CPU) agree to float32 rounding: elementwise IEEE
    operations, at most a fused multiply-add apart."""
    n = 3 * 4096 + 1000
    gen = torch.Generator().manual_seed(2)
    theta0 = torch.randn(n, generator=gen)
    moves = [0.01 * torch.randn(n, generator=gen) for _ in range(4)]
    results = []
    for device in ("cpu", "cuda"):
        theta = theta0.to(device, copy=True)
        state = AsyncGaslocState(theta, theta0.to(device), outer, host="cpu")
        for move in moves:
            theta.add_(move.to(device))
            state.round_end()
        results.append([t.cpu() for t in (state.theta, state.anchor,
                                          *state.outer.state.values()) if t is not None])
    for cpu, cuda in zip(*results, strict=True):
        torch.testing.assert_close(cuda, cpu, rtol=2e-6, atol=1e-6)
