"""`gasloc-node init`, and the run manifest a `join` trains by (docs/running.md, "A run").

``init`` builds a configuration from the same flags as ``join``, keeps the run-level settings
(:data:`gasloc_p2p.node.manifest.RUN_FIELDS`), signs them with the owner key and writes the
manifest. ``join --manifest FILE`` runs a node of that run; ``join --peers MADDR`` with no
manifest asks the node at that address for its run's manifest (over the DHT's libp2p
connection, which authenticates the address's peer id) and trains by it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from gasloc_p2p.data.corpus import DataError
from gasloc_p2p.node.config import ConfigError, NodeConfig
from gasloc_p2p.node.manifest import RUN_FIELDS, Manifest, create, data_digest
from gasloc_p2p.node.runtime.identity import default_owner_key_path
from gasloc_p2p.node.settings import add_config_flags, build_config, load_env, load_toml
from gasloc_p2p.protocol.membership import load_or_create_owner_key

log = logging.getLogger(__name__)
FETCH_TIMEOUT_S = 30.0


def add_init_parser(sub: Any) -> None:
    p = sub.add_parser(
        "init", help="write a run manifest: what every node of the run trains",
        description="Write a run manifest from the same flags as `join` (the model, data, "
                    "training shape, algorithm, codec and who may join), signed by the owner "
                    "key; its digest is the run id. Start the run's first node with `gasloc-"
                    "node join --manifest FILE`; others then join with --peers alone.")
    p.add_argument("--out", required=True, metavar="FILE", help="manifest file to write")
    p.add_argument("--name", default="", help="the run's name, shown to every node")
    add_config_flags(p)
    p.set_defaults(func=run_init)


def run_init(args: argparse.Namespace) -> int:
    out, name = args.out, args.name
    try:
        if os.path.exists(out):
            raise ConfigError(f"--out={out}: exists (a new run needs a new manifest)")
        cfg = build_config(args)
        manifest = manifest_of(cfg, name or cfg.discovery.run_id)
    except (ConfigError, OSError, ValueError, DataError) as exc:
        print(f"gasloc-node init: error: {exc}", file=sys.stderr)
        return 2
    with open(out, "x") as f:
        f.write(manifest.to_json())
    s = manifest.settings
    print(f"run {manifest.run_id} ({manifest.name}): {s['model']} model, data "
          f"{s['data'] or 'Shakespeare'}, batch {s['batch']} x {s['seq_len']} tokens, H "
          f"{s['inner_steps']}, {s['algorithm']}, {s['codec']} payloads, {manifest.admission} "
          f"admission; wrote {out}")
    print(f"  start its first node: gasloc-node join --manifest {out}")
    if manifest.admission == "closed":
        print("  invite each member: gasloc-node invite --out member.invite (they join with "
              "--invitation member.invite --peers ... and nothing else)")
    return 0


def manifest_of(cfg: NodeConfig, name: str) -> Manifest:
    """The signed manifest of ``cfg``'s run settings (the owner key: ``--owner-key``, or the
    default one, made if missing)."""
    values: dict[str, Any] = {}
    for section in ("train", "outer", "gossip", "diloco"):
        values.update(vars(getattr(cfg, section)))
    missing = [f for f in RUN_FIELDS if f not in values]
    assert not missing, missing
    net = cfg.network
    admission = "open" if net.open_swarm else "keyed" if net.swarm_key else "closed"
    owner = load_or_create_owner_key(net.owner_key or default_owner_key_path())
    return create({k: list(v) if isinstance(v, tuple) else v for k, v in values.items()},
                  owner, admission, name, data_digest(cfg.train.data, fetch=True))


def resolve(args: argparse.Namespace, fetch: bool = True) -> Manifest | None:
    """The manifest this ``join`` trains by: ``--manifest FILE``, else (``fetch``) the one
    the first of ``--peers`` that serves one answers with (None: none given, none served: the
    node's own flags decide, as before manifests). ConfigError if a manifest is bad or a peer
    served a bad one. Removes ``manifest`` from ``args``."""
    path = getattr(args, "manifest", None)
    if hasattr(args, "manifest"):
        del args.manifest
    if path:
        try:
            with open(path, "rb") as f:
                text = f.read(1 << 20)
        except OSError as exc:
            raise ConfigError(f"--manifest={path}: {exc.strerror or exc}") from None
        return Manifest.from_json(text, f"--manifest={path}")
    peers = _peers(args)
    if not peers or not fetch:
        return None
    import uvloop

    served, peer = uvloop.run(asyncio.wait_for(_ask(peers), FETCH_TIMEOUT_S))
    if not served:
        log.warning("no run manifest from %s: this node trains with its own flags (the "
                    "run's settings are not checked)", peers[0])
        return None
    return Manifest.from_json(served, f"the manifest {peer} serves")


def _peers(args: argparse.Namespace) -> list[str]:
    """``--peers`` as the configuration would read it (flag, environment, TOML)."""
    if getattr(args, "peers", None):
        return list(args.peers)
    env = load_env(os.environ).get("peers")
    if env:
        return list(env)
    toml = getattr(args, "config", None)
    return list(load_toml(toml).get("peers", ())) if toml else []


async def served_manifest(dht: Any, peer: str) -> Manifest | None:
    """The valid manifest the node at multiaddr ``peer`` serves over ``dht`` (None if none)."""
    text = await dht.ask_manifest(peer.rsplit("/p2p/", 1)[-1])
    if not text:
        return None
    try:
        return Manifest.from_json(text, "manifest")
    except ConfigError:
        return None


async def _ask(peers: list[str]) -> tuple[str, str]:
    """(manifest text, the peer that served it) from the first of ``peers`` serving one."""
    from gasloc_p2p.node.discovery.dht import HivemindDiscovery
    from gasloc_p2p.protocol.auth import Signer

    dht = HivemindDiscovery("manifest", "127.0.0.1", 0, peers, FETCH_TIMEOUT_S / 3,
                            FETCH_TIMEOUT_S / 2, client_mode=True)
    dht.use_identity(Signer(), 60.0)
    await dht.start()
    try:
        for peer in peers:
            text = await dht.ask_manifest(peer.rsplit("/p2p/", 1)[-1])
            if text:
                return text, peer
    finally:
        await dht.stop()
    return "", ""
