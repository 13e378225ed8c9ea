"""DownloadState over real gRPC: one shared snapshot streamed chunk by chunk, a concurrency
limit answered BUSY, and the exact state at the other end."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import torch

from gasloc_p2p.core.outer import LocalNesterov, MixedMomentum, PlainAverage
from gasloc_p2p.node.config import NetworkConfig
from gasloc_p2p.node.transport.service import (
    GossipServicer,
    PeerChannels,
    ServeLimits,
    StateSnapshot,
    download_state,
    start_server,
    state_request,
    target_of,
)
from gasloc_p2p.node.transport.tls import secure_channel
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.certs import TlsIdentity
from gasloc_p2p.protocol.messages import (
    BUSY,
    MAX_CHUNK_BYTES,
    ExchangeError,
    Identity,
)
from tests.node_helpers import FINGERPRINT, RUN, run, scaled

NUMEL = 700_000  # 5.6 MB of body: six chunks


MIXED = MixedMomentum(0.7, 0.5)  # the joiners' own outer optimizer (its settings suffice)


def state() -> StateSnapshot:
    gen = torch.Generator().manual_seed(5)
    return StateSnapshot(11, 3, "mixed", torch.randn(NUMEL, generator=gen),
                         {"zprev": torch.randn(NUMEL, generator=gen)})


CERTS: dict[str, TlsIdentity] = {}


def tls(name: str) -> TlsIdentity:
    if name not in CERTS:
        CERTS[name] = TlsIdentity.generate(name)
    return CERTS[name]


async def serve(limit: int, name: str = "donor"
                ) -> tuple[Any, GossipServicer, str, PeerChannels, bytes]:
    snap = state()
    servicer = GossipServicer(Identity(RUN, FINGERPRINT, name), None,  # type: ignore[arg-type]
                              lambda: pb.InfoReply(peer_id=name), lambda: snap,
                              limits=ServeLimits(max_downloads=limit))
    server, port = await start_server(servicer, "127.0.0.1", 0, NetworkConfig(), tls(name))
    return (server, servicer, f"127.0.0.1:{port}", PeerChannels(NetworkConfig()),
            tls(name).cert_der)


async def challenge(stub: Any) -> tuple[str, bytes]:
    return await target_of(stub, scaled(5))


ME = Identity.keyed(RUN, FINGERPRINT, Signer())  # state requests are signed


def test_downloads_share_one_snapshot_stream_in_chunks_and_stop_at_the_limit() -> None:
    async def main() -> None:
        server, servicer, endpoint, channels, cert = await serve(limit=2)
        try:
            stub = channels.stub(endpoint, cert)
            # no BDP probing: the receive window stays at 64 KiB, so a stream we do not read
            # really stays open on the server (loopback would otherwise take it all at once)
            slow = secure_channel(endpoint, cert, [("grpc.http2.bdp_probe", 0)])
            slow_stub = pb_grpc.GossipStub(slow)
            held = [slow_stub.DownloadState(
                state_request(RUN, FINGERPRINT, ME.signer, *await challenge(slow_stub)),
                timeout=scaled(20)) for _ in range(2)]
            for call in held:  # both admitted and holding the stream open
                assert (await call.read()).WhichOneof("kind") == "meta"
            assert servicer.downloads.active == 2
            with pytest.raises(ExchangeError) as busy:
                await download_state(stub, ME, scaled(10), outer=MIXED)
            assert busy.value.code == BUSY and "retry later" in busy.value.message
            sizes = []
            for call in held:  # the rest arrives in chunks of at most 1 MiB
                while (msg := await call.read()) is not grpc.aio.EOF:
                    assert msg.WhichOneof("kind") == "data"
                    sizes.append(len(msg.data))
            assert max(sizes) <= MAX_CHUNK_BYTES and sum(sizes) == 2 * 8 * NUMEL
            assert servicer.downloads.taken == 1  # one snapshot for both
            await asyncio.sleep(0)  # the handlers' finally blocks have run
            meta, params, outer = await download_state(stub, ME, scaled(10),
                                                       outer=MIXED)  # admitted again
            assert torch.equal(params, state().params)
            assert torch.equal(outer["zprev"], state().state["zprev"])
            assert (meta.step, meta.rounds, meta.momentum) == (11, 3, "mixed")
        finally:
            await slow.close()
            await channels.close()
            await server.stop(0)

    run(main())


def test_a_download_that_outlasts_its_deadline_is_cut_and_frees_its_slot() -> None:
    """A member that stops reading its download would hold the donor's slot for good: the
    donor cuts a download after its deadline (the node's: the state's time on the slowest
    link it plans for), and the slot serves the next node."""
    async def main() -> None:
        snap = state()
        servicer = GossipServicer(Identity(RUN, FINGERPRINT, "donor"), None,  # type: ignore
                                  lambda: pb.InfoReply(peer_id="donor"), lambda: snap,
                                  limits=ServeLimits(max_downloads=1, download_s=scaled(1.0)))
        server, port = await start_server(servicer, "127.0.0.1", 0, NetworkConfig(),
                                          tls("donor"))
        endpoint, cert = f"127.0.0.1:{port}", tls("donor").cert_der
        channels = PeerChannels(NetworkConfig())
        slow = secure_channel(endpoint, cert, [("grpc.http2.bdp_probe", 0)])
        try:
            stub, slow_stub = channels.stub(endpoint, cert), pb_grpc.GossipStub(slow)
            held = slow_stub.DownloadState(
                state_request(RUN, FINGERPRINT, ME.signer, *await challenge(slow_stub)),
                timeout=scaled(30))
            assert (await held.read()).WhichOneof("kind") == "meta"  # then reads no more
            assert servicer.downloads.active == 1
            with pytest.raises(ExchangeError) as busy:
                await download_state(stub, ME, scaled(10), outer=MIXED)
            assert busy.value.code == BUSY
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            while servicer.downloads.active and loop.time() - t0 < scaled(10):
                await asyncio.sleep(0.05)
            assert servicer.downloads.active == 0, "the stalled download still holds its slot"
            assert loop.time() - t0 < scaled(5)
            meta, params, _ = await download_state(stub, ME, scaled(10),
                                                   outer=MIXED)  # the slot serves
            assert torch.equal(params, snap.params)
        finally:
            await slow.close()
            await channels.close()
            await server.stop(0)

    run(main())


def test_concurrent_downloads_are_exact_or_busy() -> None:
    async def main() -> None:
        server, servicer, endpoint, channels, cert = await serve(limit=3)
        try:
            stub = channels.stub(endpoint, cert)
            results = await asyncio.gather(*(download_state(stub, ME, scaled(20), outer=MIXED)
                                             for _ in range(8)), return_exceptions=True)
            ok = [r for r in results if not isinstance(r, BaseException)]
            busy = [r for r in results if isinstance(r, ExchangeError) and r.code == BUSY]
            assert len(ok) + len(busy) == 8 and ok
            for _, params, outer in ok:
                assert torch.equal(params, state().params)
                assert torch.equal(outer["zprev"], state().state["zprev"])
            assert servicer.downloads.active == 0
            assert servicer.downloads.taken <= len(ok)
        finally:
            await channels.close()
            await server.stop(0)

    run(main())


def test_a_recorded_state_request_replayed_gets_nothing_from_any_node() -> None:
    """A DownloadState request is signed for one node (its peer id) with a challenge that
    node issued: sent again to that node, or to another node of the swarm, it is refused (an
    on-path observer without a key got the full state back before protocol 6), and so is one
    whose challenge another node issued or nobody did."""
    async def main() -> None:
        donor = await serve(limit=2)
        other = await serve(limit=2, name="other")  # another node of the same swarm
        try:
            to_donor = donor[3].stub(donor[2], donor[4])
            to_other = donor[3].stub(other[2], other[4])
            recorded = state_request(RUN, FINGERPRINT, ME.signer, *await challenge(to_donor))

            async def send(stub: Any, request: pb.StateRequest = recorded) -> str:
                call = stub.DownloadState(request, timeout=scaled(10))
                first = await call.read()
                call.cancel()
                kind = first.WhichOneof("kind")
                return kind if kind != "reject" else f"reject: {first.reject.message}"

            assert await send(to_donor) == "meta"  # the original: served
            # the caller reads only "refused"; the reason is the server's (logged at DEBUG)
            assert await send(to_donor) == "reject: refused"  # replayed
            assert await send(to_other) == "reject: refused"  # for another node
            _, theirs = await challenge(to_other)  # a challenge of another node, or a made-up one
            for nonce in (theirs, bytes(40), b""):
                forged = state_request(RUN, FINGERPRINT, ME.signer, "donor", nonce)
                assert await send(to_donor, forged) == "reject: refused"
            assert (donor[1].downloads.taken, other[1].downloads.taken) == (1, 0)
            fresh = await download_state(to_other, ME, scaled(10), outer=MIXED)
            assert torch.equal(fresh[1], state().params)  # a fresh request is served
        finally:
            for server, _, _, channels, _ in (donor, other):
                await channels.close()
                await server.stop(0)

    run(main())


def test_a_state_announced_for_another_model_size_is_refused_before_any_byte() -> None:
    async def main() -> None:
        # the limit is not what this test is about: a refused download's slot is freed when
        # the server sees the cancel, which under load can come after the next request
        server, servicer, endpoint, channels, cert = await serve(limit=8)
        try:
            stub = channels.stub(endpoint, cert)
            with pytest.raises(ExchangeError, match="announced"):
                await download_state(stub, ME, scaled(10), numel=NUMEL - 1, outer=MIXED)
            assert servicer.downloads.taken == 1  # it was served: the joiner refused the meta
            meta, params, _ = await download_state(stub, ME, scaled(10), numel=NUMEL,
                                                   outer=MIXED)
            assert params.numel() == NUMEL
            # a joiner running another outer optimizer refuses the state in one line, before
            # any byte of it is buffered (its sizes would be its own optimizer's)
            for own in (PlainAverage(1.0, 0.0), LocalNesterov(0.7, 0.9)):
                with pytest.raises(ExchangeError, match=f"optimizer 'mixed', this node runs "
                                                        f"'{own.name}'") as info:
                    await download_state(stub, ME, scaled(10), numel=NUMEL, outer=own)
                assert "\n" not in str(info.value)
        finally:
            await channels.close()
            await server.stop(0)

    run(main())
