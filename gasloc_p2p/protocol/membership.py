"""Who is a member of a closed swarm, without I/O: invitations signed by the swarm's owner.

A closed swarm has an owner: an ed25519 key (``gasloc-node invite`` and ``revoke`` use it;
the node started with it is a member by right). A member holds an :class:`Invitation`: the
owner's signature over the member's public key and an expiry. Every signed message a node
sends (exchange headers, Info and DownloadState requests, DHT records) carries its invitation,
and a node admits a sender only if the invitation names the sender's key, is signed by its own
swarm's owner, has not expired and its peer id is not revoked. So an identity costs the owner's
signature: a member cannot mint keys that others accept.

Revocation is a list of peer ids the owner signs (:class:`RevocationList`), published in the
DHT; an entry can lapse when the invitation it revokes would have expired anyway.
"""

from __future__ import annotations

import base64
import os
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gasloc_p2p.protocol.auth import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, encode_fields, peer_id_of

INVITATION_DOMAIN = "gasloc/invitation"
REVOCATION_DOMAIN = "gasloc/revocation"
INVITATION_BYTES = 1 + 2 * PUBLIC_KEY_BYTES + 8 + SIGNATURE_BYTES  # version, keys, expiry, sig
_VERSION = 1
MAX_REVOKED = 4096  # entries in one revocation list (bounded: it travels in a DHT record)


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw)


def _sign(key: Ed25519PrivateKey, domain: str, fields: Iterable[object]) -> bytes:
    return key.sign(encode_fields([domain, *fields]))


def _valid(public_key: bytes, signature: bytes, domain: str, fields: Iterable[object]) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            signature, encode_fields([domain, *fields]))
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Invitation:
    """The owner's word that ``member`` (an ed25519 public key) belongs to its swarm until
    ``expires`` (unix seconds)."""

    owner: bytes
    member: bytes
    expires: float
    signature: bytes

    @classmethod
    def issue(cls, owner_key: Ed25519PrivateKey, member: bytes, expires: float) -> Invitation:
        owner = public_bytes(owner_key)
        return cls(owner, member, float(expires),
                   _sign(owner_key, INVITATION_DOMAIN, [owner, member, float(expires)]))

    def to_bytes(self) -> bytes:
        return (bytes([_VERSION]) + self.owner + self.member + struct.pack(">d", self.expires)
                + self.signature)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Invitation:
        """ValueError unless ``raw`` is one invitation of this version (size checked first)."""
        if len(raw) != INVITATION_BYTES or raw[0] != _VERSION:
            raise ValueError(f"not an invitation ({len(raw)} bytes)")
        k = PUBLIC_KEY_BYTES
        return cls(raw[1:1 + k], raw[1 + k:1 + 2 * k],
                   struct.unpack(">d", raw[1 + 2 * k:9 + 2 * k])[0], raw[9 + 2 * k:])

    @property
    def member_id(self) -> str:
        return peer_id_of(self.member)

    def problem(self, owner: bytes, public_key: bytes, now: float) -> str | None:
        """Why this invitation does not make ``public_key`` a member of ``owner``'s swarm
        at ``now`` (None: it does)."""
        if self.owner != owner:
            return "invited by another owner"
        if self.member != public_key:
            return "the invitation is for another key"
        if not self.expires > now:
            return "the invitation has expired"
        if not _valid(owner, self.signature, INVITATION_DOMAIN,
                      [self.owner, self.member, self.expires]):
            return "the invitation's signature is not the owner's"
        return None


@dataclass(frozen=True)
class RevocationList:
    """Peer ids the owner revoked, each until a time (unix seconds), and the owner's
    signature over them, ``issued`` (a newer list replaces an older one) and ``expires``
    (the DHT keeps the record that long: its stored expiration must be the signed one)."""

    owner: bytes
    issued: float
    expires: float
    entries: tuple[tuple[str, float], ...]
    signature: bytes

    @classmethod
    def issue(cls, owner_key: Ed25519PrivateKey, entries: dict[str, float],
              issued: float) -> RevocationList:
        """A list of ``entries`` (peer id -> until), kept until its last entry lapses."""
        if len(entries) > MAX_REVOKED:
            raise ValueError(f"at most {MAX_REVOKED} revoked peers in one list")
        items = tuple(sorted((str(p), float(t)) for p, t in entries.items()))
        owner = public_bytes(owner_key)
        expires = max([issued + 60.0, *(t for _, t in items)])
        return cls(owner, float(issued), float(expires), items, _sign(
            owner_key, REVOCATION_DOMAIN, cls._fields(owner, issued, expires, items)))

    @staticmethod
    def _fields(owner: bytes, issued: float, expires: float,
                items: tuple[tuple[str, float], ...]) -> list[object]:
        return [owner, float(issued), float(expires), *[x for item in items for x in item]]

    def to_value(self) -> dict[str, object]:
        """A msgpack-friendly DHT value."""
        return {"owner": self.owner, "issued": self.issued, "expires": self.expires,
                "entries": [[p, t] for p, t in self.entries], "signature": self.signature}

    @classmethod
    def from_value(cls, value: object, owner: bytes,
                   expiration: float | None = None) -> RevocationList | None:
        """The list in a DHT ``value`` if ``owner`` signed it and, given the ``expiration``
        the DHT stores it with, that is the signed one (None otherwise)."""
        try:
            assert isinstance(value, dict)
            raw = value["entries"]
            if not isinstance(raw, list) or len(raw) > MAX_REVOKED:
                return None
            items = tuple((str(p), float(t)) for p, t in raw)
            rl = cls(bytes(value["owner"]), float(value["issued"]), float(value["expires"]),
                     items, bytes(value["signature"]))
        except (AssertionError, KeyError, TypeError, ValueError):
            return None
        if rl.owner != owner or (expiration is not None and expiration != rl.expires):
            return None
        if not _valid(owner, rl.signature, REVOCATION_DOMAIN,
                      cls._fields(rl.owner, rl.issued, rl.expires, rl.entries)):
            return None
        return rl


class Revocations:
    """The revoked peer ids a node knows (from the newest list its owner signed); shared by
    the node's verifiers, updated while it runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}
        self.issued = -1.0
        self.latest: RevocationList | None = None  # the list adopted (re-published by nodes)

    def update(self, rl: RevocationList) -> bool:
        """Adopt ``rl`` if it is newer than the list held; whether it was."""
        with self._lock:
            if rl.issued <= self.issued:
                return False
            self.issued, self._until, self.latest = rl.issued, dict(rl.entries), rl
            return True

    def revoked(self, peer_id: str, now: float) -> bool:
        until = self._until.get(peer_id)
        return until is not None and until > now

    def entries(self) -> dict[str, float]:
        with self._lock:
            return dict(self._until)


def read_key_file(path: str) -> Ed25519PrivateKey | None:
    """The ed25519 key in ``path`` (32 raw bytes), None if the file does not exist;
    ValueError if it holds something else."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    if len(raw) != 32:
        raise ValueError(f"{path} holds {len(raw)} bytes, not a 32-byte ed25519 key")
    return Ed25519PrivateKey.from_private_bytes(raw)


def load_or_create_owner_key(path: str) -> Ed25519PrivateKey:
    """The owner key in ``path``, created there (mode 0600, its folder too) if missing."""
    key = read_key_file(path)
    if key is not None:
        return key
    key = Ed25519PrivateKey.generate()
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                  serialization.NoEncryption()))
    return key


INVITE_HEADER = "gasloc-invitation-v1"


def write_invitation(path: str, invitation: Invitation, identity: bytes = b"") -> None:
    """An invitation file (mode 0600): the invitation and, if the owner made the member's key
    too, that private key (then the file is the member's identity: send it privately)."""
    lines = [INVITE_HEADER, "invitation " + base64.b64encode(invitation.to_bytes()).decode()]
    if identity:
        lines.append("identity " + base64.b64encode(identity).decode())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def read_invitation(path: str) -> tuple[Invitation, bytes]:
    """(invitation, the member's private key or b"") from an invitation file; ValueError if
    the file is not one."""
    with open(path, "rb") as f:
        text = f.read(4096).decode("ascii", errors="replace")
    fields = dict(line.split(" ", 1) for line in text.splitlines()[1:] if " " in line)
    if not text.startswith(INVITE_HEADER) or "invitation" not in fields:
        raise ValueError(f"{path} is not an invitation file (made by `gasloc-node invite`)")
    try:
        invitation = Invitation.from_bytes(base64.b64decode(fields["invitation"], validate=True))
        identity = base64.b64decode(fields.get("identity", ""), validate=True)
    except ValueError as exc:
        raise ValueError(f"{path}: a damaged invitation ({exc})") from None
    if not _valid(invitation.owner, invitation.signature, INVITATION_DOMAIN,
                  [invitation.owner, invitation.member, invitation.expires]):
        raise ValueError(f"{path}: a damaged invitation (its signature does not verify)")
    if identity and len(identity) != 32:
        raise ValueError(f"{path}: a damaged identity ({len(identity)} bytes)")
    if identity and public_bytes(Ed25519PrivateKey.from_private_bytes(identity)) != \
            invitation.member:
        raise ValueError(f"{path}: its identity is not the invited key")
    return invitation, identity


def expires_in(days: float, now: float | None = None) -> float:
    return (time.time() if now is None else now) + days * 86400.0


class Admission:
    """A closed swarm's rule: its owner's public key and the revocations known so far."""

    def __init__(self, owner: bytes, revocations: Revocations | None = None) -> None:
        if len(owner) != PUBLIC_KEY_BYTES:
            raise ValueError("an owner is a 32-byte ed25519 public key")
        self.owner = owner
        self.revocations = revocations or Revocations()

    def admits(self, public_key: bytes, invitation: bytes, now: float) -> str | None:
        """Why the holder of ``public_key`` showing ``invitation`` is not a member (None:
        it is)."""
        if not invitation:
            return "no invitation"
        try:
            inv = Invitation.from_bytes(invitation)
        except ValueError as exc:
            return str(exc)
        why = inv.problem(self.owner, public_key, now)
        if why is None and self.revocations.revoked(inv.member_id, now):
            why = "revoked by the owner"
        return why

    def __reduce__(self) -> tuple[object, ...]:  # into the DHT process: the owner only
        return (Admission, (self.owner,))
