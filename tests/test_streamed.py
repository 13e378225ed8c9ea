"""Exchanges with streamed payloads (``protocol/payloads``: int8, int4, fp4) give the other
path's bytes and states.

On a GPU the engine streams both payloads through chunk-sized device staging instead of
keeping them on the device from the check to the commit; here that path is forced on the CPU
and checked byte for byte against the other one, for every codec with a room: chunking,
staging, the zero-padded partial block (and a partial last byte of 4-bit data), the pieces of
a strided fragment, an anchor kept on the side and the guard's screen. The CUDA test does the
same on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.flat import Fragment, whole
from gasloc_p2p.protocol import payloads
from gasloc_p2p.protocol.engine import ExchangeEngine, NoLock
from gasloc_p2p.protocol.guard import GuardRule, UpdateGuard
from gasloc_p2p.protocol.payloads import int8 as fused

NUMEL = 3 * 4096 + 1000  # several chunks and a partial block
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="no CUDA device on this machine (the CI boxes are CPU-only)")
STRIDED = Fragment(0, [(0, 1500), (4000, 5000), (11000, NUMEL - 11000)])


def _pair(device: str, stream: bool | None, outer: AsyncConfig, fragment: Fragment,
          chunk: int | None, kernels: bool | None = False) -> list[ExchangeEngine]:
    engines = []
    theta0 = torch.randn(NUMEL, generator=torch.Generator().manual_seed(9))
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        theta = (theta0 + 0.1 * torch.randn(NUMEL, generator=gen)).to(device)
        state = AsyncGaslocState(theta, theta0.to(device), outer)
        state.theta.add_(0.05)
        engine = ExchangeEngine(state, theta0.to(torch.bfloat16), [fragment], NoLock(), chunk,
                                stream_payloads=stream, kernels=kernels)
        engine.guard = UpdateGuard(GuardRule(trust_after=1, round_budget=1e30,
                                             block_budget=1e30))
        engine.guard.round_end({0: 1.0})
        engines.append(engine)
    return engines


def _exchanges(engines: list[ExchangeEngine], numel: int, rounds: int = 3,
               codec: str = "int8") -> tuple[list[bytes], list[float], list[torch.Tensor]]:
    spec = CodecSpec.of(codec, 256)
    sent, seen = [], []
    for _ in range(rounds):
        a = engines[0].prepare("B", 0, spec)
        b = engines[1].prepare("A", 0, spec)
        sent += [bytes(a.payload), bytes(b.payload)]
        got_b = engines[0].check(spec, numel, bytearray(b.payload), b.digest, a)
        got_a = engines[1].check(spec, numel, bytearray(a.payload), a.digest, b)
        norms = engines[0].commit(a, got_b, 0.5), engines[1].commit(b, got_a, 0.5)
        assert norms[0] == norms[1] > 0  # c_i = -c_j bit for bit
        seen += [a.clip, b.clip, *norms]
    states = [t.cpu() for e in engines for t in (e.state.theta, e.state.anchor)
              if t is not None]
    return sent, seen, states


ODD = Fragment(0, [(0, 1501), (4000, 5000), (11000, NUMEL - 11000)])  # an odd piece


@pytest.mark.parametrize("outer", [AsyncConfig(), AsyncConfig(eta=0.7)],
                         ids=["theta-itself", "anchor"])
@pytest.mark.parametrize("fragment", [whole(NUMEL), STRIDED], ids=["whole", "strided"])
@pytest.mark.parametrize("chunk", [4096, None], ids=["chunks", "one-pass"])
def test_streamed_payloads_give_the_same_bytes_and_states(outer, fragment, chunk):
    _same_bytes_and_states(outer, fragment, chunk, "int8")


@pytest.mark.parametrize("codec", ["int4", "fp4"])
@pytest.mark.parametrize("fragment", [whole(NUMEL), ODD], ids=["whole", "odd"])
def test_4bit_payloads_stream_with_the_same_bytes_and_states(codec, fragment):
    """int4 and fp4 stream through their rooms' eager passes (the codec's own block math):
    two elements a byte, a partial last block and, at an odd length, a partial last byte."""
    _same_bytes_and_states(AsyncConfig(eta=0.7), fragment, 4096, codec)


def _same_bytes_and_states(outer, fragment, chunk, codec):
    numel = fragment.numel
    eager = _exchanges(_pair("cpu", False, outer, fragment, chunk), numel, codec=codec)
    forced = _pair("cpu", True, outer, fragment, chunk)
    assert forced[0].streams(CodecSpec.of(codec, 256))  # the path is taken
    got = _exchanges(forced, numel, codec=codec)
    assert got[0] == eager[0]  # payloads
    assert all(torch.equal(x, y) for x, y in zip(got[2], eager[2], strict=True))
    for x, y in zip(got[1], eager[1], strict=True):  # clips, norms (summed in another order)
        assert x == pytest.approx(y, rel=1e-6)


def test_codecs_with_a_room_stream_and_only_where_asked():
    cpu = _pair("cpu", None, AsyncConfig(), whole(NUMEL), None)[0]
    assert not cpu.streams(CodecSpec.of("int8"))  # a CPU keeps its cache-sized passes
    forced = _pair("cpu", True, AsyncConfig(), whole(NUMEL), None)[0]
    assert [c for c in ("int8", "int4", "fp4", "fp32", "fp16", "sign1", "half2")
            if forced.streams(CodecSpec.of(c))] == ["int8", "int4", "fp4"]
    with pytest.raises(ValueError, match="residual"):  # their prepare needs the link
        payloads.Room("sign1")


def test_a_non_finite_iterate_is_refused_on_the_fused_path():
    engine = _pair("cpu", True, AsyncConfig(), whole(NUMEL), 4096)[0]
    engine.state.theta[NUMEL - 3] = float("nan")  # in the partial last block
    with pytest.raises(ValueError, match="NaN or Inf"):
        engine.prepare("B", 0, CodecSpec.of("int8", 256))


def test_an_absurd_payload_is_refused_before_any_device_work():
    engines = _pair("cpu", True, AsyncConfig(), whole(NUMEL), None)
    spec = CodecSpec.of("int8", 256)
    a = engines[0].prepare("B", 0, spec)
    b = engines[1].prepare("A", 0, spec)
    bad = bytearray(b.payload)
    bad[0:4] = torch.tensor([1e30], dtype=torch.float32).numpy().tobytes()  # the first scale
    from gasloc_p2p.core.wire import payload_digest
    with pytest.raises(ValueError, match="absurd"):
        engines[0].check(spec, NUMEL, bad, payload_digest(bad), a)


@NO_CUDA
@pytest.mark.parametrize("outer", [AsyncConfig(), AsyncConfig(eta=0.7)],
                         ids=["theta-itself", "anchor"])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_streamed_payloads_on_cuda_give_the_same_bytes_and_states(outer, codec):
    """On a GPU (the default there: streamed; int8 through its kernels, int4 through the
    eager passes) against payloads kept on the device."""
    compiled = _pair("cuda", None, outer, whole(NUMEL), 4096, kernels=None)
    assert compiled[0].streams(CodecSpec.of(codec, 256))
    got = _exchanges(compiled, NUMEL, codec=codec)
    kept = _exchanges(_pair("cuda", False, outer, whole(NUMEL), 4096), NUMEL, codec=codec)
    assert got[0] == kept[0]
    assert all(torch.equal(x, y) for x, y in zip(got[2], kept[2], strict=True))
    for x, y in zip(got[1], kept[1], strict=True):
        assert x == pytest.approx(y, rel=1e-5)


FUSED_ON = "cuda" if torch.cuda.is_available() else "cpu"
NO_TRITON = pytest.mark.skipif(
    not fused.usable(torch.device(FUSED_ON)),
    reason="the fused kernels need Triton and a GPU, or TRITON_INTERPRET=1 on a CPU (PyTorch's "
           "CPU wheels come without Triton)")


@NO_TRITON
@pytest.mark.parametrize("outer", [AsyncConfig(), AsyncConfig(eta=0.7)],
                         ids=["theta-itself", "anchor"])
@pytest.mark.parametrize("fragment", [whole(NUMEL), STRIDED], ids=["whole", "strided"])
@pytest.mark.parametrize("chunk", [4096, None], ids=["chunks", "one-pass"])
def test_fused_kernels_give_the_eager_bytes_and_states(outer, fragment, chunk):
    """Triton's kernels (engine.kernels) against the eager passes on the same device: the same
    payloads and states bit for bit, both sides' ||c|| equal (c_i = -c_j: no fused
    multiply-add), the guard's clips and the norms close (summed in another order)."""
    eager = _exchanges(_pair(FUSED_ON, True, outer, fragment, chunk, False), fragment.numel)
    pair = _pair(FUSED_ON, True, outer, fragment, chunk, True)
    pair[0].warm_up(CodecSpec.of("int8", 256))
    got = _exchanges(pair, fragment.numel)
    assert got[0] == eager[0]
    assert all(torch.equal(x, y) for x, y in zip(got[2], eager[2], strict=True))
    for x, y in zip(got[1], eager[1], strict=True):
        assert x == pytest.approx(y, rel=1e-5)


@NO_TRITON
def test_the_fused_encoder_refuses_a_non_finite_iterate_and_rounds_half_to_even():
    engine = _pair(FUSED_ON, True, AsyncConfig(), whole(NUMEL), 4096, True)[0]
    spec = CodecSpec.of("int8", 256)
    theta = engine.state.theta
    halves = (torch.arange(256.0) - 128) / 2  # -64, -63.5, ..., 63.5
    theta[:256] = halves.to(theta.device)
    theta[0] = -127.0  # absmax 127: scale 1, the code of x.5 is x rounded half to even
    out = engine.prepare("B", 0, spec)
    codes = torch.frombuffer(bytearray(out.encoded.data[:256].numpy()), dtype=torch.int8)
    want = halves.round()
    want[0] = -127
    assert torch.equal(codes.float(), want)
    theta[NUMEL - 3] = float("inf")  # in the partial last block
    with pytest.raises(ValueError, match="NaN or Inf"):
        engine.prepare("B", 0, spec)


def test_kernels_that_do_not_build_leave_the_eager_passes(monkeypatch):
    """Triton builds its launcher with a C compiler at the first launch: where that fails the
    engine says why and keeps the eager passes, whose bytes and states are the same."""
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment "
                           "variable.\nmore")

    monkeypatch.setattr(fused, "encode", no_compiler)
    pair = _pair("cpu", True, AsyncConfig(), whole(NUMEL), 4096, True)
    assert pair[0].warm_up(CodecSpec.of("int8", 256)) == (
        "RuntimeError: Failed to find C compiler. Please specify via CC environment variable.")
    assert not pair[0].kernels
    pair[1].kernels = False
    got = _exchanges(pair, NUMEL)
    want = _exchanges(_pair("cpu", True, AsyncConfig(), whole(NUMEL), 4096, False), NUMEL)
    assert got[0] == want[0]
    assert all(torch.equal(x, y) for x, y in zip(got[2], want[2], strict=True))
    assert _pair("cpu", True, AsyncConfig(), whole(NUMEL), 4096, False)[0].warm_up(
        CodecSpec.of("int8", 256)) is None  # nothing to build
