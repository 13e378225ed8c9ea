"""Shared helpers for the node tests: in-process peers on real gRPC servers, timeouts, state.

Every timeout in the node tests is multiplied by ``GASLOC_TEST_TIMEOUT_SCALE`` (default 1), so
a slow machine needs one knob.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.links import LinkCache
from gasloc_p2p.core.wire import RESIDUAL_CODECS
from gasloc_p2p.node.config import GossipConfig, NetworkConfig
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.transport.exchange import GossipTransport
from gasloc_p2p.node.transport.service import (
    GossipServicer,
    NodeServer,
    PeerChannels,
    PreauthPool,
    ServeLimits,
    StateSnapshot,
    start_server,
)
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.actions import Outcome
from gasloc_p2p.protocol.auth import Signer, new_nonce
from gasloc_p2p.protocol.certs import TlsIdentity
from gasloc_p2p.protocol.engine import ExchangeEngine
from gasloc_p2p.protocol.membership import Admission, Invitation, public_bytes
from gasloc_p2p.protocol.messages import Identity, make_header, sign_header

SCALE = float(os.environ.get("GASLOC_TEST_TIMEOUT_SCALE", "1"))  # tests/conftest.py sets it
KNOB = (f"every wait is x{SCALE:g}, GASLOC_TEST_TIMEOUT_SCALE, set from the machine's load "
        "and speed at the start of the run; set it higher on a slower machine")
T = TypeVar("T")
NUMEL = 50_000
FINGERPRINT = "f" * 64
RUN = "test-run"


def scaled(seconds: float) -> float:
    return seconds * SCALE


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    """Run a coroutine on a fresh event loop with a scaled overall deadline."""

    async def bounded() -> T:
        async with asyncio.timeout(scaled(timeout_s)):
            return await coro

    return asyncio.run(bounded())


def gossip_config(**kw: Any) -> GossipConfig:
    # guard off unless a test asks for it: these peers do not train, so they have no drift
    # of their own for its limits (tests/test_bounded_updates.py tests the guard)
    base = GossipConfig(header_timeout_s=scaled(3), chunk_timeout_s=scaled(3),
                        commit_timeout_s=scaled(3), exchange_timeout_s=scaled(10),
                        chunk_bytes=64 * 1024, guard_factor=0,
                        # these peers do not train: their rounds never end
                        key_exchanges_per_round=0)
    return replace(base, **kw)


def member_signer(owner: Ed25519PrivateKey, days: float = 1.0,
                  admission: Admission | None = None) -> Signer:
    """A fresh key invited by ``owner`` for ``days``, checking others against ``owner`` (or
    ``admission``, e.g. a shared one holding revocations)."""
    key = Ed25519PrivateKey.generate()
    invitation = Invitation.issue(owner, public_bytes(key), time.time() + days * 86400)
    return Signer(key, admission=admission or Admission(public_bytes(owner)),
                  invitation=invitation.to_bytes())


@functools.cache
def cert_for(peer_id: str) -> bytes:
    """A TLS certificate naming ``peer_id`` (what a signed record must announce)."""
    return TlsIdentity.generate(peer_id).cert_der


def theta0(numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(0))


def fragments(numel: int = NUMEL) -> list[Fragment]:
    """Two interleaved fragments, like strided layers: [0, n/4) + [n/2, 3n/4) and the rest."""
    q = numel // 4
    return [Fragment(0, [(0, q), (2 * q, q)]), Fragment(1, [(q, q), (3 * q, numel - 3 * q)])]


@dataclass
class Peer:
    """One in-process node: state, engine, exchanger and a real gRPC server on 127.0.0.1:0."""

    me: Identity
    state: AsyncGaslocState
    engine: ExchangeEngine
    exchanger: GossipTransport
    server: NodeServer
    endpoint: str
    channels: PeerChannels
    tls: TlsIdentity
    servicer: GossipServicer

    @property
    def preauth(self) -> PreauthPool:
        return self.servicer.preauth

    @property
    def cert(self) -> bytes:
        return self.tls.cert_der

    def stub(self, other: Peer) -> Any:
        """A stub on this peer's TLS channel to ``other``, trusting ``other``'s certificate."""
        return self.channels.stub(other.endpoint, other.cert)

    def open_call(self, other: Peer) -> Any:
        return self.stub(other).Exchange(timeout=scaled(20))

    async def exchange(self, other: Peer, fragment: int = 0) -> Outcome:
        return await self.exchanger.initiate(lambda: self.open_call(other), other.me.peer_id,
                                             fragment, "", other.exchanger.rules.links)

    async def close(self) -> None:
        await self.channels.close()
        await self.server.stop(0)


async def make_peer(name: str, seed: int, gossip: GossipConfig | None = None,
                    fingerprint: str = FINGERPRINT, outer: AsyncConfig | None = None,
                    swarm_key: bytes = b"", signer: Signer | None = None,
                    net: NetworkConfig | None = None) -> Peer:
    """A peer whose live parameters are ``theta0`` plus seeded noise (a different drift).

    Its peer id is derived from a fresh ed25519 key (``name`` only names it in the Info
    reply); ``swarm_key``: the shared secret its signatures are keyed with; ``signer``: its
    key and membership instead (a closed swarm's member: :func:`member_signer`); ``net``: its
    server's network settings (gate, pre-authentication limits)."""
    t0 = theta0()
    outer = outer or AsyncConfig(eta=0.7, gamma=0.5, w=0.5)
    theta = t0 + 0.1 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    state = AsyncGaslocState(theta, t0, outer)
    state.theta.add_(0.05)  # live != anchor, so p != theta
    lock = TrainingLock()
    gossip = gossip or gossip_config()
    engine = ExchangeEngine(state, t0, fragments(), lock)
    if gossip.codec in RESIDUAL_CODECS:  # as the gossip mode does
        engine.links = LinkCache(gossip.links)
    me = Identity.keyed(RUN, fingerprint, signer or Signer(swarm_key=swarm_key))
    exchanger = GossipTransport(me, engine, gossip, outer)

    def snapshot() -> StateSnapshot:
        return StateSnapshot(0, state.rounds, state.outer.name, state.public_iterate(),
                             {name: t.clone() for name, t in state.outer.state_dict().items()})

    def info() -> pb.InfoReply:  # step and peers: only an authenticated caller sees them
        return pb.InfoReply(peer_id=me.peer_id, software_version=name, step=7, peers=["x"])

    net = net or NetworkConfig()
    servicer = GossipServicer(me, exchanger, info, snapshot, ServeLimits(
        net.preauth_streams, net.preauth_timeout_s))
    tls = TlsIdentity.generate(me.peer_id)
    server, port = await start_server(servicer, "127.0.0.1", 0, net, tls)
    return Peer(me, state, engine, exchanger, server, f"127.0.0.1:{port}", PeerChannels(net),
                tls, servicer)


def full_state(peer: Peer) -> dict[str, Any]:
    """Everything an exchange may change, as copies: the node state's tensors (the outer
    optimizer's buffers by name) and rounds."""
    return {"theta": peer.state.theta.clone(), "anchor": peer.state.anchor.clone(),
            **{name: t.clone() for name, t in peer.state.outer.state.items()},
            "rounds": peer.state.rounds}


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{key} changed"
        else:
            assert a[key] == b[key], f"{key}: {a[key]} != {b[key]}"


@contextlib.asynccontextmanager
async def relay_from(source: str, endpoint: str) -> AsyncIterator[str]:
    """A local TCP relay to ``endpoint`` whose connections come from ``source`` (a loopback
    address such as 127.1.0.1: another address block than the peers' 127.0.0.1); yields the
    relay's endpoint. gRPC clients cannot pick their source address; TLS passes through."""
    host, port = endpoint.rsplit(":", 1)

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def wait_until(predicate: Any, timeout_s: float = 5.0, what: str = "condition") -> None:
    """Poll ``predicate`` (cheap, no I/O) until true; fails after a scaled timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout_s)
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({scaled(timeout_s):.0f} s: "
                                 f"{KNOB})")
        await asyncio.sleep(0.01)


async def settle(aw: Awaitable[Any]) -> BaseException | Any:
    """Await and return the result or the exception."""
    try:
        return await aw
    except BaseException as exc:  # noqa: BLE001 - tests inspect it
        return exc


def moment_elements_per_file(where: Path) -> dict[str, int]:
    """AdamW moment elements (exp_avg and exp_avg_sq) each file of a DCP checkpoint holds,
    from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    meta = FileSystemReader(str(where)).read_metadata()
    out: dict[str, int] = {}
    for key, m in meta.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata) and key.endswith(("exp_avg", "exp_avg_sq")):
            for chunk in m.chunks:
                info = meta.storage_data[MetadataIndex(key, chunk.offsets)]
                out[info.relative_path] = out.get(info.relative_path, 0) + math.prod(
                    chunk.sizes)
    return out


def plain_dht(addrs: list | None = None) -> Any:
    """A hivemind DHT on loopback (no validator), ready within a bounded wait: one whose
    process stalls while starting (seen once on a loaded machine) is shut down and replaced,
    as the node does for its own."""
    import hivemind

    from gasloc_p2p.node.discovery.dht import dht_class

    for _ in range(3):
        dht = dht_class(hivemind)(initial_peers=addrs or None,
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                                  await_ready=False, shutdown_timeout=5)
        try:
            dht.wait_until_ready(timeout=scaled(20))
            return dht
        except TimeoutError:
            dht.shutdown()
    raise AssertionError("a hivemind DHT did not start in 3 attempts")


def damage_invitation(path: Path, invitation_file: Path) -> None:
    """``invitation_file`` with one bit of its owner's key flipped (past the 16 hex digits
    messages show), written to ``path``."""
    import base64

    lines = invitation_file.read_text().splitlines()
    raw = bytearray(base64.b64decode(lines[1].split()[1]))
    raw[20] ^= 1
    lines[1] = "invitation " + base64.b64encode(bytes(raw)).decode()
    path.write_text("\n".join(lines) + "\n")


def start_raw(a: Peer, b: Peer, fragment: int = 0) -> tuple[Any, pb.ExchangeMsg]:
    """A's prepared int8 exchange with B and its signed Header, for tests that drive the
    stream by hand (hold a slot, misbehave)."""
    prep = a.engine.prepare(b.me.peer_id, fragment, CodecSpec("int8", 1024))
    return prep, sign_header(make_header(a.me, prep, 2), a.me.signer, new_nonce(), b"")
