"""DHT poisoning on a real DHT: does gossip go on while an attacker floods the peer list?

Usage: python -m benchmarks.bench_poison [--nodes 3] [--fakes 20] [--window-s 60]

Starts ``--nodes`` real `gasloc-node join` processes (tiny model, 1 torch thread, under `nice`)
on loopback, then measures the swarm's exchange rate (committed exchanges, summed over the
nodes' Info) in three windows of ``--window-s`` seconds:

1. clean;
2. attacked: a hivemind DHT of the attacker's, joined to the swarm's DHT, publishes ``--fakes``
   records, each validly signed by a key of its own (anyone can mint keys in an open swarm),
   compatible with the swarm (fingerprint, codecs and version copied from a real record),
   announcing a huge step, and each pointing at its own closed port on 127.0.0.1; and it tries
   to overwrite every real node's record (another endpoint at a closed port, a 1000 s
   expiration, the owner's signature reused). It re-publishes every 5 s;
3. after: the attacker's DHT has left.

Prints the rates (per minute, and per 100 training steps: gossip events follow the steps, so
that one does not move with the machine's load), how many fakes a node knows at the end of
the attack, and a verdict: exchanges per step during the attack at least half of the clean
rate, and again after it. Exit code 1 if not.
"""

from __future__ import annotations

import argparse
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
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.certs import TlsIdentity
from gasloc_p2p.tools.nodes import NodeChild, join_argv, node_env
from gasloc_p2p.tools.procs import Child

KEY = run_key("gasloc")
MAX_TTL_S = 2 * 20.0  # 2 x --announce-ttl-s (default 20 s): longer records are refused
MIN_SHARE = 0.5


def niced(name: str, log_dir: Path, node_flags: list[str]) -> NodeChild:
    node = NodeChild.__new__(NodeChild)
    Child.__init__(node, name, ["nice", "-n", "5", *join_argv(node_flags)], log_dir, node_env())
    node.endpoint = ""
    node.signer = Signer()
    return node


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

    def __init__(self, initial_peers: list[str], fakes: int) -> None:
        import hivemind

        self.dht = hivemind.DHT(initial_peers=initial_peers,
                                host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        self.fakes = [Signer() for _ in range(fakes)]
        # a fake record must name a certificate for its own id to be accepted at all
        self.certs = {s.peer_id: TlsIdentity.generate(s.peer_id).cert_der for s in self.fakes}
        self.ports = [closed_port() for _ in range(fakes)]
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--fakes", type=int, default=20)
    p.add_argument("--window-s", type=float, default=60.0)
    args = p.parse_args()
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
            attacker = Attacker(peers, args.fakes)
            attacker.publish()
            thread = threading.Thread(target=attacker.run, daemon=True)
            thread.start()
            try:
                attacked = rate(nodes, args.window_s)
                listed = list(nodes[0].info(timeout_s=10).peers)  # candidates not backed off
            finally:
                attacker.close()
            after = rate(nodes, args.window_s)
            fake_ids = {s.peer_id for s in attacker.fakes}
            ok = attacked[1] >= MIN_SHARE * clean[1] and after[1] >= MIN_SHARE * clean[1]
            print(f"poison: {args.nodes} nodes, {args.fakes} fake records (each a valid key, "
                  f"a closed port, step 1e9) and overwrite attempts of every real record, "
                  f"re-published {attacker.published} times")
            fakes_seen = sum(k in fake_ids for k in listed)
            print(f"  at the end of the attack n0 knows {len(listed) - fakes_seen} real and "
                  f"{fakes_seen} fake peers (the fakes are valid records: each fails to connect "
                  "and is backed off; the overwrites are refused)")
            for what, i in (("per minute", 0), ("per 100 training steps", 1)):
                print(f"  exchanges {what}: clean {clean[i]:.1f}, attacked {attacked[i]:.1f} "
                      f"({attacked[i] / max(clean[i], 1e-9):.2f}x), after {after[i]:.1f} "
                      f"({after[i] / max(clean[i], 1e-9):.2f}x)")
            print(f"verdict: {'PASS' if ok else 'FAIL'} (exchanges per step at least "
                  f"{MIN_SHARE:g}x the clean rate during and after the attack)")
            return 0 if ok else 1
        finally:
            print(f"exit codes after SIGTERM: {[stop(n) for n in nodes]}")


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
