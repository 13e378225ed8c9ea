"""The keepalive settings of the node's gRPC server and channels, on a real connection: a
long-lived call that carries nothing for many keepalive intervals stays up (a relay's Listen
and a hole-punched path are such calls; the server once ended them after three idle pings)."""

from __future__ import annotations

import asyncio
import time

import grpc

from gasloc_p2p.node.config_network import NetworkConfig
from gasloc_p2p.node.transport.service import grpc_options
from tests.node_helpers import run, scaled


def test_a_quiet_long_call_outlives_many_keepalive_pings():
    net = NetworkConfig(keepalive_time_s=1.0, keepalive_timeout_s=0.5)
    quiet_s = 8.0  # eight pings; the server's abuse policy strikes out at the third

    async def hold(request: bytes, context: grpc.aio.ServicerContext):
        await asyncio.sleep(quiet_s)
        yield b"still here"

    async def main() -> tuple[list[bytes], float]:
        server = grpc.aio.server(options=grpc_options(net, server=True))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "test.Quiet", {"Hold": grpc.unary_stream_rpc_method_handler(hold)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(
                    f"127.0.0.1:{port}", options=grpc_options(net, server=False)) as channel:
                t0 = time.monotonic()
                got = [m async for m in channel.unary_stream("/test.Quiet/Hold")(b"")]
                return got, time.monotonic() - t0
        finally:
            await server.stop(0)

    got, took = run(main(), timeout_s=scaled(60))
    assert got == [b"still here"] and took >= quiet_s  # no GOAWAY "too_many_pings" on the way
