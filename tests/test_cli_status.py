"""`gasloc-node status --peers MADDR`: the header describes the node at that address (the node
asked), not another member of the swarm. The DHT and the nodes' Info are faked: which node the
header shows is decided by the command alone."""

from __future__ import annotations

import argparse
import json

import pytest

from gasloc_p2p.node import cli_node
from gasloc_p2p.node.discovery import dht as dht_mod
from gasloc_p2p.node.discovery.base import PeerInfo
from gasloc_p2p.node.transport import service
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb

DHT_B = "QmXpQZ5i5WGi6pgc3yXfELRRtZmkXo8Nqkp1UG3ziodZxX"  # B's DHT (libp2p) id
# A is far ahead of B: a header that picked "the most advanced node" would show A
NODES = {"127.0.0.1:1001": ("node-A", "QmAAAA", 900), "127.0.0.1:1002": ("node-B", DHT_B, 5)}


class FakeDHT:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def use_identity(self, *args: object) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def peers(self) -> list[PeerInfo]:
        return [PeerInfo(peer, endpoint, 1, "fp", step, cert=b"cert")
                for endpoint, (peer, _, step) in NODES.items()]


class FakeChannels:
    def __init__(self, *args: object) -> None:
        pass

    def stub(self, endpoint: str, cert: bytes) -> str:
        return endpoint

    async def close(self) -> None:
        pass


async def fake_fetch_info(endpoint: str, timeout_s: float, signer: object) -> pb.InfoReply:
    peer, dht_id, step = NODES[endpoint]
    return pb.InfoReply(peer_id=peer, endpoint=endpoint, run_id="gasloc", step=step,
                        dht_peer_id=dht_id)


@pytest.fixture
def fake_swarm(monkeypatch):
    monkeypatch.setattr(dht_mod, "HivemindDiscovery", FakeDHT)
    monkeypatch.setattr(service, "PeerChannels", FakeChannels)
    monkeypatch.setattr(service, "fetch_info", fake_fetch_info)


def status(*peers: str, as_json: bool = True) -> argparse.Namespace:
    return argparse.Namespace(endpoint=None, peers=list(peers), run_id="gasloc", timeout_s=10.0,
                              json=as_json, swarm_key="", invitation="", owner_key="")


def test_status_by_peers_describes_the_node_asked(fake_swarm, capsys):
    assert cli_node.run_status(status(f"/ip4/127.0.0.1/tcp/4001/p2p/{DHT_B}")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["info"]["peer_id"] == "node-B" and "note" not in report
    assert {p["peer_id"] for p in report["swarm"]} == {"node-A", "node-B"}
    assert cli_node.run_status(status(f"/ip4/127.0.0.1/tcp/4001/p2p/{DHT_B}",
                                      as_json=False)) == 0
    assert capsys.readouterr().out.startswith("node node-B at 127.0.0.1:1002 ")


def test_status_by_a_peer_that_is_no_node_shows_the_swarm_and_says_why(fake_swarm, capsys):
    """A bootstrap address that is a bare DHT peer (or a node not announced yet): no header
    for another node, a line saying why, and the swarm."""
    other = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    assert cli_node.run_status(status(f"/ip4/127.0.0.1/tcp/4001/p2p/{other}",
                                      as_json=False)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"no node header: no node with DHT id {other} announces itself")
    assert out[1] == "swarm (2 nodes):"
