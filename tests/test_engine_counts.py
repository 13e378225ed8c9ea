"""Kernel launches and host synchronisations per exchange do not grow with the model size.

A ``TorchDispatchMode`` counts every tensor operation (views excluded) and every host
synchronisation (``.item()``/``float()``/``bool()`` on a tensor, copies to the host) that one
exchange's tensor work issues: prepare, check (with the guard's screen) and commit, on each
side. With the engine's device-sized chunks (``ON_DEVICE_CHUNK``, 2^24 elements) the counts at
1M and 8M elements are equal, and the syncs stay equal beyond a chunk (the launches add one
chunk's worth per 2^24 elements: 74 chunks for a 1B model); with the old cache-sized chunks
they grew with the model, which is what a GPU paid for in launches and syncs
(``benchmarks/bench_engine.py`` prints the figures to 100M).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine_counts import count_exchange
from gasloc_p2p.protocol.engine import ON_DEVICE_CHUNK


def test_launches_and_syncs_per_exchange_do_not_grow_with_the_model():
    small = count_exchange(1 << 20, chunk=ON_DEVICE_CHUNK)
    large = count_exchange(1 << 23, chunk=ON_DEVICE_CHUNK)
    assert small == large, (small, large)
    assert small["syncs"] <= 12, small  # a few reads per phase, none per chunk
    assert small["ops"] <= 400, small
    # past one chunk: the syncs stay, the launches add a chunk's worth
    two = count_exchange(1 << 20, chunk=1 << 19)
    assert two["syncs"] == small["syncs"] and two["ops"] < 2 * small["ops"]


@pytest.mark.parametrize("spec", ["half2", "sign1"])
def test_residual_exchanges_do_not_grow_with_the_model_either(spec):
    """half2 and sign1 against a link: the reference's chunks are uploaded as they are read
    (no host wait per chunk), half2's positions come from integer hashes on the device."""
    small = count_exchange(1 << 20, chunk=ON_DEVICE_CHUNK, spec=spec)
    large = count_exchange(1 << 23, chunk=ON_DEVICE_CHUNK, spec=spec)
    assert small == large, (small, large)
    assert small["syncs"] <= 12, small


def test_the_count_bites_on_chunked_loops():
    """The same exchange walked in 2^18-element chunks: launches grow with the size."""
    small = count_exchange(1 << 20, chunk=1 << 18)
    large = count_exchange(1 << 23, chunk=1 << 18)
    assert large["ops"] > 4 * small["ops"]
    assert torch.get_num_threads() >= 1
