"""``--algorithm streaming-diloco``: Streaming DiLoCo in the node daemon.

Fast: the daemon's per-fragment rounds (threads, an in-memory averager returning the exact
mean, float64) equal the simulator's :class:`StreamingDiloco` bit for bit; failed and solo
fragment syncs apply the own outer gradient; a drifted fragment is repaired by resynchronizing;
the project's codecs as a hivemind compression; config flags.
The real-process swarm test is in ``tests/test_node_streaming_swarm.py``.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.streaming import StreamingConfig, StreamingDiloco
from gasloc_p2p.node.averaging.base import (
    Averager,
    AveragingResult,
    InMemoryAveragingHub,
    _Session,
)
from gasloc_p2p.node.averaging.compression import make_compression
from gasloc_p2p.node.config import ConfigError, DilocoConfig
from gasloc_p2p.node.modes.diloco import DilocoMode
from gasloc_p2p.node.modes.diloco_rounds import DilocoRounds
from gasloc_p2p.node.modes.registry import make_mode
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.settings import add_config_flags, build_config
from gasloc_p2p.node.stats import TrainStats
from tests.node_helpers import scaled

NUMEL, H = 30, 6
ETA, GAMMA = 0.7, 0.9
Snapshot = tuple[int, torch.Tensor, torch.Tensor | None]
FRAGS = [Fragment(0, [(0, 5), (15, 5)]), Fragment(1, [(5, 5), (20, 5)]),
         Fragment(2, [(10, 5), (25, 5)])]  # strided, as layer_fragments builds them


class ExactMeanHub(InMemoryAveragingHub):
    """The simulator's mean: members summed in peer-id order from zero, then divided."""

    def _close(self, session: _Session) -> None:
        super()._close(session)  # (its mean sums in arrival order: replaced below, under the lock)
        if session.mean is not None and session.mean.numel():  # (not an all-gather's)
            tensors = [session.members[p][0] for p in sorted(session.members)]
            mean = torch.zeros_like(tensors[0])
            for t in tensors:
                mean.add_(t)
            session.mean = mean.div_(len(tensors))


def theta0() -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def noise(step: int, worker: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + worker)
    return 0.01 * torch.randn(NUMEL, generator=g, dtype=torch.float64)


class Worker:
    """One streaming node without a model: its state, lock and rounds on per-fragment hubs."""

    def __init__(self, name: str, hubs: list[InMemoryAveragingHub], peers: int,
                 cfg: DilocoConfig, sources: dict[str, Callable[[], Snapshot]] | None = None):
        t0 = theta0()
        self.state = AsyncGaslocState(t0.clone(), t0, AsyncConfig(eta=ETA, gamma=GAMMA,
                                                                  momentum="local"))
        self.stats = TrainStats()
        self.stop = threading.Event()
        self.fetched: list[str] = []
        fetch = None
        if sources is not None:
            def fetch(endpoint: str) -> Snapshot:
                self.fetched.append(endpoint)
                return sources[endpoint]()
        self.rounds = DilocoRounds(self.state, FRAGS, H, cfg.tau, TrainingLock(),
                                   [h.averager(name) for h in hubs], cfg, self.stats,
                                   self.stop, lambda: peers, lambda: name, fetch)

    def step(self, step: int, worker: int) -> None:
        """A fake inner step then the mode's per-step hook."""
        self.state.theta.add_(noise(step, worker))
        self.stats.step = step
        self.rounds.after_step()


def run_lockstep(workers: list[Worker], steps: range) -> None:
    """Every worker's steps in order; a step's syncs meet in the hubs' background threads."""
    for step in steps:
        threads = [threading.Thread(target=w.step, args=(step, i)) for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(scaled(90))
            assert not t.is_alive()


def run_beside_the_simulator(sim: StreamingDiloco, workers: list[Worker]) -> None:
    """Two periods of the same steps in ``sim`` and in the daemon's rounds of ``workers``
    (every fragment syncs and lands at least once): equal thetas after every step, equal
    anchors and Nesterov buffers whenever no sync is in flight."""
    thetas = theta0().expand(len(workers), NUMEL).clone()
    for step in range(1, 2 * H + 1):
        for i in range(len(workers)):
            thetas[i].add_(noise(step, i))
        for f in sim.due(step):
            sim.begin(f, step, thetas)
        sim.land(step, thetas)
        run_lockstep(workers, range(step, step + 1))
        for i, w in enumerate(workers):
            assert torch.equal(w.state.theta, thetas[i]), (step, i)
            if not sim.pending:  # the simulator steps its global copy at the start, the node
                assert torch.equal(w.state.anchor, sim.global_params), step  # at the landing
                assert torch.equal(w.state.outer.state["momentum"],
                                   sim.outer.state["momentum"]), step


def diloco_cfg(tau: int, alpha: float = 0.0, **kw) -> DilocoConfig:
    return DilocoConfig(diloco_eta=ETA, diloco_gamma=GAMMA, tau=tau, merge_alpha=alpha, **kw)


@pytest.mark.parametrize(("tau", "alpha", "averagers"),
                         [(0, 0.0, 3), (2, 0.0, 3), (1, 0.25, 3), (0, 0.0, 1), (1, 0.5, 1),
                          (2, 0.0, 1), (4, 0.25, 1)])  # tau >= 2: syncs queue on one averager
def test_daemon_rounds_equal_the_simulator_bit_for_bit(tau, alpha, averagers):
    n = 3
    sim = StreamingDiloco(theta0(), FRAGS, StreamingConfig(H=H, tau=tau, alpha=alpha, eta=ETA,
                                                           gamma=GAMMA, codec="none"))
    hubs = [ExactMeanHub(matchmaking_time_s=scaled(30)) for _ in range(averagers)]  # a busy box
    workers = [Worker(f"w{i}", hubs, n - 1, diloco_cfg(tau, alpha)) for i in range(n)]
    run_beside_the_simulator(sim, workers)
    for w in workers:
        assert [s.last_start_step for s in w.rounds.stats] == [12, 8, 10]  # offsets 0, 2, 4
        in_flight = [int(f in w.rounds.pending) for f in range(len(FRAGS))]  # tau > 0: f0
        assert [s.ok + p for s, p in zip(w.rounds.stats, in_flight, strict=True)] == [2, 1, 1]
        assert w.rounds.epochs == [s.ok for s in w.rounds.stats]
        assert w.state.rounds == w.stats.rounds == 4 - sum(in_flight)
        assert w.rounds.info_fields()["fragment_syncs"][1]["offset"] == 2
    for w in workers:  # as a stopping node: the syncs still in flight give up at once
        w.stop.set()
        w.rounds.finish()


@pytest.mark.parametrize(("codec", "tau", "averagers"),
                         [("topk2:3", 0, 3), ("topk1:2", 1, 1), ("dense2", 2, 1)])
def test_sparse_syncs_equal_the_simulators_sparseloco_bit_for_bit(codec, tau, averagers):
    """A sparse --diloco-codec: each node's error feedback, its message as bytes through the
    all-gather, the mean of every member's message in the group's order: the simulator's
    SparseLoCo step (core.compress), bit for bit, over two periods (the residual carried)."""
    n = 3
    sim = StreamingDiloco(theta0(), FRAGS, StreamingConfig(H=H, tau=tau, eta=ETA, gamma=GAMMA,
                                                           codec=codec))
    hubs = [ExactMeanHub(matchmaking_time_s=scaled(30)) for _ in range(averagers)]
    workers = [Worker(f"w{i}", hubs, n - 1, diloco_cfg(tau, diloco_codec=codec))
               for i in range(n)]
    run_beside_the_simulator(sim, workers)
    for w in workers:
        in_flight = [int(f in w.rounds.pending) for f in range(len(FRAGS))]
        assert [s.ok + p for s, p in zip(w.rounds.stats, in_flight, strict=True)] == [2, 1, 1]
        worker = int(w.rounds.averagers[0].peer_id[1:])
        for f, ef in w.rounds.feedback.items():  # what the messages left out, still there
            if f not in w.rounds.pending:  # (a sync in flight compresses in its own thread)
                assert torch.equal(ef.error, sim.feedback[(worker, f)].error), f
        w.stop.set()
        w.rounds.finish()
    assert not torch.equal(workers[0].state.anchor, theta0())


def test_sparse_syncs_that_fail_apply_the_own_message_and_keep_the_rest():
    """No group: the node applies its own decoded message (the group of one), and what the
    message left out stays in its error feedback for the next sync."""
    hubs = [InMemoryAveragingHub(matchmaking_time_s=0.2) for _ in FRAGS]
    lonely = Worker("lonely", hubs, 1, diloco_cfg(0, diloco_codec="topk2:3"))
    ref = StreamingDiloco(theta0(), FRAGS, StreamingConfig(H=H, tau=0, eta=ETA, gamma=GAMMA,
                                                           codec="topk2:3"))
    thetas = theta0().expand(1, NUMEL).clone()
    for step in range(1, 2 * H + 1):
        thetas[0].add_(noise(step, 0))
        for f in ref.due(step):
            ref.begin(f, step, thetas)
        ref.land(step, thetas)
        lonely.step(step, 0)
    assert torch.equal(lonely.state.anchor, ref.global_params)
    assert [s.failed for s in lonely.rounds.stats] == [2, 1, 1]
    assert all(bool(ef.error.abs().sum() > 0) for ef in lonely.rounds.feedback.values())
    lonely.rounds.finish()


def test_the_error_feedback_survives_a_checkpoint_and_a_misfit_is_dropped(tmp_path, caplog):
    """What the messages left out is in the node's checkpoint (the mode's state, torch.save
    with weights_only loading) and comes back on resume; an accumulator that does not fit
    (wrong size, NaN, an unknown fragment) is dropped with a warning, never loaded."""
    from gasloc_p2p.node.runtime import checkpoint as ckpt

    hubs = [InMemoryAveragingHub(matchmaking_time_s=0.2) for _ in FRAGS]
    cfg = diloco_cfg(0, diloco_codec="topk2:3")
    lonely = Worker("lonely", hubs, 1, cfg)
    run_lockstep([lonely], range(1, 2 * H + 1))
    saved = lonely.rounds.feedback_state()
    assert sorted(saved) == ["0", "1", "2"] and all(bool(t.abs().sum() > 0)
                                                     for t in saved.values())
    ckpt.save_atomic({"mode_state": {"error_feedback": saved}}, tmp_path)
    loaded = ckpt.load(tmp_path)["mode_state"]["error_feedback"]
    fresh = Worker("fresh", hubs, 1, cfg)
    fresh.rounds.restore_feedback(loaded)
    assert sorted(fresh.rounds.feedback) == [0, 1, 2]
    for f, t in saved.items():
        assert torch.equal(fresh.rounds.feedback[int(f)].error, t)
    bad = {"0": torch.full((10,), float("nan")), "1": torch.zeros(11), "7": torch.zeros(10),
           "2": saved["2"]}
    other = Worker("other", hubs, 1, cfg)
    with caplog.at_level("WARNING"):
        other.rounds.restore_feedback(bad)
    assert sorted(other.rounds.feedback) == [2]
    assert sum("does not fit this node" in r.getMessage() for r in caplog.records) == 3
    for w in (lonely, fresh, other):
        w.rounds.finish()


def test_a_groupmates_malformed_message_fails_the_sync():
    """Indices out of order, a wrong length: the sync fails (the own message is applied)
    before anything decodes the groupmate's bytes."""
    from gasloc_p2p.core.sparse import SparseSpec

    spec = SparseSpec.parse("topk2:3")

    class Liar(InMemoryAveragingHub):
        def _average(self, peer_id, tensor, gather, target, stop):
            if peer_id == "bad" and tensor.dtype == torch.uint8:
                tensor = tensor.clone()
                tensor[-3:] = 255  # the last indices: out of their chunk
            return super()._average(peer_id, tensor, gather, target, stop)

    hub = Liar(matchmaking_time_s=scaled(5))
    good = Worker("good", [hub], 1, diloco_cfg(0, diloco_codec=str(spec)))
    bad = Worker("bad", [hub], 1, diloco_cfg(0, diloco_codec=str(spec)))
    run_lockstep([good, bad], range(1, H + 1))  # fragment 0 syncs after step 6
    assert good.rounds.stats[0].failures == {"a groupmate's message": 1}
    assert good.rounds.stats[0].ok == 0
    for w in (good, bad):
        w.rounds.finish()


def test_solo_and_failed_syncs_apply_the_own_gradient():
    hubs = [InMemoryAveragingHub(matchmaking_time_s=0.2) for _ in FRAGS]
    solo = Worker("solo", hubs, 0, diloco_cfg(1))
    lonely = Worker("lonely", hubs, 1, diloco_cfg(1))  # believes in a peer that never comes
    for w in (solo, lonely):
        ref = StreamingDiloco(theta0(), FRAGS, StreamingConfig(H=H, tau=1, eta=ETA, gamma=GAMMA,
                                                               codec="none"))
        thetas = theta0().expand(1, NUMEL).clone()
        for step in range(1, 2 * H):  # syncs start after steps 6, 8 and 10
            thetas[0].add_(noise(step, 0))
            for f in ref.due(step):
                ref.begin(f, step, thetas)
            ref.land(step, thetas)
            w.step(step, 0)
        torch.testing.assert_close(w.state.theta, thetas[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(w.state.anchor, ref.global_params, rtol=0, atol=1e-12)
        w.rounds.finish()
    assert [s.solo for s in solo.rounds.stats] == [1, 1, 1]
    assert [s.failed for s in lonely.rounds.stats] == [1, 1, 1]
    assert lonely.rounds.stats[0].failures == {"no group": 1}
    assert lonely.rounds.stats[0].wait_s > 0.05  # landing waited for the window to close


def test_a_shared_averager_brings_nodes_out_of_phase_in_step():
    hub = InMemoryAveragingHub(matchmaking_time_s=scaled(0.5))
    a, b = Worker("a", [hub], 1, diloco_cfg(0)), Worker("b", [hub], 1, diloco_cfg(0))
    for step in (1, 2):  # b is two steps ahead: at a's step 6 (fragment 0) b syncs fragment 1
        b.step(step, 1)
    for step in range(1, 11):
        threads = [threading.Thread(target=a.step, args=(step, 0)),
                   threading.Thread(target=b.step, args=(step + 2, 1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(scaled(90))
    assert b.rounds.stats[0].failures == {"no group": 1}  # b's step 6: a had nothing due
    assert a.rounds.stats[0].failures == b.rounds.stats[1].failures == {"fragment mismatch": 1}
    assert (a.rounds.shift, b.rounds.shift) == (2, 0)  # a took b's phase (b: larger peer id)
    assert [s.ok for s in a.rounds.stats] == [1, 0, 1] == [s.ok for s in b.rounds.stats]
    f2 = FRAGS[2]  # synced once, in step: the same anchor on both
    assert torch.equal(f2.gather(a.state.anchor), f2.gather(b.state.anchor))
    for w in (a, b):
        w.rounds.finish()


@pytest.mark.parametrize("codec", ["fp32", "fp4"])  # digests decide for every codec
def test_a_failed_fragment_is_repaired_by_resynchronizing(codec):
    hubs = [InMemoryAveragingHub(matchmaking_time_s=scaled(2)) for _ in FRAGS]
    sources: dict[str, Callable[[], Snapshot]] = {}
    cfg = diloco_cfg(0, diloco_codec=codec)
    a, b = Worker("a", hubs, 1, cfg, sources), Worker("b", hubs, 1, cfg, sources)
    sources.update(a=a.rounds.snapshot, b=b.rounds.snapshot)
    hubs[1].fail_at("a", 0)  # fragment 1's first sync: a fails at once, b waits and fails
    run_lockstep([a, b], range(1, H + 3))  # its syncs start after steps 8, 14, ...
    f1 = FRAGS[1]
    assert not torch.equal(f1.gather(a.state.anchor), f1.gather(b.state.anchor))
    assert a.rounds.stats[1].failed == b.rounds.stats[1].failed == 1
    run_lockstep([a, b], range(H + 3, 2 * H + 3))  # fragment 1 syncs again after step 14
    assert a.fetched == ["b"] and b.fetched == []  # equal epochs: the larger peer id wins
    for frag in FRAGS:
        torch.testing.assert_close(frag.gather(a.state.anchor), frag.gather(b.state.anchor),
                                   rtol=0, atol=1e-12)
        torch.testing.assert_close(frag.gather(a.state.outer.state["momentum"]),
                                   frag.gather(b.state.outer.state["momentum"]),
                                   rtol=0, atol=1e-12)
    assert a.rounds.epochs == b.rounds.epochs == [2, 2, 1]
    assert a.rounds.stats[1].resyncs == 1 and b.rounds.stats[1].resyncs == 0
    for w in (a, b):
        w.rounds.finish()


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "int4", "fp4"])
def test_project_codecs_as_a_hivemind_compression(codec):
    from hivemind.compression import CompressionInfo

    comp = make_compression(codec)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    msg = comp.compress(x, CompressionInfo.from_tensor(x))
    spec = CodecSpec.of(codec)
    expected = spec.codec().decode(spec.codec().encode(x))
    assert torch.equal(comp.extract(msg), expected)
    assert comp.bytes_sent() == len(msg.buffer) == spec.codec().wire_bytes(3000)
    ratio = comp.estimate_compression_ratio(CompressionInfo.from_tensor(x))
    assert ratio == pytest.approx(len(msg.buffer) / (4 * 3000))


def test_config_flags_and_validation():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    cfg = build_config(parser.parse_args(
        ["--algorithm", "streaming-diloco", "--fragments", "2", "--tau", "3",
         "--merge-alpha", "0.25", "--diloco-codec", "fp4", "--n-layer", "2"]), environ={})
    assert cfg.outer.algorithm == "streaming-diloco" and cfg.gossip.fragments == 2
    assert cfg.diloco.tau == 3 and cfg.diloco.merge_alpha == 0.25
    assert cfg.diloco.diloco_codec == "fp4"
    mode = make_mode("streaming-diloco")
    assert isinstance(mode, DilocoMode) and mode.name == "streaming-diloco"
    assert make_mode("diloco").name == "diloco"  # the same mode, one fragment
    sparse = build_config(parser.parse_args(["--diloco-codec", "topk2:123"]), environ={})
    assert str(sparse.diloco.sparse_spec()) == "topk2:123"
    assert str(build_config(parser.parse_args(["--diloco-codec", "dense2"]),
                            environ={}).diloco.sparse_spec()) == "dense2"
    bad = [(["--algorithm", "streaming-diloco", "--tau", "20"], "--tau"),  # H = 20
           (["--merge-alpha", "1.5"], "--merge-alpha"), (["--tau", "-1"], "--tau"),
           (["--diloco-codec", "randk2:123"], "--diloco-codec='randk2:123': randk needs"),
           (["--diloco-codec", "topk3:12"], "--diloco-codec='topk3:12': choose one of"),
           (["--diloco-codec", "topk2:5000"], r"k must be in \[1, chunk=4096\]"),
           (["--diloco-codec", "int9"], "--diloco-codec='int9': choose one of")]
    for argv, flag in bad:
        with pytest.raises(ConfigError, match=flag):
            build_config(parser.parse_args(argv), environ={})


def test_status_prints_every_fragment(capsys):
    from google.protobuf.json_format import MessageToDict

    from gasloc_p2p.node.cli_node import _print_report
    from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb

    info = pb.InfoReply(peer_id="p", endpoint="h:1", run_id="r", algorithm="streaming-diloco",
                        outer_epoch=5, fragment_syncs=[
                            pb.FragmentSync(index=0, offset=0, syncs_ok=3, bytes_sent=12345),
                            pb.FragmentSync(index=1, offset=3, syncs_ok=2, syncs_failed=1)])
    _print_report({"swarm": [], "info": MessageToDict(
        info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)})
    out = capsys.readouterr().out
    assert "streaming-diloco epoch 5" in out
    assert "fragment 0 at offset 0: syncs 3 ok / 0 failed / 0 solo, epoch 0, 12,345 B" in out
    assert "fragment 1 at offset 3: syncs 2 ok / 1 failed" in out


class RecordingAverager(Averager):
    """Records the fragment of every sync that reaches it, in order; every group fails."""

    peer_id = "rec"

    def __init__(self) -> None:
        self.fragments: list[int] = []

    def start(self) -> None:
        pass

    def average(self, tensor, gather, target_group_size, stop) -> AveragingResult:
        self.fragments.append(int(gather["fragment"]))
        return AveragingResult.failed("recorded")

    def close(self) -> None:
        pass


def test_syncs_reach_a_shared_averager_in_the_order_they_started():
    """tau > the gap between two fragments' offsets: a sync starts while the one before it is
    still queued. The earlier one's thread is held up (as a loaded machine can) before it
    reaches the averager: the later one must wait for it, not overtake it (its group would
    meet the other nodes' earlier fragment: "fragment mismatch", a failed sync)."""
    averager, first = RecordingAverager(), threading.Event()

    def peer_count() -> int:  # the first call is the first sync's, in its pool thread
        if not first.is_set():
            first.set()
            time.sleep(0.3)
        return 2

    t0 = theta0()
    state = AsyncGaslocState(t0.clone(), t0, AsyncConfig(eta=ETA, gamma=GAMMA, momentum="local"))
    rounds = DilocoRounds(state, FRAGS, H, 4, TrainingLock(), [averager], diloco_cfg(4),
                          TrainStats(), threading.Event(), peer_count, lambda: "w0")
    rounds.begin(1, 2)
    rounds.begin(2, 4)
    for f in (1, 2):
        rounds.land(f)
    rounds.finish()
    assert averager.fragments == [1, 2]

