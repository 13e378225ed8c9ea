"""A node's TLS certificate, without I/O: self-signed, naming the node's peer id.

The certificate is announced in the node's DHT record, which the node's ed25519 key signs, so
the record binds it to the peer id; clients then trust that certificate alone
(:mod:`gasloc_p2p.node.transport.tls`). No certificate authority is involved.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

MAX_CERT_BYTES = 2048  # a P-256 self-signed certificate is about 400 bytes of DER
_NOT_BEFORE = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)  # clocks may be off
_NOT_AFTER = datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)  # the record expires, not this


@dataclass(frozen=True)
class TlsIdentity:
    """A node's TLS key (PEM) and self-signed certificate (DER) for ``name``, its peer id."""

    name: str
    key_pem: bytes = field(repr=False)
    cert_der: bytes

    @classmethod
    def generate(cls, name: str) -> TlsIdentity:
        """A fresh ECDSA P-256 key and certificate (about 20 ms)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), False)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), True)
                .sign(key, hashes.SHA256()))
        return cls(name, key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()),
                   cert.public_bytes(serialization.Encoding.DER))


def cert_name(der: bytes) -> str:
    """The name a certificate (DER) is for, its first DNS name; ValueError if it is empty,
    too large, does not parse or names nothing."""
    if not der or len(der) > MAX_CERT_BYTES:
        raise ValueError(f"certificate of {len(der)} bytes")
    try:
        cert = x509.load_der_x509_certificate(der)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise ValueError(f"not a certificate with a name ({exc})") from None
    dns = names.get_values_for_type(x509.DNSName)
    if not dns:
        raise ValueError("certificate without a DNS name")
    return str(dns[0])
