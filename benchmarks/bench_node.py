"""Node benchmark: a gossip exchange over loopback against a raw gRPC stream of the same bytes.

Usage: python -m benchmarks.bench_node [--numel 10000000] [--repeats 3] [--threads 2]
                                       [--train-window-s 20] [--skip-training]

The responder runs in a child process (a real gRPC server on 127.0.0.1:0 that also serves a
raw bidirectional byte stream); the initiator in this process. For each codec it prints:
- the exchange wall time (snapshot, encode, both payloads on one stream, check, commit) and the
  time of a raw chunked gRPC stream moving the same payload bytes both ways, measured in the
  same run; their ratio is the protocol's throughput relative to the bare transport;
- the bytes on the wire per exchange and direction (every serialized message plus gRPC's 5-byte
  frame prefix) as a ratio to fp32 (targets: int8 <= 0.27, 4-bit <= 0.14).
Then (unless --skip-training) the training throughput of a `gasloc-node join` process (default
model, torch threads 1) in a 2-node swarm as a ratio to the same node alone (target >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.flat import whole
from gasloc_p2p.node.config import GossipConfig, NetworkConfig
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.transport.exchange import GossipTransport
from gasloc_p2p.node.transport.gate import Gate, GateLimits
from gasloc_p2p.node.transport.service import GossipServicer, StateSnapshot, grpc_options
from gasloc_p2p.node.transport.tls import secure_channel, server_credentials
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.certs import TlsIdentity
from gasloc_p2p.protocol.engine import ExchangeEngine
from gasloc_p2p.protocol.messages import (
    MAX_CHUNK_BYTES,
    Identity,
)
from gasloc_p2p.tools.nodes import NodeChild

CODECS = ("fp32", "fp16", "int8", "int4", "fp4")
RAW_METHOD = "/bench.Raw/Stream"
GRPC_FRAME = 5  # gRPC length-prefixed message header, bytes


def bench_signer(name: str) -> Signer:
    """A key derived from ``name``: the initiator knows the responder's (key-derived) peer id."""
    return Signer.from_private_bytes(hashlib.sha256(name.encode()).digest())


def build_side(name: str, numel: int, seed: int) -> tuple[GossipTransport, Identity]:
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(numel, generator=gen)
    theta = theta0 + 0.01 * torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    outer = AsyncConfig()
    state = AsyncGaslocState(theta, theta0, outer)
    engine = ExchangeEngine(state, theta0, [whole(numel)], TrainingLock())
    me = Identity.keyed("bench", "f" * 64, bench_signer(name))
    # the guard off: these vectors do not train, so there is no drift to judge an update by
    # (with it on, every exchange was refused BUSY)
    gossip = GossipConfig(header_timeout_s=60, chunk_timeout_s=60, commit_timeout_s=60,
                          exchange_timeout_s=300, guard_factor=0)
    return GossipTransport(me, engine, gossip, outer), me


async def _raw_handler(request_iterator: Any, context: Any) -> None:
    """Echo the volume: read the client's bytes while sending as many back (1 MiB chunks)."""
    first = await context.read()
    total = int(first.decode())
    chunk = bytes(MAX_CHUNK_BYTES)

    async def send() -> None:
        for start in range(0, total, MAX_CHUNK_BYTES):
            await context.write(chunk[: min(MAX_CHUNK_BYTES, total - start)])

    sender = asyncio.ensure_future(send())
    got = 0
    while got < total:
        got += len(await context.read())
    await sender


async def _serve(numel: int, port_queue: Any, stop: Any) -> None:
    exchanger, me = build_side("responder", numel, 2)
    state = exchanger.engine.state
    servicer = GossipServicer(me, exchanger, lambda: pb.InfoReply(), lambda: StateSnapshot(
        0, 0, state.outer.name, state.public_iterate(), state.outer.state_dict()))
    net = NetworkConfig()
    server = grpc.aio.server(options=grpc_options(net, server=True))
    pb_grpc.add_GossipServicer_to_server(servicer, server)
    raw = grpc.stream_stream_rpc_method_handler(_raw_handler)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Raw", {"Stream": raw}),))
    tls = TlsIdentity.generate(me.peer_id)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    await server.start()
    gate = Gate(GateLimits(), ("127.0.0.1", port))  # the node's front door, as a node runs it
    gated = await gate.start("127.0.0.1", 0)
    port_queue.put((port, gated, tls.cert_der))
    while not stop.is_set():
        await asyncio.sleep(0.1)
    await server.stop(0)
    await gate.close()


def serve(numel: int, threads: int, port_queue: Any, stop: Any) -> None:
    torch.set_num_threads(threads)
    asyncio.run(_serve(numel, port_queue, stop))


class CountingCall:
    """Wraps an Exchange call and counts the initiator's bytes on the wire."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.sent = 0

    async def write(self, msg: pb.ExchangeMsg) -> None:
        self.sent += msg.ByteSize() + GRPC_FRAME
        await self.call.write(msg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.call, name)


async def raw_seconds(channel: grpc.aio.Channel, nbytes: int) -> float:
    call = channel.stream_stream(RAW_METHOD)()
    chunk = bytes(MAX_CHUNK_BYTES)
    start = time.perf_counter()
    await call.write(str(nbytes).encode())

    async def send() -> None:
        for offset in range(0, nbytes, MAX_CHUNK_BYTES):
            await call.write(chunk[: min(MAX_CHUNK_BYTES, nbytes - offset)])
        await call.done_writing()

    sender = asyncio.ensure_future(send())
    got = 0
    while got < nbytes:
        got += len(await call.read())
    await sender
    await call.code()
    return time.perf_counter() - start


async def gate_cost(numel: int, repeats: int, direct: str, gated: str, cert: bytes
                    ) -> dict[str, tuple[float, float]]:
    """The best int8 exchange and raw-stream times straight to the gRPC server and through
    the gate in front of it (a node's port), alternating, in one run."""
    exchanger, _ = build_side("initiator", numel, 1)
    exchanger.cfg = GossipConfig(codec="int8", header_timeout_s=60, chunk_timeout_s=60,
                                 commit_timeout_s=60, exchange_timeout_s=300, guard_factor=0)
    channels = {name: secure_channel(ep, cert, grpc_options(NetworkConfig(), False))
                for name, ep in (("direct", direct), ("gate", gated))}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in channels}
    for _ in range(repeats):
        for name, channel in channels.items():
            stub = pb_grpc.GossipStub(channel)
            start = time.perf_counter()
            outcome = await exchanger.initiate(lambda s=stub: s.Exchange(timeout=300),
                                               bench_signer("responder").peer_id, 0)
            took = time.perf_counter() - start
            times[name].append((took, await raw_seconds(channel, outcome.bytes_sent)))
    for channel in channels.values():
        await channel.close()
    return {name: (min(t for t, _ in rows), min(r for _, r in rows))
            for name, rows in times.items()}


async def bench(numel: int, repeats: int, endpoint: str, cert: bytes) -> list[dict[str, Any]]:
    exchanger, _ = build_side("initiator", numel, 1)
    channel = secure_channel(endpoint, cert, grpc_options(NetworkConfig(), False))
    stub = pb_grpc.GossipStub(channel)
    rows = []
    for codec in CODECS:
        exchanger.cfg = GossipConfig(codec=codec, header_timeout_s=60, chunk_timeout_s=60,
                                     commit_timeout_s=60, exchange_timeout_s=300, guard_factor=0)
        calls: list[CountingCall] = []

        def open_call(calls: list[CountingCall] = calls) -> CountingCall:
            calls.append(CountingCall(stub.Exchange(timeout=300)))
            return calls[-1]

        ex_times, raw_times = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            outcome = await exchanger.initiate(open_call, bench_signer("responder").peer_id, 0)
            ex_times.append(time.perf_counter() - start)
            raw_times.append(await raw_seconds(channel, outcome.bytes_sent))
        rows.append({"codec": codec, "payload": outcome.bytes_sent, "wire": calls[-1].sent,
                     "exchange_s": min(ex_times), "raw_s": min(raw_times)})
    await channel.close()
    return rows


def start_node(name: str, tmp: Path, flags: list[str]) -> NodeChild:
    return NodeChild(name, tmp, ["--host", "127.0.0.1", "--torch-threads", "1",
                                 "--no-init-from-swarm", *flags],
                     env={"HIVEMIND_LOGLEVEL": "ERROR"})


def steps_per_s(node: NodeChild, window_s: float) -> tuple[float, int]:
    """Inner steps per second over ``window_s`` after a warm-up; also the exchanges done."""
    while node.info().step < 20:  # past start-up and the first evaluation
        time.sleep(0.5)
    first, t0 = node.info(), time.monotonic()
    time.sleep(window_s)
    last, t1 = node.info(), time.monotonic()
    return (last.step - first.step) / (t1 - t0), _exchanges(last) - _exchanges(first)


def _exchanges(info: pb.InfoReply) -> int:
    return int(info.exchanges_ok_initiator + info.exchanges_ok_responder)


def training_ratio(window_s: float, data: str) -> None:
    """Node A alone, then A with a gossiping partner B: A's steps/s ratio."""
    flags = ["--data", data] if data else []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        alone = start_node("alone", tmp, flags)
        try:
            alone.wait_up(120)
            solo, _ = steps_per_s(alone, window_s)
        finally:
            alone.stop(30)
        a = start_node("a", tmp, flags)
        b = None
        try:
            peers = a.join_peers(120)
            b = start_node("b", tmp, [*flags, "--peers", *peers])
            a.wait_up(120)
            while _exchanges(a.info()) < 1:  # measure once gossip is under way
                time.sleep(0.5)
            pair, exchanges = steps_per_s(a, window_s)
        finally:
            a.stop(30)
            if b is not None:
                b.stop(30)
    print(f"training throughput, default model, torch threads 1, {window_s:g} s windows: alone "
          f"{solo:.2f} steps/s, in a 2-node swarm {pair:.2f} steps/s ({exchanges} exchanges in "
          f"the window): ratio {pair / solo:.2f} (target >= 0.9)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side")
    parser.add_argument("--train-window-s", type=float, default=20.0)
    parser.add_argument("--data", default="", help="corpus for the training part "
                        "(default: Shakespeare, downloaded once)")
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=serve, args=(args.numel, args.threads, ports, stop), daemon=True)
    child.start()
    try:
        port, gated, cert = ports.get(timeout=120)
        rows = asyncio.run(bench(args.numel, args.repeats, f"127.0.0.1:{port}", cert))
        gate = asyncio.run(gate_cost(args.numel, args.repeats, f"127.0.0.1:{port}",
                                     f"127.0.0.1:{gated}", cert))
    finally:
        stop.set()
        child.join(10)
        if child.is_alive():
            child.kill()
    fp32_wire = next(r["wire"] for r in rows if r["codec"] == "fp32")
    print(f"gossip exchange of a {args.numel:,}-parameter vector over loopback "
          f"(responder in another process, torch threads {args.threads}, best of "
          f"{args.repeats})")
    print(f"{'codec':<6} {'payload MB':>10} {'wire B/exchange/dir':>20} {'wire vs fp32':>12} "
          f"{'exchange s':>10} {'raw stream s':>12} {'throughput vs raw':>17}")
    for r in rows:
        print(f"{r['codec']:<6} {r['payload'] / 1e6:>10.2f} {r['wire']:>20,} "
              f"{r['wire'] / fp32_wire:>12.3f} {r['exchange_s']:>10.3f} {r['raw_s']:>12.3f} "
              f"{r['raw_s'] / r['exchange_s']:>17.2f}")
    print("throughput vs raw = raw stream time / exchange time for the same payload bytes both "
          "ways (1.0 = protocol and tensor work cost nothing); raw fp32 stream "
          f"{2 * rows[0]['payload'] / rows[0]['raw_s'] / 1e6:.0f} MB/s both directions")
    (ex_d, raw_d), (ex_g, raw_g) = gate["direct"], gate["gate"]
    print(f"through the gate (a node's port relays to its gRPC server): int8 exchange "
          f"{ex_g:.3f} s against {ex_d:.3f} s straight to the server ({ex_g / ex_d:.3f}x); "
          f"raw stream {raw_g:.3f} s against {raw_d:.3f} s ({raw_g / raw_d:.3f}x)")
    if not args.skip_training:
        training_ratio(args.train_window_s, args.data)


if __name__ == "__main__":
    main()
