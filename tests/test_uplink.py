"""The uplink's exchanges at once (node/transport/uplink.py): from the node's own measured
upload rate, robust to a peer that reads slowly or answers early; and the transport's
admission by it, over real gRPC (a newcomer cannot take the uplink from peers that committed
here before)."""

from __future__ import annotations

import pytest

from gasloc_p2p.node.transport.uplink import MIN_SAMPLE_BYTES, UplinkMeter
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.messages import Rejected
from tests.node_helpers import gossip_config, make_peer, run, settle, start_raw, wait_until

MIB = 1 << 20
PAYLOAD = 845_788  # the NAT bench's int8 payload


def _at(mbit: float, nbytes: int = PAYLOAD) -> tuple[int, float]:
    return nbytes, nbytes * 8 / (mbit * 1e6)


def test_no_measurement_no_limit_and_small_payloads_time_nothing():
    meter = UplinkMeter()
    assert meter.slots(PAYLOAD, MIB, 15.0, 60.0) is None
    meter.sample(MIN_SAMPLE_BYTES - 1, 1e-3)  # a round trip, not a rate
    meter.sample(PAYLOAD, 0.0)
    meter.sample(PAYLOAD, float("nan"))
    assert meter.rate() is None


@pytest.mark.parametrize(("mbit", "slots"), [(1.0, 1), (2.0, 2), (20.0, 22)])
def test_slots_keep_every_payload_within_half_the_peers_deadline(mbit, slots):
    # the NAT bench's homes: one payload 6.8 s at 1 Mbit/s, the message deadline 15 s
    meter = UplinkMeter()
    meter.sample(*_at(mbit))
    assert meter.slots(PAYLOAD, MIB, 15.0, 60.0) == slots
    # k payloads at once each take k times as long: the k-th still within half the deadline
    alone_s = PAYLOAD / meter.rate()
    assert slots * alone_s <= 0.5 * 15.0 < (slots + 1) * alone_s
    # a large payload is bound by the whole exchange's deadline, a message by its own
    big = 135_000_000
    meter = UplinkMeter()
    meter.sample(*_at(20.0))
    got = meter.slots(big, MIB, 15.0, 60.0 + big * 8 / 10e6)
    assert got == 1  # 54 s of payload at 20 Mbit/s against a deadline of 168 s


def test_a_slow_reader_cannot_shrink_the_uplink_and_an_early_ready_gives_back_no_more():
    meter = UplinkMeter(window=4)
    meter.sample(*_at(1.0))
    for _ in range(3):  # a peer that reads at a tenth of the link
        meter.sample(*_at(0.1))
    assert meter.slots(PAYLOAD, MIB, 15.0, 60.0) == 1
    for _ in range(4):  # the honest sample leaves the window: only then the limit shrinks...
        meter.sample(*_at(0.1))
    assert meter.slots(PAYLOAD, MIB, 15.0, 60.0) == 1  # ...to one at a time, never zero
    # members that are all of a fast node's last partners, reading slowly: at most 4x fewer
    fast = UplinkMeter(window=4)
    fast.sample(*_at(100.0))
    before = fast.slots(PAYLOAD, MIB, 15.0, 60.0)
    for _ in range(8):
        fast.sample(*_at(0.2))
    assert fast.rate() == pytest.approx(100e6 / 8 / 4)
    assert fast.slots(PAYLOAD, MIB, 15.0, 60.0) >= before // 4 - 1 > 6  # the inbound limits
    meter.sample(PAYLOAD, 1e-6)  # a peer answering Ready before the payload could arrive
    assert meter.slots(PAYLOAD, MIB, 15.0, 60.0) > 1000  # as before any measurement: no
    # limit of its own (the node's inbound limit still holds)


def test_a_full_uplink_answers_newcomers_busy_but_not_peers_that_committed_here():
    async def main():
        a, b = await make_peer("A", 1), await make_peer("B", 2, gossip_config())
        c, d = await make_peer("C", 3), await make_peer("D", 4)
        try:
            await a.exchange(b, 0)  # A has committed with B: B knows it as good
            await wait_until(lambda: b.exchanger.stats.ok_responder == 1, what="B commit")
            # B measured an uplink on which one of its payloads fills half the deadline
            chunk_s = b.exchanger.rules.timeouts.chunk_s
            size = max(b.exchanger.payload_bytes, MIN_SAMPLE_BYTES)
            b.exchanger.uplink_sampled(size, 0.6 * chunk_s * size / b.exchanger.payload_bytes)
            assert b.exchanger.uplink_slots() == b.exchanger.stats.uplink_slots == 1
            _, header = start_raw(d, b)  # newcomer D takes B's uplink
            call = d.open_call(b)
            await call.write(header)
            assert (await call.read()).WhichOneof("kind") == "header"
            err = await settle(c.exchange(b, 0))  # another newcomer: BUSY
            assert isinstance(err, Rejected) and err.code == pb.BUSY
            assert b.exchanger.stats.uplink_busy == 1
            await a.exchange(b, 1)  # a peer that committed here before still gets through
            call.cancel()
            await wait_until(lambda: not b.exchanger.inflight, what="slot freed")
            await c.exchange(b, 0)
            assert b.exchanger.stats.uplink_busy == 1
        finally:
            for p in (a, b, c, d):
                await p.close()

    run(main())


def test_a_full_uplink_skips_the_nodes_own_gossip_event():
    async def main():
        a, b = await make_peer("A", 1), await make_peer("B", 2)
        try:
            await a.exchange(b, 0)
            await wait_until(lambda: b.exchanger.stats.ok_responder == 1, what="B commit")
            chunk_s = b.exchanger.rules.timeouts.chunk_s
            size = max(b.exchanger.payload_bytes, MIN_SAMPLE_BYTES)
            b.exchanger.uplink.sample(size, 0.6 * chunk_s * size / b.exchanger.payload_bytes)
            assert b.exchanger.uplink_free(None)
            b.exchanger.inflight.add(a.me.peer_id)  # an exchange with A in flight
            assert not b.exchanger.uplink_free(None)  # A committed here: it counts
            b.exchanger.inflight.discard(a.me.peer_id)
            b.exchanger.inflight.add("x")  # one B started itself
            b.exchanger.initiating.add("x")
            assert not b.exchanger.uplink_free(None) and not b.exchanger.uplink_free("new")
        finally:
            await a.close()
            await b.close()

    run(main())
