"""Quantized gossip with references and error feedback (ALGORITHM.md section 4)."""

from __future__ import annotations

import random

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import get_codec
from gasloc_p2p.core.flat import Fragment, whole
from gasloc_p2p.core.references import ReferenceTable


def quantized_exchange(states, tables, i, j, frag, codec, w=0.5):
    """Both sides of one exchange, in memory: snapshot, encode, commit, apply."""
    li, lj = tables[i].get(str(j)), tables[j].get(str(i))
    enc_i = li.encode(states[i].public_iterate(frag), frag, codec)
    enc_j = lj.encode(states[j].public_iterate(frag), frag, codec)
    c_i = li.commit(enc_i, enc_j, frag, w)
    c_j = lj.commit(enc_j, enc_i, frag, w)
    states[i].apply_correction(c_i, frag)
    states[j].apply_correction(c_j, frag)
    return c_i, c_j


@pytest.mark.parametrize("codec_name", ["int8", "int4", "fp4"])
def test_references_stay_bit_identical_and_mean_is_kept(codec_name):
    n, numel = 6, 5000
    codec = get_codec(codec_name)
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(numel, generator=gen)
    states = [AsyncGaslocState(theta0.clone(), theta0, AsyncConfig(eta=0.7)) for _ in range(n)]
    tables = [ReferenceTable(theta0, capacity=n) for _ in range(n)]
    halves = [Fragment(0, [(0, numel // 2)]), Fragment(1, [(numel // 2, numel - numel // 2)])]
    rng = random.Random(0)
    for _ in range(100):
        for s in states:  # local training moves each node differently
            s.theta.add_(torch.randn(numel, generator=gen) * 0.01)
        i, j = rng.sample(range(n), 2)
        mean_before = torch.stack([s.public_iterate() for s in states]).double().mean(dim=0)
        frag = rng.choice([*halves, whole(numel)])
        c_i, c_j = quantized_exchange(states, tables, i, j, frag, codec)
        assert torch.equal(c_i, -c_j)
        mean_after = torch.stack([s.public_iterate() for s in states]).double().mean(dim=0)
        torch.testing.assert_close(mean_after, mean_before, rtol=0, atol=1e-5)
    for i in range(n):
        for j in range(n):
            if i != j and str(j) in tables[i]:
                assert torch.equal(tables[i].get(str(j)).ref_out, tables[j].get(str(i)).ref_in)
                assert tables[i].get(str(j)).version == tables[j].get(str(i)).version


@pytest.mark.parametrize("codec_name", ["int8", "int4", "fp4"])
def test_error_feedback_converges_to_exact_average(codec_name):
    # Two static nodes exchanging repeatedly: the residual is re-sent, so they reach consensus
    # far below the codec's one-shot error.
    numel = 4096
    codec = get_codec(codec_name)
    gen = torch.Generator().manual_seed(1)
    theta0 = torch.zeros(numel)
    states = [AsyncGaslocState(torch.randn(numel, generator=gen), theta0, AsyncConfig(eta=1.0))
              for _ in range(2)]
    tables = [ReferenceTable(theta0) for _ in range(2)]
    start = (states[0].public_iterate() - states[1].public_iterate()).norm()
    for _ in range(30):
        quantized_exchange(states, tables, 0, 1, whole(numel), codec)
    gap = (states[0].public_iterate() - states[1].public_iterate()).norm()
    assert gap < 1e-3 * start, float(gap / start)


def test_failed_exchange_changes_nothing_until_commit():
    theta0 = torch.zeros(100)
    table = ReferenceTable(theta0)
    link = table.get("peer")
    enc = link.encode(torch.ones(100), whole(100), get_codec("int8"))
    assert link.version == 0 and torch.equal(link.ref_out, theta0)  # encoding is side-effect free
    with pytest.raises(ValueError, match="fragment size"):
        link.commit(enc, enc, Fragment(0, [(0, 50)]), 0.5)


def test_lru_evicts_and_restarts_from_theta0():
    theta0 = torch.zeros(10)
    table = ReferenceTable(theta0, capacity=2)
    a = table.get("a")
    enc = a.encode(torch.ones(10), whole(10), get_codec("fp32"))
    a.commit(enc, enc, whole(10), 0.5)
    assert a.version == 1
    table.get("b")
    table.get("a")  # touch: "b" is now least recently used
    table.get("c")
    assert "b" not in table and "a" in table and len(table) == 2
    assert table.get("a").version == 1
    table.get("d")  # evicts "c"
    table.get("e")  # evicts "a"
    fresh = table.get("a")
    assert fresh.version == 0 and torch.equal(fresh.ref_out, theta0)
