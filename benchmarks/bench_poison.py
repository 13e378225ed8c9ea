"""Attacks on a swarm's reachability: does gossip go on while an attacker floods the peer
list with dead records, with tarpits, or holds what the nodes give callers before they
authenticate?

Usage: python -m benchmarks.bench_poison [--attack records|tarpits|preauth] [--nodes 3]
       [--fakes 20] [--window-s 60] [--windows 2]

Starts ``--nodes`` real `gasloc-node join` processes (tiny model, 1 torch thread, under `nice`)
on loopback, then measures the swarm's exchange rate (committed exchanges, summed over the
nodes' Info).

``records`` and ``tarpits``: three windows of ``--window-s`` seconds (60): clean, attacked,
after the attacker has left.

   - ``records``: a hivemind DHT of the attacker's, joined to the swarm's DHT, publishes
     ``--fakes`` records, each validly signed by a key of its own (the nodes run an open
     swarm, ``--open``: anyone can mint keys), compatible with the swarm (fingerprint, codecs
     and version copied from a real record), announcing a huge step, and each pointing at its
     own closed port on 127.0.0.1; and it tries to overwrite every real node's record
     (another endpoint at a closed port, a 1000 s expiration, the owner's signature reused).
     It re-publishes every 5 s;
   - ``tarpits``: the same records, each at a port that accepts TCP and never answers (the
     TLS handshake hangs), 150 of them by default.

``preauth`` (issue 39): two swarms of ``--nodes`` side by side, so that both see the same
machine load; after a window with neither attacked, every node of one gets, from one address
(127.66.0.1, outside the nodes' 127.0.0.0/24), 100 half-open Info calls (headers, never a
message), 600 silent TCP connections (never a byte) and 15 idle Exchange streams (never a
Header), each re-opened as soon as the node ends it (:class:`PreauthFlood`), for
``--windows`` windows of ``--window-s`` seconds (40). Prints both swarms' exchanges per
window, the members' signed Info calls to the attacked nodes answered, and every node's open
file descriptors over time (``/proc/PID/fd``).

Verdict: exchanges per step during the attack at least ``MIN_SHARE`` of the clean rate (0.5
for records and tarpits, and again after the attack); for preauth, every attacked window's
exchanges at least 0.8x the clean swarm's, every member's Info answered and the open files
within the gate's fixed cap. Exit code 1 if not.
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

import grpc

from benchmarks.swarm_eval import flags
from gasloc_p2p.node.config import NetworkConfig
from gasloc_p2p.node.discovery.base import PeerInfo, run_key
from gasloc_p2p.node.discovery.records import signed_value
from gasloc_p2p.node.transport.gate import FDS_PER_CONNECTION
from gasloc_p2p.node.transport.tls import fetch_certificate, secure_channel
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.certs import TlsIdentity
from gasloc_p2p.tools.nodes import NodeChild

KEY = run_key("gasloc")
MAX_TTL_S = 2 * 20.0  # 2 x --announce-ttl-s (default 20 s): longer records are refused
MIN_SHARE = {"records": 0.5, "tarpits": 0.5, "preauth": 0.8}


def niced(name: str, log_dir: Path, node_flags: list[str]) -> NodeChild:
    """A node in an open swarm (anyone can mint keys: the attacks below), under ``nice``; its
    keys in ``log_dir``, not the user's data folder."""
    return NodeChild(name, log_dir, [*node_flags, "--open", "--identity-file",
                                     str(log_dir / f"{name}.key")], prefix=("nice", "-n", "5"))


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


class PreauthFlood:
    """The issue-39 attack on what callers who proved nothing can hold, from one address
    (``source``, a loopback address outside the nodes' 127.0.0.0/24), on every node at once:
    ``half_open`` Info calls that send their headers and never a message, ``silent`` TCP
    connections that never send a byte, and ``idle`` Exchange streams that never send a
    Header; each re-opened as soon as the node ends it. It runs in a child process at the
    lowest priority (``nice 19``): on a real network the attacker's CPU is its own, here it
    shares the nodes' cores. gRPC cannot pick a source address, so its calls go through a
    local TCP relay that connects from ``source`` (TLS passes through: the node's certificate
    is pinned)."""

    FIELDS = ("calls", "connections", "refused_calls", "channels_ready")

    def __init__(self, endpoints: list[str], source: str = "127.66.0.1", half_open: int = 100,
                 silent: int = 600, idle: int = 15) -> None:
        ctx = mp.get_context("spawn")  # the parent has used gRPC: no fork
        self._counts = ctx.Array("q", len(self.FIELDS))
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_flood_main, args=(
            endpoints, source, half_open, silent, idle, self._counts, self._stop), daemon=True)

    def counts(self) -> dict[str, int]:
        """Calls opened, TCP connections opened, calls the node refused or cut (a status
        other than the deadline's), the calls' connections that were up at the start."""
        return dict(zip(self.FIELDS, self._counts[:], strict=True))

    def start(self) -> None:
        self._proc.start()

    def close(self) -> None:
        self._stop.set()
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()


def _flood_main(endpoints: list[str], source: str, half_open: int, silent: int, idle: int,
                counts: Any, stop: Any) -> None:
    os.nice(19)
    asyncio.run(_flood(endpoints, source, half_open, silent, idle, counts, stop))


async def _flood(endpoints: list[str], source: str, half_open: int, silent: int, idle: int,
                 counts: Any, stop: Any) -> None:
    done = asyncio.Event()

    def count(i: int) -> None:
        with counts.get_lock():
            counts[i] += 1

    async def watch() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.2)
        done.set()

    async def until_done(aw: Any) -> None:
        """Await ``aw`` until it ends or the attack stops."""
        task, ended = asyncio.ensure_future(aw), asyncio.ensure_future(done.wait())
        await asyncio.wait([task, ended], return_when=asyncio.FIRST_COMPLETED)
        for t in (task, ended):
            t.cancel()
        await asyncio.gather(task, ended, return_exceptions=True)

    async def never() -> Any:
        await done.wait()
        yield pb.InfoRequest()  # never reached: headers only

    async def calls(channel: Any, n: int, exchange: bool) -> None:
        stub = pb_grpc.GossipStub(channel)
        info = channel.stream_unary("/gasloc.v1.Gossip/Info",
                                    request_serializer=pb.InfoRequest.SerializeToString,
                                    response_deserializer=pb.InfoReply.FromString)

        async def one() -> None:
            while not done.is_set():
                call = stub.Exchange(timeout=60) if exchange else info(never(), timeout=60)
                count(0)
                await until_done(call.read() if exchange else call)
                if call.done() and await call.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                             grpc.StatusCode.CANCELLED):
                    count(2)
                call.cancel()
                await asyncio.sleep(0.01)  # a call the relay could not connect fails at once

        await asyncio.gather(*(one() for _ in range(n)))

    async def quiet(host: str, port: int) -> None:
        """A silent connection, re-opened when the node closes it; one the node refused at
        once is retried after a second (at once, the retries would take this process's CPU
        from the calls, which cost the node more)."""
        while not done.is_set():
            count(1)
            opened = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection(host, port,
                                                               local_addr=(source, 0))
            except OSError:
                await asyncio.sleep(1.0)
                continue
            await until_done(reader.read())  # ends when the node closes it
            writer.close()
            if time.monotonic() - opened < 0.5:
                await asyncio.sleep(1.0)

    # the calls' connections first, so that the silent ones cannot keep them out: what the
    # node lets one address hold goes to the calls that cost it the most
    jobs, silent_jobs, channels = [watch()], [], []
    for endpoint in endpoints:
        cert = await asyncio.to_thread(fetch_certificate, endpoint)
        host, port = endpoint.rsplit(":", 1)
        relay = await asyncio.start_server(functools.partial(
            _relay, (host, int(port)), source), "127.0.0.1", 0)
        via = f"127.0.0.1:{relay.sockets[0].getsockname()[1]}"
        per_channel = 16  # the node's calls per connection
        for first in range(0, half_open + idle, per_channel):  # a connection of its own each
            channel = secure_channel(via, cert, [("grpc.use_local_subchannel_pool", 1)])
            channels.append(channel)
            n = min(per_channel, half_open + idle - first)
            if first + n <= half_open:
                jobs.append(calls(channel, n, exchange=False))
            else:  # the last connection carries the idle streams
                jobs += [calls(channel, max(0, half_open - first), exchange=False),
                         calls(channel, n - max(0, half_open - first), exchange=True)]
        silent_jobs += [quiet(host, int(port)) for _ in range(silent)]

    async def ready(channel: Any) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(channel.channel_ready(), 20)
            count(3)

    await asyncio.gather(*map(ready, channels))
    await asyncio.gather(*jobs, *silent_jobs)


async def _relay(target: tuple[str, int], source: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    try:
        up_r, up_w = await asyncio.open_connection(*target, local_addr=(source, 0))
    except OSError:
        writer.close()
        return

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
    p.add_argument("--window-s", type=float, default=0.0,
                   help="measurement window (default: 60 s, 40 s for preauth)")
    p.add_argument("--windows", type=int, default=2, help="attacked windows (preauth)")
    p.add_argument("--half-open", type=int, default=100, help="half-open Info calls (preauth)")
    p.add_argument("--silent", type=int, default=600, help="silent connections (preauth)")
    p.add_argument("--idle", type=int, default=15, help="idle Exchange streams (preauth)")
    args = p.parse_args()
    args.fakes = args.fakes or (150 if args.attack == "tarpits" else 20)
    args.window_s = args.window_s or (40.0 if args.attack == "preauth" else 60.0)
    with tempfile.TemporaryDirectory() as tmp_dir:
        if args.attack == "preauth":
            return side_by_side(args, Path(tmp_dir))
        tmp = Path(tmp_dir)
        nodes: list[NodeChild] = []
        try:
            nodes, peers = start_swarm("n", tmp, args.nodes)
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


def start_swarm(prefix: str, tmp: Path, n: int, run_id: str = "gasloc"
                ) -> tuple[list[NodeChild], list[str]]:
    """``n`` nodes of one swarm, up and serving; and the first one's ``--peers``."""
    base = flags({"eval_interval_steps": 1000, "metrics_port": -1,
                  "dht_start_timeout_s": 120.0, "run_id": run_id})
    nodes = [niced(f"{prefix}0", tmp, base)]
    peers = nodes[0].join_peers(180)
    nodes += [niced(f"{prefix}{i}", tmp, [*base, "--peers", *peers]) for i in range(1, n)]
    for node in nodes:
        node.wait_up(180)
    return nodes, peers


def open_files(node: NodeChild) -> int:
    """The node process's open file descriptors (0 once it has gone)."""
    try:
        return len(os.listdir(f"/proc/{node.proc.pid}/fd"))
    except OSError:
        return 0


class Watch:
    """In a thread: every ``every_s`` seconds, each node's open files and one signed Info
    call to it (what a member does), until ``close``."""

    def __init__(self, nodes: list[NodeChild], every_s: float = 2.0) -> None:
        self.nodes, self.every_s = nodes, every_s
        self.files: dict[str, list[tuple[float, int]]] = {n.name: [] for n in nodes}
        self.info_ok = self.info_tried = 0
        self.phase = "before"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for node in self.nodes:
                self.files[node.name].append((time.monotonic() - self._start,
                                              open_files(node)))
                if self.phase == "attack":
                    self.info_tried += 1
                    with contextlib.suppress(Exception):
                        node.info(timeout_s=5)
                        self.info_ok += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def count_in(nodes: list[NodeChild]) -> tuple[int, int]:
    """:func:`committed`, tried three times (a member's Info under attack is what we test,
    but the count must not be lost to one failed call)."""
    for attempt in range(3):
        try:
            return committed(nodes)
        except grpc.RpcError:
            if attempt == 2:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")


def windows(swarms: dict[str, list[NodeChild]], window_s: float
            ) -> dict[str, tuple[float, float]]:
    """Each swarm's exchanges per window and per 100 training steps, in one shared window."""
    first = {name: count_in(nodes) for name, nodes in swarms.items()}
    time.sleep(window_s)
    last = {name: count_in(nodes) for name, nodes in swarms.items()}
    return {name: (last[name][0] - first[name][0],
                   100 * (last[name][0] - first[name][0])
                   / max(last[name][1] - first[name][1], 1)) for name in swarms}


def side_by_side(args: argparse.Namespace, tmp: Path) -> int:
    """Two swarms of ``args.nodes`` nodes at once, one clean, one under :class:`PreauthFlood`
    (after a window with neither attacked): honest exchanges per window in each, members'
    signed Info calls to the attacked nodes, the nodes' open files."""
    swarms: dict[str, list[NodeChild]] = {}
    flood = watch = None
    try:
        for name in ("clean", "attacked"):
            swarms[name], _ = start_swarm(name[0], tmp, args.nodes, run_id=name)
        watch = Watch([*swarms["clean"], *swarms["attacked"]])
        time.sleep(30)  # every node has found the others, evaluated and exchanged
        before = windows(swarms, args.window_s)
        flood = PreauthFlood([n.endpoint for n in swarms["attacked"]],
                             half_open=args.half_open, silent=args.silent, idle=args.idle)
        flood.start()
        time.sleep(5)  # the flood is up
        watch.phase = "attack"
        during = [windows(swarms, args.window_s) for _ in range(args.windows)]
        watch.phase = "after"
        counts = flood.counts()
        flood.close()
        flood = None
        return report(args, before, during, watch, counts)
    finally:
        if flood is not None:
            flood.close()
        if watch is not None:
            watch.close()
        print(f"exit codes after SIGTERM: "
              f"{[stop(n) for nodes in swarms.values() for n in nodes]}")


def report(args: argparse.Namespace, before: dict[str, tuple[float, float]],
           during: list[dict[str, tuple[float, float]]], watch: Watch,
           counts: dict[str, int]) -> int:
    w = f"{args.window_s:g} s"
    print(f"preauth: 2 swarms of {args.nodes} nodes side by side; on each node of one, from "
          f"one address (127.66.0.1): {args.half_open} half-open Info calls, {args.silent} "
          f"silent TCP connections, {args.idle} idle Exchange streams, each re-opened when "
          "the node ends it "
          f"({counts['calls']} calls and {counts['connections']} connections opened, "
          f"{counts['channels_ready']} of the calls' connections up at the start, "
          f"{counts['refused_calls']} calls refused or cut by the nodes)")
    print(f"  before the attack: exchanges per {w}: clean {before['clean'][0]:.0f}, "
          f"other {before['attacked'][0]:.0f} "
          f"({before['attacked'][0] / max(before['clean'][0], 1):.2f}x)")
    ratios = []
    for i, window in enumerate(during):
        ratio = window["attacked"][0] / max(window["clean"][0], 1)
        ratios.append(ratio)
        print(f"  attacked window {i + 1}: exchanges per {w}: clean {window['clean'][0]:.0f}, "
              f"attacked {window['attacked'][0]:.0f} ({ratio:.2f}x); per 100 training steps: "
              f"clean {window['clean'][1]:.1f}, attacked {window['attacked'][1]:.1f}")
    print(f"  members' signed Info to the attacked nodes: {watch.info_ok} of {watch.info_tried} "
          "answered")
    budget = FDS_PER_CONNECTION * NetworkConfig().max_connections
    worst = 0
    for name, series in watch.files.items():
        base = series[0][1] if series else 0
        peak = max((f for _, f in series), default=0)
        worst = max(worst, peak - base)
        every = max(1, len(series) // 12)
        print(f"  open files of {name}: first {base}, peak {peak}; over time "
              + " ".join(f"{t:.0f}s:{f}" for t, f in series[::every]))
    ok = (min(ratios) >= MIN_SHARE["preauth"] and watch.info_ok == watch.info_tried
          and worst <= budget)
    print(f"verdict: {'PASS' if ok else 'FAIL'} (every attacked window at least "
          f"{MIN_SHARE['preauth']:g}x the clean swarm's exchanges, every member's Info "
          f"answered, open files at most {budget} above the first sample: the gate's "
          "fixed cap)")
    return 0 if ok else 1


def attack(args: argparse.Namespace, peers: list[str], nodes: list[NodeChild]
           ) -> tuple[tuple[float, float], str]:
    """The exchange rate during ``args.attack`` (records or tarpits), and what the attacker
    did."""
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
