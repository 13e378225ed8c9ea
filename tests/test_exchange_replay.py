"""A recorded initiator Header replayed by someone without the key reads nothing (real gRPC).

The responder answers a Header with its own Header and a fresh nonce, and sends its payload only
after the initiator's second Header, signed over that nonce: a replay cannot produce it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from tests.node_helpers import Peer, full_state, make_peer, run, scaled


class Recorder:
    """Wraps an Exchange call and keeps a copy of every message written to it."""

    def __init__(self, call: Any, sent: list[pb.ExchangeMsg]) -> None:
        self.call, self.sent = call, sent

    async def write(self, msg: pb.ExchangeMsg) -> None:
        copy = pb.ExchangeMsg()
        copy.CopyFrom(msg)
        self.sent.append(copy)
        await self.call.write(msg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.call, name)


async def _replay(attacker: Peer, victim: Peer, msgs: list[pb.ExchangeMsg]) -> tuple[list[str], int]:
    """Send ``msgs`` on a fresh stream to ``victim``; (kinds of what it answers, payload bytes
    received) until it ends the stream or stays silent for a while."""
    call = attacker.open_call(victim)
    kinds, payload = [], 0
    try:
        for msg in msgs:
            await call.write(msg)
        while True:
            try:
                msg = await asyncio.wait_for(call.read(), scaled(6))
            except (TimeoutError, grpc.aio.AioRpcError):
                break
            if msg is grpc.aio.EOF:
                break
            kind = msg.WhichOneof("kind")
            kinds.append(kind)
            if kind == "chunk":
                payload += len(msg.chunk.data)
    finally:
        call.cancel()
    return kinds, payload


def test_replayed_initiator_header_gets_no_payload():
    async def main():
        a, b, eve = (await make_peer("A", 1), await make_peer("B", 2),
                     await make_peer("Eve", 3))
        try:
            sent: list[pb.ExchangeMsg] = []
            await a.exchanger.initiate(lambda: Recorder(a.open_call(b), sent), b.me.peer_id, 0)
            before = full_state(b)
            # Eve replays A's first Header, alone and with everything A sent after it
            for msgs in ([sent[0]], [sent[0], *[m for m in sent[1:] if m.HasField("chunk")]],
                         sent):
                answered, payload = await _replay(eve, b, msgs)
                print(f"replayed {len(msgs)} message(s): B answered {answered}, "
                      f"{payload} payload bytes")
                assert payload == 0, answered
                assert "ready" not in answered and answered[:1] in (["header"], ["reject"])
            kinds = [m.WhichOneof("kind") for m in sent]
            # the honest flow: Header, the proof Header over B's nonce, payload, Ready, Commit
            assert kinds[:2] == ["header", "header"], kinds
            assert sent[0].header.nonce == sent[1].header.nonce
            assert sent[0].header.signature != sent[1].header.signature
            after = full_state(b)
            assert before.keys() == after.keys()
            assert all(bool((before[k] == after[k]).all()) if hasattr(before[k], "all")
                       else before[k] == after[k] for k in before)
            await a.exchange(b)  # the honest pair still exchanges
        finally:
            for p in (a, b, eve):
                await p.close()

    run(main(), timeout_s=120)
