"""The authenticated fuzz client (a swarm member with its own key) and the run over N streams.

A member's stream passes the header checks by construction: its Header and the proof Header
over the node's nonce are validly signed, so what it mutates (see
:mod:`benchmarks.tools.fuzz_streams`) reaches the payload and commit paths.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import grpc

from benchmarks.tools.fuzz_streams import (
    CODECS,
    COMMITS,
    FRAMING,
    PAYLOADS,
    Counts,
    Result,
    Stream,
    Target,
    chunked,
    finish,
    make_payload,
    mutate_header,
    outsider_stream,
)
from gasloc_p2p.core.wire import BLOCK_CODECS
from gasloc_p2p.node.transport.tls import fetch_certificate, secure_channel
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer, new_nonce
from gasloc_p2p.protocol.messages import (
    COMMIT_DOMAIN,
    INTERNAL,
    MAX_CHUNK_BYTES,
    STANDARD_BLOCK_SIZES,
    commit_fields,
    sign_header,
)
from gasloc_p2p.tools.nodes import NodeChild

ODD_FIRST = {"ready_first": pb.ExchangeMsg(ready=pb.Ready(rounds_since_snapshot=0)),
             "commit_first": pb.ExchangeMsg(commit=pb.Commit(signature=bytes(64))),
             "abort": pb.ExchangeMsg(abort=pb.Abort(code=INTERNAL, message="\nINFO forged"))}


def choose(rng: random.Random) -> tuple[str, str, int, str]:
    """(mutation, codec, block size, payload kind) of one member stream."""
    group = rng.choice([PAYLOADS, PAYLOADS, FRAMING, COMMITS])
    mutation = rng.choice(group)
    codec = rng.choice(CODECS)
    block = rng.choice(STANDARD_BLOCK_SIZES) if codec in BLOCK_CODECS else 0
    return mutation, codec, block, mutation if group is PAYLOADS else "mirror"


def signed_copy(msg: pb.ExchangeMsg, signer: Signer, mine: bytes,
                theirs: bytes) -> pb.ExchangeMsg:
    out = pb.ExchangeMsg()
    out.CopyFrom(msg)
    return sign_header(out, signer, mine, theirs)


def proof_of(mutation: str, first: pb.ExchangeMsg, signer: Signer, mine: bytes,
             theirs: bytes, rng: random.Random) -> pb.ExchangeMsg | None:
    """The second Header (over the node's nonce ``theirs``), spoiled as ``mutation`` says."""
    if mutation == "no_proof":
        return None
    if mutation == "proof_bad_nonce":
        return signed_copy(first, signer, mine, rng.randbytes(16))
    if mutation == "proof_other_key":
        proof = signed_copy(first, Signer(), mine, theirs)
        proof.header.peer_id = signer.peer_id  # claims our id with another key
        return proof
    proof = signed_copy(first, signer, mine, theirs)
    if mutation == "proof_changed":
        h = proof.header
        h.block_size = 64 if h.block_size != 64 else 128
        if not h.codec.startswith(("int", "fp4")):
            h.codec = "fp16" if h.codec == "fp32" else "fp32"
        sign_header(proof, signer, mine, theirs)
    return proof


async def send_payload(s: Stream, mutation: str, payload: bytes, rng: random.Random) -> None:
    pieces = chunked(payload, rng)
    if mutation.startswith("truncate"):
        cut = rng.randrange(1, len(payload))
        pieces = chunked(payload[:cut], rng)
    elif mutation == "oversize":
        pieces.append(b"\0" * rng.choice([1, 4, 1000]))
    elif mutation == "empty_chunk":
        # before the last piece: the payload is incomplete, so no Ready may come (one after
        # the complete payload is "oversize", where Ready may race the node's Abort)
        pieces.insert(rng.randrange(len(pieces)), b"")
    elif mutation == "big_chunk":
        pieces = [payload + b"\0" * (MAX_CHUNK_BYTES + 1 - len(payload))]
    for piece in pieces:
        await s.write(pb.ExchangeMsg(chunk=pb.Chunk(data=piece)))
    if mutation == "truncate_close":
        await s.done_writing()


_LAST_VALID: list[pb.ExchangeMsg] = []  # the last valid Commit sent (for "commit_replayed")


def valid_commit(signer: Signer, mine: pb.Header, theirs: pb.Header) -> pb.ExchangeMsg:
    return pb.ExchangeMsg(commit=pb.Commit(signature=signer.sign(
        COMMIT_DOMAIN, commit_fields(mine, theirs))))


def bad_commit(mutation: str, signer: Signer, mine: pb.Header, theirs: pb.Header,
               rng: random.Random) -> pb.ExchangeMsg | None:
    """What a member sends as its Commit (None: nothing): a bad one, or for
    ``commit_valid`` a valid one (remembered, so a later stream can replay it)."""
    if mutation == "commit_valid":
        _LAST_VALID[:] = [valid_commit(signer, mine, theirs)]
        return _LAST_VALID[0]
    if mutation == "commit_replayed":  # another stream's valid Commit: not this one's
        return _LAST_VALID[0] if _LAST_VALID else pb.ExchangeMsg(commit=pb.Commit())
    if mutation == "commit_garbage":
        return pb.ExchangeMsg(commit=pb.Commit(signature=rng.randbytes(64)))
    if mutation == "commit_empty":
        return pb.ExchangeMsg(commit=pb.Commit())
    if mutation == "commit_wrong_fields":  # the responder's view, not the initiator's
        sig = signer.sign(COMMIT_DOMAIN, commit_fields(theirs, mine))
        return pb.ExchangeMsg(commit=pb.Commit(signature=sig))
    if mutation == "commit_other_key":
        sig = Signer().sign(COMMIT_DOMAIN, commit_fields(mine, theirs))
        return pb.ExchangeMsg(commit=pb.Commit(signature=sig))
    if mutation == "chunk_after_ready":
        return pb.ExchangeMsg(chunk=pb.Chunk(data=b"\0"))
    if mutation == "header_after_ready":
        return pb.ExchangeMsg(header=mine)
    return None  # commit_silent, commit_close, and any payload or framing mutation


async def member_stream(channel: grpc.aio.Channel, rng: random.Random, t: Target) -> Result:
    """One authenticated stream with one mutation after (or in) the signed headers."""
    mutation, codec, block, kind = choose(rng)
    signer, mine = Signer(), new_nonce()
    if kind == "mirror":
        payload = t.mirror(codec, block)
    else:
        payload = make_payload(codec, block, t.numel, kind, rng)
    first = t.header(signer.peer_id, codec, block, payload)
    if kind == "digest":  # one bit of the announced SHA-256 flipped
        digest = bytearray(first.header.payload_digest)
        digest[rng.randrange(len(digest))] ^= 1 << rng.randrange(8)
        first.header.payload_digest = bytes(digest)
    if mutation == "signed_header_mutated":
        before = first.header.SerializeToString()
        mutate_header(first.header, rng)
        if first.header.SerializeToString() == before:  # the draw left it valid
            mutation = "signed_header_unchanged"
    sign_header(first, signer, mine, b"")
    s = Stream(pb_grpc.GossipStub(channel).Exchange(timeout=t.deadline_s), t.deadline_s)
    try:
        await s.write(first)
        what, msg = await s.until("header")
        if what != "header":
            return finish(what, msg, mutation)
        theirs = msg.header  # type: ignore[attr-defined]
        proof = proof_of(mutation, first, signer, mine, theirs.nonce, rng)
        if proof is not None:
            await s.write(proof)
            if mutation == "dup_proof":
                await s.write(proof)
        if mutation in ODD_FIRST:
            await s.write(ODD_FIRST[mutation])
        await send_payload(s, mutation, payload, rng)
        if mutation == "commit_valid_early":  # before the node's Ready: it must abort
            sent = proof.header if proof is not None else first.header
            await s.write(valid_commit(signer, sent, theirs))
        what, msg = await s.until("ready")
        if what != "ready":
            return finish(what, msg, mutation)
        ready_to = kind if mutation in PAYLOADS or mutation in COMMITS else mutation
        await s.write(pb.ExchangeMsg(ready=pb.Ready(rounds_since_snapshot=rng.choice(
            [0, 1, 7]))))
        sent = proof.header if proof is not None else first.header
        last = bad_commit(mutation, signer, sent, theirs, rng)
        if last is not None:
            await s.write(last)
        if mutation != "commit_silent":
            await s.done_writing()
        result = finish(*await s.until("never"), mutation)
        if mutation == "commit_valid":
            result.notes.append("valid-commit-sent")
        unrefused = mutation == "oversize" and result.stage != "framing"
        result.ready_to = "oversize-unrefused" if unrefused else ready_to
        return result
    finally:
        s.close()


async def run_fuzz(endpoint: str, target: Target, streams: int, concurrency: int, seed: int,
                   member_share: float = 0.8, progress_every: int = 0) -> Counts:
    """Send ``streams`` generated streams (``member_share`` of them authenticated) with
    ``concurrency`` in flight; the counts of where they were stopped."""
    counts = Counts()
    cert = await asyncio.to_thread(fetch_certificate, endpoint)
    async with secure_channel(endpoint, cert, [
            ("grpc.max_send_message_length", 8 << 20)]) as channel:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(streams):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                rng = random.Random(seed * 1_000_003 + i)
                if rng.random() < member_share:
                    counts.add(await member_stream(channel, rng, target))
                else:
                    counts.add(await outsider_stream(channel, rng, target, i))
                if progress_every and (i + 1) % progress_every == 0:
                    print(f"  {i + 1} streams ...", flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


NODE_FLAGS = ["--host", "127.0.0.1", "--n-layer", "2", "--n-embd", "64", "--seq-len", "64",
              "--batch-size", "8", "--header-timeout-s", "2", "--chunk-timeout-s", "2",
              "--commit-timeout-s", "2", "--exchange-timeout-s", "8", "--torch-threads", "1",
              "--max-inbound", "4", "--codec", "int8",
              # every stream has a fresh key from 127.0.0.1: no backoff of the address block
              # after a refused one, so the later streams reach the checks under test
              "--guard-backoff-s", "0"]
STREAM_DEADLINE_S = 15.0  # the node's own timeouts end any stream within about 10 s


def fuzz_node(log_dir: Path, streams: int, concurrency: int, seed: int,
              member_share: float, progress_every: int = 0) -> dict[str, object]:
    """Start a node (logs in ``log_dir``), send it ``streams`` generated streams, check it
    afterwards; the figures: counts, took (s), numel, crashed, finite, steps, committed,
    tracebacks and forged (log lines)."""
    node = NodeChild("target", log_dir, NODE_FLAGS)
    try:
        node.wait_up(180)
        before = node.info()
        params = node.download_state(before.run_id)[1]
        numel = params.numel()
        target = Target(before.run_id, before.model_fingerprint, numel,
                        STREAM_DEADLINE_S, params)
        t0 = time.monotonic()
        counts = asyncio.run(run_fuzz(node.endpoint, target, streams, concurrency, seed,
                                      member_share, progress_every))
        took = time.monotonic() - t0
        crashed = not node.alive
        try:
            after = node.info(timeout_s=10)
            finite = bool(node.download_state(before.run_id)[1].isfinite().all())
        except grpc.RpcError:
            crashed, after, finite = True, before, False
    finally:
        node.stop(30)
    err = node.err.read_text(errors="replace")
    return {"counts": counts, "took": took, "numel": numel, "crashed": crashed,
            "finite": finite, "steps": after.step - before.step,
            "committed": after.exchanges_ok_responder - before.exchanges_ok_responder,
            "tracebacks": err.count("Traceback"), "forged": err.count("\nINFO forged")}


async def honest_stream(channel: grpc.aio.Channel, t: Target, signer: Signer) -> str:
    """One valid member exchange (the node's own parameters as an int8 payload, a valid
    Commit); how it ended: "committed" (the node closed the stream without an error after our
    Commit), or the stage where it stopped."""
    payload = t.mirror("int8", 1024)
    mine = new_nonce()
    first = sign_header(t.header(signer.peer_id, "int8", 1024, payload), signer, mine, b"")
    s = Stream(pb_grpc.GossipStub(channel).Exchange(timeout=t.deadline_s), t.deadline_s)
    try:
        await s.write(first)
        what, msg = await s.until("header")
        if what != "header":
            return what
        theirs = msg.header  # type: ignore[attr-defined]
        proof = signed_copy(first, signer, mine, theirs.nonce)
        await s.write(proof)
        for start in range(0, len(payload), MAX_CHUNK_BYTES):
            await s.write(pb.ExchangeMsg(chunk=pb.Chunk(
                data=payload[start:start + MAX_CHUNK_BYTES])))
        what, msg = await s.until("ready")
        if what != "ready":
            return what
        await s.write(pb.ExchangeMsg(ready=pb.Ready(rounds_since_snapshot=0)))
        await s.write(valid_commit(signer, proof.header, theirs))
        await s.done_writing()
        what, msg = await s.until("never")
        if what == "rpc" and getattr(msg, "code", lambda: None)() == grpc.StatusCode.OK:
            return "committed"
        return "committed" if what == "end" else what
    finally:
        s.close()
