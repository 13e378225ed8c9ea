"""A real swarm: `gasloc-node join` processes on 127.0.0.1 with a real DHT and real gRPC.

Three gossiping nodes and two no-gossip control nodes train side by side (torch threads 1,
tiny model). Checked: every gossiping node commits exchanges as initiator and as responder; a
node killed with SIGKILL stops neither the others nor leaves a p2pd behind; the gossiping pair's
consensus distance ends far below the control pair's; validation loss falls on every node;
`gasloc-node status` lists the swarm; SIGTERM, to a node or to its whole process group, stops
the rest cleanly (exit 0, no orphans).
Runs in the default suite (about 60 s). Every wait is scaled by GASLOC_TEST_TIMEOUT_SCALE.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch

from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.messages import PROTOCOL_VERSION
from tests.node_helpers import scaled
from tests.test_node_daemon import write_corpus

COMMON = ["--host", "127.0.0.1", "--n-layer", "2", "--n-embd", "64", "--seq-len", "64",
          "--batch-size", "8", "--inner-steps", "20", "--torch-threads", "1",
          "--warmup-steps", "20", "--eval-interval-steps", "50", "--eval-batches", "2",
          "--exchanges-per-round", "1", "--announce-interval-s", "1", "--announce-ttl-s", "4",
          "--refresh-interval-s", "1", "--log-interval-s", "5", "--backoff-s", "3",
          "--no-init-from-swarm"]


class NodeProc:
    """One `gasloc-node join` child in its own session (process group), logs in files."""

    def __init__(self, name: str, tmp: Path, args: list[str]) -> None:
        self.name = name
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        env = dict(os.environ, PYTHONUNBUFFERED="1", HIVEMIND_LOGLEVEL="WARNING")
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gasloc_p2p.cli", "--log-level", "INFO", "join",
                 *COMMON, *args], stdout=out, stderr=err, env=env, start_new_session=True)
        self.pgid = self.proc.pid
        self.endpoint = ""

    def wait_log(self, pattern: str, timeout_s: float, stdout: bool = False) -> re.Match[str]:
        deadline = time.monotonic() + scaled(timeout_s)
        path = self.out if stdout else self.err
        while time.monotonic() < deadline:
            found = re.search(pattern, path.read_text())
            if found:
                return found
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.err.read_text()[-3000:]}"
            time.sleep(0.2)
        raise AssertionError(f"{self.name}: no {pattern!r} in {timeout_s} s:\n"
                             f"{path.read_text()[-3000:]}")

    def wait_up(self, timeout_s: float = 60) -> None:
        self.endpoint = self.wait_log(r"up: gRPC (\S+),", timeout_s).group(1)

    def info(self) -> pb.InfoReply:
        with grpc.insecure_channel(self.endpoint) as channel:
            reply: pb.InfoReply = pb_grpc.GossipStub(channel).Info(pb.InfoRequest(), timeout=5)
            return reply

    def public_iterate(self, run_id: str) -> torch.Tensor:
        request = pb.StateRequest(protocol_version=PROTOCOL_VERSION, run_id=run_id,
                                  model_fingerprint=self.info().model_fingerprint)
        body, numel = bytearray(), 0
        with grpc.insecure_channel(self.endpoint) as channel:
            for msg in pb_grpc.GossipStub(channel).DownloadState(request, timeout=20):
                if msg.WhichOneof("kind") == "meta":
                    numel = msg.meta.numel
                else:
                    assert msg.WhichOneof("kind") == "data", msg
                    body += msg.data
        return torch.frombuffer(body, dtype=torch.float32)[:numel].clone()

    def alive_in_group(self) -> list[str]:
        """Live (non-zombie) processes of this node's process group: itself, DHT, p2pd."""
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.pgid and fields[0] != "Z":
                alive.append(stat.parent.name)
        return alive

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def wait_for(predicate, timeout_s: float, what: str, period_s: float = 0.5):
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_swarm_of_processes(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    data = ["--data", str(corpus)]
    nodes: list[NodeProc] = []
    try:
        seed = NodeProc("g0", tmp_path, data)
        controls = [NodeProc(f"c{i}", tmp_path, [*data, "--run-id", f"control{i}",
                                                  "--exchanges-per-round", "0"])
                    for i in range(2)]
        nodes += [seed, *controls]
        hint = seed.wait_log(r"(gasloc-node join .+)", 60, stdout=True).group(1)
        assert "--n-layer 2 --n-embd 64 --seq-len 64 --peers /ip4/127.0.0.1/tcp/" in hint
        maddrs = hint.split("--peers ")[1].split()
        gossip = [seed] + [NodeProc(f"g{i}", tmp_path, [*data, "--peers", *maddrs])
                           for i in (1, 2)]
        nodes += gossip[1:]
        for node in nodes:
            node.wait_up()

        def both_roles() -> bool:
            infos = [g.info() for g in gossip]
            return all(i.exchanges_ok_initiator >= 2 and i.exchanges_ok_responder >= 2
                       for i in infos)

        wait_for(both_roles, 60, "exchanges in both roles on every gossiping node")
        victim = gossip[2]
        before_kill = victim.info()
        assert before_kill.val_loss < before_kill.first_val_loss
        survivors = gossip[:2]
        counts = [g.info() for g in survivors]
        os.kill(victim.proc.pid, signal.SIGKILL)  # the node only: its DHT watchdog reaps p2pd
        victim.proc.wait(timeout=10)
        wait_for(lambda: not victim.alive_in_group(), 15, "the killed node's DHT and p2pd")

        def progressed() -> bool:
            now = [g.info() for g in survivors]
            return all(n.step > c.step + 50 and n.exchanges_ok_initiator + n.exchanges_ok_responder
                       > c.exchanges_ok_initiator + c.exchanges_ok_responder + 3
                       for n, c in zip(now, counts, strict=True))

        wait_for(progressed, 40, "the survivors to keep training and gossiping")

        status = subprocess.run(
            [sys.executable, "-m", "gasloc_p2p.cli", "status", "--peers", *maddrs, "--json",
             "--timeout-s", str(scaled(30))], capture_output=True, text=True,
            timeout=scaled(60), env=dict(os.environ, HIVEMIND_LOGLEVEL="ERROR"),
            start_new_session=True)
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        listed = {p["peer_id"] for p in report["swarm"]}
        assert {survivors[0].info().peer_id, survivors[1].info().peer_id} <= listed
        assert report["info"]["run_id"] == "gasloc"

        params = {n.name: n.public_iterate(run) for n, run in
                  [(survivors[0], "gasloc"), (survivors[1], "gasloc"),
                   (controls[0], "control0"), (controls[1], "control1")]}
        gossip_dist = float((params["g0"] - params["g1"]).pow(2).sum())
        control_dist = float((params["c0"] - params["c1"]).pow(2).sum())
        print(f"consensus distance: gossip pair {gossip_dist:.4g}, control pair "
              f"{control_dist:.4g} (ratio {gossip_dist / control_dist:.3g})")
        assert gossip_dist < 0.3 * control_dist

        for node in [*survivors, *controls]:
            info = node.info()
            assert info.val_loss < info.first_val_loss - 0.5, (node.name, info)
        for node in [*survivors, controls[0]]:
            node.proc.send_signal(signal.SIGTERM)
        os.killpg(controls[1].pgid, signal.SIGTERM)  # as `timeout` or systemd would: all of it
        for node in [*survivors, *controls]:
            assert node.proc.wait(timeout=scaled(30)) == 0, node.err.read_text()[-3000:]
            wait_for(lambda n=node: not n.alive_in_group(), 15, f"{node.name}'s children")
    finally:
        for node in nodes:
            node.kill_group()
