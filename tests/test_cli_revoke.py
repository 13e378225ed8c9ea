"""`gasloc-node revoke` writes into the run of the node --peers names (from the manifest it
serves), as `status` reads it, or refuses in one line: never into a guessed run while
reporting success. The DHT is faked: which run it writes is decided by the command alone."""

from __future__ import annotations

import argparse

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gasloc_p2p.node import cli_members
from gasloc_p2p.node.config import NodeConfig
from gasloc_p2p.node.discovery import dht as dht_mod
from gasloc_p2p.node.discovery.base import revocation_key
from gasloc_p2p.node.manifest import Manifest, create
from gasloc_p2p.protocol.membership import load_or_create_owner_key

PEER = "/ip4/127.0.0.1/tcp/4001/p2p/QmXpQZ5i5WGi6pgc3yXfELRRtZmkXo8Nqkp1UG3ziodZxX"
MEMBER = "g1vvnkxlwcvxb7foitftieh62t5ipe6jqp"


def a_manifest(owner: Ed25519PrivateKey) -> Manifest:
    cfg = NodeConfig()
    values = {k: v for s in ("train", "outer", "gossip", "diloco")
              for k, v in vars(getattr(cfg, s)).items()}
    return create({k: list(v) if isinstance(v, tuple) else v for k, v in values.items()},
                  owner, "closed", "demo")


class FakeDHT:
    """Serves ``manifest`` (None: none) and records where revocation lists are written."""

    manifest: Manifest | None = None
    written: list[str] = []

    def __init__(self, run_id: str, *args: object, **kwargs: object) -> None:
        self.use_run(run_id)

    def use_run(self, run_id: str) -> None:
        self.revoked_key = revocation_key(run_id)

    def use_identity(self, *args: object) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def ask_manifest(self, dht_peer_id: str) -> str:
        assert PEER.endswith(dht_peer_id)
        return self.manifest.to_json() if self.manifest is not None else ""

    async def revocations(self) -> None:
        return None

    async def publish_revocations(self, rl: object) -> None:
        FakeDHT.written.append(self.revoked_key)


@pytest.fixture
def owner_key(tmp_path, monkeypatch):
    monkeypatch.setattr(dht_mod, "HivemindDiscovery", FakeDHT)
    monkeypatch.setattr(FakeDHT, "written", [])
    path = tmp_path / "owner.key"
    return path, load_or_create_owner_key(str(path))


def revoke(owner_path, run_id: str = "") -> argparse.Namespace:
    return argparse.Namespace(member=[MEMBER], peers=[PEER], run_id=run_id, days=1.0,
                              timeout_s=10.0, owner_key=str(owner_path))


def test_revoke_writes_into_the_run_of_the_manifest_the_peer_serves(owner_key, monkeypatch,
                                                                    capsys):
    path, key = owner_key
    manifest = a_manifest(key)
    monkeypatch.setattr(FakeDHT, "manifest", manifest)
    assert cli_members.run_revoke(revoke(path)) == 0
    assert FakeDHT.written == [revocation_key(manifest.run_id)]
    assert f"in run '{manifest.run_id}'" in capsys.readouterr().out


def test_revoke_refuses_a_run_it_cannot_tell_or_another_owners(owner_key, monkeypatch, capsys):
    path, key = owner_key
    assert cli_members.run_revoke(revoke(path)) == 2  # the peer serves no manifest
    err = capsys.readouterr().err.strip()
    assert err.startswith("gasloc-node revoke: error: --run-id: the node at ")
    assert len(err.splitlines()) == 1
    monkeypatch.setattr(FakeDHT, "manifest", a_manifest(Ed25519PrivateKey.generate()))
    assert cli_members.run_revoke(revoke(path)) == 2
    assert "--owner-key: run r" in capsys.readouterr().err
    assert FakeDHT.written == []
    assert cli_members.run_revoke(revoke(path, run_id="gasloc")) == 0  # named: as asked
    assert FakeDHT.written == [revocation_key("gasloc")]
