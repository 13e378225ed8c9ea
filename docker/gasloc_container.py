#!/opt/gasloc/venv/bin/python
"""Helpers of the gasloc container image (installed as ``gasloc-container``; not the package).

``gasloc-container health [HOST:PORT]``
    Exit 0 when the node's gRPC ``Info`` answers within ``--timeout-s``: the image's
    HEALTHCHECK. HOST:PORT defaults to ``127.0.0.1:$GASLOC_PORT``. It imports only grpc and the
    generated stubs (about 0.2 s), not the CLI (about 2.5 s of CPU with torch).

``gasloc-container join-via HOST:GRPC_PORT [gasloc-node join flags...]``
    Wait until the node at HOST:GRPC_PORT answers ``Info``, build its DHT multiaddr
    ``/dns4/HOST/tcp/DHT_PORT/p2p/PEER_ID`` and ``exec gasloc-node join --peers MADDR flags...``
    (the same process, so signals from the init still reach the node). A bootstrap node's peer
    id is random at each start, so compose workers cannot name it statically. DHT_PORT is
    ``$GASLOC_BOOTSTRAP_DHT_PORT``, else ``$GASLOC_DHT_PORT`` (every container uses the same
    fixed port); the wait is bounded by ``$GASLOC_BOOTSTRAP_TIMEOUT_S`` (default 600 s).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import time

INFO_TIMEOUT_S = 5.0
RETRY_S = 2.0


def fetch_peer_id(endpoint: str, timeout_s: float) -> str:
    """The DHT peer id a node reports in ``Info`` (health-level: no signature needed); raises
    ``grpc.RpcError`` if it does not answer."""
    from gasloc_p2p.node.transport.tls import unpinned_channel
    from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
    from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2_grpc as pb_grpc

    with unpinned_channel(endpoint, timeout_s) as channel:
        reply = pb_grpc.GossipStub(channel).Info(pb.InfoRequest(), timeout=timeout_s)
    return str(reply.dht_peer_id or reply.peer_id)


def health(args: argparse.Namespace) -> int:
    import grpc

    endpoint = args.endpoint or f"127.0.0.1:{os.environ.get('GASLOC_PORT', '50051')}"
    try:
        peer_id = fetch_peer_id(endpoint, args.timeout_s)
    except grpc.RpcError as exc:
        print(f"unhealthy: Info on {endpoint}: {exc.code().name}", file=sys.stderr)
        return 1
    except OSError as exc:  # no TLS answer: nothing listens, or not a node
        print(f"unhealthy: no TLS answer on {endpoint}: {exc}", file=sys.stderr)
        return 1
    print(f"healthy: {peer_id} at {endpoint}")
    return 0


def multiaddr(host: str, port: int, peer_id: str) -> str:
    try:
        proto = f"ip{ipaddress.ip_address(host).version}"
    except ValueError:
        proto = "dns4"  # hivemind's p2pd resolves /dns4 names (checked with hivemind 1.1.12)
    return f"/{proto}/{host}/tcp/{port}/p2p/{peer_id}"


def join_via(args: argparse.Namespace) -> int:
    import grpc

    host, _, _ = args.bootstrap.rpartition(":")
    dht_port = int(os.environ.get("GASLOC_BOOTSTRAP_DHT_PORT")
                   or os.environ.get("GASLOC_DHT_PORT") or "31337")
    deadline = time.monotonic() + float(os.environ.get("GASLOC_BOOTSTRAP_TIMEOUT_S", "600"))
    while True:
        try:
            peer_id = fetch_peer_id(args.bootstrap, INFO_TIMEOUT_S)
            break
        except (grpc.RpcError, OSError) as exc:  # OSError: no TLS answer yet
            if time.monotonic() > deadline:
                why = exc.code().name if isinstance(exc, grpc.RpcError) else str(exc)
                print(f"join-via: bootstrap {args.bootstrap} did not answer Info ({why}); "
                      "giving up", file=sys.stderr)
                return 1
            time.sleep(RETRY_S)
    maddr = multiaddr(host.strip("[]"), dht_port, peer_id)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    owner = os.environ.get("GASLOC_INVITE_FROM", "")
    if owner and not any(f.split("=")[0] in CREDENTIALS for f in flags):
        flags = [*flags, "--invitation", invite_self(owner)]
    argv = ["gasloc-node", "join", "--peers", maddr, *flags]
    print(f"join-via: bootstrap {args.bootstrap} is {maddr}", flush=True)
    os.execvp(argv[0], argv)  # replaces this process: no return


CREDENTIALS = ("--invitation", "--swarm-key", "--owner-key", "--open")


def invite_self(owner_path: str) -> str:
    """An invitation file (with a new key) signed by the owner key at ``owner_path``: a local
    compose swarm shares its owner key with its workers so that each can invite itself. Over
    the internet the owner keeps the key and sends each member its invitation file."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gasloc_p2p.protocol.membership import (
        Invitation,
        expires_in,
        public_bytes,
        read_key_file,
        write_invitation,
    )

    owner = read_key_file(owner_path)
    if owner is None:
        raise SystemExit(f"join-via: no owner key at {owner_path} (GASLOC_INVITE_FROM)")
    key = Ed25519PrivateKey.generate()
    path = f"/tmp/gasloc-{os.getpid()}.invite"
    write_invitation(path, Invitation.issue(owner, public_bytes(key), expires_in(30.0)),
                     key.private_bytes_raw())
    return path


def main() -> int:
    parser = argparse.ArgumentParser(prog="gasloc-container", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("health", help="exit 0 if the node answers Info")
    p.add_argument("endpoint", nargs="?", help="HOST:PORT (default 127.0.0.1:$GASLOC_PORT)")
    p.add_argument("--timeout-s", type=float, default=INFO_TIMEOUT_S)
    p.set_defaults(func=health)
    p = sub.add_parser("join-via", help="join the swarm of the node at HOST:GRPC_PORT")
    p.add_argument("bootstrap", help="HOST:GRPC_PORT of a running node")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="more gasloc-node join flags")
    p.set_defaults(func=join_via)
    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
