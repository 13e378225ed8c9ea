"""TLS for every gRPC connection, pinned by the peer's signed record (no certificate authority).

Each node makes an ECDSA P-256 key and a self-signed certificate naming its peer id at start-up
(:class:`~gasloc_p2p.protocol.certs.TlsIdentity`), serves gRPC only over TLS with it, and
announces the certificate in its DHT record, which its ed25519 key signs
(:mod:`gasloc_p2p.node.discovery.records`). A client dials a peer with that one certificate as
its only trust root and the peer id as the expected name: only the process holding the
certificate's key completes the handshake, so an on-path proxy can neither read nor change a
byte. gRPC's own TLS (BoringSSL) does the work: encryption, integrity, the handshake.

Local tools that know only a ``host:port`` (``gasloc-node swarm``, ``status --endpoint``, the
container health check) fetch the certificate the port presents first
(:func:`fetch_certificate`): trust on first use, for a node the user points them at.
"""

from __future__ import annotations

import ssl
from typing import Any

import grpc

from gasloc_p2p.protocol.certs import TlsIdentity, cert_name


def server_credentials(tls: TlsIdentity) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(tls.key_pem, cert_pem(tls.cert_der))])


def cert_pem(der: bytes) -> bytes:
    return ssl.DER_cert_to_PEM_cert(der).encode()


def channel_args(der: bytes) -> tuple[grpc.ChannelCredentials, list[tuple[str, Any]]]:
    """Credentials trusting only ``der`` and the option that makes gRPC check the name in it
    (the peer id) instead of the dialed host. ValueError if ``der`` names nothing."""
    name = cert_name(der)
    return (grpc.ssl_channel_credentials(root_certificates=cert_pem(der)),
            [("grpc.ssl_target_name_override", name)])


def secure_channel(endpoint: str, der: bytes,
                   options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``endpoint`` that completes only with the holder of ``der``."""
    creds, extra = channel_args(der)
    return grpc.aio.secure_channel(endpoint, creds, options=[*(options or []), *extra])


def fetch_certificate(endpoint: str, timeout_s: float = 5.0) -> bytes:
    """The certificate (DER) that ``host:port`` presents, unverified (trust on first use).
    OSError if nothing answers in time."""
    host, port = endpoint.rsplit(":", 1)
    pem = ssl.get_server_certificate((host.strip("[]"), int(port)), timeout=timeout_s)
    return ssl.PEM_cert_to_DER_cert(pem)


def unpinned_channel(endpoint: str, timeout_s: float = 5.0) -> grpc.Channel:
    """A blocking channel to the node at ``endpoint``, trusting the certificate it presents
    now (local tools only)."""
    creds, extra = channel_args(fetch_certificate(endpoint, timeout_s))
    return grpc.secure_channel(endpoint, creds, options=extra)
