"""Attacks on a swarm's reachability: does gossip go on while an attacker floods the peer
list with dead records, with tarpits, or holds the nodes' pre-authentication slots?

Usage: python -m benchmarks.bench_poison [--attack records|tarpits|preauth] [--nodes 3]
       [--fakes 20] [--window-s 60]

Starts ``--nodes`` real `gasloc-node join` processes (tiny model, 1 torch thread, under `nice`)
on loopback, then measures the swarm's exchange rate (committed exchanges, summed over the
nodes' Info) in three windows of ``--window-s`` seconds:

1. clean;
2. attacked, by ``--attack``:

   - ``records``: a hivemind DHT of the attacker's, joined to the swarm's DHT, publishes
     ``--fakes`` records, each validly signed by a key of its own (the nodes run an open
     swarm, ``--open``: anyone can mint keys), compatible with the swarm (fingerprint, codecs
     and version copied from a real record), announcing a huge step, and each pointing at its
     own closed port on 127.0.0.1; and it tries to overwrite every real node's record
     (another endpoint at a closed port, a 1000 s expiration, the owner's signature reused).
     It re-publishes every 5 s;
   - ``tarpits``: the same records, each at a port that accepts TCP and never answers (the
     TLS handshake hangs), 150 of them by default;
   - ``preauth``: 15 Exchange streams held open on every node from 5 source addresses
     (127.0.0.2-6, 3 each), never sending a Header, each re-opened as soon as the node drops
     it;
3. after: the attacker has left.

Prints the rates (per minute, and per 100 training steps: gossip events follow the steps, so
that one does not move with the machine's load) and a verdict: exchanges per step during the
attack at least ``MIN_SHARE`` of the clean rate (0.5 for records and tarpits, 0.8 for
pre-authentication slots), and again after it. Exit code 1 if not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.swarm_eval import flags
from gasloc_p2p.node.discovery.base import PeerInfo, run_key
from gasloc_p2p.node.discovery.records import signed_value
from gasloc_p2p.node.transport.tls import fetch_certificate, secure_channel
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.certs import TlsIdentity
from gasloc_p2p.tools.nodes import NodeChild

KEY = run_key("gasloc")
MAX_TTL_S = 2 * 20.0  # 2 x --announce-ttl-s (default 20 s): longer records are refused
MIN_SHARE = {"records": 0.5, "tarpits": 0.5, "preauth": 0.8}


def niced(name: str, log_dir: Path, node_flags: list[str]) -> NodeChild:
    """A node in an open swarm (anyone can mint keys: the attacks below), under ``nice``."""
    return NodeChild(name, log_dir, [*node_flags, "--open"], prefix=("nice", "-n", "5"))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def committed(nodes: list[NodeChild]) -> tuple[int, int]:
    """Exchanges committed so far, counted once (by their initiator), and training steps."""
    infos = [n.info(timeout_s=10) for n in nodes]
    return sum(int(i.exchanges_ok_initiator) for i in infos), sum(int(i.step) for i in infos)


def rate(nodes: list[NodeChild], window_s: float) -> tuple[float, float]:
    """Exchanges per minute and per 100 training steps (gossip events follow the steps, so
    the second does not move with the machine's load) during ``window_s``."""
    x0, s0 = committed(nodes)
    time.sleep(window_s)
    x1, s1 = committed(nodes)
    return (x1 - x0) / window_s * 60, 100 * (x1 - x0) / max(s1 - s0, 1)


class Attacker:
    """A plain hivemind DHT (no validator) joined to the swarm, re-publishing poison."""

    def __init__(self, initial_peers: list[str], fakes: int, tarpits: bool = False) -> None:
        import hivemind

        self.dht = hivemind.DHT(initial_peers=initial_peers,
                                host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        self.fakes = [Signer() for _ in range(fakes)]
        # a fake record must name a certificate for its own id to be accepted at all
        self.certs = {s.peer_id: TlsIdentity.generate(s.peer_id).cert_der for s in self.fakes}
        # tarpits: ports that complete TCP handshakes (the kernel's backlog), never answer
        self.pits = [tarpit() for _ in range(fakes)] if tarpits else []
        self.ports = ([p.getsockname()[1] for p in self.pits] if tarpits
                      else [closed_port() for _ in range(fakes)])
        self.stop = threading.Event()
        self.published = 0

    def real_records(self) -> dict[str, Any]:
        found = self.dht.get(KEY, latest=True)
        values = getattr(found, "value", None) or {}
        return {k: v.value for k, v in values.items() if isinstance(v.value, dict)}

    def publish(self) -> None:
        from hivemind.utils import get_dht_time

        real = self.real_records()  # this DHT has no validator: forged ones may come back
        real = {k: v for k, v in real.items() if v.get("expires", 0) < get_dht_time() + 500}
        if not real:
            return
        template = PeerInfo.from_value(*next(iter(real.items())))
        assert template is not None
        now, stores = get_dht_time(), []
        for signer, port in zip(self.fakes, self.ports, strict=True):
            info = PeerInfo(signer.peer_id, f"127.0.0.1:{port}", template.protocol_version,
                            template.fingerprint, 10**9, 1e6, True, template.codecs,
                            template.algorithm, self.certs[signer.peer_id])
            expires = now + 0.9 * MAX_TTL_S  # the longest a node accepts
            stores.append(self.dht.store(KEY, signed_value(KEY, info, signer, expires),
                                         expires, subkey=signer.peer_id, return_future=True))
        for peer_id, value in real.items():  # overwrite attempts: the owner's old signature
            forged = {**value, "endpoint": f"127.0.0.1:{closed_port()}", "expires": now + 1000}
            stores.append(self.dht.store(KEY, forged, now + 1000, subkey=peer_id,
                                         return_future=True))
        for future in stores:
            future.result(timeout=60)
        self.published += 1

    def run(self) -> None:
        while not self.stop.wait(5.0):
            self.publish()

    def close(self) -> None:
        self.stop.set()
        self.dht.shutdown()
        for pit in self.pits:
            pit.close()


def tarpit() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4096)
    return s


class IdleStreams:
    """Holds ``per_address`` idle Exchange streams on each node from each of ``addresses``
    source addresses (127.0.0.2...), re-opening each one the node drops. It runs in a child
    process at the lowest priority (``nice 19``): on a real network the attacker's CPU is its
    own, here it shares the nodes' cores. gRPC cannot pick a source address, so each address
    is a local TCP relay that connects to the node from it (TLS passes through: the node's
    certificate is pinned)."""

    def __init__(self, endpoints: list[str], addresses: int = 5, per_address: int = 3) -> None:
        ctx = mp.get_context("spawn")  # the parent has used gRPC: no fork
        self._opened = ctx.Value("q", 0)
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_idle_main, args=(
            endpoints, addresses, per_address, self._opened, self._stop), daemon=True)

    @property
    def opened(self) -> int:
        return int(self._opened.value)

    def start(self) -> None:
        self._proc.start()

    def close(self) -> None:
        self._stop.set()
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()


def _idle_main(endpoints: list[str], addresses: int, per_address: int, opened: Any,
               stop: Any) -> None:
    os.nice(19)
    asyncio.run(_idle(endpoints, addresses, per_address, opened, stop))


async def _idle(endpoints: list[str], addresses: int, per_address: int, opened: Any,
                stop: Any) -> None:
    done = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.2)
        done.set()

    async def hold(via: str, cert: bytes) -> None:
        async with secure_channel(via, cert) as channel:
            stub = pb_grpc.GossipStub(channel)
            while not done.is_set():
                call = stub.Exchange(timeout=60)
                with opened.get_lock():
                    opened.value += 1
                reader = asyncio.ensure_future(call.read())
                ended = asyncio.ensure_future(done.wait())
                await asyncio.wait([reader, ended], return_when=asyncio.FIRST_COMPLETED)
                call.cancel()
                for task in (reader, ended):
                    task.cancel()
                await asyncio.gather(reader, ended, return_exceptions=True)

    jobs = [watch()]
    for endpoint in endpoints:
        cert = await asyncio.to_thread(fetch_certificate, endpoint)
        host, port = endpoint.rsplit(":", 1)
        for a in range(addresses):
            relay = await asyncio.start_server(functools.partial(
                _relay, (host, int(port)), f"127.0.0.{2 + a}"), "127.0.0.1", 0)
            via = f"127.0.0.1:{relay.sockets[0].getsockname()[1]}"
            jobs += [hold(via, cert) for _ in range(per_address)]
    await asyncio.gather(*jobs)


async def _relay(target: tuple[str, int], source: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    up_r, up_w = await asyncio.open_connection(*target, local_addr=(source, 0))

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    with contextlib.suppress(asyncio.CancelledError):  # the attacker stops: so do its relays
        await asyncio.gather(pump(reader, up_w), pump(up_r, writer))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attack", choices=tuple(MIN_SHARE), default="records")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--fakes", type=int, default=0,
                   help="fake records (default: 20, or 150 tarpits)")
    p.add_argument("--window-s", type=float, default=60.0)
    args = p.parse_args()
    args.fakes = args.fakes or (150 if args.attack == "tarpits" else 20)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        nodes: list[NodeChild] = []
        try:
            base = flags({"eval_interval_steps": 1000, "metrics_port": -1,
                          "dht_start_timeout_s": 120.0})
            nodes.append(niced("n0", tmp, base))
            peers = nodes[0].join_peers(180)
            nodes += [niced(f"n{i}", tmp, [*base, "--peers", *peers])
                      for i in range(1, args.nodes)]
            for node in nodes:
                node.wait_up(180)
            time.sleep(30)  # every node has found the others, evaluated and exchanged
            clean = rate(nodes, args.window_s)
            attacked, what = attack(args, peers, nodes)
            after = rate(nodes, args.window_s)
            share = MIN_SHARE[args.attack]
            ok = attacked[1] >= share * clean[1] and after[1] >= share * clean[1]
            print(f"{args.attack}: {args.nodes} nodes; {what}")
            for unit, i in (("per minute", 0), ("per 100 training steps", 1)):
                print(f"  exchanges {unit}: clean {clean[i]:.1f}, attacked {attacked[i]:.1f} "
                      f"({attacked[i] / max(clean[i], 1e-9):.2f}x), after {after[i]:.1f} "
                      f"({after[i] / max(clean[i], 1e-9):.2f}x)")
            print(f"verdict: {'PASS' if ok else 'FAIL'} (exchanges per step at least "
                  f"{share:g}x the clean rate during and after the attack)")
            return 0 if ok else 1
        finally:
            print(f"exit codes after SIGTERM: {[stop(n) for n in nodes]}")


def attack(args: argparse.Namespace, peers: list[str], nodes: list[NodeChild]
           ) -> tuple[tuple[float, float], str]:
    """The exchange rate during ``args.attack``, and what the attacker did."""
    if args.attack == "preauth":
        idle = IdleStreams([n.endpoint for n in nodes])
        idle.start()
        try:
            attacked = rate(nodes, args.window_s)
        finally:
            idle.close()
        return attacked, (f"15 idle streams per node from 5 source addresses, {idle.opened} "
                          "opened (each re-opened when the node drops it)")
    attacker = Attacker(peers, args.fakes, tarpits=args.attack == "tarpits")
    attacker.publish()
    thread = threading.Thread(target=attacker.run, daemon=True)
    thread.start()
    try:
        attacked = rate(nodes, args.window_s)
        listed = list(nodes[0].info(timeout_s=10).peers)  # candidates not backed off
    finally:
        attacker.close()
    fakes_seen = sum(k in {s.peer_id for s in attacker.fakes} for k in listed)
    where = "a tarpit port (accepts TCP, never answers)" if attacker.pits else "a closed port"
    return attacked, (f"{args.fakes} fake records (each a valid key, {where}, step 1e9) and "
                      f"overwrite attempts of every real record, re-published "
                      f"{attacker.published} times; at the end n0 lists "
                      f"{len(listed) - fakes_seen} real and {fakes_seen} fake peers")


def stop(node: NodeChild, grace_s: float = 30.0) -> int | None:
    """SIGTERM; a node still running after ``grace_s`` prints its stacks (SIGUSR1), is killed."""
    node.terminate()
    try:
        return node.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        node.signal(signal.SIGUSR1)
        time.sleep(2)
        print(f"{node.name} still runs {grace_s:g} s after SIGTERM; its log ends with:\n"
              f"{node.tail(15000)}")
        return node.stop(1)


if __name__ == "__main__":
    sys.exit(main())
