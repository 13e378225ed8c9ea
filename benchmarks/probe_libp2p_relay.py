"""What hivemind's libp2p daemon relays between two nodes behind routers (why the project does
not carry exchanges over it; docs/architecture.md "Paths between nodes").

    python -m benchmarks.probe_libp2p_relay [--tries 5] [--mib 1]

In a :class:`benchmarks.tools.netns.NatNetwork` (one public host, two homes behind MASQUERADE
routers), a public ``p2pd`` serves circuit relay v2 (reachability forced public; relay limits
raised to 1 GiB and 30 minutes by its flags, or hivemind's defaults with ``--default-limits``), home A reserves a slot there (static relay,
reachability forced private), and home B opens a stream to A through the relay and writes
``--mib`` MiB, ``--tries`` times. It prints the bytes A received per try and the path of each
stream, then whether any stream was upgraded to a direct (hole-punched) connection.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.tools.netns import NatNetwork, nat_unavailable

_NODE = r'''
import asyncio, json, sys, time
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr
role, addr, work = sys.argv[1], sys.argv[2], sys.argv[3]
relay_flags = {} if open(f"{work}/defaults").read() == "1" else {
    "relayDataLimit": 1 << 30, "relayTimeLimit": "1800s"}
quic = open(f"{work}/quic").read() == "1"

def daemon_maddr(text):  # /p2p/ values as bare multihashes, as go-multiaddr reads them
    head, *rest = text.split("/p2p/")
    data = Multiaddr(head).to_bytes()
    for seg in rest:
        peer, _, tail = seg.partition("/")
        digest = PeerID.from_base58(peer).to_bytes()
        data += b"\xa5\x03" + bytes([len(digest)]) + digest
        if tail:
            data += Multiaddr("/" + tail).to_bytes()
    return Multiaddr(data)

class Host(P2P):
    @staticmethod
    def _make_process_args(*a, **k):
        if "trustedRelays" in k:
            k["relayDiscovery"] = False
        if k.get("forceReachabilityPublic"):
            k.update(relay_flags)
        return P2P._make_process_args(*a, **k)

async def main():
    if role == "relay":
        p = await Host.create(host_maddrs=[f"/ip4/{addr}/tcp/4001"] + (
                                  [f"/ip4/{addr}/udp/4001/quic-v1"] if quic else []),
                              force_reachability="public",
                              check_if_identity_free=False)
        print(json.dumps({"id": p.peer_id.to_base58()}), flush=True)
        await asyncio.sleep(3600)
    info = json.loads(open(f"{work}/relay.json").read())
    relay = f"/ip4/{info['addr']}/tcp/4001/p2p/{info['id']}"
    p = await Host.create(initial_peers=[relay], host_maddrs=["/ip4/0.0.0.0/tcp/4001"] + (
                              ["/ip4/0.0.0.0/udp/4001/quic-v1"] if quic else []),
                          use_auto_relay=True, trusted_relays=[relay],
                          force_reachability="private", check_if_identity_free=False)
    if role == "a":
        print(json.dumps({"id": p.peer_id.to_base58()}), flush=True)
        async def handler(stream, reader, writer):
            n = 0
            try:
                while d := await reader.read(65536):
                    n += len(d)
            except Exception:
                pass
            print(json.dumps({"received": n, "path": str(stream.addr)}), flush=True)
        await p.add_binary_stream_handler("/probe", handler)
        await asyncio.sleep(3600)
    a = PeerID.from_base58(json.loads(open(f"{work}/a.json").read())["id"])
    mib, tries = int(sys.argv[4]), int(sys.argv[5])
    await asyncio.sleep(5)  # A's reservation
    for _ in range(tries):
        await p._client.connect(a, [daemon_maddr(relay + "/p2p-circuit")])
        _, r, w = await p.call_binary_stream_handler(a, "/probe")
        try:
            for _ in range(mib * 16):
                w.write(b"x" * 65536)
                await w.drain()
        except Exception:
            pass
        w.close()
        await asyncio.sleep(2)
    direct = [str(x) for peer in await p.list_peers() if peer.peer_id == a for x in peer.addrs]
    print(json.dumps({"connections_to_a": direct}), flush=True)
asyncio.run(main())
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--mib", type=int, default=1)
    parser.add_argument("--quic", action="store_true", help="every host also listens on QUIC")
    parser.add_argument("--default-limits", action="store_true",
                        help="the relay without the flags that raise its limits (hivemind's)")
    args = parser.parse_args(argv)
    reason = nat_unavailable()
    if reason is not None:
        print(f"probe_libp2p_relay: {reason}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="probe-libp2p-"))
    script = work / "node.py"
    script.write_text(_NODE)
    (work / "defaults").write_text("1" if args.default_limits else "0")
    (work / "quic").write_text("1" if args.quic else "0")
    procs: list[subprocess.Popen[str]] = []
    with NatNetwork([None], [[None], [None]]) as net:
        try:
            def run(role: str, host, *extra: str) -> subprocess.Popen[str]:
                proc = subprocess.Popen(host.cmd([sys.executable, str(script), role, host.addr,
                                                  str(work), *extra]),
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True)
                procs.append(proc)
                return proc

            relay = run("relay", net.public[0])
            assert relay.stdout is not None
            first = json.loads(relay.stdout.readline())
            (work / "relay.json").write_text(json.dumps({**first, "addr": net.public[0].addr}))
            a = run("a", net.homes[0][0])
            assert a.stdout is not None
            (work / "a.json").write_text(a.stdout.readline())
            b = run("b", net.homes[1][0], str(args.mib), str(args.tries))
            out, _ = b.communicate(timeout=60 + 10 * args.tries)
            time.sleep(1)
            a.terminate()
            received = [json.loads(line) for line in a.communicate(timeout=10)[0].splitlines()]
        finally:
            for proc in procs:
                proc.kill()
    sent = args.mib << 20
    print(f"{len(received)} streams from B to A through the public relay, {sent} bytes written "
          "each:")
    for r in received:
        print(f"  received {r['received']:>8} bytes ({r['received'] / sent:.1%}) via {r['path']}")
    print(f"B's connections to A at the end: {json.loads(out.splitlines()[-1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
