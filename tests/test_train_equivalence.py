"""One training loop: a simulated worker and a daemon Trainer end bit-identical.

Both are built from the same seed, model dimensions, corpus, shard, batch seed and inner
settings, and take the same number of steps. Any difference in the inner step (schedule,
weight-decay groups, betas, order of zero_grad/backward/step) or in batch sampling breaks
``torch.equal``; the last test shows the comparison does catch such a difference.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.node.config import TrainConfig
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.trainer import Trainer
from gasloc_p2p.node.stats import TrainStats
from gasloc_p2p.sim.clock import Clock
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.gossip import run_gossip
from gasloc_p2p.sim.workers import SimWorkers, worker_data_seed

SEED, STEPS = 3, 12
MODEL = dict(n_layer=1, n_embd=32, n_head=2, seq_len=32, batch_size=4)
INNER = dict(lr=3e-3, warmup_steps=4, min_lr_ratio=0.1, weight_decay=0.1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small real-text corpus (standard-library sources), the same for both drivers."""
    directory = tmp_path_factory.mktemp("corpus")
    for name in ("argparse", "typing", "inspect"):
        src = Path(importlib.import_module(name).__file__ or "")
        (directory / f"{name}.txt").write_text(src.read_text())
    return directory


def sim_config(corpus: Path, **kw: object) -> SimConfig:
    base = SimConfig(workers=2, steps=STEPS, H=STEPS + 1, algorithm="local", data=str(corpus),
                     iid=True, seed=SEED, eval_batches=1, **MODEL, **INNER)
    return dataclasses.replace(base, **kw)


def node_trainer(corpus: Path, worker: int, workers: int, outer: AsyncConfig | None = None,
                 **kw: object) -> Trainer:
    """The daemon's trainer as ``--shard worker/workers`` with the simulator's batch seed."""
    cfg = TrainConfig(data=str(corpus), shard=f"{worker}/{workers}" if workers > 1 else "",
                      seed=SEED, lr_horizon_steps=STEPS, inner_steps=STEPS + 1, eval_batches=1,
                      **MODEL, **INNER)
    trainer = Trainer(dataclasses.replace(cfg, **kw), outer or AsyncConfig(), 1,
                      TrainingLock(), TrainStats())
    trainer.load_data(worker_data_seed(SEED, worker))
    return trainer


def test_sim_worker_and_daemon_trainer_take_identical_inner_steps(corpus):
    sim = SimWorkers(sim_config(corpus))
    trainer = node_trainer(corpus, worker=1, workers=2)
    assert torch.equal(sim.thetas[1], trainer.flat.buffer)  # the same theta_0
    for _ in range(STEPS):
        assert sim.inner_step(1) == trainer.step()  # the same batches, the same losses
    assert trainer.stats.rounds == 0  # H > steps: inner steps only
    assert not torch.equal(sim.thetas[1], sim.theta0)
    assert torch.equal(sim.thetas[1], trainer.flat.buffer)


def test_equal_with_round_ends_of_async_gasloc(corpus):
    """One async GASLoC worker (no peers: its round ends only) against the daemon's."""
    cfg = sim_config(corpus, workers=1, algorithm="gasloc", mode="async", H=4, eta=0.7,
                     gamma=0.5, codec="none")
    sim = SimWorkers(cfg)
    stats = run_gossip(sim, Clock(1), lambda now: None)
    assert stats["exchanges"] == 0
    outer = AsyncConfig(eta=0.7, gamma=0.5)
    trainer = node_trainer(corpus, worker=0, workers=1, outer=outer, inner_steps=4)
    for _ in range(STEPS):
        trainer.step()
    assert trainer.state.rounds == STEPS // 4
    assert torch.equal(sim.thetas[0], trainer.flat.buffer)


def test_the_comparison_catches_different_weight_decay_groups(corpus):
    sim = SimWorkers(sim_config(corpus, decay_vectors=True))
    trainer = node_trainer(corpus, worker=1, workers=2)
    for _ in range(STEPS):
        sim.inner_step(1)
        trainer.step()
    assert not torch.equal(sim.thetas[1], trainer.flat.buffer)
    trainer_all = node_trainer(corpus, worker=1, workers=2, decay_vectors=True)
    for _ in range(STEPS):
        trainer_all.step()
    assert torch.equal(sim.thetas[1], trainer_all.flat.buffer)
