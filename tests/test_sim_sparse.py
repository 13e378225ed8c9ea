"""Sparse payloads in the simulator (issue 24): gossip exchanges keep the network mean, link
references stay identical on both sides, DiLoCo all-gathers with error feedback, exact bytes."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.flat import whole
from gasloc_p2p.core.options import ConfigError
from gasloc_p2p.core.sparse import SparseSpec
from gasloc_p2p.core.streaming import StreamingConfig, StreamingDiloco
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.run import run
from gasloc_p2p.sim.sparse_exchange import SparseExchanger
from gasloc_p2p.sim.workers import load_token_data

TINY = SimConfig(workers=4, steps=20, H=5, n_layer=1, n_embd=32, n_head=2, seq_len=32,
                 batch_size=4, eval_every=10, eval_batches=2, warmup_steps=4, threads=1,
                 trace_batches=0)


@pytest.fixture(scope="module")
def data():
    return load_token_data(None)


def _states(n: int, numel: int) -> tuple[torch.Tensor, list[AsyncGaslocState]]:
    thetas = torch.randn(n, numel, generator=torch.Generator().manual_seed(0))
    return thetas, [AsyncGaslocState(thetas[i], torch.zeros(numel), AsyncConfig())
                    for i in range(n)]


@pytest.mark.parametrize(("codec", "reference", "shrink"), [
    ("topk2:8:256", "theta0", 0.9),  # supports differ: a one-sided entry pulls towards theta_0
    ("randk8:16:256", "theta0", 0.5),
    ("topk2:8:256", "link", 0.5),
    ("dense2:256", "link", 0.5),
])
def test_sparse_exchanges_keep_the_network_mean(codec: str, reference: str,
                                                shrink: float) -> None:
    n, numel = 5, 1000
    thetas, states = _states(n, numel)
    ex = SparseExchanger(states, torch.zeros(numel), [whole(numel)], SparseSpec.parse(codec),
                         0.5, reference)
    rng = random.Random(0)
    start = (thetas - thetas.mean(dim=0)).norm()
    for _ in range(300):
        i, j = rng.sample(range(n), 2)
        before = thetas.double().sum(dim=0)
        ex.commit(ex.begin(i, j, 0))
        torch.testing.assert_close(thetas.double().sum(dim=0), before, rtol=0, atol=1e-4)
    assert (thetas - thetas.mean(dim=0)).norm() < shrink * start  # gossip brought them closer


def test_link_references_are_one_per_pair_and_fragment() -> None:
    thetas, states = _states(4, 512)
    ex = SparseExchanger(states, torch.zeros(512), [whole(512)], SparseSpec.parse("topk2:8:256"),
                         0.5, "link")
    for i, j in ((0, 1), (1, 0), (2, 3), (0, 1)):
        ex.commit(ex.begin(i, j, 0))
    assert sorted(ex.links) == [(0, 1, 0), (2, 3, 0)]
    assert ex.links[(0, 1, 0)].exchanges == 3


@pytest.mark.parametrize(("codec", "reference"), [("topk2:41", "theta0"), ("randk2:512", "link")])
def test_sparse_gossip_counts_exact_wire_bytes(data, codec: str, reference: str) -> None:
    cfg = dataclasses.replace(TINY, codec=codec, reference=reference)
    res = run(cfg, data)
    exchanges = res["stats"]["exchanges"]
    wire = SparseSpec.parse(codec).wire_bytes(res["params"])
    assert exchanges == (cfg.steps // cfg.H) * cfg.workers // 2
    assert res["final"]["bytes_per_worker"] == pytest.approx(2 * exchanges * wire / cfg.workers)
    assert res["final"]["val_loss"] < res["history"][0]["val_loss"]


def test_sparse_diloco_all_gathers_with_error_feedback(data) -> None:
    cfg = dataclasses.replace(TINY, algorithm="diloco", codec="topk2:41", eta=1.0, gamma=0.0)
    res = run(cfg, data)
    wire = SparseSpec.parse("topk2:41").wire_bytes(res["params"])
    rounds = cfg.steps // cfg.H
    assert res["final"]["bytes_per_worker"] == rounds * (cfg.workers - 1) * wire
    assert res["final"]["consensus"] < 1e-10  # every worker applies the same mean
    assert res["final"]["val_loss"] < res["history"][0]["val_loss"]


def test_error_feedback_exists_only_for_sparse_codecs() -> None:
    theta0 = torch.zeros(300)
    thetas = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    frag = [whole(300)]
    dense = StreamingDiloco(theta0, frag, StreamingConfig(H=1, tau=0, codec="int8", gamma=0.0))
    dense.begin(0, 1, thetas)
    assert not dense.feedback and not dense.allgather
    sparse = StreamingDiloco(theta0, frag, StreamingConfig(H=1, tau=0, codec="topk2:4:64",
                                                           gamma=0.0, eta=1.0))
    sparse.begin(0, 1, thetas)
    assert sparse.allgather and sorted(sparse.feedback) == [(0, 0), (1, 0), (2, 0)]
    # what the all-gather applied plus what waits in the accumulators is the mean drift
    waiting = sum(ef.error for ef in sparse.feedback.values()) / 3
    applied = theta0 - sparse.global_params
    torch.testing.assert_close(applied + waiting, (theta0 - thetas).mean(dim=0), atol=1e-6,
                               rtol=0)


def test_sparse_options_are_refused_where_they_mean_nothing() -> None:
    with pytest.raises(ConfigError, match="--reference"):
        SimConfig(codec="int8", reference="link").validate()
    with pytest.raises(ConfigError, match="--reference"):
        SimConfig(algorithm="diloco", codec="topk2:41", reference="link").validate()
    with pytest.raises(ConfigError, match="--ef-beta"):
        SimConfig(codec="topk2:41", ef_beta=0.9).validate()
    with pytest.raises(ConfigError, match="sparse codec"):
        SimConfig(codec="topk9:41").validate()
    SimConfig(algorithm="diloco", codec="topk2:41", ef_beta=0.9).validate()
