"""The sans-I/O exchange protocol: two sessions in memory, rejections, failures, a fuzzer."""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch

from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.actions import (
    Admit,
    Prepare,
    Send,
    SendPayload,
)
from gasloc_p2p.protocol.engine import ExchangeEngine
from gasloc_p2p.protocol.memory import MemoryExchange
from gasloc_p2p.protocol.messages import (
    ExchangeError,
    PeerAborted,
    ProtocolError,
    make_header,
)
from gasloc_p2p.protocol.session import ExchangeSession, Stage
from tests.node_helpers import fragments
from tests.session_helpers import node


def snapshot(engine: ExchangeEngine) -> list[torch.Tensor]:
    s = engine.state
    assert s.outer.state
    return [t.clone() for t in (s.theta, s.anchor, *s.outer.state.values())]


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "fp4"])
def test_memory_exchange_commits_symmetrically(codec):
    a, b = node("A", 1, codec), node("B", 2, codec)
    frag = fragments()[1]
    before = a[1].state.public_iterate(frag) + b[1].state.public_iterate(frag)
    theta_a, theta_b = a[1].state.theta.clone(), b[1].state.theta.clone()
    out_a, out_b = MemoryExchange(a, b, 1).run()
    assert (out_a.weight, out_a.staleness, out_a.fragment) == (0.5, 0, 1)
    assert out_a.correction_norm == out_b.correction_norm > 0
    # c_a = -c_b: both sides fold the same two decoded messages (up to the adds' rounding)
    torch.testing.assert_close(a[1].state.theta - theta_a, -(b[1].state.theta - theta_b),
                               rtol=0, atol=1e-6)
    after = a[1].state.public_iterate(frag) + b[1].state.public_iterate(frag)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)  # the pair's sum is kept
    untouched = fragments()[0].gather(a[1].state.theta - theta_a)
    assert not untouched.any()  # the other fragment did not move


def test_an_fp32_pair_average_meets_in_the_middle():
    a, b = node("A", 1, "fp32"), node("B", 2, "fp32")
    frag = fragments()[0]
    mid = (a[1].state.public_iterate(frag) + b[1].state.public_iterate(frag)) / 2
    MemoryExchange(a, b, 0).run()
    torch.testing.assert_close(a[1].state.public_iterate(frag), mid, rtol=0, atol=1e-6)
    torch.testing.assert_close(b[1].state.public_iterate(frag), mid, rtol=0, atol=1e-6)


def test_staleness_down_weights_both_sides_alike():
    a, b = node("A", 1), node("B", 2)
    ex = MemoryExchange(a, b, 0)
    ex.open()
    a[1].state.round_end()
    b[1].state.round_end()
    b[1].state.round_end()
    out_a, out_b = ex.finish()
    assert out_a.staleness == out_b.staleness == 3
    assert out_a.weight == out_b.weight == 0.5 / 3  # downweighted beyond one round end


def _first_header(rules, engine, peer="B", **changes):
    prep = engine.prepare(peer, 0, rules.codec)
    msg = make_header(rules.me, prep, len(engine.fragments))
    for key, value in changes.items():
        setattr(msg.header, key, value)
    return msg


@pytest.mark.parametrize("change,code", [
    ({"protocol_version": 99}, pb.VERSION_MISMATCH), ({"run_id": "other"}, pb.RUN_MISMATCH),
    ({"model_fingerprint": "0" * 64}, pb.FINGERPRINT_MISMATCH), ({"peer_id": "B"}, pb.BAD_REQUEST),
    ({"fragment_index": 2}, pb.BAD_REQUEST), ({"fragment_numel": 5}, pb.BAD_REQUEST),
    ({"codec": "int3"}, pb.BAD_REQUEST), ({"block_size": 1 << 20}, pb.BAD_REQUEST),
    ({"block_size": 6}, pb.BAD_REQUEST), ({"payload_bytes": 12}, pb.BAD_REQUEST)])
def test_responder_rejects_bad_headers_with_their_code(change, code):
    (ra, ea), (rb, eb) = node("A", 1), node("B", 2)
    session = ExchangeSession.responder(rb, eb)
    assert session.expecting() == ("the initiator's Header", 1.0)
    (act,) = session.receive(_first_header(ra, ea, **change))
    assert isinstance(act, Send) and act.msg.reject.code == code
    assert session.stage is Stage.REJECTED and session.problem is not None
    assert session.fail(ProtocolError("late")) == []


def test_responder_rejects_a_non_header_first_and_busy():
    (ra, ea), (rb, eb) = node("A", 1), node("B", 2)
    first = ExchangeSession.responder(rb, eb)
    (act,) = first.receive(pb.ExchangeMsg(ready=pb.Ready()))
    assert isinstance(act, Send) and act.msg.reject.code == pb.BAD_REQUEST
    busy = ExchangeSession.responder(rb, eb)
    (admit,) = busy.receive(_first_header(ra, ea))
    assert isinstance(admit, Admit) and admit.peer_id == "A"
    (act,) = busy.refused()
    assert isinstance(act, Send) and act.msg.reject.code == pb.BUSY


def test_timeouts_and_failures_name_what_was_awaited():
    ra, ea = node("A", 1)
    init = ExchangeSession.initiator(ra, ea, "B", 0)
    (prepare,) = init.start()
    assert isinstance(prepare, Prepare) and prepare.codec == CodecSpec("int8", 1024)
    init.prepared(ea.prepare("B", 0, prepare.codec))
    with pytest.raises(ProtocolError, match="no the responder's Header within 1 s"):
        init.timed_out()
    with pytest.raises(ProtocolError, match="stream closed"):
        init.closed()
    init.stage = Stage.TRANSFER  # a payload late on a slow link: the flag that sets its deadline
    with pytest.raises(ProtocolError, match=r"no payload within .*--min-link-mbps"):
        init.timed_out()
    (act,) = init.fail(ProtocolError("broken"))
    assert isinstance(act, Send) and act.msg.abort.code == pb.BAD_REQUEST
    other = ExchangeSession.initiator(ra, ea, "B", 0)
    other.start()
    assert other.fail(PeerAborted(pb.INTERNAL, "bye")) == []
    assert other.fail(ValueError("twice")) == []  # failing twice tells the peer nothing more


def test_fuzzed_messages_raise_protocol_errors_and_change_nothing():
    rng = random.Random(0)
    (ra, ea), (rb, eb) = node("A", 1), node("B", 2)
    before = snapshot(eb)
    kinds = ["header", "chunk", "ready", "commit", "abort", "reject", "empty"]
    for trial in range(200):
        session = ExchangeSession.responder(rb, eb)
        (admit,) = session.receive(_first_header(ra, ea))
        todo = session.admitted()
        assert isinstance(todo[0], Prepare)
        acts = session.prepared(eb.prepare("A", 0, todo[0].codec))
        assert isinstance(acts[-1], SendPayload)
        try:
            for _ in range(rng.randrange(1, 6)):
                kind = rng.choice(kinds)
                data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
                msg = {"header": lambda: _first_header(ra, ea),
                       "chunk": lambda data=data: pb.ExchangeMsg(chunk=pb.Chunk(data=data)),
                       "ready": lambda: pb.ExchangeMsg(ready=pb.Ready(
                           rounds_since_snapshot=rng.randrange(3))),
                       "commit": lambda: pb.ExchangeMsg(commit=pb.Commit()),
                       "abort": lambda: pb.ExchangeMsg(abort=pb.Abort(code=pb.INTERNAL)),
                       "reject": lambda: pb.ExchangeMsg(reject=pb.Reject(code=pb.BUSY)),
                       "empty": lambda: pb.ExchangeMsg()}[kind]()
                for act in session.receive(msg):
                    assert not hasattr(act, "prep"), f"trial {trial}: applied on garbage"
        except ExchangeError:
            pass
    after = snapshot(eb)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert math.isfinite(float(eb.state.theta.sum()))


def keep_crc32(data: bytes, at: int, target: int) -> bytes:
    """``data`` with the 4 bytes at ``at`` re-chosen so its CRC32 is ``target``'s: CRC32 is
    affine over GF(2), so the 32 bits that cancel a change solve a 32 x 32 linear system (what
    an on-path proxy without any key did to the CRC-only protocol)."""
    base = bytearray(data)
    base[at:at + 4] = bytes(4)
    want = zlib.crc32(base) ^ target
    cols = []
    for bit in range(32):  # the CRC change of each bit of the 4 bytes
        probe = bytearray(base)
        probe[at + bit // 8] ^= 1 << (bit % 8)
        cols.append(zlib.crc32(probe) ^ zlib.crc32(base))
    rows = [(cols[b], 1 << b) for b in range(32)]  # Gaussian elimination over GF(2)
    basis: dict[int, tuple[int, int]] = {}
    for value, combo in rows:
        for top in sorted(basis, reverse=True):
            if value >> top & 1:
                value, combo = value ^ basis[top][0], combo ^ basis[top][1]
        if value:
            basis[value.bit_length() - 1] = (value, combo)
    pick = 0
    for top in sorted(basis, reverse=True):
        if want >> top & 1:
            want, pick = want ^ basis[top][0], pick ^ basis[top][1]
    assert want == 0
    base[at:at + 4] = pick.to_bytes(4, "little")
    return bytes(base)


@pytest.mark.parametrize("keep_the_crc", [False, True])
def test_a_payload_changed_in_transit_fails_its_signed_digest(monkeypatch, keep_the_crc):
    """The receiver hashes each chunk as it arrives (not the whole payload again after) and
    compares with the SHA-256 in the sender's signed Header: one flipped byte fails the
    exchange before anything commits, and so do 4 KB changed with the CRC32 kept."""
    from gasloc_p2p.protocol import memory

    a, b = node("A", 1), node("B", 2)
    theta_a, theta_b = a[1].state.theta.clone(), b[1].state.theta.clone()
    original, tampered = memory.chunks, []

    def tamper(payload, size):
        data = bytearray(payload)
        if not tampered:
            if keep_the_crc:
                target = zlib.crc32(data)
                data[100:4196] = bytes(4096)  # 4 KB of the payload zeroed
                data = bytearray(keep_crc32(bytes(data), 4196, target))
                assert zlib.crc32(data) == target and data != payload
            else:
                data[0] ^= 1
            tampered.append(True)
        yield from original(bytes(data), size)

    monkeypatch.setattr(memory, "chunks", tamper)
    with pytest.raises(Exception, match="SHA-256"):
        MemoryExchange(a, b, 1).run()
    assert tampered
    assert torch.equal(a[1].state.theta, theta_a) and torch.equal(b[1].state.theta, theta_b)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 1 << 22, (1 << 22) + 1, 3 * (1 << 22) + 5])
def test_the_payload_digest_is_the_same_for_any_split_and_moves_with_any_byte(nbytes):
    """The signed payload digest (a SHA-256 tree over 4 MiB leaves, the leaves hashed in
    parallel) equals what a receiver computes chunk by chunk, whatever the chunks; a changed
    byte in any leaf, or a different length with the same bytes, changes it."""
    import hashlib

    from gasloc_p2p.core.wire import DIGEST_LEAF, PayloadHasher, payload_digest

    rng = random.Random(nbytes)
    data = bytearray(rng.randbytes(nbytes))
    whole = payload_digest(data)
    for cuts in ([], [1], [nbytes // 3, nbytes // 2], sorted(rng.sample(range(nbytes + 1), 5))
                 if nbytes > 5 else []):
        hasher, last = PayloadHasher(), 0
        for cut in [*cuts, nbytes]:
            hasher.update(data[last:cut])
            last = cut
        assert hasher.digest() == whole, cuts
    leaves = [hashlib.sha256(data[i:i + DIGEST_LEAF]).digest()
              for i in range(0, nbytes, DIGEST_LEAF)]
    assert whole == hashlib.sha256(b"gasloc-payload-tree-v1" + nbytes.to_bytes(8, "little")
                                   + b"".join(leaves)).digest()
    if nbytes:
        for at in {0, nbytes // 2, nbytes - 1}:
            changed = bytearray(data)
            changed[at] ^= 1
            assert payload_digest(changed) != whole, at
    assert payload_digest(data + b"\0") != whole
