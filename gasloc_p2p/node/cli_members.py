"""`gasloc-node invite`, `revoke` and `id`: a closed swarm's members, managed by its owner.

``invite`` signs a member's public key with the owner key and an expiry, into an invitation
file; without ``--member`` it also makes the member's key and puts it in the file (send it
privately). ``revoke`` publishes, through the swarm's DHT, the owner's signed list of revoked
peer ids, which every node reads within seconds. ``id`` prints a node key's peer id and public
key (what a member sends its owner for ``invite --member``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gasloc_p2p.node.config import ConfigError
from gasloc_p2p.node.config_network import check_bootstrap_peers
from gasloc_p2p.node.runtime.identity import default_owner_key_path
from gasloc_p2p.protocol.auth import PUBLIC_KEY_BYTES, Signer, load_or_create_identity, peer_id_of
from gasloc_p2p.protocol.membership import (
    Admission,
    Invitation,
    RevocationList,
    expires_in,
    load_or_create_owner_key,
    public_bytes,
    read_key_file,
    write_invitation,
)


def add_member_parsers(sub: Any) -> None:
    p = sub.add_parser("invite", help="invite a member into your closed swarm (owner)",
                       description="Write an invitation file signed by the swarm's owner key. "
                                   "Without --member the file also holds a new key for the "
                                   "member: send it privately.")
    p.add_argument("--out", required=True, metavar="FILE", help="invitation file to write")
    p.add_argument("--member", default="", metavar="PUBKEY",
                   help="the member's public key (hex, from `gasloc-node id`): sign it "
                        "instead of making a new key")
    p.add_argument("--days", type=float, default=30.0, help="the invitation expires after "
                                                             "this many days")
    _owner_flag(p)
    p.set_defaults(func=run_invite)

    p = sub.add_parser("revoke", help="revoke members of your closed swarm (owner)",
                       description="Publish the owner's signed list of revoked peer ids in the "
                                   "swarm's DHT; nodes refuse them within about 10 s.")
    p.add_argument("--member", nargs="+", required=True, metavar="PEER_ID",
                   help="peer ids to revoke (as `gasloc-node status` lists them)")
    p.add_argument("--peers", nargs="+", required=True, metavar="MADDR",
                   help="bootstrap multiaddrs of the swarm's DHT")
    p.add_argument("--run-id", default="", help="the swarm's run (default: the run of the "
                                                "manifest the node --peers names serves; "
                                                "without one, refused: pass it)")
    p.add_argument("--days", type=float, default=365.0,
                   help="keep each revocation this many days (at least the invitation's life)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="overall deadline, seconds")
    _owner_flag(p)
    p.set_defaults(func=run_revoke, exit_at_once=True)

    p = sub.add_parser("id", help="print a node key's peer id and public key",
                       description="Print the peer id and public key of --identity-file "
                                   "(created if missing): what an owner needs to invite it.")
    p.add_argument("--identity-file", required=True, metavar="FILE",
                   help="the node's key file (as `join --identity-file`)")
    p.set_defaults(func=run_id)


def _owner_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--owner-key", default="", metavar="FILE",
                   help=f"the swarm's owner key (default {default_owner_key_path()}, made "
                        "by the node that started the swarm)")


def _fail(command: str, message: str) -> int:
    print(f"gasloc-node {command}: error: {message}", file=sys.stderr)
    return 2


def _owner(command: str, args: argparse.Namespace, create: bool = False
           ) -> Ed25519PrivateKey | str:
    """The owner key (made if missing and ``create``: inviting before the first node
    starts), or a one-line error."""
    path = args.owner_key or default_owner_key_path()
    try:
        key = read_key_file(path)
        if key is None and create:
            key = load_or_create_owner_key(path)
            print(f"made a new owner key in {path}: the swarm's first node uses it "
                  "(keep it safe: it admits members)")
    except (OSError, ValueError) as exc:
        return f"--owner-key={path}: {exc}"
    if key is None:
        return (f"--owner-key={path}: no such file (the node that starts a closed swarm makes "
                "it; pass the one it printed)")
    return key


def run_invite(args: argparse.Namespace) -> int:
    owner = _owner("invite", args, create=True)
    if isinstance(owner, str):
        return _fail("invite", owner)
    if not args.days > 0:
        return _fail("invite", f"--days={args.days}: must be > 0")
    if os.path.exists(args.out):
        return _fail("invite", f"--out={args.out}: exists (an invitation may hold a key: "
                               "choose a new file)")
    identity = b""
    if args.member:
        try:
            member = bytes.fromhex(args.member)
        except ValueError:
            member = b""
        if len(member) != PUBLIC_KEY_BYTES:
            return _fail("invite", f"--member={args.member}: not a 64-hex-digit public key "
                                   "(`gasloc-node id --identity-file FILE` prints it)")
    else:
        key = Ed25519PrivateKey.generate()
        member, identity = public_bytes(key), key.private_bytes_raw()
    invitation = Invitation.issue(owner, member, expires_in(args.days))
    try:
        write_invitation(args.out, invitation, identity)
    except OSError as exc:
        return _fail("invite", f"--out={args.out}: {exc.strerror or exc}")
    until = time.strftime("%Y-%m-%d %H:%M", time.localtime(invitation.expires))
    print(f"invited {invitation.member_id} until {until} into the swarm of owner "
          f"{invitation.owner.hex()[:16]}: wrote {args.out}")
    if identity:
        print("  the file holds the member's key: send it privately; they join with "
              f"gasloc-node join --invitation {os.path.basename(args.out)} --peers ...")
    else:
        print(f"  they join with gasloc-node join --identity-file THEIR_KEY --invitation "
              f"{os.path.basename(args.out)} --peers ...")
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    owner = _owner("revoke", args)
    if isinstance(owner, str):
        return _fail("revoke", owner)
    try:
        check_bootstrap_peers(tuple(args.peers))
    except ConfigError as exc:
        return _fail("revoke", str(exc))
    bad = [m for m in args.member if not m.startswith("g1")]
    if bad:
        return _fail("revoke", f"--member={bad[0]}: not a peer id (g1...; `gasloc-node "
                               "status` lists them)")
    import uvloop

    try:
        rl = uvloop.run(asyncio.wait_for(_revoke(owner, args), args.timeout_s))
    except ConfigError as exc:  # which run is unknown, or not this owner's
        return _fail("revoke", str(exc))
    except Exception as exc:  # noqa: BLE001 - one line, whatever failed
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"gasloc-node revoke: error: {text}", file=sys.stderr)
        return 1
    print(f"revoked {', '.join(args.member)} in run {args.run_id!r}: the owner's list now "
          f"names {len(rl.entries)} peer(s); nodes refuse them within about 10 s")
    return 0


async def _revoke(owner: Ed25519PrivateKey, args: argparse.Namespace) -> RevocationList:
    from gasloc_p2p.node.discovery.dht import HivemindDiscovery

    dht = HivemindDiscovery(args.run_id or "revoke", "127.0.0.1", 0, args.peers,
                            args.timeout_s / 3, args.timeout_s / 2, client_mode=True)
    dht.use_identity(Signer(admission=Admission(public_bytes(owner))), 3600.0)
    await dht.start()
    try:
        if not args.run_id:
            args.run_id = await _run_of(dht, args.peers[0], public_bytes(owner))
            dht.use_run(args.run_id)
        old = await dht.revocations()
        now = time.time()
        entries = {p: t for p, t in (old.entries if old else ()) if t > now}
        entries.update({m: expires_in(args.days, now) for m in args.member})
        issued = max(now, old.issued + 1e-3) if old else now
        rl = RevocationList.issue(owner, entries, issued)
        await dht.publish_revocations(rl)
        return rl
    finally:
        await dht.stop()


async def _run_of(dht: Any, peer: str, owner: bytes) -> str:
    """The run of the manifest ``peer`` serves, if ``owner`` owns it; else ConfigError (a
    revocation written into a guessed run would change nothing and report success)."""
    from gasloc_p2p.node.cli_run import served_manifest

    manifest = await served_manifest(dht, peer)
    if manifest is None:
        raise ConfigError(f"--run-id: the node at {peer} serves no run manifest, so its run is "
                          "unknown; pass --run-id RUN (its start-up line says \"run 'RUN'\")")
    if manifest.owner != owner:
        raise ConfigError(f"--owner-key: run {manifest.run_id} of {peer} is owned by "
                          f"{manifest.owner.hex()[:16]}, not by this key")
    return manifest.run_id


def run_id(args: argparse.Namespace) -> int:
    try:
        signer = load_or_create_identity(args.identity_file)
    except (OSError, ValueError) as exc:
        return _fail("id", f"--identity-file={args.identity_file}: {exc}")
    assert peer_id_of(signer.public_key) == signer.peer_id
    print(f"peer id     {signer.peer_id}")
    print(f"public key  {signer.public_key.hex()}")
    return 0
