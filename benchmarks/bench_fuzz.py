"""Fuzz a live node: thousands of generated malformed Exchange streams from a hand-written client.

Usage: python benchmarks/bench_fuzz.py [--streams 5000] [--concurrency 4] [--seed 0]

Starts one real `gasloc-node join` process (tiny model, short timeouts) and sends it seeded,
generated streams, each from a fresh peer id, in these families: raw bytes that are no protobuf;
a valid Header with one field mutated (sizes, codec, block size, fragments, strings with control
characters); a valid Header then out-of-order or malformed messages (Ready/Commit first, empty
or oversized chunks, a second Header, Abort, nothing at all); a valid Header and a full payload
that is bad (CRC, NaN, finite offsets of 1e4 and 1e30, int8 block scales of 3e38). The client
never sends Commit. It prints the counts of streams, crashes (the node died or stopped
answering Info), hangs (a stream the node did not end within its own timeouts plus a margin)
and accepted-bad (the node sent Ready for a payload known to be bad), and the node's training
progress during the run. Exit code 1 if any crash, hang or accepted-bad.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import struct
import sys
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb  # noqa: E402
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc  # noqa: E402
from gasloc_p2p.protocol.messages import PROTOCOL_VERSION  # noqa: E402
from gasloc_p2p.tools.nodes import NodeChild  # noqa: E402

NODE_FLAGS = ["--host", "127.0.0.1", "--n-layer", "2", "--n-embd", "64", "--seq-len", "64",
              "--batch-size", "8", "--header-timeout-s", "2", "--chunk-timeout-s", "2",
              "--commit-timeout-s", "2", "--exchange-timeout-s", "8", "--torch-threads", "1",
              "--max-inbound", "4"]
STREAM_DEADLINE_S = 15.0  # the node's own timeouts end any stream within about 10 s
EXCHANGE = "/gasloc.v1.Gossip/Exchange"
SAMPLES: dict[str, str] = {}  # gRPC status -> one example of its details


class Target:
    """What a valid Header for this node looks like (from its Info)."""

    def __init__(self, info: pb.InfoReply, numel: int) -> None:
        self.run_id, self.fingerprint, self.numel = info.run_id, info.model_fingerprint, numel

    def header(self, peer: str, codec: str = "fp32", block: int = 0,
               payload: bytes = b"") -> pb.Header:
        return pb.Header(protocol_version=PROTOCOL_VERSION, run_id=self.run_id,
                         model_fingerprint=self.fingerprint, peer_id=peer, codec=codec,
                         block_size=block, fragment_index=0, fragment_count=1,
                         fragment_numel=self.numel, payload_bytes=len(payload),
                         payload_crc32=zlib.crc32(payload), link_version=0, rounds=0)


def fp32(values: list[float], numel: int) -> bytes:
    reps = -(-numel // len(values))
    return struct.pack(f"<{len(values) * reps}f", *(values * reps))[: 4 * numel]


def bad_payload(rng: random.Random, t: Target) -> tuple[str, str, int, bytes, bool]:
    """(name, codec, block, payload, crc ok) of a payload the node must refuse."""
    n = t.numel
    kind = rng.choice(["nan", "offset1e4", "offset1e30", "int8scale", "crc", "negscale"])
    if kind == "nan":
        return kind, "fp32", 0, fp32([0.0, float("nan")], n), True
    if kind == "offset1e4":
        return kind, "fp32", 0, fp32([1e4], n), True
    if kind == "offset1e30":
        return kind, "fp32", 0, fp32([1e30, -1e30], n), True
    blocks = -(-n // 1024)
    if kind in ("int8scale", "negscale"):
        scale = 3e38 if kind == "int8scale" else -1.0
        return kind, "int8", 1024, struct.pack(f"<{blocks}f", *([scale] * blocks)) + bytes(
            [1] * n), True
    return kind, "fp32", 0, fp32([0.01], n), False


def mutated_header(rng: random.Random, t: Target, peer: str) -> pb.Header:
    h = t.header(peer, payload=fp32([0.0], t.numel))
    field = rng.choice(["protocol_version", "run_id", "model_fingerprint", "peer_id", "codec",
                        "block_size", "fragment_index", "fragment_count", "fragment_numel",
                        "payload_bytes", "link_version"])
    if field in ("run_id", "model_fingerprint", "peer_id", "codec"):
        value: object = rng.choice(["", "x" * rng.randrange(1, 5000), "evil\nINFO forged",
                                    "\x1b[2J", "int8", "fp4", t.fingerprint[:-1] + "0"])
    else:
        value = rng.choice([0, 1, 2, 3, 7, 1 << 28, (1 << 31) - 1, (1 << 32) - 1,
                            t.numel + 1, t.numel - 1, rng.randrange(1 << 32)])
        if field in ("link_version",):
            value = rng.randrange(1 << 63)
    with contextlib.suppress(ValueError, TypeError):  # a value the field cannot hold
        setattr(h, field, value)
    return h


async def one_stream(channel: grpc.aio.Channel, rng: random.Random, t: Target,
                     index: int) -> str:
    """Run one generated stream; returns its outcome class."""
    family = rng.choice(["raw", "header", "order", "payload", "payload"])
    peer = f"fuzz-{index}"
    if family == "raw":
        call = channel.stream_stream(EXCHANGE, request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)(timeout=STREAM_DEADLINE_S)
        for _ in range(rng.randrange(1, 4)):
            await call.write(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
        await call.done_writing()
        return await drain(call, expect_bad=False)
    stub = pb_grpc.GossipStub(channel)
    call = stub.Exchange(timeout=STREAM_DEADLINE_S)
    if family == "header":
        await call.write(pb.ExchangeMsg(header=mutated_header(rng, t, peer)))
        await call.done_writing()
        return await drain(call, expect_bad=False)
    if family == "order":
        first = rng.choice(["ready", "commit", "empty", "chunk", "abort"])
        msgs = {"ready": pb.ExchangeMsg(ready=pb.Ready(rounds_since_snapshot=3)),
                "commit": pb.ExchangeMsg(commit=pb.Commit()), "empty": pb.ExchangeMsg(),
                "chunk": pb.ExchangeMsg(chunk=pb.Chunk(data=b"x" * rng.randrange(0, 2048))),
                "abort": pb.ExchangeMsg(abort=pb.Abort(code=pb.INTERNAL, message="\n"))}
        payload = fp32([0.0], t.numel)
        if rng.random() < 0.5:  # out of order right after a valid Header
            await call.write(pb.ExchangeMsg(header=t.header(peer, payload=payload)))
        await call.write(msgs[first])
        if rng.random() < 0.3:
            await call.write(pb.ExchangeMsg(header=t.header(peer, payload=payload)))
        if rng.random() < 0.5:
            await call.done_writing()  # else: silence, the node's timeout must end it
        return await drain(call, expect_bad=False)
    name, codec, block, payload, crc_ok = bad_payload(rng, t)
    header = t.header(peer, codec, block, payload)
    if not crc_ok:
        header.payload_crc32 ^= 1
    await call.write(pb.ExchangeMsg(header=header))
    for start in range(0, len(payload), 1 << 20):
        await call.write(pb.ExchangeMsg(chunk=pb.Chunk(data=payload[start:start + (1 << 20)])))
    return await drain(call, expect_bad=True)


async def drain(call, expect_bad: bool) -> str:
    """Read until the node ends the stream; 'accepted-bad' if it sends Ready to a bad payload."""
    try:
        async with asyncio.timeout(STREAM_DEADLINE_S):
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF or msg is None:
                    return "ended"
                if isinstance(msg, bytes):
                    continue
                kind = msg.WhichOneof("kind")
                if kind == "ready" and expect_bad:
                    call.cancel()
                    return "accepted-bad"
                if kind in ("abort", "reject"):
                    call.cancel()
                    return f"refused-{kind}"
    except TimeoutError:
        call.cancel()
        return "hang"
    except grpc.RpcError as exc:
        code = exc.code()
        SAMPLES.setdefault(code.name, str(exc.details())[:160])
        return "hang" if code == grpc.StatusCode.DEADLINE_EXCEEDED else f"rpc-{code.name}"


async def fuzz(endpoint: str, numel: int, streams: int, concurrency: int,
               seed: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(endpoint, options=[
            ("grpc.max_send_message_length", 8 << 20)]) as channel:
        info = await pb_grpc.GossipStub(channel).Info(pb.InfoRequest(), timeout=10)
        target = Target(info, numel)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(streams):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                rng = random.Random(seed * 1_000_003 + i)
                try:
                    counts[await one_stream(channel, rng, target, i)] += 1
                except grpc.RpcError as exc:
                    counts[f"rpc-{exc.code().name}"] += 1
                except asyncio.InvalidStateError:  # the node ended it while we still wrote
                    counts["ended-early"] += 1
                if (i + 1) % 500 == 0:
                    print(f"  {i + 1} streams ...", flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    flags = NODE_FLAGS
    with tempfile.TemporaryDirectory() as tmp:
        node = NodeChild("target", Path(tmp), flags)
        try:
            node.wait_up(180)
            before = node.info()
            numel = node.download_state(before.run_id)[1].numel()
            t0 = time.monotonic()
            counts = asyncio.run(fuzz(node.endpoint, numel, args.streams, args.concurrency,
                                      args.seed))
            took = time.monotonic() - t0
            crashed = not node.alive
            try:
                after = node.info(timeout_s=10)
            except grpc.RpcError:
                crashed, after = True, before
        finally:
            node.stop(30)
        err = node.err.read_text(errors="replace")
    hangs, bad = counts["hang"], counts["accepted-bad"]
    print(f"fuzz: {sum(counts.values())} streams in {took:.0f} s against a live node "
          f"({numel:,} params), seed {args.seed}")
    print(f"crashes {int(crashed)}  hangs {hangs}  accepted-bad {bad}")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for code, details in sorted(SAMPLES.items()):
        print(f"  e.g. {code}: {details!r}")
    print(f"node trained {after.step - before.step} steps meanwhile; committed exchanges "
          f"{after.exchanges_ok_responder}; tracebacks in its log {err.count('Traceback')}; "
          f"forged log lines {err.count(chr(10) + 'INFO forged')}")
    sys.exit(1 if crashed or hangs or bad or after.exchanges_ok_responder else 0)


if __name__ == "__main__":
    main()
