"""Lossy all-reduce payloads give every member the SAME averaged tensor, bit for bit.

Real hivemind averagers (each its own forked process) on three real DHT nodes on 127.0.0.1.
Streaming DiLoCo and DiLoCo need every replica to take its outer step with the same averaged
outer gradient: hivemind's stock all-reduce returns ``Q(mean - own part)`` to each member and
keeps the exact mean on the reducer, so with fp4 or int8 payloads the members' results differed
by quantization noise and their fragments drifted apart (:mod:`gasloc_p2p.node.averaging.uniform`).

Checked here: several syncs of three nodes' streaming rounds (3 fragments, one shared averager
as the daemon runs them) leave every fragment's anchor and Nesterov buffer bit-identical on all
members; the averaged result equals the true mean up to the codec's error; the payload bytes
counted as sent and received agree across the group. About 40 s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.node.averaging.dht import HivemindAverager, averaging_prefix
from gasloc_p2p.node.config import DilocoConfig
from gasloc_p2p.node.modes.diloco_rounds import DilocoRounds
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.stats import TrainStats
from tests.node_helpers import plain_dht, scaled

NUMEL, H, N = 6000, 6, 3
FRAGS = [Fragment(0, [(0, 1000), (3000, 1000)]), Fragment(1, [(1000, 1000), (4000, 1000)]),
         Fragment(2, [(2000, 1000), (5000, 1000)])]


@pytest.fixture(scope="module")
def dhts() -> Iterator[list]:
    first = plain_dht()
    nodes = [first] + [plain_dht(first.get_visible_maddrs()) for _ in range(N - 1)]
    try:
        yield nodes
    finally:
        for dht in nodes:
            dht.shutdown()


def cfg_for(codec: str) -> DilocoConfig:
    return DilocoConfig(diloco_codec=codec, tau=0, matchmaking_time_s=scaled(5.0),
                        request_timeout_s=scaled(3.0), averaging_timeout_s=scaled(60),
                        part_timeout_s=scaled(10))


def theta0() -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))


def noise(step: int, worker: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + worker)
    return 0.01 * torch.randn(NUMEL, generator=g) * (1 + worker)  # unequal magnitudes


class Member:
    """One node's streaming rounds on a real hivemind averager (the daemon's shared one)."""

    def __init__(self, dht, codec: str, prefix: str) -> None:
        cfg = cfg_for(codec)
        width = max(f.numel for f in FRAGS)
        sparse = cfg.sparse_spec()
        if sparse is not None:  # an all-gather: message bytes as float32s (as the mode sizes it)
            width = -(-sparse.wire_bytes(width) // 4)
        self.averager = HivemindAverager(dht, width, prefix, cfg)
        self.averager.start()
        t0 = theta0()
        self.state = AsyncGaslocState(t0.clone(), t0, AsyncConfig(eta=0.7, gamma=0.9,
                                                                  momentum="local"))
        self.stats = TrainStats()
        self.rounds = DilocoRounds(self.state, FRAGS, H, cfg.tau, TrainingLock(),
                                   [self.averager], cfg, self.stats, threading.Event(),
                                   lambda: N - 1, lambda: "unused:1")

    def step(self, step: int, worker: int) -> None:
        self.state.theta.add_(noise(step, worker))
        self.stats.step = step
        self.rounds.after_step()

    def close(self) -> None:
        self.rounds.finish()
        self.averager.close()


def _sync_all(members: list[Member]) -> bool:
    """Every member's steps of two periods; False if hivemind failed a sync somewhere (on a
    loaded machine a groupmate's part can miss its deadline: "averaged values did not
    arrive"); the members then hold a failed round each, which the caller retries."""
    for step in range(1, 2 * H + 1):  # every fragment syncs; fragment 0 twice
        threads = [threading.Thread(target=m.step, args=(step, i))
                   for i, m in enumerate(members)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(scaled(120))
            assert not t.is_alive()
    return all(s.failed + s.solo == 0 for m in members for s in m.rounds.stats)


def _sync_and_check(dhts: list, codec: str, name: str,
                    check: Callable[[list[Member], str], None]) -> None:
    """Three members sync every fragment (:func:`_sync_all`) and ``check`` them; a sync that
    hivemind failed under load starts the whole attempt over, three times at most."""
    for attempt in range(3):
        prefix = averaging_prefix(f"{name}{attempt}", "f" * 64, codec, "stream3")
        members = [Member(dht, codec, prefix) for dht in dhts]
        try:
            if _sync_all(members):
                check(members, codec)
                return
        finally:
            for m in members:
                m.close()
    pytest.fail("hivemind failed a sync in each of 3 attempts")


@pytest.mark.parametrize("codec", ["fp4", "int8"])
def test_lossy_syncs_leave_every_fragment_bit_identical(dhts, codec):
    _sync_and_check(dhts, codec, "identical", _check_identical)


def test_sparse_syncs_all_gather_and_leave_every_fragment_bit_identical(dhts):
    """A sparse --diloco-codec on real averagers: every member receives every member's
    message bytes through the reducers' relays, in the same order, and so takes the same
    outer step; each sends about its own message n - 1 times and receives n - 1 messages."""
    _sync_and_check(dhts, "topk2:40", "sparse", _check_gathered)


def _check_gathered(members: list[Member], codec: str) -> None:
    for m in members:
        assert [s.ok for s in m.rounds.stats] == [2, 1, 1]
        assert [s.last_group_size for s in m.rounds.stats] == [N, N, N]
    ref = members[0].state
    assert ref.anchor is not None and not torch.equal(ref.anchor, theta0())
    for m in members[1:]:
        assert m.state.anchor is not None
        assert torch.equal(m.state.anchor, ref.anchor)
        assert torch.equal(m.state.outer.state["momentum"], ref.outer.state["momentum"])
    # 4 syncs. A member takes in at least the n - 1 other messages (as a reducer's relays, or
    # as inputs of its own share); the group puts out each message to the n - 1 other
    # reducers (its parts) and n - 1 times again (the relays): (n - 1)(n + 1) messages a
    # sync, where an ideal all-gather sends n (n - 1).
    wire = members[0].averager.message_bytes  # the padded message
    for m in members:
        assert m.averager.bytes_received() >= 4 * wire * (N - 1), wire
    sent = sum(m.averager.bytes_sent() for m in members)
    got = sum(m.averager.bytes_received() for m in members)
    assert got <= sent <= 4 * wire * (N - 1) * (N + 1) * 1.05, (sent, got, wire)


def test_one_all_gather_delivers_every_message_in_one_order(dhts):
    """Three real averagers all-gather messages of distinct random bytes (any bit pattern,
    NaNs as float32 included): every member gets all three, byte for byte, in the same
    order, keyed by the member that sent each."""
    from gasloc_p2p.core.sparse import SparseSpec

    size = SparseSpec.parse("topk2:123").wire_bytes(50_000)
    numel = -(-size // 4)
    messages = [bytes(torch.randint(0, 256, (size,), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(i)).numpy())
                for i in range(N)]
    for attempt in range(3):  # a hivemind deadline missed under load: start over
        results = _gather_once(dhts, messages, numel, f"gather{attempt}")
        if all(r is not None and r.ok for r in results):
            break
    else:
        pytest.fail(f"hivemind failed the all-gather in each of 3 attempts: {results}")
    order = list(results[0].gathered)
    padded = [m + bytes(4 * numel - size) for m in messages]
    for r in results:
        assert list(r.gathered) == order and len(r.messages) == N
        by_sender = {r.gathered[p]["i"]: msg for p, msg in zip(order, r.messages, strict=True)}
        assert by_sender == dict(enumerate(padded))


def _gather_once(dhts: list, messages: list[bytes], numel: int, run_id: str) -> list:
    """One all-gather of ``messages`` by three fresh averagers; each member's result."""
    return _each_member(dhts, "topk2:123", numel, run_id, lambda a, i, stop: a.allgather(
        messages[i], {"i": i}, N, stop), cfg=quick("topk2:123"))


def _check_identical(members: list[Member], codec: str) -> None:
    for m in members:
        assert [s.ok for s in m.rounds.stats] == [2, 1, 1]
        assert [s.last_group_size for s in m.rounds.stats] == [N, N, N]
        assert sum(s.resyncs for s in m.rounds.stats) == 0
    ref = members[0].state
    assert ref.anchor is not None and ref.outer.state
    for m in members[1:]:
        assert m.state.anchor is not None and m.state.outer.state
        for frag in FRAGS:
            assert torch.equal(frag.gather(m.state.anchor), frag.gather(ref.anchor))
            assert torch.equal(frag.gather(m.state.outer.state["momentum"]),
                               frag.gather(ref.outer.state["momentum"]))
    # the members' own steps differ, so their thetas do; the anchors moved (not all solo)
    assert not torch.equal(ref.anchor, theta0())
    # every member sent and received encoded payloads of about the codec's size
    width = max(f.numel for f in FRAGS)
    wire = CodecSpec.of(codec).codec().wire_bytes(width)
    for m in members:
        sent, got = m.averager.bytes_sent(), m.averager.bytes_received()
        per_sync = 4  # syncs
        assert 0 < sent <= per_sync * 2 * wire * 1.05, (sent, wire)
        assert 0 < got <= per_sync * 2 * wire * 1.05, (got, wire)
    total_sent = sum(m.averager.bytes_sent() for m in members)
    total_got = sum(m.averager.bytes_received() for m in members)
    # every byte taken in was put out; a part a reducer answers after its sender stopped
    # reading (seen under load: one part of about 4 kB) is sent but never received
    assert total_got <= total_sent <= 1.25 * total_got


@pytest.mark.parametrize("codec", ["fp4", "int8", "fp32"])
def test_one_average_equals_the_mean_up_to_the_codec_error(dhts, codec):
    inputs = [noise(1, i) for i in range(N)]
    for attempt in range(3):  # a hivemind deadline missed under load: start over
        results = _average_once(dhts, codec, inputs, f"mean{attempt}")
        if all(r is not None and r.ok and r.group_size == N for r in results):
            break
    else:
        pytest.fail(f"hivemind failed the average in each of 3 attempts: {results}")
    for r in results[1:]:
        assert torch.equal(r.averaged, results[0].averaged)
    mean = torch.stack(inputs).mean(0)
    err = float((results[0].averaged - mean).abs().max() / mean.abs().max())
    bound = {"fp32": 1e-6, "int8": 0.02, "fp4": 0.6}[codec]  # fp4: one binade per value
    assert err < bound, err
    if codec == "fp32":
        torch.testing.assert_close(results[0].averaged, mean, rtol=0, atol=1e-6)


def _average_once(dhts: list, codec: str, inputs: list[torch.Tensor], run_id: str) -> list:
    """One all-reduce of ``inputs`` by three fresh averagers; each member's result (None if
    its thread did not finish). On a loaded machine a groupmate's part can miss its deadline
    ("averaged values did not arrive"); the caller then starts over under a new prefix."""
    return _each_member(dhts, codec, NUMEL, run_id, lambda a, i, stop: a.average(
        inputs[i], {"i": i}, N, stop), cfg=quick(codec))


def quick(codec: str) -> DilocoConfig:
    """:func:`cfg_for` with an attempt that gives up within a minute: a group that missed its
    members under load waited out hivemind's retries for 60 s before the next attempt (seen in
    a full parallel run; 0.4 s alone)."""
    return dataclasses.replace(cfg_for(codec), averaging_timeout_s=scaled(15),
                               allreduce_timeout_s=scaled(30))


def _each_member(dhts: list, codec: str, numel: int, run_id: str,
                 call: Callable[[HivemindAverager, int, threading.Event], Any],
                 cfg: DilocoConfig | None = None) -> list:
    """``call(averager, i, stop)`` on three fresh averagers at once, one thread each; their
    results (None where a thread did not finish)."""
    prefix = averaging_prefix(run_id, "f" * 64, codec, "diloco")
    cfg = cfg if cfg is not None else cfg_for(codec)
    averagers = [HivemindAverager(dht, numel, prefix, cfg) for dht in dhts]
    results: list = [None] * N
    try:
        for a in averagers:
            a.start()
        stop = threading.Event()

        def run(i: int) -> None:
            results[i] = call(averagers[i], i, stop)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(scaled(120))
    finally:
        for a in averagers:
            a.close()
    return results


def test_a_reducer_accepts_only_parts_of_its_codec_size_and_weight():
    # hivemind's runner asks for the current event loop: give it one of its own (earlier tests
    # in the same process may have closed and unset the main thread's loop).
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        _check_reducer()
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _check_reducer() -> None:
    from hivemind.averaging.partition import AllreduceException
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import averaging_pb2, runtime_pb2

    from gasloc_p2p.node.averaging.compression import make_compression
    from gasloc_p2p.node.averaging.uniform import runner_class

    class FakeP2P:
        peer_id = "a"

    comp = make_compression("fp4")
    runner = runner_class()(p2p=FakeP2P(), servicer_type=runner_class(), prefix=None,
                            group_id=b"g", tensors=[torch.zeros(1000)],
                            ordered_peer_ids=["a", "b"], peer_fractions=(0.5, 0.5),
                            compression=comp, part_size_bytes=125)  # ~250 fp4 values a part
    shapes = runner.tensor_part_reducer.part_shapes
    assert len(shapes) == 2  # this reducer's share of the 1000 values, in parts
    n = shapes[0][0]
    x = torch.randn(n)

    def data(part, weight=1.0):
        return averaging_pb2.AveragingData(tensor_part=part, weight=weight)

    index, got, weight = runner._decode_input((0, data(comp.encode_part(x))), shapes)
    spec = CodecSpec.of("fp4")
    assert index == 0 and weight == 1.0
    assert torch.equal(got, spec.codec().decode(spec.codec().encode(x)))
    assert comp.bytes_received() == spec.codec().wire_bytes(n)
    bad = [data(comp.encode_part(torch.randn(n - 1))),  # not this share's part size
           data(serialize_torch_tensor(x, runtime_pb2.CompressionType.NONE)),  # another codec
           data(comp.encode_part(x), weight=1e9)]  # would outweigh the group
    for msg in bad:
        with pytest.raises(AllreduceException):
            runner._decode_input((0, msg), shapes)
    with pytest.raises(AllreduceException):  # more parts than the share has
        runner._decode_input((2, data(comp.encode_part(x))), shapes)
    runner.finalize()


def test_an_all_gather_refuses_a_group_beyond_the_cap_of_its_own_target():
    """A leader picks the group, and an all-gather holds every member's message: a group
    beyond the cap this node derives from its own target fails before anything is allocated
    for it; a group somewhat larger than the target (the swarm grew since this node counted
    it) is within the cap (a cap of exactly the target refused honest groups: their rounds
    stalled, seen in the three-process DiLoCo test)."""
    from types import SimpleNamespace

    from hivemind.averaging.partition import AllreduceException

    from gasloc_p2p.node.averaging.compression import make_compression
    from gasloc_p2p.node.averaging.dht import gather_cap
    from gasloc_p2p.node.averaging.uniform import run_uniform_allreduce

    assert gather_cap(2) >= 4 and gather_cap(64) >= 128
    group = SimpleNamespace(group_id=b"g", peer_ids=[f"p{i}" for i in range(gather_cap(2) + 1)])
    with pytest.raises(AllreduceException, match=f"a group of {gather_cap(2) + 1} for an "
                                                 f"all-gather; this node gathers at most "
                                                 f"{gather_cap(2)}"):
        asyncio.run(run_uniform_allreduce(None, [torch.zeros(8)], group,
                                          max_members=gather_cap(2),
                                          compression=make_compression("topk2:41")))
