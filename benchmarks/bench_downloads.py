"""DownloadState under concurrent requests: the donor's resident memory (issue 9).

A donor process serves the state of an ``--numel``-parameter node (public iterate + memory,
float32) over gRPC on loopback; this process runs ``--clients`` concurrent downloads and
checks each received state bit for bit. Printed: the donor's RSS before, its peak during the
downloads (kernel VmHWM, reset after start-up), how many downloads were served and how many
were answered BUSY, for ``--max-downloads`` values. Before issue 9, 20 downloads of a 6.4M
node took it from 0.7 GB to 2.9 GB (one serialized copy per request).

Run: ``python -m benchmarks.bench_downloads [--numel 6400000] [--clients 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import torch

from gasloc_p2p.core.outer import MixedMomentum
from gasloc_p2p.node.config import NetworkConfig
from gasloc_p2p.node.transport.service import (
    GossipServicer,
    PeerChannels,
    ServeLimits,
    StateSnapshot,
    download_state,
    start_server,
)
from gasloc_p2p.node.transport.tls import fetch_certificate
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.certs import TlsIdentity
from gasloc_p2p.protocol.messages import BUSY, ExchangeError, Identity

RUN, FINGERPRINT = "bench", "b" * 64


def state(numel: int) -> StateSnapshot:
    gen = torch.Generator().manual_seed(1)
    return StateSnapshot(1, 2, "mixed", torch.randn(numel, generator=gen),
                         {"zprev": torch.randn(numel, generator=gen)})


def vm(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


async def donor(numel: int, limit: int) -> None:
    params = state(numel)  # the node's own buffers (the snapshot function copies them)

    def take() -> StateSnapshot:
        return StateSnapshot(params.step, params.rounds, params.outer, params.params.clone(),
                             {k: t.clone() for k, t in params.state.items()})

    servicer = GossipServicer(Identity(RUN, FINGERPRINT, "donor"), None,  # type: ignore[arg-type]
                              lambda: pb.InfoReply(), take, limits=ServeLimits(max_downloads=limit))
    server, port = await start_server(servicer, "127.0.0.1", 0, NetworkConfig(),
                                      TlsIdentity.generate("donor"))
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await server.stop(0)


async def clients(port: int, numel: int, n: int) -> tuple[int, int]:
    channels = PeerChannels(NetworkConfig())
    me = Identity.keyed(RUN, FINGERPRINT, Signer())  # state requests are signed
    want = state(numel)
    endpoint = f"127.0.0.1:{port}"
    stub = channels.stub(endpoint, fetch_certificate(endpoint))
    try:
        outer = MixedMomentum(0.7, 0.5)  # the joiners' own (the donor's: "mixed")
        results = await asyncio.gather(*(download_state(stub, me, 120.0, outer=outer)
                                         for _ in range(n)), return_exceptions=True)
    finally:
        await channels.close()
    ok = busy = 0
    for r in results:
        if isinstance(r, ExchangeError) and r.code == BUSY:
            busy += 1
        elif isinstance(r, BaseException):
            raise r
        else:
            assert torch.equal(r[1], want.params)
            assert torch.equal(r[2]["zprev"], want.state["zprev"])
            ok += 1
    return ok, busy


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=6_400_000)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--limits", default="2,20", help="max_downloads values to run")
    p.add_argument("--donor", nargs=2, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.donor:
        asyncio.run(donor(*args.donor))
        return 0
    mb = 8 * args.numel / 1e6
    print(f"donor state {mb:.0f} MB (public iterate + memory, {args.numel:,} parameters), "
          f"{args.clients} concurrent downloads")
    for limit in (int(x) for x in args.limits.split(",")):
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_downloads", "--donor", str(args.numel),
                                 str(limit)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            port = int(proc.stdout.readline())
            before = vm(proc.pid, "VmRSS")
            with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
                f.write("5")
            ok, busy = asyncio.run(clients(port, args.numel, args.clients))
            peak = vm(proc.pid, "VmHWM")
            print(f"max_downloads {limit:>3}: served {ok:>3}, BUSY {busy:>3}; donor RSS "
                  f"{before / 1e6:.0f} MB -> peak {peak / 1e6:.0f} MB (+{(peak - before) / 1e6:.0f} "
                  f"MB = {(peak - before) / 1e6 / mb:.2f} x the state)", flush=True)
            proc.stdin.write("\n")
            proc.stdin.flush()
            proc.wait(timeout=30)
        finally:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
