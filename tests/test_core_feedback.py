"""Reference schemes (links, feedback, plain) through the fused engine: exact antisymmetry,
error-feedback dithering, the fused paths against the plain formulas, cheap payload checks."""

from __future__ import annotations

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec, Encoded
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.protocol.engine import ExchangeEngine, NoLock
from gasloc_p2p.protocol.memory import MemoryExchange
from gasloc_p2p.protocol.messages import Identity, Rejected
from gasloc_p2p.protocol.session import Rules, Timeouts
from tests.node_helpers import NUMEL, fragments, theta0

OUTER = AsyncConfig(eta=0.7, gamma=0.5, w=0.5)
TIMEOUTS = Timeouts(1.0, 2.0, 3.0)


def node(name: str, seed: int, codec: str, references: str, zero_anchor: bool = False):
    t0 = theta0()
    theta = t0 + 0.1 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    state = AsyncGaslocState(theta, t0, OUTER)
    if zero_anchor:  # then the anchor after commits is exactly the sum of the corrections
        state.anchor.zero_()
    engine = ExchangeEngine(state, t0, fragments(), NoLock(), 4, references)
    rules = Rules.build(Identity("run", "f" * 64, name), CodecSpec.parse(codec), OUTER, TIMEOUTS)
    return rules, engine


@pytest.mark.parametrize("references", ["links", "feedback", "plain"])
@pytest.mark.parametrize("codec", ["int8:256", "int4", "fp4:64", "fp16", "fp32"])
def test_corrections_are_exact_negatives(references: str, codec: str) -> None:
    a = node("A", 1, codec, references, zero_anchor=True)
    b = node("B", 2, codec, references, zero_anchor=True)
    for k in range(4):  # both roles, both fragments, the feedback buffers in use
        first, second = (a, b) if k % 2 == 0 else (b, a)
        out_1, out_2 = MemoryExchange(first, second, k // 2).run()
        assert out_1.correction_norm == out_2.correction_norm > 0
    c_a, c_b = a[1].state.anchor, b[1].state.anchor  # sums of the corrections, exact
    assert torch.equal(c_a, -c_b)
    assert bool(c_a.ne(0).any())


def test_a_node_rejects_another_reference_scheme() -> None:
    a, b = node("A", 1, "int8", "links"), node("B", 2, "int8", "feedback")
    with pytest.raises(Rejected, match="reference scheme"):
        MemoryExchange(a, b, 0).run()


def _mean_error(references: str, rounds: int) -> float:
    """|mean of what was sent - p| over ``rounds`` messages of a state that does not move."""
    rules, engine = node("A", 1, "int4", references)
    frag = engine.fragments[0]
    spec = rules.codec
    p = engine.state.public_iterate(frag)
    total = torch.zeros(frag.numel)
    for _ in range(rounds):
        total += spec.codec().decode(engine.prepare("B", 0, spec, False).encoded)
    return float((total / rounds - p).abs().mean())


def test_feedback_dithers_where_plain_rounding_is_stuck() -> None:
    stuck, dithered = _mean_error("plain", 64), _mean_error("feedback", 64)
    assert dithered < stuck / 10  # the mean of sigma-delta messages converges to p


def test_feedback_memory_does_not_grow_with_peers() -> None:
    _, engine = node("A", 1, "int8", "feedback")
    spec = CodecSpec.of("int8")
    for peer in range(20):
        engine.prepare(str(peer), 0, spec, False)
    error = engine.refs.errors[0]  # type: ignore[attr-defined]
    assert len(engine.refs.errors) == 1  # type: ignore[attr-defined]
    assert error.nbytes < 0.3 * 4 * engine.fragments[0].numel  # int8 + a scale per 64


@pytest.mark.parametrize("codec", ["int8:256", "int4:64", "fp4", "fp16"])
def test_fused_links_paths_equal_the_plain_formulas(codec: str) -> None:
    """prepare = encode(p - ref) on the gathered fragment; commit folds decode(messages)."""
    a, b = node("A", 1, codec, "links"), node("B", 2, codec, "links")
    spec, frag = a[0].codec, a[1].fragments[1]
    for _ in range(2):
        link = a[1].refs.get("B") if "B" in a[1].refs else None  # type: ignore[attr-defined]
        ref = frag.gather(link.ref_out if link else a[1].theta0)
        expected = spec.codec().encode(a[1].state.public_iterate(frag) - ref).to_bytes()
        assert bytes(a[1].prepare("B", 1, spec, False).payload) == expected
        anchor = a[1].state.anchor.clone()
        ref_in = frag.gather(link.ref_in if link else a[1].theta0)
        ex = MemoryExchange(a, b, 1)
        ex.run()
        sent = ex.sides[0].session._prep.encoded  # noqa: SLF001
        received = ex.sides[0].session._received  # noqa: SLF001
        c = (ref_in + spec.codec().decode(received) - (ref + spec.codec().decode(sent))) * 0.5
        assert torch.equal(frag.gather(a[1].state.anchor), frag.gather(anchor) + c)


def test_check_rejects_scales_that_would_overflow_without_decoding() -> None:
    _, engine = node("A", 1, "int8", "links")
    spec = CodecSpec.of("int8", 4)
    enc = spec.codec().encode(torch.ones(8))
    enc.scales.fill_(3e38)  # finite, but 127 * 3e38 is not
    payload = bytearray(enc.to_bytes())
    import zlib

    with pytest.raises(ValueError, match="overflow"):
        engine.check(spec, 8, payload, zlib.crc32(payload))


def test_fragment_chunks_tile_the_ranges() -> None:
    frag = Fragment(0, [(3, 5), (20, 7), (40, 2)])
    buf = torch.arange(50.0)
    compact = []
    for pos, n, pieces in frag.chunks(4):
        chunk = torch.empty(n)
        for start, length, o in pieces:
            chunk[o : o + length] = buf[start : start + length]
        assert pos == len(compact)
        compact.extend(chunk.tolist())
    assert compact == frag.gather(buf).tolist()


@pytest.mark.parametrize("codec", ["int8:64", "fp4:64", "fp16", "fp32"])
def test_encoding_into_payload_views_matches_to_bytes(codec: str) -> None:
    spec = CodecSpec.parse(codec)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    payload, enc = Encoded.empty(spec.name, 1000, spec.block_size)
    for pos in range(0, 1000, 128):
        n = min(128, 1000 - pos)
        spec.codec().encode_into(x[pos : pos + n], enc.view(pos, n))
    assert bytes(payload) == spec.codec().encode(x).to_bytes()


def test_auto_resolves_by_codec_the_same_on_every_node() -> None:
    from gasloc_p2p.core.feedback import resolve_references
    from gasloc_p2p.node.config import GossipConfig
    from gasloc_p2p.sim.config import SimConfig

    assert [resolve_references("auto", c) for c in ("fp32", "fp16", "int8", "int4", "fp4")] == [
        "plain"] * 5
    assert resolve_references("links", "int4") == "links"
    assert resolve_references("feedback", "int8") == "feedback"
    assert GossipConfig().reference_scheme == "plain"
    assert GossipConfig(references="feedback").reference_scheme == "feedback"
    assert GossipConfig(codec="fp4").reference_scheme == "plain"
    assert SimConfig(codec="int4:256").reference_scheme == "plain"
