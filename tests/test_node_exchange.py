"""The Exchange protocol between two in-process nodes on real gRPC servers (127.0.0.1:0)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.options import ConfigError
from gasloc_p2p.core.wire import payload_digest
from gasloc_p2p.node.config import GossipConfig
from gasloc_p2p.node.transport.tls import secure_channel
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import new_nonce
from gasloc_p2p.protocol.messages import (
    MAX_CHUNK_BYTES,
    PROTOCOL_VERSION,
    Rejected,
    make_header,
    sign_header,
)
from tests.node_helpers import (
    assert_same_state,
    full_state,
    gossip_config,
    make_peer,
    run,
    scaled,
    settle,
    start_raw,
    wait_until,
)


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4"])
def test_full_exchange_commits_on_both_sides(codec):
    async def main():
        a = await make_peer("A", 1, gossip_config(codec=codec))
        b = await make_peer("B", 2, gossip_config(codec=codec))
        try:
            frag = a.engine.fragments[0]
            pa, pb_ = a.state.public_iterate(frag), b.state.public_iterate(frag)
            ta, tb = frag.gather(a.state.theta), frag.gather(b.state.theta)
            drift_a = a.state.theta - a.state.anchor
            other = a.engine.fragments[1]
            rest_a = a.state.public_iterate(other)
            outcome = await a.exchange(b, fragment=0)
            await wait_until(lambda: b.exchanger.stats.ok_responder == 1, what="B commit")
            # c_a = -c_b (the adds' rounding aside): the same folds of the same two messages
            ca, cb = frag.gather(a.state.theta) - ta, frag.gather(b.state.theta) - tb
            torch.testing.assert_close(ca, -cb, rtol=0, atol=1e-6)
            assert float(ca.norm()) == pytest.approx(outcome.correction_norm, rel=1e-4)
            # p moved by c, the drift theta - a is untouched, the pair's mean is kept
            pa2, pb2 = a.state.public_iterate(frag), b.state.public_iterate(frag)
            torch.testing.assert_close(pa2 - pa, ca, rtol=0, atol=1e-5)
            torch.testing.assert_close(a.state.theta - a.state.anchor, drift_a, rtol=0, atol=1e-6)
            torch.testing.assert_close(pa2 + pb2, pa + pb_, rtol=0, atol=1e-5)
            # w = 1/2: the pair average, up to each message's quantization error (relative to
            # the parameters' scale: the messages are the iterates themselves)
            tol = {"fp32": 1e-6, "int8": 0.02, "int4": 0.25}[codec]
            assert (pa2 - pb2).norm() < tol * pa.norm()
            assert outcome.staleness == 0 and outcome.weight == 0.5
            assert a.exchanger.stats.ok_initiator == 1 and not a.exchanger.inflight
            assert torch.equal(a.state.public_iterate(other), rest_a)  # fragment 1 untouched
        finally:
            await a.close()
            await b.close()

    run(main())


@pytest.mark.parametrize("codec", ["half2", "sign1"])
def test_residual_links_over_grpc_seed_then_send_8x_fewer_bytes(codec):
    """Two nodes with --codec half2 (sign1) on real gRPC (TLS, signed headers): the first
    exchange is int8 and seeds the pair's link, the next ones in either direction carry
    residuals against it (8x fewer bytes), keep the pair's sum and leave both references
    alike."""
    async def main():
        a = await make_peer("A", 1, gossip_config(codec=codec))
        b = await make_peer("B", 2, gossip_config(codec=codec))
        try:
            frag = a.engine.fragments[0]
            first = await a.exchange(b, fragment=0)
            assert first.bytes_sent == CodecSpec.of("int8").codec().wire_bytes(frag.numel)
            await wait_until(lambda: b.exchanger.stats.ok_responder == 1, what="B commit")
            sizes = []
            for x, y in ((b, a), (a, b), (b, a)):
                total = x.state.public_iterate(frag) + y.state.public_iterate(frag)
                served = y.exchanger.stats.ok_responder
                out = await x.exchange(y, fragment=0)
                await wait_until(lambda y=y, n=served: y.exchanger.stats.ok_responder == n + 1,
                                 what="the responder's commit")
                torch.testing.assert_close(
                    x.state.public_iterate(frag) + y.state.public_iterate(frag), total,
                    rtol=0, atol=1e-5)
                sizes.append(out.bytes_sent)
            assert sizes == [CodecSpec.of(codec).codec().wire_bytes(frag.numel)] * 3
            assert sizes[0] * 7.8 <= first.bytes_sent  # 7.97x on large fragments
            la, lb = a.engine.links.get(b.me.peer_id, 0), b.engine.links.get(a.me.peer_id, 0)
            assert la.exchanges == lb.exchanges == 4 and torch.equal(la.ref, lb.ref)
        finally:
            await a.close()
            await b.close()
    run(main())


def test_repeated_exchanges_in_both_directions_converge():
    async def main():
        a, b = await make_peer("A", 1), await make_peer("B", 2)
        try:
            frag = a.engine.fragments[0]
            gap = float((a.state.public_iterate(frag) - b.state.public_iterate(frag)).norm())
            await a.exchange(b, 0)
            first = a.exchanger.stats.bytes_sent
            await b.exchange(a, 0)  # the other direction: no per-peer state to agree on
            await wait_until(lambda: a.exchanger.stats.ok_responder == 1, what="A commit")
            assert a.exchanger.stats.bytes_sent == 2 * first  # int8: fixed size per fragment
            after = float((a.state.public_iterate(frag) - b.state.public_iterate(frag)).norm())
            assert after < 0.1 * gap  # pair averages: the quantization error is what is left
        finally:
            await a.close()
            await b.close()

    run(main())


@pytest.mark.parametrize("what", ["fingerprint", "version", "run"])
def test_incompatible_peer_is_rejected_with_its_code(what):
    async def main():
        a = await make_peer("A", 1, fingerprint="0" * 64 if what == "fingerprint" else "f" * 64)
        b = await make_peer("B", 2)
        try:
            before_a, before_b = full_state(a), full_state(b)
            if what == "fingerprint":
                err = await settle(a.exchange(b, 0))
            else:
                err = await settle(_raw_exchange(a, b, what))
            expected = {"fingerprint": pb.FINGERPRINT_MISMATCH, "version": pb.VERSION_MISMATCH,
                        "run": pb.RUN_MISMATCH}[what]
            assert isinstance(err, Rejected) and err.code == expected, err
            assert_same_state(before_a, full_state(a))
            assert_same_state(before_b, full_state(b))
        finally:
            await a.close()
            await b.close()

    run(main())


async def _raw_exchange(a, b, what):
    """Send a header with a wrong version or run id; return the peer's reply as an error."""
    codec = CodecSpec("int8", 1024)
    prep = a.engine.prepare(b.me.peer_id, 0, codec)
    msg = make_header(a.me, prep, 2)
    if what == "version":
        msg.header.protocol_version = PROTOCOL_VERSION + 1
    else:
        msg.header.run_id = "another-run"
    sign_header(msg, a.me.signer, new_nonce(), b"")  # a member: it reads the reason
    call = a.open_call(b)
    await call.write(msg)
    reply = await call.read()
    call.cancel()
    assert reply.WhichOneof("kind") == "reject"
    raise Rejected(reply.reject.code, reply.reject.message)


MISBEHAVIOURS = ["garbage", "oversized-chunk", "huge-message", "too-long", "too-short-ready",
                 "dies-mid-stream", "silent"]


@pytest.mark.parametrize("how", MISBEHAVIOURS)
def test_misbehaving_initiator_changes_nothing_and_server_keeps_serving(how):
    async def main():
        fast = gossip_config(chunk_timeout_s=scaled(1.5), header_timeout_s=scaled(1.5),
                             commit_timeout_s=scaled(1.5), exchange_timeout_s=scaled(6))
        a, b = await make_peer("A", 1), await make_peer("B", 2, fast)
        wide = None
        try:
            before_a, before_b = full_state(a), full_state(b)
            prep, header = start_raw(a, b)
            payload = prep.payload
            if how == "garbage":  # right length, wrong bytes: the CRC catches it
                payload = bytes(len(payload))
            elif how == "too-long":
                header.header.payload_digest = payload_digest(payload)
                payload = payload + b"\x00" * 10
            wide = _wide_channel(b) if how == "huge-message" else None
            call = pb_grpc.GossipStub(wide).Exchange() if wide else a.open_call(b)
            await call.write(header)
            reply = await call.read()
            assert reply.WhichOneof("kind") == "header"
            result = await settle(_misbehave(call, how, payload))
            if how == "huge-message":  # the server's receive limit ends the stream
                assert "RESOURCE_EXHAUSTED" in str(result), result
            await wait_until(lambda: not b.exchanger.inflight, what="B to drop the exchange")
            call.cancel()
            assert b.exchanger.stats.failed >= 1 and b.exchanger.stats.ok == 0
            assert_same_state(before_a, full_state(a))
            assert_same_state(before_b, full_state(b))
            await a.exchange(b, 0)  # the server still serves
            await wait_until(lambda: b.exchanger.stats.ok_responder == 1, what="B commit")
        finally:
            if wide is not None:
                await wide.close()
            await a.close()
            await b.close()

    run(main())


def _wide_channel(b):
    """A channel whose own send limit would let a 4 MiB message out."""
    big = 16 * MAX_CHUNK_BYTES
    return secure_channel(b.endpoint, b.cert, [
        ("grpc.max_send_message_length", big), ("grpc.max_receive_message_length", big)])


async def _misbehave(call, how, payload):
    """Play a broken initiator after the header handshake; returns the last message read."""
    if how == "oversized-chunk":
        await call.write(pb.ExchangeMsg(chunk=pb.Chunk(data=bytes(MAX_CHUNK_BYTES + 1))))
    elif how == "huge-message":  # above the gRPC message limit: the transport refuses it
        await call.write(pb.ExchangeMsg(chunk=pb.Chunk(data=bytes(4 * MAX_CHUNK_BYTES))))
    elif how == "too-short-ready":
        await call.write(pb.ExchangeMsg(chunk=pb.Chunk(data=payload[:100])))
        await call.write(pb.ExchangeMsg(ready=pb.Ready()))
        await call.write(pb.ExchangeMsg(commit=pb.Commit()))
    elif how == "dies-mid-stream":
        await call.write(pb.ExchangeMsg(chunk=pb.Chunk(data=payload[: len(payload) // 2])))
        call.cancel()
        return None
    elif how == "silent":
        pass  # send nothing more: the responder's chunk timeout fires
    else:
        await call.write(pb.ExchangeMsg(chunk=pb.Chunk(data=payload)))
        await call.write(pb.ExchangeMsg(ready=pb.Ready()))
        await call.write(pb.ExchangeMsg(commit=pb.Commit()))
    last = None
    while True:
        msg = await call.read()
        if msg is None or msg.__class__.__name__ == "_EOF" or not hasattr(msg, "WhichOneof"):
            return last
        last = msg


def test_responder_dying_mid_stream_changes_nothing_on_the_initiator():
    async def main():
        fast = gossip_config(chunk_timeout_s=scaled(1.5), exchange_timeout_s=scaled(6))
        a, b = await make_peer("A", 1, fast), await make_peer("B", 2)
        try:
            before_a = full_state(a)
            respond = b.exchanger.respond

            async def dying(stream):  # B sends its header and part of its payload, then dies
                first = await stream.read()
                prep = b.engine.prepare(a.me.peer_id, 0, CodecSpec("int8", 1024))
                await stream.write(sign_header(make_header(b.me, prep, 2), b.me.signer,
                                               new_nonce(), first.header.nonce))
                await stream.write(pb.ExchangeMsg(chunk=pb.Chunk(data=bytes(prep.payload[:1000]))))
                assert first.WhichOneof("kind") == "header"
                raise RuntimeError("simulated crash")

            b.exchanger.respond = dying
            err = await settle(a.exchange(b, 0))
            assert isinstance(err, Exception), err
            assert_same_state(before_a, full_state(a))
            assert not a.exchanger.inflight
            b.exchanger.respond = respond
            await a.exchange(b, 0)
        finally:
            await a.close()
            await b.close()

    run(main())


def test_busy_responder_answers_busy():
    async def main():
        a, b = await make_peer("A", 1), await make_peer("B", 2, gossip_config(max_inbound=1))
        c = await make_peer("C", 3)
        try:
            _, header = start_raw(a, b)  # A occupies B's only inbound slot
            call = a.open_call(b)
            await call.write(header)
            assert (await call.read()).WhichOneof("kind") == "header"
            err = await settle(c.exchange(b, 0))
            assert isinstance(err, Rejected) and err.code == pb.BUSY
            call.cancel()
            await wait_until(lambda: not b.exchanger.inflight, what="slot freed")
            await c.exchange(b, 0)
        finally:
            for p in (a, b, c):
                await p.close()

    run(main())


def test_concurrent_exchanges_with_two_peers_all_commit():
    async def main():
        a, b, c = await make_peer("A", 1), await make_peer("B", 2), await make_peer("C", 3)
        try:
            total = sum(p.state.public_iterate() for p in (a, b, c))
            await asyncio.gather(b.exchange(a, 0), c.exchange(a, 1), b.exchange(c, 1))
            await wait_until(lambda: a.exchanger.stats.ok_responder == 2
                             and c.exchanger.stats.ok == 2, what="all commits")
            assert b.exchanger.stats.ok_initiator == 2
            after = sum(p.state.public_iterate() for p in (a, b, c))
            torch.testing.assert_close(after, total, rtol=0, atol=1e-5)  # every pair kept its sum
        finally:
            for p in (a, b, c):
                await p.close()

    run(main())


def test_upload_cap_slows_the_transfer():
    async def main():
        capped = gossip_config(max_upload_mbps=2.0, codec="fp32")  # 250 kB/s
        a, b = await make_peer("A", 1, capped), await make_peer("B", 2)
        try:
            loop = asyncio.get_running_loop()
            await a.exchange(b, 0)  # 100 kB: within the 1 MiB burst
            sent = a.exchanger.stats.bytes_sent
            assert sent == 4 * a.engine.fragments[0].numel
            a.exchanger.bucket.burst = 0.0  # now every byte waits for its tokens
            a.exchanger.bucket._tokens = 0.0
            t0 = loop.time()
            await a.exchange(b, 0)
            assert loop.time() - t0 >= 0.9 * sent / 250_000
        finally:
            await a.close()
            await b.close()

    run(main())


def test_a_payload_slower_than_the_fixed_deadlines_completes_on_a_slow_link():
    """A node whose upload takes 4 s (capped at 0.2 Mbit/s, as a slow home uplink) with a
    whole-exchange deadline of 2 s and a message timeout of 1.5 s: both grow by its payload's
    time on the slowest link it plans for, so the exchange completes (with fixed deadlines it
    failed: a 1 GB payload at 1B parameters took 800 s at 10 Mbit/s against 120 s)."""

    async def main():
        slow = gossip_config(max_upload_mbps=0.2, codec="fp32", chunk_bytes=16 * 1024,
                             exchange_timeout_s=2.0, header_timeout_s=1.5,
                             chunk_timeout_s=1.5, commit_timeout_s=1.5)
        a, b = await make_peer("A", 1, slow), await make_peer("B", 2)
        try:
            payload = 4 * a.engine.fragments[0].numel
            upload_s = payload * 8 / 0.2e6
            assert upload_s > 3.0
            assert a.exchanger.deadline_s == pytest.approx(2.0 + upload_s)
            # one message may take its largest chunk's time twice over on that link
            assert a.exchanger.rules.timeouts.chunk_s == pytest.approx(2 * (1 << 20) * 8 / 0.2e6)
            assert b.exchanger.rules.timeouts.chunk_s == b.exchanger.cfg.chunk_timeout_s
            a.exchanger.bucket.burst = 0.0  # every byte waits for its tokens
            a.exchanger.bucket._tokens = 0.0
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            outcome = await a.exchange(b, 0)
            took = loop.time() - t0
            assert outcome.weight > 0 and a.exchanger.stats.ok_initiator == 1, outcome
            assert took >= 0.9 * upload_s > slow.exchange_timeout_s, took
            await wait_until(lambda: b.exchanger.stats.ok_responder == 1, what="B's commit")
        finally:
            await a.close()
            await b.close()

    run(main())


def test_deadlines_grow_with_this_nodes_own_bytes_on_the_slowest_link():
    g = GossipConfig()
    assert g.min_link_mbps == 10.0
    assert g.transfer_s(10**9) == pytest.approx(800.0)  # 1 GB at 10 Mbit/s
    assert replace(g, max_upload_mbps=2.0).transfer_s(10**9) == pytest.approx(4000.0)
    assert replace(g, max_upload_mbps=50.0).transfer_s(10**9) == pytest.approx(800.0)
    assert replace(g, min_link_mbps=0.0).transfer_s(10**9) == 0.0
    # a state download: parameters and memory in float32
    assert g.download_deadline_s(10**9) == pytest.approx(g.download_timeout_s + 6400.0)
    with pytest.raises(ConfigError, match="--min-link-mbps=-1.0: must be >= 0"):
        replace(g, min_link_mbps=-1.0).validate()


@pytest.mark.parametrize("block_size", [2, 6, 1 << 16, 1 << 30])
def test_header_block_size_outside_the_allowed_set_is_rejected(block_size):
    """A peer's header never chooses how much memory the responder's codec uses."""

    async def main():
        a, b = await make_peer("A", 1), await make_peer("B", 2)
        try:
            before_b = full_state(b)
            prep = a.engine.prepare(b.me.peer_id, 0, CodecSpec("int8", 1024))
            header = make_header(a.me, prep, 2)
            header.header.block_size = block_size
            sign_header(header, a.me.signer, new_nonce(), b"")  # signed as sent: a member
            call = a.open_call(b)
            await call.write(header)
            reply = await call.read()
            call.cancel()
            assert reply.WhichOneof("kind") == "reject"
            assert reply.reject.code == pb.BAD_REQUEST, reply
            assert b.exchanger.stats.rejected_inbound == 1
            assert_same_state(before_b, full_state(b))
        finally:
            await a.close()
            await b.close()

    run(main())


def test_an_all_reduce_deadline_grows_with_its_traffic_on_the_slowest_link():
    """DiLoCo: a 1B model's fp32 all-reduce moves about 8 GB up per node; its deadline is the
    fixed all-reduce timeout plus that on the slowest link, for hivemind and for the node's
    own wait."""
    from types import SimpleNamespace

    from gasloc_p2p.node.averaging.dht import HivemindAverager
    from gasloc_p2p.node.config import DilocoConfig

    dht = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me"))
    cfg = DilocoConfig()
    upload = 2 * 4 * 10**9
    averager = HivemindAverager(dht, 10**9, "p", cfg, GossipConfig().transfer_s(upload))
    assert averager.allreduce_s == pytest.approx(cfg.allreduce_timeout_s + 6400.0)
    assert HivemindAverager(dht, 10**9, "p", cfg).allreduce_s == cfg.allreduce_timeout_s
