"""Wire codecs (gasloc_p2p.core.codecs): round trips, error bounds, wire format, determinism."""

from __future__ import annotations

import struct

import pytest
import torch

from gasloc_p2p.core.codecs import (
    CODEC_NAMES,
    CodecSpec,
    Encoded,
    NonFiniteError,
    get_codec,
    parse_optional,
)

BLOCK_CODECS = ("int8", "int4", "fp4", "sign1", "half2")
# Relative L2 error on N(0, 1) data, block 1024, measured (seed 0, 100k elements):
# fp16 2.1e-4, int8 7.9e-3, int4 0.143, fp4 0.195, sign1 0.603 (sqrt(1 - 2/pi) = 0.603), half2
# 0.749 (half the elements dropped, the other half at 2 bits: sqrt(0.5 + 0.5 * 0.34^2) = 0.747).
# The bands are about +-20% (half2's tighter: its floor is 0.707): a wrong scale (e.g.
# absmax/128 for int8) or a lost sign falls outside them.
REL_ERR_BAND = {
    "fp32": (0.0, 0.0),
    "fp16": (1.5e-4, 3e-4),
    "int8": (6.5e-3, 9.5e-3),
    "int4": (0.12, 0.17),
    "fp4": (0.16, 0.23),
    "sign1": (0.55, 0.66),
    "half2": (0.72, 0.78),
}
AWKWARD_SIZES = (0, 1, 2, 3, 63, 64, 65, 1000, 64 * 5 + 17)


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def rel_err(y: torch.Tensor, x: torch.Tensor) -> float:
    """||y - x|| / ||x||, in float64 so that huge values do not overflow the norm."""
    return float((y.double() - x.double()).norm() / x.double().norm())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("n", AWKWARD_SIZES)
def test_round_trip_awkward_sizes(name: str, n: int) -> None:
    codec = get_codec(name, block_size=64)
    x = gaussian(n, seed=n)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert enc.numel == n and enc.nbytes == codec.wire_bytes(n)
    if n == 0:
        return
    if name == "fp32":
        assert torch.equal(y, x)
    elif n == 1:  # the single element is its block's absmax: reproduced to float rounding
        torch.testing.assert_close(y, x, rtol=1e-3 if name == "fp16" else 1e-6, atol=0)
    else:
        assert rel_err(y, x) < REL_ERR_BAND[name][1] * 1.5  # small n: looser than the band


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_relative_error_on_gaussian_data(name: str) -> None:
    codec = get_codec(name)
    x = gaussian(100_000)
    lo, hi = REL_ERR_BAND[name]
    assert lo <= rel_err(codec.decode(codec.encode(x)), x) <= hi


@pytest.mark.parametrize("name", ("int8", "int4"))
def test_integer_codecs_error_at_most_half_a_step(name: str) -> None:
    bs, levels = 64, {"int8": 127, "int4": 7}[name]
    x = gaussian(64 * 20 + 5) * torch.linspace(0.01, 100, 64 * 20 + 5)  # blocks of unequal scale
    y = get_codec(name, bs).decode(get_codec(name, bs).encode(x))
    padded = torch.cat([x, x.new_zeros(-x.numel() % bs)]).view(-1, bs)
    step = padded.abs().amax(dim=1).repeat_interleave(bs)[: x.numel()] / levels
    assert bool(((y - x).abs() <= step * (0.5 + 1e-5)).all())


def test_fp4_rounds_to_nearest_power_of_two_of_absmax() -> None:
    # absmax 1: levels 0, 2^-6 .. 2^0; midpoints 2^-7 and 0.75 * 2^k (ties away from zero)
    x = torch.tensor(
        [1.0, 0.75, 0.7499, 0.375, 0.3749, 2**-7, 2**-7 * 0.999, -0.5, -1.5 * 2**-6, -0.0, 0.0]
    )
    expect = [1.0, 1.0, 0.5, 0.5, 0.25, 2**-6, 0.0, -0.5, -(2**-5), 0.0, 0.0]
    codec = get_codec("fp4", block_size=len(x) + 1)
    y = codec.decode(codec.encode(x))
    assert y.tolist() == expect
    assert bool((bits(y[-2:]) == 0).all())  # zeros decode to +0.0 whatever the input sign


def test_fp4_matches_brute_force_nearest_level() -> None:
    levels = torch.tensor([1.0] + [2.0**-k for k in range(1, 7)] + [0.0], dtype=torch.float64)
    mids = torch.cat([(levels[:-1] + levels[1:]) / 2, torch.tensor([2.0**-7])]).float()
    edges = torch.cat([mids, mids.nextafter(torch.ones(1)), mids.nextafter(torch.zeros(1))])
    a = torch.cat([torch.rand(20_000, generator=torch.Generator().manual_seed(1)), edges])
    x = torch.cat([torch.ones(1), a, -a])  # absmax exactly 1: y = x, both signs
    codec = get_codec("fp4", block_size=x.numel() + 1)
    y = codec.decode(codec.encode(x))
    # nearest level of |x|; argmin takes the first minimum, i.e. the larger level on a tie
    dist = (x.double().abs()[:, None] - levels[None, :]).abs()
    assert torch.equal(y.double(), levels[dist.argmin(dim=1)] * x.sign())


def test_fp4_scales_with_block_absmax() -> None:
    x = torch.tensor([-6.0, 3.0, 1.4, 0.0, 0.02, 0.05])  # absmax 6 -> levels 6 * 2^-k
    codec = get_codec("fp4", block_size=6)
    assert codec.decode(codec.encode(x)).tolist() == [-6.0, 3.0, 1.5, 0.0, 0.0, 0.09375]


@pytest.mark.parametrize(
    ("name", "scale", "data"),
    [
        # q = round_half_even([127, -63.5, 31.75, 0]) = [127, -64, 32, 0]
        ("int8", 1 / 127, bytes([0x7F, 0xC0, 0x20, 0x00])),
        # q = round_half_even([7, -3.5, 1.75, 0]) = [7, -4, 2, 0]; nibbles 7, 0xC, 2, 0
        ("int4", 1 / 7, bytes([0xC7, 0x02])),
        # codes sign<<3|m: 1 -> 7, -0.5 -> 8|6, 0.25 -> 5, 0 -> 0
        ("fp4", 1.0, bytes([0xE7, 0x05])),
    ],
)
def test_golden_wire_bytes(name: str, scale: float, data: bytes) -> None:
    enc = get_codec(name, block_size=4).encode(torch.tensor([1.0, -0.5, 0.25, 0.0]))
    assert enc.to_bytes() == struct.pack("<f", scale) + data


def test_golden_wire_bytes_sign1() -> None:
    # scale = mean |x| = (1 + 0.5 + 0.25 + 0 + 2 + 0.25 + 0 + 0) / 8 = 0.5; bit k of the byte is
    # element k's sign (1: >= 0): + - + + + - + +  ->  0b11011101; the tail of 3 elements
    # [-4, 1, 1]: its mean over its own 3 (2.0), bits - + +  ->  0b110
    x = torch.tensor([1.0, -0.5, 0.25, 0.0, 2.0, -0.25, 0.0, 0.0, -4.0, 1.0, 1.0])
    enc = get_codec("sign1", block_size=8).encode(x)
    assert enc.to_bytes() == struct.pack("<ff", 0.5, 2.0) + bytes([0b11011101, 0b110])
    y = get_codec("sign1", block_size=8).decode(enc)
    assert y.tolist() == [0.5, -0.5, 0.5, 0.5, 0.5, -0.5, 0.5, 0.5, -2.0, 2.0, 2.0]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_all_zeros_decode_to_exact_zero(name: str) -> None:
    codec = get_codec(name, block_size=64)
    y = codec.decode(codec.encode(torch.zeros(64 * 3 + 5)))
    assert bool((bits(y) == 0).all())


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_zero_and_tiny_blocks_next_to_large_ones(name: str) -> None:
    huge = torch.linspace(-3e38, 3e38, 64, dtype=torch.float64).float()  # near float32 max
    x = torch.cat([torch.zeros(64), gaussian(64) * 1e-35, huge, gaussian(10)])
    codec = get_codec(name, block_size=64)
    y = codec.decode(codec.encode(x))
    assert bool((bits(y[:128]) == 0).all())  # absmax < 2^-100: flushed, never inf/NaN
    assert rel_err(y[128:192], x[128:192]) < REL_ERR_BAND[name][1] * 1.5
    assert rel_err(y[192:], x[192:]) < REL_ERR_BAND[name][1] * 2


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(name: str, dtype: torch.dtype) -> None:
    codec = get_codec(name, block_size=64)
    x = gaussian(64 * 4 + 3).to(dtype)
    y = codec.decode(codec.encode(x))
    assert y.dtype == torch.float32
    if name == "fp32" or (name == "fp16" and dtype == torch.float16):
        assert torch.equal(y, x.float())
    else:
        assert rel_err(y, x) < REL_ERR_BAND[name][1] * 1.5


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("where", [0, 70, 200])  # first block, middle block, partial last block
def test_non_finite_input_raises(name: str, where: int) -> None:
    codec = get_codec(name, block_size=64)
    x = gaussian(203)
    x[where] = float("nan")
    x[5] = float("inf")
    x[6] = float("-inf")
    with pytest.raises(NonFiniteError, match=rf"{name} codec: input has 3 non-finite"):
        codec.encode(x)
    with pytest.raises(NonFiniteError):
        codec.encode(x.to(torch.bfloat16))


def test_fp16_out_of_range_raises_instead_of_inf() -> None:
    with pytest.raises(ValueError, match="fp16 range"):
        get_codec("fp16").encode(torch.tensor([1.0, -7e4]))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_bytes_round_trip_and_exact_length(name: str) -> None:
    codec = get_codec(name, block_size=64)
    x = gaussian(64 * 3 + 11)
    enc = codec.encode(x)
    buf = bytearray(enc.to_bytes())
    assert len(buf) == enc.nbytes == codec.wire_bytes(x.numel())
    back = Encoded.from_bytes(name, enc.numel, enc.block_size, memoryview(buf))
    buf[:] = bytes(len(buf))  # the parsed payload must not alias the transport buffer
    assert torch.equal(bits(codec.decode(back)), bits(codec.decode(enc)))
    for wrong in (bytes(len(buf) - 1), bytes(len(buf) + 1)):
        with pytest.raises(ValueError, match=f"must be {len(buf)} bytes"):
            Encoded.from_bytes(name, enc.numel, enc.block_size, wrong)


@pytest.mark.parametrize("name", BLOCK_CODECS)
@pytest.mark.parametrize("bad_scale", [float("nan"), float("inf"), -1.0])
def test_from_bytes_rejects_bad_scales(name: str, bad_scale: float) -> None:
    bs = 8 if name in ("sign1", "half2") else 4  # whole bytes per block
    enc = get_codec(name, block_size=bs).encode(torch.ones(bs))
    raw = struct.pack("<f", bad_scale) + enc.to_bytes()[4:]
    with pytest.raises(ValueError, match="scales"):
        Encoded.from_bytes(name, bs, bs, raw)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_wire_bytes_matches_layout(name: str) -> None:
    codec = get_codec(name, block_size=64)
    for n in (*AWKWARD_SIZES, 12_345):
        scales = 0 if name in ("fp32", "fp16") else -(-n // 64)
        last = n % 64  # half2: 32 2-bit codes per block of 64, min(32, last) in the last
        data = {"fp32": 4 * n, "fp16": 2 * n, "int8": n, "sign1": (n + 7) // 8,
                "half2": (n - last) // 8 + (2 * min(32, last) + 7) // 8}.get(name, (n + 1) // 2)
        assert codec.wire_bytes(n) == 4 * scales + data
    assert codec.encode(gaussian(12_345)).nbytes == codec.wire_bytes(12_345)


def test_compression_ratios_at_one_million_elements() -> None:
    n = 1 << 20
    fp32 = get_codec("fp32").wire_bytes(n)
    assert fp32 == 4 * n
    assert get_codec("int8").encode(gaussian(n)).nbytes / fp32 <= 0.27
    for name in ("int4", "fp4"):
        assert get_codec(name).wire_bytes(n) / fp32 <= 0.14
    # sign1 and half2 at their block of 4096: 8x fewer bytes than int8 at 1024, the scales
    # included (7.97x: one float32 per 4096 elements)
    for name in ("sign1", "half2"):
        assert get_codec("int8").wire_bytes(n) / get_codec(name).wire_bytes(n) >= 7.96


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_is_deterministic_across_calls_and_threads(name: str) -> None:
    codec = get_codec(name)
    enc = codec.encode(gaussian(300_001))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = codec.decode(enc)
        torch.set_num_threads(2)
        out = torch.full((enc.numel,), float("nan"))
        two = codec.decode(enc, out=out)
    finally:
        torch.set_num_threads(threads)
    assert two is out
    assert torch.equal(bits(one), bits(two))
    assert torch.equal(bits(codec.decode(enc)), bits(one))


def test_encode_does_not_alias_input() -> None:
    x = gaussian(10)
    enc = get_codec("fp32").encode(x)
    x.zero_()
    assert bool((get_codec("fp32").decode(enc) != 0).all())


def test_misuse_gives_clear_errors() -> None:
    with pytest.raises(ValueError, match="valid codecs: fp32, fp16, int8, int4, fp4"):
        get_codec("int3")
    for bad in (0, 3, -2):
        with pytest.raises(ValueError, match="block_size"):
            get_codec("int8", block_size=bad)
    with pytest.raises(ValueError, match="1-D"):
        get_codec("int8").encode(torch.zeros(2, 2))
    with pytest.raises(TypeError, match="float32"):
        get_codec("int8").encode(torch.zeros(4, dtype=torch.int32))
    enc = get_codec("int8", 64).encode(gaussian(10))
    with pytest.raises(ValueError, match="payload is int8/block 64"):
        get_codec("int8", 128).decode(enc)
    with pytest.raises(ValueError, match="out must be"):
        get_codec("int8", 64).decode(enc, out=torch.empty(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="Encoded.data"):
        Encoded("int8", 10, 64, torch.zeros(9, dtype=torch.uint8), torch.zeros(1))


def test_codec_spec_parses_prints_and_validates_in_one_place():
    assert CodecSpec.parse("int8:256") == CodecSpec("int8", 256)
    assert CodecSpec.parse("int4") == CodecSpec("int4", 1024)  # the default block size
    assert CodecSpec.parse("fp32") == CodecSpec.of("fp32", 4096) == CodecSpec("fp32", 0)
    for text in ("int8:256", "fp4:1024", "fp16"):
        assert str(CodecSpec.parse(text)) == text
    assert parse_optional("none") is None and parse_optional("int8") == CodecSpec("int8", 1024)
    for bad in ("int8:3", "int8:0", "fp32:1024", "int3", "int8:x", f"int8:{1 << 17}"):
        with pytest.raises(ValueError):
            CodecSpec.parse(bad)
    spec = CodecSpec("int8", 64)
    assert spec.codec() is spec.codec() and spec.codec().block_size == 64  # shared, stateless
    assert get_codec("int8", 64).encode(gaussian(100)).spec == spec


@pytest.mark.parametrize("name", ["fp32", "fp16", "int8", "int4", "fp4"])
def test_selected_runs_decode_as_each_run_does(name):
    """The push meter's sample: runs of whole blocks (the last one short: the fragment's
    end) gathered into one payload decode bit for bit as each run's own view."""
    from gasloc_p2p.core.wire import run_index

    spec = CodecSpec.of(name, 64 if name in ("int8", "int4", "fp4") else 0)
    numel = 64 * 9 + 22
    enc = spec.codec().encode(torch.randn(numel, generator=torch.Generator().manual_seed(1)))
    runs = [(0, 64), (192, 64), (320, 64), (576, 22)]
    codec = spec.codec()
    each = torch.cat([codec.decode(enc.view(s, n)) for s, n in runs])
    assert torch.equal(codec.decode(enc.select(run_index(name, spec.block_size, runs))), each)
    if spec.block_size:  # a run that does not start on a block boundary is refused
        with pytest.raises(ValueError, match="whole blocks"):
            run_index(name, spec.block_size, [(32, 64)])


@pytest.mark.parametrize("n", [3 * 4096 + 1000, 2 * 4096 + 3000, 4096, 100])
def test_half2_is_the_simulators_randk2_bit_for_bit(n: int) -> None:
    """half2 with a seed is the simulator's ``randk2:2048`` with that seed (the payload its
    study measured): the same bytes and the same decoded values, whole, through views of
    whole blocks and through a selection of blocks (the push meter's sample)."""
    from gasloc_p2p.core import sparse
    from gasloc_p2p.core.wire import run_index

    codec, x = get_codec("half2"), gaussian(n, seed=3)
    payload, enc = Encoded.empty("half2", n, 4096)
    enc = enc.seeded(12345)
    codec.encode_into(x, enc)
    want = sparse.encode(sparse.SparseSpec.parse("randk2:2048"), x, 12345)
    assert bytes(payload) == want.to_bytes()
    y = codec.decode(enc)
    assert torch.equal(bits(y), bits(sparse.decode(want)))
    sent = min(2048, n % 4096) + n // 4096 * 2048
    assert int((y != 0).sum()) == sent  # which half: nothing else decodes to non-zero
    if n > 4096:
        assert torch.equal(bits(codec.decode(enc.view(4096, n - 4096))), bits(y[4096:]))
        runs = [(0, 4096), (n - n % 4096 or n - 4096, n % 4096 or 4096)]
        picked = codec.decode(enc.select(run_index("half2", 4096, runs)))
        assert torch.equal(bits(picked), bits(torch.cat([y[s:s + k] for s, k in runs])))
    other = codec.decode(Encoded.from_bytes("half2", n, 4096, payload).seeded(999))
    if n > 4096:  # another seed puts the same values elsewhere
        assert not torch.equal((other != 0), (y != 0))
    with pytest.raises(NonFiniteError):
        codec.encode(torch.full((n,), float("nan")))


def test_every_layout_has_its_codec_and_a_codec_needs_a_layout() -> None:
    """A codec is its class (registered by its name) and its line in wire.CODECS: one
    without the other is refused or noticed here."""
    from gasloc_p2p.core.codecs import _CODECS, Codec
    from gasloc_p2p.core.wire import CODECS

    assert sorted(_CODECS) == sorted(CODECS)
    for name, lay in CODECS.items():
        codec = get_codec(name)
        assert codec.block_size == lay.default_block
        assert codec.wire_bytes(4096) == 4 * (4096 // lay.default_block if lay.blocks else 0) \
            + 4096 * lay.bits // 8
    with pytest.raises(TypeError, match="no layout"):
        type("Int3Codec", (Codec,), {"name": "int3"})
