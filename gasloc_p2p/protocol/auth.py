"""Node identity and message authentication, without I/O.

Each node holds an ed25519 key. Its peer id is derived from the public key
(:func:`peer_id_of`), so an id cannot be claimed without the key: whoever signs for a peer id
must show a public key that hashes to it. Everything a node signs (exchange headers and
commits, DHT records, Info and DownloadState requests) goes through :meth:`Signer.digest`:
sha256 of a domain tag and length-prefixed fields, or, with a swarm key (``--swarm-key``),
HMAC-SHA256 keyed by that secret. Without the secret one can neither produce a signature that
members accept nor check theirs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
NONCE_BYTES = 16
PEER_ID_PREFIX = "g1"  # version of the id scheme

if TYPE_CHECKING:
    from gasloc_p2p.protocol.membership import Admission


def peer_id_of(public_key: bytes) -> str:
    """The peer id of an ed25519 public key: ``g1`` + base32 of 20 bytes of its sha256."""
    digest = hashlib.sha256(b"gasloc-peer-id" + public_key).digest()[:20]
    return PEER_ID_PREFIX + base64.b32encode(digest).decode().lower()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def encode_fields(fields: Iterable[object]) -> bytes:
    """An unambiguous byte string of ``fields`` (length-prefixed; ints/floats by value)."""
    out = bytearray()
    for f in fields:
        if isinstance(f, bool | int):
            data = b"i" + str(int(f)).encode()
        elif isinstance(f, float):
            data = b"f" + struct.pack(">d", f)
        elif isinstance(f, str):
            data = b"s" + f.encode()
        elif isinstance(f, bytes | bytearray):
            data = b"b" + bytes(f)
        else:
            raise TypeError(f"cannot sign a {type(f).__name__}")
        out += struct.pack(">I", len(data)) + data
    return bytes(out)


@dataclass(frozen=True)
class Verifier:
    """Checks signatures made with the same swarm key (empty: none) and, in a closed swarm
    (``admission``), that the signer holds an invitation from the swarm's owner."""

    swarm_key: bytes = b""
    admission: Admission | None = None

    def admits(self, public_key: bytes, invitation: bytes, now: float | None = None
               ) -> str | None:
        """Why the holder of ``public_key`` showing ``invitation`` is not a member (None:
        it is, or the swarm admits any key)."""
        if self.admission is None:
            return None
        return self.admission.admits(public_key, invitation,
                                     time.time() if now is None else now)

    def digest(self, domain: str, fields: Iterable[object]) -> bytes:
        data = encode_fields([domain, *fields])
        if self.swarm_key:
            return hmac.new(self.swarm_key, data, hashlib.sha256).digest()
        return hashlib.sha256(data).digest()

    def verify(self, peer_id: str, public_key: bytes, signature: bytes, domain: str,
               fields: Iterable[object]) -> str | None:
        """Why ``signature`` is not ``peer_id``'s over ``fields`` (None: it is)."""
        if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            return "missing or malformed public key or signature"
        if peer_id_of(public_key) != peer_id:
            return "the public key does not match the peer id"
        try:
            Ed25519PublicKey.from_public_bytes(public_key).verify(
                signature, self.digest(domain, fields))
        except (InvalidSignature, ValueError):
            return "bad signature (wrong key, or another --swarm-key)"
        return None


class Signer(Verifier):
    """A node's key pair; signs digests (with the swarm key, if any)."""

    def __init__(self, private_key: Ed25519PrivateKey | None = None,
                 swarm_key: bytes = b"", admission: Admission | None = None,
                 invitation: bytes = b"") -> None:
        super().__init__(swarm_key, admission)
        object.__setattr__(self, "invitation", invitation)  # what this node shows as member
        key = private_key or Ed25519PrivateKey.generate()
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "public_key", key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw))
        object.__setattr__(self, "peer_id", peer_id_of(self.public_key))

    _key: Ed25519PrivateKey
    public_key: bytes
    peer_id: str
    invitation: bytes

    def sign(self, domain: str, fields: Iterable[object]) -> bytes:
        return self._key.sign(self.digest(domain, fields))

    def private_bytes(self) -> bytes:
        return self._key.private_bytes(serialization.Encoding.Raw,
                                       serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())

    @classmethod
    def from_private_bytes(cls, raw: bytes, swarm_key: bytes = b"",
                           admission: Admission | None = None,
                           invitation: bytes = b"") -> Signer:
        return cls(Ed25519PrivateKey.from_private_bytes(raw), swarm_key, admission, invitation)

    def __reduce__(self) -> tuple[object, ...]:  # picklable (the DHT validator's child process)
        return (Signer.from_private_bytes, (self.private_bytes(), self.swarm_key,
                                            self.admission, self.invitation))


def load_or_create_identity(path: str, swarm_key: bytes = b"",
                            admission: Admission | None = None,
                            invitation: bytes = b"") -> Signer:
    """The key pair stored in ``path`` (32 raw bytes), created there (mode 0600) if missing:
    a node keeps its peer id across restarts. ValueError if the file holds something else."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        signer = Signer(swarm_key=swarm_key, admission=admission, invitation=invitation)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(signer.private_bytes())
        return signer
    if len(raw) != 32:
        raise ValueError(f"identity file {path} holds {len(raw)} bytes, not a 32-byte ed25519 "
                         "key (delete it to create a new identity)")
    return Signer.from_private_bytes(raw, swarm_key, admission, invitation)


def read_swarm_key(path: str) -> bytes:
    """The shared secret in ``path`` (its bytes, surrounding whitespace removed); ValueError
    if it is shorter than 16 bytes."""
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"swarm key file {path} holds {len(secret)} bytes; use at least 16 "
                         "(e.g. `head -c 32 /dev/urandom | base64 > swarm.key`)")
    return secret
