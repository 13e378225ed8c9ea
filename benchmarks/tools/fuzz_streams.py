"""Generated hostile Exchange streams against a live node, and where each one was stopped.

Two kinds of client write the streams (each stream with a fresh identity):

- an *outsider* without a valid key: raw bytes that are no protobuf, unsigned Headers with one
  field mutated, unsigned messages out of order, unsigned Headers followed by bad payloads;
- an *authenticated member* (its own ed25519 key, which without ``--swarm-key`` any member
  holds): a signed Header, the proof Header signed over the node's fresh nonce, and then
  everything after it mutated (codec and block size, chunk sizes, CRC, NaN/Inf/huge values,
  truncated or oversized payloads, reordered or duplicated messages, bad proofs, bad or missing
  Commits). It never sends a valid Commit, so nothing it sends may change the node.

:func:`stage_of` names the check that stopped a stream from the node's own Reject/Abort text,
so a run shows how many streams reached the payload and commit paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections import Counter
from dataclasses import dataclass, field

import grpc
import torch

from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.wire import BLOCK_CODECS, layout, payload_digest
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.messages import (
    MAX_CHUNK_BYTES,
    PROTOCOL_VERSION,
    STANDARD_BLOCK_SIZES,
    UNAUTHENTICATED,
)

EXCHANGE = "/gasloc.v1.Gossip/Exchange"
CODECS = ("fp32", "fp16", "int8", "int4", "fp4")
# payloads the node must refuse (digest, non-finite, |x| > 1e6); "offset1e4" is finite and only
# the bounded-update guard can refuse it, so a Ready to it is counted apart
BAD_PAYLOADS = ("digest", "nan", "inf", "huge")
PAYLOADS = (*BAD_PAYLOADS, "offset1e4", "negscale", "zero")
FRAMING = ("truncate_close", "truncate_silent", "oversize", "empty_chunk", "big_chunk",
           "no_proof", "proof_bad_nonce", "proof_changed", "proof_other_key", "dup_proof",
           "ready_first", "commit_first", "abort", "signed_header_mutated")
COMMITS = ("commit_garbage", "commit_empty", "commit_wrong_fields", "commit_other_key",
           "commit_silent", "commit_close", "chunk_after_ready", "header_after_ready",
           # a valid Commit: applied exactly once when it follows both Ready messages, never
           # before the node's Ready, never when replayed from another stream
           "commit_valid", "commit_valid_early", "commit_replayed")
# what the node may answer with Ready: valid payloads and legal orders; "oversize" sends a
# valid payload and then one chunk too many (Ready may precede it; the node must then Abort)
GOOD_READY = ("mirror", "oversize", "zero", "negscale", "offset1e4", "ready_first",
              "signed_header_unchanged")
HEADER_CHECKS = ("protocol ", "run ", "model ", "reference scheme", "bad sender", "fragment ",
                 "codec ", "payload ")
# the checks a stream can be stopped by, in the order a stream meets them
STAGES = ("grpc-decode", "busy", "header-check", "header-auth", "proof", "framing",
          "payload-decode", "guard", "commit", "timeout", "ended", "other")


@dataclass
class Target:
    """What a valid Header for this node carries (from its Info and its config)."""

    run_id: str
    fingerprint: str
    numel: int
    deadline_s: float  # the node's own timeouts end any stream within this
    params: torch.Tensor | None = None  # the node's parameters (float32, flat), if known
    _mirrors: dict[tuple[str, int], bytes] = field(default_factory=dict)

    def mirror(self, codec: str, block: int) -> bytes:
        """The node's own parameters encoded as ``codec``: a payload its guard accepts (its
        distance to the node's half is only quantization and the steps trained since)."""
        if self.params is None:
            raise ValueError("no parameters to mirror")
        key = (codec, block)
        if key not in self._mirrors:
            spec = CodecSpec(codec, block)
            self._mirrors[key] = spec.codec().encode(self.params).to_bytes()
        return self._mirrors[key]

    def header(self, peer_id: str, codec: str, block: int, payload: bytes) -> pb.ExchangeMsg:
        return pb.ExchangeMsg(header=pb.Header(
            protocol_version=PROTOCOL_VERSION, run_id=self.run_id,
            model_fingerprint=self.fingerprint, peer_id=peer_id, codec=codec, block_size=block,
            fragment_index=0, fragment_count=1, fragment_numel=self.numel,
            payload_bytes=len(payload), payload_digest=payload_digest(payload), rounds=0))


def make_payload(codec: str, block: int, numel: int, kind: str,
                 rng: random.Random) -> bytes:
    """A wire payload (scales, then data) of ``kind`` (one of :data:`PAYLOADS`)."""
    n_scales, n_data = layout(codec, numel, block)
    bad = {"nan": float("nan"), "inf": float("inf"), "huge": 3e38}.get(kind)
    if codec in BLOCK_CODECS:
        scale = {"negscale": -1e-3, "offset1e4": 1e4}.get(kind, 1e-3)
        scales = [scale] * n_scales
        if bad is not None:
            scales[rng.randrange(n_scales)] = bad
        return struct.pack(f"<{n_scales}f", *scales) + bytes([0x11]) * n_data
    fmt = "f" if codec == "fp32" else "e"
    value = {"offset1e4": 1e4, "negscale": -1e-3, "zero": 0.0}.get(kind, 1e-3)
    values = [value] * numel
    if bad is not None:
        values[rng.randrange(numel)] = bad if codec == "fp32" or kind != "huge" else float("inf")
    return struct.pack(f"<{numel}{fmt}", *values)


def stage_of(kind: str, code: int, message: str) -> str:
    """Which check stopped a stream, from the node's Reject or Abort."""
    if kind == "reject":
        return ("header-auth" if code == UNAUTHENTICATED else
                "busy" if code == pb.BUSY else "header-check")
    m = message.split(": ", 1)[1] if message[:1].isupper() and ": " in message else message
    if m.startswith(("no Commit", "stream closed while waiting for Commit")):
        return "commit"
    if m.startswith(("header:", "header without", "the re-sent Header")):
        return "proof"
    if m.startswith(("chunk of", "payload exceeds", "unexpected", "expected Commit")):
        return "framing"
    if kind == "abort" and (m.startswith(HEADER_CHECKS) or "has no blocks" in m):
        return "proof"  # check_header's words on the re-sent Header
    if m.startswith("bad payload"):
        return "payload-decode"
    if "implausible" in m:
        return "guard"
    if m.startswith("commit:"):
        return "commit"
    if m.startswith(("no ", "stream closed")) or "rate" in m:
        return "timeout"
    return "other"


@dataclass
class Result:
    stage: str  # see STAGES
    family: str
    ready_to: str = ""  # the payload kind the node answered with Ready ("" if none)
    hang: bool = False
    notes: list[str] = field(default_factory=list)


class Stream:
    """One Exchange call: a reader task queues what the node sends; writes never raise."""

    def __init__(self, call: grpc.aio.StreamStreamCall, deadline_s: float) -> None:
        self.call, self.deadline_s = call, deadline_s
        self.inbox: asyncio.Queue[object] = asyncio.Queue()
        self.reader = asyncio.ensure_future(self._read())
        self.open = True

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.call.read()
                await self.inbox.put(msg)
                if msg is grpc.aio.EOF:
                    return
        except grpc.RpcError as exc:
            await self.inbox.put(exc)
        except asyncio.CancelledError:
            await self.inbox.put(grpc.aio.EOF)
            raise

    async def write(self, msg: object) -> None:
        if self.open:
            try:
                await self.call.write(msg)
            except (grpc.RpcError, asyncio.InvalidStateError):
                self.open = False

    async def done_writing(self) -> None:
        if self.open:
            with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
                await self.call.done_writing()

    async def until(self, wanted: str, timeout_s: float | None = None) -> tuple[str, object]:
        """Read until a message of kind ``wanted``, a Reject/Abort, the end or the deadline:
        ``(what, message)`` with what one of wanted, reject, abort, end, rpc, hang."""
        try:
            async with asyncio.timeout(timeout_s or self.deadline_s):
                while True:
                    msg = await self.inbox.get()
                    if msg is grpc.aio.EOF:
                        return "end", None
                    if isinstance(msg, grpc.RpcError):
                        return "rpc", msg
                    if isinstance(msg, bytes):
                        continue
                    kind = msg.WhichOneof("kind")  # type: ignore[attr-defined]
                    if kind in (wanted, "reject", "abort"):
                        return kind, msg
        except TimeoutError:
            return "hang", None

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()


def finish(what: str, msg: object, family: str) -> Result:
    """The Result of a stream that ended with ``what`` (see :meth:`Stream.until`)."""
    if what in ("reject", "abort"):
        body = getattr(msg, what)
        stage = stage_of(what, body.code, body.message)
        return Result(stage, family, notes=[f"{what}: {body.message[:60]}"] * (stage == "other"))
    if what == "rpc":
        code = msg.code()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Result("timeout", family, hang=True)
        return Result("grpc-decode" if family == "raw" else "other", family,
                      notes=[f"rpc {code.name}"])
    return Result("timeout", family, hang=True) if what == "hang" else Result("ended", family)


def chunked(payload: bytes, rng: random.Random) -> list[bytes]:
    size = rng.choice([1 << 12, 1 << 16, MAX_CHUNK_BYTES])
    return [payload[i:i + size] for i in range(0, len(payload), size)]


async def outsider_stream(channel: grpc.aio.Channel, rng: random.Random, t: Target,
                          index: int) -> Result:
    """An unsigned (or raw) stream: the node must stop it at the header or earlier."""
    family = rng.choice(["raw", "header", "order", "payload"])
    if family == "raw":
        call = channel.stream_stream(EXCHANGE, request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)(timeout=t.deadline_s)
        s = Stream(call, t.deadline_s)
        for _ in range(rng.randrange(1, 4)):
            await s.write(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
        await s.done_writing()
    else:
        s = Stream(pb_grpc.GossipStub(channel).Exchange(timeout=t.deadline_s), t.deadline_s)
        codec = rng.choice(CODECS)
        block = rng.choice(STANDARD_BLOCK_SIZES) if codec in BLOCK_CODECS else 0
        payload = make_payload(codec, block, t.numel, rng.choice(PAYLOADS), rng)
        header = t.header(f"g1outsider{index}", codec, block, payload)
        if family == "header":
            mutate_header(header.header, rng)
        elif family == "order":
            await s.write(pb.ExchangeMsg(commit=pb.Commit(signature=bytes(64))))
        with contextlib.suppress(ValueError):  # an unsigned header with a stolen-looking key
            header.header.public_key, header.header.signature = rng.randbytes(32), bytes(64)
            header.header.nonce = rng.randbytes(16)
        await s.write(header)
        for piece in chunked(payload, rng):
            await s.write(pb.ExchangeMsg(chunk=pb.Chunk(data=piece)))
        await s.done_writing()
    try:
        what, msg = await s.until("ready")
        result = finish(what, msg, family)
        if what == "ready":  # an outsider's payload must never be taken
            result = Result("other", family, ready_to="outsider")
        return result
    finally:
        s.close()


def mutate_header(h: pb.Header, rng: random.Random) -> None:
    name = rng.choice(["protocol_version", "run_id", "model_fingerprint", "peer_id", "codec",
                       "block_size", "fragment_index", "fragment_count", "fragment_numel",
                       "payload_bytes"])
    if name in ("run_id", "model_fingerprint", "peer_id", "codec"):
        value: object = rng.choice(["", "x" * rng.randrange(1, 5000), "evil\nINFO forged",
                                    "\x1b[2J", "fp4", "links", "int9"])
    else:
        value = rng.choice([0, 1, 3, 7, 1 << 28, (1 << 31) - 1, (1 << 32) - 1,
                            h.fragment_numel + 1, h.payload_bytes - 1, rng.randrange(1 << 32)])
    with contextlib.suppress(ValueError, TypeError):
        setattr(h, name, value)


class Counts:
    """Totals over a run: outcomes per stage and per family, hangs, accepted-bad."""

    def __init__(self) -> None:
        self.stages: Counter[str] = Counter()
        self.families: Counter[str] = Counter()
        self.ready_to: Counter[str] = Counter()
        self.notes: Counter[str] = Counter()
        self.hangs = 0

    def add(self, r: Result) -> None:
        self.stages[r.stage] += 1
        self.families[r.family] += 1
        self.hangs += r.hang
        if r.ready_to:
            self.ready_to[r.ready_to] += 1
        self.notes.update(r.notes)

    @property
    def streams(self) -> int:
        return sum(self.stages.values())

    @property
    def accepted_bad(self) -> int:
        """Streams the node sent Ready to though their payload or framing was bad."""
        return sum(v for k, v in self.ready_to.items() if k not in GOOD_READY)

    def past_header(self) -> int:
        """Streams the node let past its header and signature checks."""
        return sum(v for k, v in self.stages.items()
                   if k not in ("grpc-decode", "busy", "header-check", "header-auth"))

