"""The member attack of issue 23: a fresh identity for every exchange, one fixed direction,
a distance just under each victim's soft limit (not part of the package).

A white-box attacker, the strongest the benchmark can field: for each exchange it mints a new
ed25519 key, takes the victim's public iterate from a state download at most ``refresh_s``
old, and sends ``p_victim + k * drift * u``, where ``u`` is one fixed random direction of unit
RMS and ``drift`` the victim's own drift per round, read from the victim's progress log (what
an attacker training beside the swarm with the same settings would measure on itself). Its
displacement from ``theta_0`` is the victim's own plus a small push, so the direction test
passes; ``k`` below the guard's soft factor keeps every exchange unclipped, so no clip streak
ever trips. It speaks the real protocol with valid signatures and Commits.

The push it has left in a victim is the victim's displacement along ``u`` (honest training has
none there: ``u`` is random), :func:`along`.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from benchmarks.tools.fuzz_streams import Stream, Target
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.node.transport.tls import fetch_certificate, secure_channel
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer, new_nonce
from gasloc_p2p.protocol.messages import COMMIT_DOMAIN, MAX_CHUNK_BYTES, commit_fields, sign_header
from gasloc_p2p.tools.nodes import NodeChild

DRIFT = re.compile(r"guard drift ([0-9.eE+-]+)")
DEADLINE_S = 20.0


def direction(numel: int, seed: int = 2323) -> torch.Tensor:
    """The attacker's fixed direction, of unit RMS."""
    u = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return u / u.pow(2).mean().sqrt()


def along(params: torch.Tensor, theta0: torch.Tensor, u: torch.Tensor) -> float:
    """The RMS-unit component of ``params - theta0`` along ``u``: the push left in a node."""
    return float((params - theta0).double().dot(u.double()) / u.numel())


def victim_drift(node: NodeChild) -> float:
    """The victim's own drift per round, from its latest progress line (0: none yet)."""
    found = DRIFT.findall(node.err.read_text(errors="replace"))
    return float(found[-1]) if found else 0.0


@dataclass
class Tally:
    """What the attacker's exchanges met, per outcome; and each victim's pushes committed."""

    outcomes: Counter[str] = field(default_factory=Counter)
    pushed: defaultdict[str, float] = field(  # victim -> sum of w * offset committed
        default_factory=lambda: defaultdict(float))
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)  # victim -> summed pushes

    def add_vector(self, victim: str, push: torch.Tensor) -> None:
        """Add one committed push (``w * offset * direction``) to the victim's sum."""
        held = self.vectors.get(victim)
        self.vectors[victim] = push.double() if held is None else held + push.double()


async def exchange(channel: grpc.aio.Channel, target: Target, payload: bytes,
                   signer: Signer | None = None) -> str:
    """One exchange as initiator under ``signer`` (default: a fresh key): "committed", or
    where it stopped."""
    signer, mine = signer or Signer(), new_nonce()
    first = sign_header(target.header(signer.peer_id, "fp32", 0, payload), signer, mine, b"")
    s = Stream(pb_grpc.GossipStub(channel).Exchange(timeout=DEADLINE_S), DEADLINE_S)
    try:
        await s.write(first)
        what, msg = await s.until("header")
        if what != "header":
            return _why(what, msg)
        theirs = msg.header  # type: ignore[attr-defined]
        proof = pb.ExchangeMsg()
        proof.CopyFrom(first)
        sign_header(proof, signer, mine, theirs.nonce)
        await s.write(proof)
        for start in range(0, len(payload), MAX_CHUNK_BYTES):
            await s.write(pb.ExchangeMsg(chunk=pb.Chunk(
                data=payload[start:start + MAX_CHUNK_BYTES])))
        what, msg = await s.until("ready")
        if what != "ready":
            return _why(what, msg)
        await s.write(pb.ExchangeMsg(ready=pb.Ready(rounds_since_snapshot=0)))
        sig = signer.sign(COMMIT_DOMAIN, commit_fields(proof.header, theirs))
        await s.write(pb.ExchangeMsg(commit=pb.Commit(signature=sig)))
        await s.done_writing()
        what, msg = await s.until("never")
        return "committed" if what == "end" else _why(what, msg)
    finally:
        s.close()


def _why(what: str, msg: object) -> str:
    if what in ("reject", "abort"):
        text = getattr(getattr(msg, what), "message", "")
        if "implausible" in text:
            return "refused (implausible)"
        if "budget" in text:
            return "refused (budget spent)"
        return f"{what}: {text[:40]}"
    return what


async def attack(victims: list[NodeChild], run_id: str, theta0: torch.Tensor, k: float,
                 until: float, tally: Tally, w: float = 0.5, refresh_s: float = 2.0) -> None:
    """Attack every victim in turn, one exchange in flight per victim, until ``until``."""
    u = direction(theta0.numel())

    async def one(victim: NodeChild) -> None:
        info = await asyncio.to_thread(victim.info)
        base, fetched = None, 0.0
        cert = await asyncio.to_thread(fetch_certificate, victim.endpoint)
        async with secure_channel(victim.endpoint, cert, [
                ("grpc.max_send_message_length", 64 << 20)]) as channel:
            while time.monotonic() < until:
                drift = victim_drift(victim)
                if drift <= 0 or not victim.alive:
                    await asyncio.sleep(1.0)
                    continue
                if base is None or time.monotonic() - fetched > refresh_s:
                    try:
                        base = (await asyncio.to_thread(victim.download_state, run_id))[1]
                    except Exception:  # noqa: BLE001 - busy serving others: use the old one
                        await asyncio.sleep(0.5)
                        if base is None:
                            continue
                    fetched = time.monotonic()
                offset = k * drift
                payload = CodecSpec("fp32", 0).codec().encode(base + offset * u).to_bytes()
                target = Target(run_id, info.model_fingerprint, theta0.numel(), DEADLINE_S)
                try:
                    outcome = await exchange(channel, target, payload)
                except grpc.RpcError as exc:
                    outcome = f"rpc {exc.code()}"
                tally.outcomes[outcome] += 1
                if outcome == "committed":
                    tally.pushed[victim.name] += w * offset
                else:
                    await asyncio.sleep(0.05)

    await asyncio.gather(*(one(v) for v in victims))


def read_drift_log(path: Path) -> list[float]:
    """Every drift a node reported (for the report)."""
    return [float(x) for x in DRIFT.findall(path.read_text(errors="replace"))]
