"""Nothing in the node assumes CPU: the paths where host bytes meet device tensors.

Decoding starts from host bytes and moves them to the device once; encoding happens on the
device and only the encoded bytes cross (``ExchangeEngine.prepare`` stages each chunk on the
device, then copies it into the host payload). The CUDA tests run when a GPU is present and are
skipped with a reason otherwise; the CPU tests drive the same code paths where that is honest
(the staged encode, forced on the host, must give the same payload bytes as the direct one).
"""

from __future__ import annotations

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.diloco import NesterovOuter
from gasloc_p2p.core.flat import Fragment, whole
from gasloc_p2p.core.streaming import fragment_outer_step
from gasloc_p2p.node.runtime import bootstrap
from gasloc_p2p.node.transport.service import SharedSnapshot, StateSnapshot
from gasloc_p2p.protocol import engine as engine_mod
from gasloc_p2p.protocol.engine import ExchangeEngine, NoLock

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="no CUDA device on this machine (the CI boxes are CPU-only)")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]
NUMEL = 3 * 4096 + 1000  # several chunks (CHUNK_ELEMS patched to 4096) and a partial block


def _pair(device: str) -> list[ExchangeEngine]:
    engines = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        theta0 = torch.randn(NUMEL, generator=torch.Generator().manual_seed(9)).to(device)
        theta = (theta0 + 0.1 * torch.randn(NUMEL, generator=gen).to(device)).contiguous()
        state = AsyncGaslocState(theta, theta0, AsyncConfig(eta=0.7))
        state.theta.add_(0.05)
        engines.append(ExchangeEngine(state, theta0, [whole(NUMEL)], NoLock()))
    return engines


def _exchanges(engines: list[ExchangeEngine], spec: CodecSpec, rounds: int = 3) -> list[bytes]:
    """Payload bytes of ``rounds`` exchanges (both sides), committing each."""
    sent = []
    for _ in range(rounds):
        a = engines[0].prepare("B", 0, spec)
        b = engines[1].prepare("A", 0, spec)
        sent += [bytes(a.payload), bytes(b.payload)]
        got_b = engines[0].check(spec, NUMEL, bytearray(b.payload), b.crc32)
        got_a = engines[1].check(spec, NUMEL, bytearray(a.payload), a.crc32)
        norms = engines[0].commit(a, got_b, 0.5), engines[1].commit(b, got_a, 0.5)
        assert norms[0] == norms[1] > 0  # c_i = -c_j bit for bit
    return sent


@pytest.mark.parametrize("codec", ["int8", "int4", "fp4", "fp16"])
def test_staged_encode_gives_the_direct_payload_bytes(monkeypatch, codec):
    """The device path of prepare (encode into a staging Encoded, copy its bytes into the host
    payload), forced on the host: same bytes as encoding straight into the payload, over
    several chunks and a partial last block."""
    monkeypatch.setattr(engine_mod, "CHUNK_ELEMS", 4096)
    spec = CodecSpec.of(codec, 256)
    direct = _exchanges(_pair("cpu"), spec)
    monkeypatch.setattr(engine_mod, "stages_on_device", lambda device: True)
    assert _exchanges(_pair("cpu"), spec) == direct


@NO_CUDA
@pytest.mark.parametrize("codec", ["int8", "int4", "fp4", "fp16"])
def test_exchanges_on_cuda_send_the_cpu_bytes(monkeypatch, codec):
    monkeypatch.setattr(engine_mod, "CHUNK_ELEMS", 4096)
    spec = CodecSpec.of(codec, 256)
    assert _exchanges(_pair("cuda"), spec) == _exchanges(_pair("cpu"), spec)


@pytest.mark.parametrize("device", DEVICES)
def test_outer_steps_take_a_host_gradient_onto_the_device(device):
    """An all-reduced outer gradient comes back in the averager's host buffer."""
    anchor = torch.ones(8, device=device)
    memory = torch.zeros(8, device=device)
    outer = NesterovOuter(8, eta=0.5, gamma=0.5, buf=memory)
    assert outer.buf is memory
    outer.step_(anchor, torch.full((8,), 2.0))  # host gradient
    assert memory.device.type == device and torch.equal(memory.cpu(), torch.full((8,), 2.0))
    assert torch.equal(anchor.cpu(), torch.full((8,), 1 - 0.5 * (2 + 0.5 * 2)))
    frag = Fragment(0, ((0, 4),))
    new = fragment_outer_step(frag, anchor, memory, torch.ones(4), 0.5, 0.5)
    assert new.device.type == device and anchor.device.type == device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bootstrap_agreement_with_host_downloads(device, dtype):
    """Downloads are host tensors; theta_0 lives on the device (bfloat16 when compacted)."""
    theta0 = torch.zeros(64, device=device, dtype=dtype)
    a = bootstrap.Candidate("a", 1, torch.ones(64), torch.zeros(64), None)  # type: ignore[arg-type]
    b = bootstrap.Candidate("b", 2, torch.ones(64) * 1.01, torch.zeros(64), None)  # type: ignore[arg-type]
    far = bootstrap.Candidate("c", 3, -torch.ones(64), torch.zeros(64), None)  # type: ignore[arg-type]
    assert bootstrap.choose([a, far, b], theta0) is b
    assert bootstrap.choose([a, far], theta0) is None


@pytest.mark.parametrize("device", DEVICES)
def test_state_downloads_serve_host_copies(device):
    """DownloadState streams bytes views of host memory; a device snapshot is copied once."""
    params = torch.arange(6, dtype=torch.float32, device=device)

    def take() -> StateSnapshot:
        return StateSnapshot(3, 1, "mixed", params.clone(), params.clone() * 2)

    shared = SharedSnapshot(take, limit=2)
    snap, views, _ = shared._take()
    assert snap.params.device.type == "cpu" and snap.memory.device.type == "cpu"
    assert bytes(views[0]) == params.cpu().numpy().tobytes()
    assert bytes(views[1]) == (params.cpu() * 2).numpy().tobytes()
