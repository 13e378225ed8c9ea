"""Link references for residual payloads (``core/links.py``, ``half2``, ``sign1``): the cache, the chained
state, and exchanges through two real engines: a plain int8 exchange seeds the link, residual
exchanges then keep the pair's sum exactly, leave both references bit for bit alike, cost 8x
fewer bytes than int8 and lose less and less as the reference catches up."""

from __future__ import annotations

import math

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.compress import LinkReference, pair_correction
from gasloc_p2p.core.flat import Fragment, whole
from gasloc_p2p.core.links import LinkCache, next_state, position_seed, seed_state
from gasloc_p2p.core.sparse import SparseSpec, encode
from gasloc_p2p.core.wire import RESIDUAL_CODECS
from gasloc_p2p.protocol.engine import ExchangeEngine, NoLock, Prepared
from gasloc_p2p.protocol.guard import GuardRule, UpdateGuard
from gasloc_p2p.protocol.memory import MemoryExchange
from gasloc_p2p.protocol.messages import LINK_OUT_OF_STEP, PROTOCOL_VERSION, Identity, Rejected
from gasloc_p2p.protocol.session import Rules, Timeouts

NUMEL = 3 * 4096 + 1000  # several blocks of 4096 and a partial one
INT8, SIGN1, HALF2 = CodecSpec.of("int8"), CodecSpec.of("sign1"), CodecSpec.of("half2")
RESIDUAL = pytest.mark.parametrize("spec", [HALF2, SIGN1], ids=["half2", "sign1"])
STRIDED = Fragment(0, [(0, 1500), (4000, 5000), (11000, NUMEL - 11000)])


def test_cache_evicts_the_least_recently_used():
    cache = LinkCache(2)
    a = cache.slot("A", 0, 10)
    b = cache.slot("B", 0, 10)
    assert cache.get("A", 0) is a  # A is now the most recent: B goes first
    c = cache.slot("C", 0, 10)
    assert cache.get("B", 0) is None and len(cache) == 2
    assert c.ref.data_ptr() != b.ref.data_ptr()  # an exchange in flight may still hold B's
    assert cache.slot("C", 0, 10) is c  # re-seeding keeps the link object
    assert cache.slot("D", 0, 7).ref.numel() == 7
    assert cache.drop("D", 0) and not cache.drop("D", 0)
    assert cache.state("nobody", 0) == b""
    assert LinkCache.nbytes(4, 1000) == 16_000
    with pytest.raises(ValueError, match="at least one"):
        LinkCache(0)


def test_the_state_chains_both_digests_in_either_order():
    d1, d2, d3 = bytes(32), bytes([1]) * 32, bytes([2]) * 32
    s = seed_state(d1, d2)
    assert s == seed_state(d2, d1) and len(s) == 32
    assert next_state(s, d1, d3) == next_state(s, d3, d1)
    assert len({s, next_state(s, d1, d2), next_state(s, d1, d3), seed_state(d1, d3)}) == 4


def _engines(fragment: Fragment) -> list[ExchangeEngine]:
    theta0 = torch.randn(NUMEL, generator=torch.Generator().manual_seed(9))
    common = torch.randn(NUMEL, generator=torch.Generator().manual_seed(8))  # shared training
    engines = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        theta = theta0 + 0.02 * common + 0.01 * torch.randn(NUMEL, generator=gen)
        state = AsyncGaslocState(theta, theta0.clone(), AsyncConfig())
        engine = ExchangeEngine(state, theta0.to(torch.bfloat16), [fragment], NoLock(), 4096)
        engine.links = LinkCache(2)
        engine.guard = UpdateGuard(GuardRule(trust_after=1, round_budget=1e30,
                                             block_budget=1e30))
        engine.guard.round_end({0: 1.0})
        engines.append(engine)
    return engines


def _exchange(engines: list[ExchangeEngine], spec: CodecSpec, seed: bool = False,
              weight: float = 0.5) -> tuple[Prepared, Prepared]:
    links = [e.links.get(peer, 0) if spec.name in RESIDUAL_CODECS else None
             for e, peer in zip(engines, ("B", "A"), strict=True)]
    a = engines[0].prepare("B", 0, spec, link=links[0])
    b = engines[1].prepare("A", 0, spec, link=links[1])
    numel = a.fragment.numel
    got_b = engines[0].check(spec, numel, bytearray(b.payload), b.digest, a)
    got_a = engines[1].check(spec, numel, bytearray(a.payload), a.digest, b)
    a.seed = b.seed = seed
    norms = engines[0].commit(a, got_b, weight), engines[1].commit(b, got_a, weight)
    assert norms[0] == norms[1] > 0  # c_i = -c_j bit for bit
    return a, b


@RESIDUAL
@pytest.mark.parametrize("fragment", [whole(NUMEL), STRIDED], ids=["whole", "strided"])
def test_residual_exchanges_keep_the_sum_and_the_references_alike(fragment, spec):
    engines = _engines(fragment)
    with pytest.raises(ValueError, match="residuals against a link"):
        engines[0].prepare("B", 0, spec)  # no link yet
    _exchange(engines, INT8, seed=True)  # a plain exchange seeds the link on both sides
    la, lb = engines[0].links.get("B", 0), engines[1].links.get("A", 0)
    assert la is not None and lb is not None
    assert torch.equal(la.ref, lb.ref) and la.state == lb.state and la.exchanges == 1
    sizes, gaps = [], []
    noise = torch.Generator().manual_seed(5)
    for _ in range(6):
        for e in engines:  # each side trains on between exchanges: the iterates move apart
            e.state.theta.add_(0.002 * torch.randn(NUMEL, generator=noise))
        before = sum(e.state.theta.double() for e in engines)
        gap_before = gap(engines, fragment)
        a, b = _exchange(engines, spec)
        after = sum(e.state.theta.double() for e in engines)
        torch.testing.assert_close(after, before, rtol=0, atol=1e-5)  # the pair's sum kept
        assert torch.equal(la.ref, lb.ref) and la.state == lb.state
        sizes.append(len(a.payload))
        gaps.append((gap_before, gap(engines, fragment)))
    assert la.exchanges == 7
    # 8x fewer bytes than int8 on large fragments (tests/test_codecs.py); here, below 10^4
    # elements, half2's short last block (all of it at 2 bits) costs a little more
    assert sizes == [spec.codec().wire_bytes(fragment.numel)] * 6
    assert sizes[0] * 7.4 <= INT8.codec().wire_bytes(fragment.numel)
    # each residual exchange pulls the pair's public iterates together (a 1-bit code of what
    # the reference has not caught up with: the pull is about half, less its error). half2
    # pulls a seeded half of each block at 2 bits: 0.45-0.88 of the gap left, measured, as the
    # half drawn is new or the one the last exchange pulled (0.70 on average)
    ratios = [after / before for before, after in gaps]
    if spec == SIGN1:
        assert max(ratios) < 0.75, gaps
    else:
        assert max(ratios) < 0.95 and math.prod(ratios) < 0.8 ** len(ratios), gaps


def gap(engines: list[ExchangeEngine], fragment: Fragment) -> float:
    a, b = (e.state.public_iterate(fragment) for e in engines)
    return float((a - b).norm())


def test_a_commit_one_side_missed_leaves_the_states_apart():
    """A link used out of step would decode garbage: the chained state tells the two ends
    apart after a commit only one of them made."""
    engines = _engines(whole(NUMEL))
    _exchange(engines, INT8, seed=True)
    la, lb = engines[0].links.get("B", 0), engines[1].links.get("A", 0)
    a = engines[0].prepare("B", 0, SIGN1, link=la)
    b = engines[1].prepare("A", 0, SIGN1, link=lb)
    got_b = engines[0].check(SIGN1, NUMEL, bytearray(b.payload), b.digest, a)
    engines[0].commit(a, got_b, 0.5)  # B never commits (its Commit was lost)
    assert la.state != lb.state


@pytest.mark.parametrize(("spec", "sim"), [(HALF2, "randk2:2048"), (SIGN1, "dense1")],
                         ids=["half2", "sign1"])
def test_a_residual_exchange_equals_the_simulators_link_exchange(spec, sim):
    """The daemon's half2 (sign1) against a link is the simulator's randk2:2048 (dense1)
    against a link reference (``--codec randk2:2048 --reference link``), whose study decided
    it: same correction and same reference afterwards, from the same reference, iterates and
    (half2) seed of positions, the link's state."""
    engines = _engines(whole(NUMEL))
    _exchange(engines, INT8, seed=True)
    la = engines[0].links.get("B", 0)
    ref = LinkReference(la.ref.clone())
    p = [e.state.public_iterate(whole(NUMEL)).clone() for e in engines]
    seed = position_seed(la.state)
    m_a, m_b = (encode(SparseSpec.parse(sim), x - ref.ref, seed) for x in p)
    want = pair_correction(m_a, m_b, 0.5)
    ref.update(m_a, m_b)
    before = engines[0].state.theta.double()
    _exchange(engines, spec)
    # theta + c rounds to theta's float32 grid (|theta| < 8: within half an ulp, 4.8e-7)
    torch.testing.assert_close(engines[0].state.theta.double() - before, want.double(),
                               rtol=0, atol=4.8e-7)
    assert float(want.abs().max()) > 1e-3  # the correction is far above that rounding
    assert torch.equal(la.ref, ref.ref)


def _rules(peer: str, codec: CodecSpec) -> Rules:
    never = Timeouts(math.inf, math.inf, math.inf)
    return Rules.build(Identity("run", "model", peer), codec, 0.5, never)


@RESIDUAL
def test_the_protocol_seeds_uses_and_reseeds_links(spec):
    """Through the sessions (the daemon's protocol, in memory): a pair's first exchange is
    plain int8 and seeds the link on both sides, the next ones send half2 (sign1) against it; a link
    one side lost is refused in the Header (LINK_OUT_OF_STEP, nothing applied), the sender
    drops its side and the exchange after that seeds again. A refusal changes nothing on the
    refusing side (the Header may be a member's replay). A node without links gets plain int8
    only."""
    engines = _engines(whole(NUMEL))
    sides = [(_rules(peer, spec), e) for peer, e in zip(("A", "B"), engines, strict=True)]
    first, _ = MemoryExchange(sides[0], sides[1], 0).run()
    assert first.bytes_sent == INT8.codec().wire_bytes(NUMEL)  # plain, seeding
    la, lb = engines[0].links.get("B", 0), engines[1].links.get("A", 0)
    assert la is not None and lb is not None and la.state == lb.state
    second, _ = MemoryExchange(sides[1], sides[0], 0).run()  # B initiates this time
    assert second.bytes_sent == spec.codec().wire_bytes(NUMEL)
    assert la.exchanges == lb.exchanges == 2 and torch.equal(la.ref, lb.ref)
    engines[1].links.drop("A", 0)  # B restarted, say
    before = [e.state.theta.clone() for e in engines]
    with pytest.raises(Rejected) as refused:
        MemoryExchange(sides[0], sides[1], 0).run()
    assert refused.value.code == LINK_OUT_OF_STEP
    assert all(torch.equal(b, e.state.theta) for b, e in zip(before, engines, strict=True))
    assert engines[0].links.get("B", 0) is None  # A dropped its side on the Reject
    third, _ = MemoryExchange(sides[0], sides[1], 0).run()
    assert third.bytes_sent == INT8.codec().wire_bytes(NUMEL)  # seeds again
    assert engines[0].links.get("B", 0).state == engines[1].links.get("A", 0).state
    kept = engines[1].links.get("A", 0)
    kept_state = kept.state
    engines[0].links.get("B", 0).state = bytes(32)  # A names a state B never held
    with pytest.raises(Rejected):
        MemoryExchange(sides[0], sides[1], 0).run()
    assert engines[1].links.get("A", 0) is kept and kept.state == kept_state  # untouched
    assert engines[0].links.get("B", 0) is None
    MemoryExchange(sides[0], sides[1], 0).run()  # seeds anew, over B's old one
    assert kept.state != kept_state and kept.state == engines[0].links.get("B", 0).state
    plain = (_rules("C", INT8), _engines(whole(NUMEL))[1])
    plain[1].links = None
    out, _ = MemoryExchange(sides[0], plain, 0).run()
    assert out.bytes_sent == INT8.codec().wire_bytes(NUMEL)
    assert engines[0].links.get("C", 0) is None  # C keeps no links: nothing seeded


def test_a_residual_header_must_name_a_link_state():
    """check_header: sign1 with no (or a short) link state, or with a seed, is a bad request;
    a node that keeps no links accepts no residual payload at all."""
    from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
    from gasloc_p2p.protocol.messages import accepted_codecs, check_header
    me = Identity("run", "model", "B")
    frag = [whole(NUMEL)]
    base = dict(protocol_version=PROTOCOL_VERSION, run_id="run", model_fingerprint="model",
                peer_id="A", codec="sign1", block_size=4096, fragment_index=0,
                fragment_count=1, fragment_numel=NUMEL, payload_digest=bytes(32),
                payload_bytes=SIGN1.codec().wire_bytes(NUMEL))
    ok = pb.Header(**base, link_state=bytes(32))
    assert check_header(ok, me, frag, accepted_codecs(SIGN1)) is None
    for bad in (pb.Header(**base), pb.Header(**base, link_state=bytes(31)),
                pb.Header(**base, link_state=bytes(32), link_seed=True)):
        assert "link state" in check_header(bad, me, frag, accepted_codecs(SIGN1)).message
    assert "not accepted" in check_header(ok, me, frag, accepted_codecs(INT8)).message
