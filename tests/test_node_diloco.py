"""``--algorithm diloco``: the DiLoCo baseline in the node daemon (the one DiLoCo round logic,
:class:`DilocoRounds`, with one fragment and no overlap).

Fast: the outer-step math through the averaging seam (an in-memory averager, threads, float64)
against ``torch.optim.SGD(nesterov=True)`` on the mean outer gradient; failed and solo rounds;
resynchronization after a failed round; config and compatibility rules; two in-process nodes
(real gRPC, in-memory discovery and averaging) with an injected failure.
Slow (about 60 s): three real ``gasloc-node join --algorithm diloco`` processes on 127.0.0.1
averaging through hivemind on their own DHT. Every wait is scaled by GASLOC_TEST_TIMEOUT_SCALE.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from google.protobuf.json_format import MessageToDict

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.flat import whole
from gasloc_p2p.node.averaging.base import AveragingResult, InMemoryAveragingHub
from gasloc_p2p.node.cli_node import _print_report
from gasloc_p2p.node.config import ConfigError, DilocoConfig
from gasloc_p2p.node.daemon import Node
from gasloc_p2p.node.discovery.base import (
    CompatibilityFilter,
    InMemoryDiscovery,
    InMemoryRegistry,
    PeerInfo,
)
from gasloc_p2p.node.modes.diloco import DilocoMode
from gasloc_p2p.node.modes.diloco_rounds import (
    DilocoRounds,
    choose_reference,
    digests_match,
    state_digest,
)
from gasloc_p2p.node.runtime import checkpoint as ckpt
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.settings import add_config_flags, build_config
from gasloc_p2p.node.stats import TrainStats
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.messages import BUSY, PROTOCOL_VERSION
from tests.daemon_helpers import spy_on_gossip_machinery, tiny_config, write_corpus
from tests.node_helpers import run, scaled, wait_until
from tests.swarm_helpers import NodeProc, start_three, wait_for

NUMEL = 1000
ETA, GAMMA = 0.7, 0.9
Snapshot = tuple[int, torch.Tensor, torch.Tensor | None]


class Worker:
    """One DiLoCo node without a model: its state, lock and round logic on a shared hub."""

    def __init__(self, name: str, hub: InMemoryAveragingHub, peers: int,
                 sources: dict[str, Callable[[], Snapshot]] | None = None) -> None:
        """``sources``: endpoint -> that node's snapshot function, for resynchronization."""
        theta0 = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0),
                             dtype=torch.float64)
        self.name = name
        self.state = AsyncGaslocState(theta0.clone(), theta0,
                                      AsyncConfig(eta=ETA, gamma=GAMMA, momentum="local"))
        self.stop = threading.Event()
        self.fetched: list[str] = []
        fetch = None
        if sources is not None:
            def fetch(endpoint: str) -> Snapshot:
                self.fetched.append(endpoint)
                return sources[endpoint]()
        self.train_stats = TrainStats()
        self.rounds = DilocoRounds(self.state, [whole(NUMEL)], 1, 0, TrainingLock(),
                                   [hub.averager(name)], DilocoConfig(), self.train_stats,
                                   self.stop, lambda: peers, lambda: name, fetch)

    def round_end(self) -> None:
        """One inner step is a round here (H 1): the sync starts and lands at once."""
        self.train_stats.step += 1
        self.rounds.after_step()

    @property
    def stats(self):  # the one fragment's counters
        return self.rounds.stats[0]

    @property
    def epoch(self) -> int:
        return self.rounds.epochs[0]

    def drift(self, seed: int) -> torch.Tensor:
        """Fake inner steps: ``theta = anchor + noise``; returns the outer gradient."""
        g = torch.Generator().manual_seed(seed)
        self.state.theta.copy_(self.state.anchor + 0.01 * torch.randn(NUMEL, generator=g,
                                                                      dtype=torch.float64))
        return self.state.anchor - self.state.theta


def round_in_threads(workers: list[Worker]) -> None:
    threads = [threading.Thread(target=w.round_end) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(20))
        assert not t.is_alive()


def test_rounds_equal_torch_nesterov_on_the_mean_outer_gradient():
    hub = InMemoryAveragingHub(matchmaking_time_s=scaled(5))
    workers = [Worker(n, hub, peers=2) for n in "abc"]
    ref = torch.nn.Parameter(workers[0].state.anchor.clone())
    opt = torch.optim.SGD([ref], lr=ETA, momentum=GAMMA, nesterov=True)
    for r in range(5):
        grads = [w.drift(100 * r + i) for i, w in enumerate(workers)]
        round_in_threads(workers)
        ref.grad = torch.stack(grads).mean(dim=0)
        opt.step()
        for w in workers:
            torch.testing.assert_close(w.state.anchor, ref.detach(), rtol=0, atol=1e-12)
            assert torch.equal(w.state.theta, w.state.anchor)
    for w in workers:
        s = w.stats
        assert (s.ok, s.failed, s.solo, w.epoch) == (5, 0, 0, 5)
        assert s.last_group_size == 3 and s.resyncs == 0


def test_solo_and_failed_rounds_apply_the_own_gradient():
    solo = Worker("solo", InMemoryAveragingHub(), peers=0)
    hub = InMemoryAveragingHub(matchmaking_time_s=0.2)
    lonely = Worker("lonely", hub, peers=1)  # believes in a peer that never comes
    waited = {}
    for w in (solo, lonely):
        anchor = w.state.anchor.clone()
        g = w.drift(7)
        t0 = time.monotonic()
        w.round_end()
        waited[w.name] = time.monotonic() - t0
        torch.testing.assert_close(w.state.anchor, anchor - ETA * (g + GAMMA * g))  # buf = g
        assert w.epoch == 1
    assert solo.stats.solo == 1 and waited["solo"] < 0.1  # no waiting alone
    assert lonely.stats.failed == 1 and waited["lonely"] >= 0.2
    assert lonely.stats.failures == {"no group": 1}


def test_stop_cancels_a_waiting_round_promptly():
    w = Worker("w", InMemoryAveragingHub(matchmaking_time_s=60), peers=1)
    w.drift(1)
    threading.Timer(0.2, w.stop.set).start()
    t0 = time.monotonic()
    w.round_end()
    assert time.monotonic() - t0 < 5
    assert w.stats.failed == 1 and w.stats.failures == {"cancelled": 1}


@pytest.mark.parametrize("fetch_after_step", [False, True])
def test_a_failed_round_is_repaired_by_resynchronizing(fetch_after_step):
    # a window wide enough for two threads on a loaded machine: the failed round waits it out
    hub = InMemoryAveragingHub(matchmaking_time_s=scaled(2))
    sources: dict[str, Callable[[], Snapshot]] = {}
    a, b = Worker("a", hub, 1, sources), Worker("b", hub, 1, sources)
    sources.update(a=a.rounds.snapshot, b=b.rounds.snapshot)
    hub.fail_at("a", 1)  # round 2: a fails at once, b waits for the window and fails too
    for r in range(2):
        a.drift(10 * r), b.drift(10 * r + 1)
        round_in_threads([a, b])
    assert not torch.equal(a.state.anchor, b.state.anchor)  # no way back in plain DiLoCo
    assert a.stats.failed == b.stats.failed == 1
    a.drift(20), b.drift(21)
    if not fetch_after_step:  # force the other branch: b's state from before b's step
        before = b.rounds.snapshot()
        sources["b"] = lambda: before
    round_in_threads([a, b])  # else a fetches b's post-step state (or races it: both fine)
    assert a.fetched == ["b"] and b.fetched == []  # equal epochs: the larger peer id wins
    torch.testing.assert_close(a.state.anchor, b.state.anchor, rtol=0, atol=1e-12)
    torch.testing.assert_close(a.state.outer.state["momentum"], b.state.outer.state["momentum"],
                               rtol=0, atol=1e-12)
    assert a.epoch == b.epoch == 3
    assert a.stats.resyncs == 1 and torch.equal(a.state.theta, a.state.anchor)


def test_digest_tolerates_rounding_but_not_a_missed_step():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    buf = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    rounded = x + (x * 1e-7) * torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    stepped = x - 0.7 * 1e-3 * torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    assert digests_match(state_digest([x, buf]), state_digest([rounded, buf]))
    assert not digests_match(state_digest([x, buf]), state_digest([stepped, buf]))
    members = {"p1": {"epoch": 3, "digest": state_digest([stepped, buf])},
               "p2": {"epoch": 3, "digest": state_digest([x, buf])},
               "p3": {"epoch": 3, "digest": state_digest([rounded, buf])}}
    assert choose_reference(members) == "p3"  # same epochs: the majority, then the larger id
    members["p1"]["epoch"] = 9
    assert choose_reference(members) == "p1"  # the longest history first


def test_config_flags_env_and_validation():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    cfg = build_config(parser.parse_args(["--algorithm", "diloco"]),
                       environ={"GASLOC_DILOCO_GAMMA": "0.8", "GASLOC_TARGET_GROUP_SIZE": "4"})
    assert cfg.outer.algorithm == "diloco" and cfg.diloco.target_group_size == 4
    assert cfg.diloco.diloco_gamma == 0.8 and cfg.diloco.diloco_eta == 0.7
    assert cfg.diloco.async_config().momentum == "local"
    assert build_config(environ={"GASLOC_ALGORITHM": "diloco"}).outer.algorithm == "diloco"
    bad = [(["--algorithm", "allreduce"], {}, "--algorithm"),
           ([], {"GASLOC_REQUEST_TIMEOUT_S": "6"}, "request_timeout_s=6.0 .*GASLOC_REQUEST"),
           ([], {"GASLOC_AVERAGING_TIMEOUT_S": "4"}, "averaging_timeout_s"),
           ([], {"GASLOC_MIN_GROUP_SIZE": "1"}, "min_group_size"),
           ([], {"GASLOC_TARGET_GROUP_SIZE": "1"}, "target_group_size"),
           (["--diloco-codec", "int2"], {}, "--diloco-codec"),
           (["--algorithm", "diloco", "--fragments", "2"], {}, "--fragments")]
    for argv, env, flag in bad:
        with pytest.raises(ConfigError, match=flag):
            build_config(parser.parse_args(argv), environ=env)
    with pytest.raises(SystemExit):  # tuning is no flag of join
        parser.parse_args(["--request-timeout-s", "1"])


def test_toml_diloco_table(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text('[outer]\nalgorithm = "diloco"\n[diloco]\nmatchmaking_time_s = 2\n'
                    'request_timeout_s = 1\n')
    cfg = build_config(argparse.Namespace(config=str(toml)), environ={})
    assert cfg.outer.algorithm == "diloco" and cfg.diloco.matchmaking_time_s == 2.0


def test_gasloc_and_diloco_nodes_never_pair(caplog):
    filt = CompatibilityFilter(1, "f" * 64, "me", "gasloc")
    diloco = PeerInfo("d", "h:1", 1, "f" * 64, algorithm="diloco")
    old = PeerInfo.from_value("o", {k: v for k, v in PeerInfo("o", "h:2", 1, "f" * 64)
                                    .to_value().items() if k != "algorithm"})
    assert old is not None and old.algorithm == "gasloc"  # announcements without the field
    with caplog.at_level("WARNING"):
        assert filt([diloco, old]) == [old]
    assert "--algorithm diloco" in caplog.records[0].getMessage()


def test_in_memory_averaging_result_shapes():
    res = AveragingResult.failed("x")
    assert not res.ok and res.group_size == 0


# ------------------------------------------------------------------ nodes in one process
def test_two_in_process_nodes_average_and_resync_over_grpc(corpus, tmp_path, capsys,
                                                           monkeypatch):
    built = spy_on_gossip_machinery(monkeypatch)

    async def main():
        reg, hub = InMemoryRegistry(), InMemoryAveragingHub(matchmaking_time_s=scaled(2))
        hub.fail_at("node-b", 3)  # one failed round on b: a waits out the window, fails too
        flags = {"algorithm": "diloco", "n_layer": 1, "n_embd": 32, "seq_len": 32,
                 "batch_size": 4, "inner_steps": 5, "eval_interval_steps": 20,
                 "diloco_codec": "topk2:123"}  # (fp32: the rounds' tests above)
        a = Node(tiny_config(corpus, **flags, checkpoint_dir=str(tmp_path)),
                 InMemoryDiscovery(reg, "gasloc", "node-a"),
                 DilocoMode("diloco", [hub.averager("node-a")]))
        b = Node(tiny_config(corpus, **flags, peers=("/memory/node-a",)),
                 InMemoryDiscovery(reg, "gasloc", "node-b"),
                 DilocoMode("diloco", [hub.averager("node-b")]))
        async with a, b:
            assert isinstance(a.mode, DilocoMode) and isinstance(b.mode, DilocoMode)
            ra, rb = a.mode.rounds, b.mode.rounds
            assert ra is not None and rb is not None
            assert a.mode.exchanger is None and not hasattr(a.mode, "book")  # no gossip here
            sa, sb = ra.stats[0], rb.stats[0]
            await wait_until(lambda: min(sa.ok, sb.ok) >= 12, timeout_s=60,
                             what="averaged rounds on both nodes")
            assert sa.resyncs + sb.resyncs >= 1
            assert sb.failures["injected failure"] == 1
            info = b.info()
            assert info.algorithm == "diloco" and info.averaging_rounds_ok >= 12
            assert info.last_group_size == 2 and info.outer_epoch >= 12
            for _ in range(200):  # equal epochs: the anchors agree
                (ea, pa, ma), (eb, pb, mb) = ra.snapshot(), rb.snapshot()
                if ea == eb:
                    break
            assert ea == eb
            torch.testing.assert_close(pa, pb, rtol=0, atol=1e-5)
            torch.testing.assert_close(ma, mb, rtol=0, atol=1e-5)
            assert a.stats.ok == 0 and b.stats.ok == 0  # never gossiped
            _print_report({"swarm": [], "info": MessageToDict(
                info, preserving_proto_field_name=True,
                always_print_fields_with_no_presence=True)})
            assert "diloco epoch" in capsys.readouterr().out  # gasloc-node status
            assert await stray_exchange(a, b) == BUSY  # as before: no gossip
        for node in (a, b):
            assert not node.train_stats.error
        saved = ckpt.load(tmp_path)  # written at stop: the epoch travels with the anchor
        assert saved is not None and saved["rounds"] == ra.epochs[0]
        assert torch.equal(saved["anchor"], a.trainer.state.anchor)
        # and what the sparse messages left out (the error feedback), restored on resume
        assert torch.equal(saved["mode_state"]["error_feedback"]["0"], ra.feedback[0].error)
        c = Node(tiny_config(corpus, **flags, checkpoint_dir=str(tmp_path),
                             max_steps=int(saved["step"])),  # resumes, takes no step
                 InMemoryDiscovery(reg, "gasloc", "node-c"),
                 DilocoMode("diloco", [hub.averager("node-c")]))
        async with c:
            assert isinstance(c.mode, DilocoMode) and c.mode.rounds is not None
            assert torch.equal(c.mode.rounds.feedback[0].error, ra.feedback[0].error)
            assert c.train_stats.step == saved["step"]

    run(main(), timeout_s=120)
    assert built == []  # no exchanger, peer book or gossip loop was ever built


async def stray_exchange(node: Node, other: Node) -> int:
    """Open an Exchange stream to ``other`` with a well-formed header; the reject code."""
    header = pb.Header(protocol_version=PROTOCOL_VERSION, run_id=node.me.run_id,
                       model_fingerprint=node.me.fingerprint, peer_id="stray", codec="int8",
                       block_size=1024, fragment_count=1, fragment_numel=node.trainer.flat.numel)
    call = node.channels.stub(other.endpoint, other.tls.cert_der).Exchange(timeout=scaled(10))
    await call.write(pb.ExchangeMsg(header=header))
    reply = await call.read()
    call.cancel()
    assert reply.WhichOneof("kind") == "reject", reply
    return int(reply.reject.code)


# ------------------------------------------------------------------ real processes
# the sparse payload (an all-gather with error feedback): the fp32 and lossy all-reduces run
# through real averagers in tests/test_node_averaging_identical.py and the streaming swarm
DILOCO = ["--algorithm", "diloco", "--diloco-codec", "topk2:123",
          "--n-layer", "1", "--n-embd", "32", "--seq-len", "32",
          "--batch-size", "4", "--inner-steps", "5", "--eval-interval-steps", "20",
          "--matchmaking-time-s", "2", "--request-timeout-s", "1", "--averaging-timeout-s", "8",
          "--log-interval-s", "3"]  # tuning flags travel as GASLOC_* (tools.nodes.split_tuning)


class DilocoProc(NodeProc):
    def state(self, run_id: str) -> tuple[int, torch.Tensor]:
        """(epoch, anchor) from DownloadState."""
        meta, anchor = self.download_state(run_id)
        assert meta.momentum == "local", meta  # the outer optimizer: Nesterov
        return meta.rounds, anchor


def anchors_agree(nodes: list[DilocoProc]) -> list[float] | None:
    """``[largest anchor difference]`` if every node reports the same epoch (DownloadState's
    rounds) in one pass and their anchors agree within float32 rounding, else None (a pass
    that straddles a round end, or a round a node missed and has not repaired yet)."""
    states = [n.state("gasloc") for n in nodes]
    if len({epoch for epoch, _ in states}) != 1:
        return None
    diff = max(float((a - states[0][1]).abs().max()) for _, a in states[1:])
    return [diff] if diff <= 1e-5 else None


def test_three_diloco_processes_average_through_hivemind(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus")
    data = ["--data", str(corpus)]
    nodes: list[DilocoProc] = []
    try:
        start_three(nodes, DilocoProc, tmp_path, [*data, *DILOCO], "d", "diloco")

        def averaged() -> bool:
            return all(i.averaging_rounds_ok >= 10 and i.last_group_size >= 2
                       for i in (n.info() for n in nodes))

        try:
            wait_for(averaged, 60, "10 averaged rounds in groups of >= 2 on every node", 1.0)
        except AssertionError as exc:  # say where each node stood
            stood = [(n.name, i.step, i.averaging_rounds_ok, i.averaging_rounds_failed,
                      i.averaging_rounds_solo) for n, i in ((n, n.info()) for n in nodes)]
            raise AssertionError(f"{exc}; (node, step, ok, failed, solo): {stood}") from None
        diff = wait_for(lambda: anchors_agree(nodes), 20,
                        "identical anchors at one epoch on every node", 0.05)
        print(f"anchors at one epoch agree: largest difference {diff[0]:.3g}")
        infos = [n.info() for n in nodes]
        for node, info in zip(nodes, infos, strict=True):
            assert info.algorithm == "diloco" and info.exchanges_ok_initiator == 0
            assert info.val_loss < info.first_val_loss - 0.3, (node.name, info)
            waited = info.averaging_rounds_ok + info.averaging_rounds_failed
            print(f"{node.name}: rounds ok {info.averaging_rounds_ok} failed "
                  f"{info.averaging_rounds_failed} solo {info.averaging_rounds_solo}, "
                  f"resyncs {info.resyncs}, group {info.last_group_size}, mean averaging "
                  f"{info.total_averaging_s / max(1, waited):.3f} s/round")
        # the joiners started from theta_0 (--no-init-from-swarm) while d0 trained alone
        assert sum(i.resyncs for i in infos) >= 1
        nodes[1].wait_for(r"\| diloco epochs \[\d+\] syncs ok/failed/solo f0:\d+/\d+/\d+ \| "
                          r"group \d \| stalled [\d.]+ s", scaled(15), stdout=False)  # progress
        for node in nodes:
            node.proc.send_signal(signal.SIGTERM)
        for node in nodes:
            assert node.proc.wait(timeout=scaled(30)) == 0, node.err.read_text()[-3000:]
            wait_for(lambda n=node: not n.group_alive(), 15, f"{node.name}'s children")
    finally:
        for node in nodes:
            node.kill()
