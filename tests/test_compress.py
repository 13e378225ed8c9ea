"""Compression schemes (gasloc_p2p.core.compress): the gossip correction keeps the pair's sum
bit for bit, link references keep the unsent residual, error feedback loses nothing."""

from __future__ import annotations

import pytest
import torch

from gasloc_p2p.core import sparse
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.compress import (
    ErrorFeedback,
    LinkReference,
    exchange_seed,
    gossip_message,
    mean_of,
    pair_correction,
    parse_codec,
)
from gasloc_p2p.core.sparse import SparseSpec

SCHEMES = ("topk2:41", "topk8:123", "randk8:41", "randk2:410", "dense2", "topk1:20:2048")


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("text", SCHEMES)
def test_corrections_are_exact_negatives(text: str) -> None:
    spec = SparseSpec.parse(text)
    theta0 = gaussian(10_000, 0)
    p_i, p_j = theta0 + 0.1 * gaussian(10_000, 1), theta0 + 0.1 * gaussian(10_000, 2)
    seed = exchange_seed(7, 3)
    m_i, m_j = gossip_message(spec, p_i, theta0, seed), gossip_message(spec, p_j, theta0, seed)
    for w in (0.5, 0.3, 1 / 3):
        c_i, c_j = pair_correction(m_i, m_j, w), pair_correction(m_j, m_i, w)
        assert torch.equal(c_i, c_j.neg())  # == treats -0 and +0 alike; nothing else differs
        assert bool((c_i + c_j == 0).all())
        assert bool(c_i.abs().sum() > 0)


def test_randk_correction_averages_exactly_the_sent_coordinates() -> None:
    spec = SparseSpec.parse("randk8:410")
    theta0 = gaussian(8192, 0)
    p_i, p_j = theta0 + gaussian(8192, 1), theta0 + gaussian(8192, 2)
    m_i, m_j = (gossip_message(spec, p, theta0, 5) for p in (p_i, p_j))
    c = pair_correction(m_i, m_j, 0.5)
    sent = sparse.positions(m_i)
    assert torch.equal(sent, sparse.positions(m_j))  # one shared support
    untouched = torch.ones(8192, dtype=torch.bool)
    untouched[sent] = False
    assert bool((c[untouched] == 0).all())
    # int8 values: the sent coordinates land within a quantization step of the pair mean
    torch.testing.assert_close((p_i + c)[sent], ((p_i + p_j) / 2)[sent], atol=0.05, rtol=0)


def test_link_reference_keeps_exactly_the_unsent_residual() -> None:
    spec = SparseSpec.parse("topk2:41")
    theta0 = gaussian(3 * 4096, 0)
    a, b = LinkReference(theta0), LinkReference(theta0)  # each side's copy of the pair's
    p_i, p_j = theta0 + gaussian(3 * 4096, 1), theta0 + gaussian(3 * 4096, 2)
    for _ in range(3):
        m_i, m_j = gossip_message(spec, p_i, a.ref, 0), gossip_message(spec, p_j, b.ref, 0)
        resid_i = p_i - a.ref - sparse.decode(m_i)  # what i's message left out
        p_i = p_i + pair_correction(m_i, m_j, 0.5)
        p_j = p_j + pair_correction(m_j, m_i, 0.5)
        a.update(m_i, m_j)
        b.update(m_j, m_i)
        assert torch.equal(a.ref, b.ref)  # both sides hold the same reference, bit for bit
        torch.testing.assert_close(p_i - a.ref, resid_i, atol=1e-5, rtol=0)


@pytest.mark.parametrize("text", ("topk2:41", "randk8:123", "dense2", "topk1:41"))
def test_error_feedback_loses_nothing(text: str) -> None:
    spec = SparseSpec.parse(text)
    ef = ErrorFeedback(spec, 2 * 4096 + 7)
    sent = torch.zeros(2 * 4096 + 7, dtype=torch.float64)
    total = torch.zeros_like(sent)
    for t in range(20):
        delta = gaussian(2 * 4096 + 7, t) * 0.01
        total += delta.double()
        sent += sparse.decode(ef.compress(delta, seed=t)).double()
    # everything fed in was either sent or is still waiting in the accumulator
    torch.testing.assert_close(sent + ef.error.double(), total, atol=1e-5, rtol=0)
    assert float(ef.error.norm()) > 0


def test_error_feedback_decay() -> None:
    ef = ErrorFeedback(SparseSpec.parse("topk8:1:64"), 64, beta=0.5)
    ef.compress(torch.ones(64))
    before = ef.error.clone()
    ef.compress(torch.zeros(64))
    assert float(ef.error.sum()) < float(before.sum()) * 0.5 + 1e-6
    with pytest.raises(ValueError):
        ErrorFeedback(SparseSpec.parse("dense2"), 10, beta=1.5)


def test_mean_of_messages_is_their_decoded_mean() -> None:
    spec = SparseSpec.parse("topk2:41")
    msgs = [sparse.encode(spec, gaussian(9000, s)) for s in range(4)]
    want = sum(sparse.decode(m) for m in msgs) / 4
    torch.testing.assert_close(mean_of(msgs), want, atol=1e-7, rtol=0)
    assert torch.equal(mean_of(msgs), mean_of(msgs))


def test_exchange_seed_is_deterministic_and_spread() -> None:
    assert exchange_seed(1, 2) == exchange_seed(1, 2)
    assert len({exchange_seed(0, i) for i in range(1000)}) == 1000
    assert exchange_seed(1, 2) != exchange_seed(2, 1)


def test_parse_codec() -> None:
    assert parse_codec("none") is None
    assert parse_codec("int8:256") == CodecSpec("int8", 256)
    assert parse_codec("topk2:41") == SparseSpec("topk", 2, 41)
    assert parse_codec("dense2") == SparseSpec("dense", 2, 4096, 4096)
    for bad in ("int3", "topk9:41", "foo"):
        with pytest.raises(ValueError):
            parse_codec(bad)
