"""The sans-I/O exchange protocol: two sessions in memory, rejections, failures, a fuzzer."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.actions import (
    Admit,
    Apply,
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
    refs = [t for pid in list(engine.refs._links) for t in (engine.refs.get(pid).ref_out,
                                                             engine.refs.get(pid).ref_in)]
    return [t.clone() for t in (s.theta, s.anchor, s.memory, *refs)]


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "fp4"])
def test_memory_exchange_commits_symmetrically(codec):
    a, b = node("A", 1, codec), node("B", 2, codec)
    frag = fragments()[1]
    before = a[1].state.public_iterate(frag) + b[1].state.public_iterate(frag)
    out_a, out_b = MemoryExchange(a, b, 1).run()
    la, lb = a[1].refs.get("B"), b[1].refs.get("A")
    assert torch.equal(la.ref_out, lb.ref_in) and torch.equal(la.ref_in, lb.ref_out)
    assert la.version == lb.version == 1
    assert (out_a.weight, out_a.staleness, out_a.fragment) == (0.5, 0, 1)
    assert out_a.correction_norm == out_b.correction_norm > 0
    after = a[1].state.public_iterate(frag) + b[1].state.public_iterate(frag)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)  # the pair's sum is kept


def test_versions_that_differ_reset_the_link_on_both_sides():
    a, b = node("A", 1), node("B", 2)
    MemoryExchange(a, b, 0).run()
    MemoryExchange(b, a, 0).run()
    b[1].refs.get("A").reset(b[1].theta0)  # B lost the link
    MemoryExchange(a, b, 1).run()
    la, lb = a[1].refs.get("B"), b[1].refs.get("A")
    assert la.version == lb.version == 1
    assert torch.equal(la.ref_out, lb.ref_in) and torch.equal(la.ref_in, lb.ref_out)


def test_staleness_down_weights_both_sides_alike():
    a, b = node("A", 1), node("B", 2)
    ex = MemoryExchange(a, b, 0)
    ex.open()
    a[1].state.round_end()
    b[1].state.round_end()
    b[1].state.round_end()
    out_a, out_b = ex.finish()
    assert out_a.staleness == out_b.staleness == 3
    assert out_a.weight == out_b.weight == 0.5 / 3  # downweight, max_staleness 1


def _first_header(rules, engine, peer="B", **changes):
    prep = engine.prepare(peer, 0, rules.codec, False)
    msg = make_header(rules.me, prep, len(engine.fragments))
    for key, value in changes.items():
        setattr(msg.header, key, value)
    return msg


@pytest.mark.parametrize("change,code", [
    ({"protocol_version": 7}, pb.VERSION_MISMATCH), ({"run_id": "other"}, pb.RUN_MISMATCH),
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
    init.prepared(ea.prepare("B", 0, prepare.codec, False))
    with pytest.raises(ProtocolError, match="no the responder's Header within 1 s"):
        init.timed_out()
    with pytest.raises(ProtocolError, match="stream closed"):
        init.closed()
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
        acts = session.prepared(eb.prepare("A", 0, todo[0].codec, todo[0].reset))
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
                    assert not isinstance(act, Apply), f"trial {trial}: applied on garbage"
        except ExchangeError:
            pass
    after = snapshot(eb)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert math.isfinite(float(eb.state.theta.sum()))
