"""Nothing in the node assumes CPU: the paths where host bytes meet device tensors.

Decoding starts from host bytes and moves them to the device once; encoding happens on the
device and only the encoded bytes cross (``ExchangeEngine.prepare`` stages each chunk on the
device, then copies it into the pinned host payload). The CUDA tests run when a GPU is present
and are skipped with a reason otherwise (``make gpu-check`` runs them); the CPU tests drive the
chunked paths (chunking changes no byte).
"""

from __future__ import annotations

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.flat import Fragment, whole
from gasloc_p2p.core.outer import LocalNesterov
from gasloc_p2p.core.wire import Encoded
from gasloc_p2p.node.runtime import bootstrap
from gasloc_p2p.node.transport.service import SharedSnapshot, StateSnapshot
from gasloc_p2p.protocol.engine import ExchangeEngine, NoLock

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="no CUDA device on this machine (the CI boxes are CPU-only)")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]
NUMEL = 3 * 4096 + 1000  # several 4096-element chunks and a partial block


def _pair(device: str, chunk: int | None = None, outer: AsyncConfig | None = None,
          host: str | None = None) -> list[ExchangeEngine]:
    engines = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        theta0 = torch.randn(NUMEL, generator=torch.Generator().manual_seed(9))
        theta = (theta0 + 0.1 * torch.randn(NUMEL, generator=gen)).to(device)
        state = AsyncGaslocState(theta, theta0.to(device), outer or AsyncConfig(eta=0.7),
                                 host=host)
        state.theta.add_(0.05)
        engines.append(ExchangeEngine(state, theta0.to(torch.bfloat16), [whole(NUMEL)],
                                      NoLock(), chunk))
    return engines


def _exchanges(engines: list[ExchangeEngine], spec: CodecSpec,
               rounds: int = 3) -> tuple[list[bytes], list[torch.Tensor]]:
    """Payload bytes of ``rounds`` exchanges (both sides), committing each; the final states."""
    sent = []
    for _ in range(rounds):
        a = engines[0].prepare("B", 0, spec)
        b = engines[1].prepare("A", 0, spec)
        sent += [bytes(a.payload), bytes(b.payload)]
        got_b = engines[0].check(spec, NUMEL, bytearray(b.payload), b.digest, a)
        got_a = engines[1].check(spec, NUMEL, bytearray(a.payload), a.digest, b)
        norms = engines[0].commit(a, got_b, 0.5), engines[1].commit(b, got_a, 0.5)
        assert norms[0] == norms[1] > 0  # c_i = -c_j bit for bit
    states = [t.cpu() for e in engines for t in (e.state.theta, e.state.anchor)
              if t is not None]
    return sent, states


@pytest.mark.parametrize("codec", ["int8", "int4", "fp4", "fp16"])
def test_chunking_changes_no_byte(codec):
    """Chunks of 4096 elements (a partial last block included) give the payloads and states
    of one pass: the chunked loops are elementwise."""
    spec = CodecSpec.of(codec, 256)
    (sent_a, states_a), (sent_b, states_b) = (_exchanges(_pair("cpu", 4096), spec),
                                              _exchanges(_pair("cpu", 1 << 27), spec))
    assert sent_a == sent_b
    assert all(torch.equal(x, y) for x, y in zip(states_a, states_b, strict=True))


@NO_CUDA
@pytest.mark.parametrize("codec", ["int8", "int4", "fp4", "fp16"])
@pytest.mark.parametrize("outer", [AsyncConfig(), AsyncConfig(eta=0.7)])
def test_a_gpu_node_with_host_outer_state_tracks_the_cpu_node(codec, outer):
    """The same exchanges on CUDA (outer state in pinned host memory, the engine's own stream,
    4096-element chunks) and on the CPU: the payloads decode alike (encodings may round one
    ulp apart: fused multiply-adds) and the states agree to float32 rounding."""
    spec = CodecSpec.of(codec, 256)
    cpu_sent, cpu_states = _exchanges(_pair("cpu", 4096, outer), spec)
    gpu = _pair("cuda", 4096, outer, host="cpu")
    assert all(e.state.anchor is None or e.state.anchor.is_pinned() for e in gpu)
    gpu_sent, gpu_states = _exchanges(gpu, spec)
    codec_ = spec.codec()
    for x, y in zip(cpu_sent, gpu_sent, strict=True):
        dx = codec_.decode(Encoded.from_bytes(spec.name, NUMEL, spec.block_size, x))
        dy = codec_.decode(Encoded.from_bytes(spec.name, NUMEL, spec.block_size, y))
        torch.testing.assert_close(dx, dy, rtol=0, atol=0.15 if codec in ("int4", "fp4")
                                   else 0.02)
    for x, y in zip(cpu_states, gpu_states, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0.1)


@NO_CUDA
def test_decoding_is_bit_identical_on_cpu_and_cuda():
    """Both sides of an exchange fold the same bytes: a GPU node and a CPU node decode a
    payload to the same bits (the antisymmetry of c rests on it)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10_000, generator=gen)
    for name in ("int8", "int4", "fp4", "fp16", "fp32"):
        codec = CodecSpec.of(name, 256).codec()
        enc = codec.encode(x)
        assert torch.equal(codec.decode(enc), codec.decode(enc.to("cuda")).cpu()), name


@pytest.mark.parametrize("device", DEVICES)
def test_outer_steps_take_a_host_gradient_onto_the_device(device):
    """An all-reduced outer gradient comes back in the averager's host buffer."""
    anchor = torch.ones(8, device=device)
    outer = LocalNesterov(0.5, 0.5).allocate(anchor, anchor.device, anchor)  # state beside it
    memory = outer.state["momentum"]
    outer.step_fragment(whole(8), anchor, torch.full((8,), 2.0))  # host gradient
    assert memory.device.type == device and torch.equal(memory.cpu(), torch.full((8,), 2.0))
    assert torch.equal(anchor.cpu(), torch.full((8,), 1 - 0.5 * (2 + 0.5 * 2)))
    frag = Fragment(0, ((0, 4),))
    new = outer.step_fragment(frag, anchor, torch.ones(4))
    assert new.device.type == device and anchor.device.type == device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bootstrap_agreement_with_host_downloads(device, dtype):
    """Downloads are host tensors; theta_0 lives on the device (bfloat16 when compacted)."""
    theta0 = torch.zeros(64, device=device, dtype=dtype)
    sampler = bootstrap.Sampler(theta0)
    states = [bootstrap.Candidate(n, i, v * torch.ones(64), {"zprev": torch.zeros(64)},
                                  None)  # type: ignore[arg-type]
              for i, (n, v) in enumerate([("a", 1.0), ("b", 1.01), ("c", 0.99), ("far", -1.0)])]
    for c in states:
        sampler.measure(c)
    medoid, group = bootstrap.choose(states, 3)
    assert medoid is states[0] and len(group) == 3
    assert bootstrap.choose([states[0], states[3]], 2) is None


@pytest.mark.parametrize("device", DEVICES)
def test_state_downloads_serve_host_copies(device):
    """DownloadState streams bytes views of host memory; a device snapshot is copied once."""
    params = torch.arange(6, dtype=torch.float32, device=device)

    def take() -> StateSnapshot:
        return StateSnapshot(3, 1, "mixed", params.clone(), {"zprev": params.clone() * 2})

    shared = SharedSnapshot(take, limit=2)
    snap, views, _ = shared._take()
    assert snap.params.device.type == "cpu" and snap.state["zprev"].device.type == "cpu"
    assert bytes(views[0]) == params.cpu().numpy().tobytes()
    assert bytes(views[1]) == (params.cpu() * 2).numpy().tobytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["int8", "int4", "fp4", "fp16", "fp32"])
def test_a_staging_area_on_the_device_encodes_like_the_payload(device, codec):
    """The engine's per-chunk staging (Encoded.empty_on: one allocation on the device) holds
    what encoding straight into the payload's memory writes."""
    spec = CodecSpec.of(codec, 256)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    payload, direct = Encoded.empty(spec.name, x.numel(), spec.block_size)
    spec.codec().encode_into(x, direct)
    staged = Encoded.empty_on(spec.name, x.numel(), spec.block_size, device)
    assert staged.data.device.type == device
    spec.codec().encode_into(x.to(device), staged)
    decode = spec.codec().decode
    torch.testing.assert_close(decode(staged).cpu(), decode(direct), rtol=0, atol=0.02 * (
        codec in ("int4", "fp4")) + 0.01 * (codec == "int8"))
