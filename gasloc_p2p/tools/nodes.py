"""A `gasloc-node join` child process: the one node wrapper of the swarm command, the tests and
the benchmarks.

It adds to :class:`Child` what every caller of a node process needs: the join hint a first
node prints (the ``--peers`` multiaddrs for the others), the gRPC endpoint from the start-up
line, the Info RPC and the state download.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path

import grpc
import torch

from gasloc_p2p.node.transport.tls import unpinned_channel
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.messages import PROTOCOL_VERSION, sign_info_request, sign_state_request
from gasloc_p2p.tools.procs import Child

CREDENTIAL_FLAGS = ("--swarm-key", "--invitation", "--owner-key", "--open", "--manifest")
# stdout of a node that can be joined (tuning without a flag first, as GASLOC_X=value)
JOIN_HINT = r"^\s*((?:GASLOC_\w+=\S+ )*gasloc-node join .*--peers (.+))$"
UP_LINE = r"up: gRPC (\S+),"  # stderr (log) line once the node serves
METRICS_LINE = r"^  metrics  (http://\S+)$"  # stdout, in the start-up block


def join_argv(flags: Sequence[str], log_level: str = "INFO") -> list[str]:
    return [sys.executable, "-m", "gasloc_p2p.cli", "--log-level", log_level, "join", *flags]


def split_tuning(flags: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``join`` flags, with the advanced settings among them (timeouts, guard, limits: no
    flags of ``join``) moved to their ``GASLOC_*`` variables: ``--backoff-s 3`` becomes
    ``GASLOC_BACKOFF_S=3``, ``--decay-vectors`` ``GASLOC_DECAY_VECTORS=true``. What the swarm
    command, the tests and the benchmarks pass to node children."""
    from gasloc_p2p.node.settings import env_name, options

    tuning = {o.cli: o for o in options().values() if o.advanced}
    out, env, i = [], {}, 0
    while i < len(flags):
        flag = flags[i]
        name, eq, value = flag.partition("=")
        negated = name.startswith("--no-") and "--" + name[5:] in tuning
        opt = tuning.get("--" + name[5:] if negated else name)
        if opt is None:
            out.append(flag)
        elif opt.kind is bool and not eq:
            env[env_name(opt)] = "false" if negated else "true"
        else:
            if not eq:
                i += 1
                value = flags[i]
            env[env_name(opt)] = value
        i += 1
    return out, env


def node_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a node child: unbuffered output, hivemind's own logs quiet."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               HIVEMIND_LOGLEVEL=os.environ.get("HIVEMIND_LOGLEVEL", "WARNING"))
    env.update(extra or {})
    return env


def child_env(log_dir: Path, extra: Mapping[str, str]) -> dict[str, str]:
    """A node child's environment (:func:`node_env`) with its state folder (its identity
    and the checkpoint it keeps beside it) in ``log_dir/state`` unless ``extra`` names one:
    nodes of one run id started one after another from a shared home folder took each
    other's identities and resumed from each other's checkpoints (a benchmark's second
    swarm from the state its first one left)."""
    return node_env({"XDG_DATA_HOME": str(Path(log_dir).resolve() / "state"), **extra})


class NodeChild(Child):
    """``gasloc-node join FLAGS`` with logs in ``<log_dir>/<name>.out|.err``."""

    def __init__(self, name: str, log_dir: Path, flags: Sequence[str], log_level: str = "INFO",
                 env: Mapping[str, str] | None = None, prefix: Sequence[str] = (),
                 as_given: bool = False) -> None:
        """``prefix``: a command that runs the node, e.g. ``ip netns exec NS`` (a shaped host);
        advanced settings among ``flags`` travel as ``GASLOC_*`` variables (:func:`split_tuning`).
        Flags without a membership credential (``--swarm-key``, ``--invitation``,
        ``--owner-key``, ``--manifest``) get ``--open``, unless ``as_given``: tests and
        benchmarks of other things run open swarms."""
        flags, tuning = split_tuning(flags)
        if not as_given and not any(f.split("=")[0] in CREDENTIAL_FLAGS for f in flags):
            flags = [*flags, "--open"]
        super().__init__(name, [*prefix, *join_argv(flags, log_level)], log_dir,
                         child_env(log_dir, {**tuning, **(env or {})}))
        self.endpoint = ""
        self.signer = Signer()  # signs Info/DownloadState (set swarm_key for a keyed swarm)

    def join_peers(self, timeout_s: float) -> list[str]:
        """The ``--peers`` multiaddrs this node prints for others to join it."""
        return self.wait_for(JOIN_HINT, timeout_s).group(2).split()

    def join_hint(self, timeout_s: float) -> str:
        """The whole ``gasloc-node join ...`` line this node prints."""
        return self.wait_for(JOIN_HINT, timeout_s).group(1)

    def wait_up(self, timeout_s: float) -> str:
        """Wait for the node to serve; returns (and keeps) its gRPC endpoint."""
        self.endpoint = self.wait_for(UP_LINE, timeout_s, stdout=False).group(1)
        return self.endpoint

    def channel(self, timeout_s: float = 5.0) -> grpc.Channel:
        """A TLS channel to the node, trusting the certificate it presents (we started it)."""
        return unpinned_channel(self.endpoint, timeout_s)

    def info(self, timeout_s: float = 5.0) -> pb.InfoReply:
        """The node's full Info (a signed request, bound to the peer id it answers with and
        the challenge it issued)."""
        with self.channel(timeout_s) as channel:
            stub = pb_grpc.GossipStub(channel)
            health = stub.Info(pb.InfoRequest(), timeout=timeout_s)
            request = sign_info_request(pb.InfoRequest(), self.signer, time.time(),
                                        health.peer_id, health.challenge)
            reply: pb.InfoReply = stub.Info(request, timeout=timeout_s)
            return reply

    def download_state(self, run_id: str, timeout_s: float = 20.0
                       ) -> tuple[pb.StateMeta, torch.Tensor]:
        """The node's published state: its metadata and parameters (float32, flat)."""
        info = self.info()
        request = sign_state_request(pb.StateRequest(
            protocol_version=PROTOCOL_VERSION, run_id=run_id,
            model_fingerprint=info.model_fingerprint), self.signer, time.time(), info.peer_id,
            info.challenge)
        body, meta = bytearray(), pb.StateMeta()
        with self.channel() as channel:
            for msg in pb_grpc.GossipStub(channel).DownloadState(request, timeout=timeout_s):
                kind = msg.WhichOneof("kind")
                if kind == "meta":
                    meta = msg.meta
                elif kind == "data":
                    body += msg.data
                else:
                    raise ValueError(f"{self.name}: unexpected state message {kind!r}")
        return meta, torch.frombuffer(body, dtype=torch.float32)[:meta.numel].clone()

    def kill(self) -> None:
        """SIGKILL the whole process group (the node, its DHT process and p2pd) and reap."""
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with suppress(Exception):
            self.proc.wait(timeout=10)
