"""Someone on the path between a member and a node: what it reads, changes and replays.

Usage: python -m benchmarks.bench_tamper [--exchanges 20]

Starts one real `gasloc-node join` process (tiny model, an open swarm so that a fresh key is a
member) and a TCP relay in front of its gRPC port. A member (its own key, valid signed headers,
the node's own parameters as an int8 payload, a valid Commit) exchanges with the node through
the relay:

1. relayed as is: ``--exchanges`` exchanges, which commit; the relay's capture is searched for
   plaintext (the run id, the member's peer id, any 32 bytes of the payload);
2. relayed with one byte in every 4 KiB flipped after the first 2 KiB (the member's
   direction, then the node's): ``--exchanges`` each, of which the node must commit none;
3. the bytes of a relayed DownloadState request sent again on a new connection: what comes
   back (a replayed request must get no state).

Prints the figures and a verdict (tampered exchanges committed 0, plaintext found 0, replayed
requests answered with state 0); exit code 1 if not. Before protocol 7 an on-path proxy kept a
payload's CRC32 while changing 6.6 KB of it, and 18 of 18 such payloads were committed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # the corrupted records are the point here

from benchmarks.tools.fuzz_member import honest_stream  # noqa: E402 (after the variable)
from benchmarks.tools.fuzz_streams import Target
from benchmarks.tools.proxy import Proxy, replay
from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.node.config import NetworkConfig
from gasloc_p2p.node.transport.service import PeerChannels, download_state
from gasloc_p2p.node.transport.tls import fetch_certificate, secure_channel
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.messages import Identity
from gasloc_p2p.tools.nodes import NodeChild

NODE_FLAGS = ["--host", "127.0.0.1", "--n-layer", "2", "--n-embd", "64", "--seq-len", "64",
              "--batch-size", "8", "--torch-threads", "1", "--metrics-port", "-1",
              "--guard-backoff-s", "0", "--exchanges-per-round", "0"]


async def through(proxy: Proxy, endpoint: str, cert: bytes, target: Target,
                  n: int) -> list[str]:
    """``n`` honest member exchanges with the node, each through ``proxy``."""
    relay = await proxy.start()
    outcomes = []
    try:
        for _ in range(n):
            async with secure_channel(relay, cert) as channel:
                outcomes.append(await honest_stream(channel, target, Signer()))
    finally:
        await proxy.close()
    return outcomes


async def run(node: NodeChild, exchanges: int) -> dict[str, object]:
    info = node.info()
    params = node.download_state(info.run_id)[1]
    target = Target(info.run_id, info.model_fingerprint, params.numel(), 15.0, params)
    endpoint = node.endpoint
    cert = await asyncio.to_thread(fetch_certificate, endpoint)
    host, port = endpoint.rsplit(":", 1)
    addr = (host, int(port))
    out: dict[str, object] = {}

    def committed() -> int:
        return int(node.info().exchanges_ok_responder)

    before = committed()
    honest = Proxy(addr)
    out["honest"] = await through(honest, endpoint, cert, target, exchanges)
    out["honest_committed"] = committed() - before
    payload = target.mirror("int8", 1024)
    markers = [info.run_id.encode(), *(payload[i:i + 32] for i in range(0, len(payload), 4096))]
    out["seen_bytes"] = len(honest.seen)
    out["plaintext"] = sum(m in honest.seen for m in markers)
    for name, up in (("tampered_up", True), ("tampered_down", False)):
        before = committed()
        proxy = Proxy(addr, tamper_after=2048, flip_up=up)
        out[name] = await through(proxy, endpoint, cert, target, exchanges)
        out[name + "_committed"] = committed() - before
        out[name + "_flipped"] = proxy.flipped
    # a state request relayed, then its bytes (TLS records) sent again on a new connection
    recorder = Proxy(addr)
    relay = await recorder.start()
    channels = PeerChannels(NetworkConfig())
    try:
        me = Identity.keyed(info.run_id, info.model_fingerprint, Signer())
        meta, _, _ = await download_state(channels.stub(relay, cert), me, 30.0,
                                          outer=AsyncConfig().outer())  # the node's default
        out["state_bytes"] = int(meta.total_bytes)
    finally:
        await channels.close()
        await recorder.close()
    answers = [await replay(addr, bytes(conn)) for conn in recorder.up]
    out["replayed"] = len(answers)
    out["replay_answers_with_state"] = sum(len(a) > out["state_bytes"] // 2 for a in answers)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--exchanges", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        node = NodeChild("target", Path(tmp), NODE_FLAGS)
        try:
            node.wait_up(180)
            while node.info().rounds < 1:  # before its first round a node answers BUSY
                time.sleep(0.5)
            t0 = time.monotonic()
            r = asyncio.run(run(node, args.exchanges))
            took = time.monotonic() - t0
        finally:
            node.stop(30)
    n = args.exchanges
    print(f"tamper: an on-path relay between a member and a live node, {took:.0f} s")
    print(f"  relayed as is: {r['honest_committed']} of {n} exchanges committed "
          f"({', '.join(sorted(set(r['honest'])))}); the relay saw "
          f"{r['seen_bytes']:,} bytes, plaintext markers found in them: {r['plaintext']} "
          "(the run id, 32-byte runs of the payload)")
    for name, what in (("tampered_up", "the member's bytes"), ("tampered_down",
                                                                "the node's bytes")):
        print(f"  {what} changed ({r[name + '_flipped']} bytes flipped): "
              f"{r[name + '_committed']} of {n} exchanges committed")
    print(f"  a relayed state request replayed on new connections: "
          f"{r['replay_answers_with_state']} of {r['replayed']} answered with state "
          f"({r['state_bytes']:,} B)")
    ok = (r["tampered_up_committed"] == r["tampered_down_committed"] == 0
          and r["plaintext"] == 0 and r["replay_answers_with_state"] == 0
          and r["honest_committed"] == n)
    print(f"verdict: {'PASS' if ok else 'FAIL'} (tampered exchanges committed 0, plaintext "
          "found 0, replayed requests answered with state 0, honest relayed exchanges all "
          "committed)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
