"""Signed, owned peer records: what a node announces, and the checks every reader applies.

A record about peer X sits under the run key with X's peer id as subkey. Its value carries X's
ed25519 public key, the record's expiration and X's signature over the run key, the subkey,
every announced field and that expiration (keyed by the swarm secret, if any). A reader accepts
it only if the public key hashes to the subkey, the signature verifies, the signed expiration
is the one the DHT stores, it lies at most ``max_ttl_s`` ahead, the TLS certificate it
announces names X, and (in a closed swarm) X's invitation from the owner comes with it: nobody but X can write a record for X, nor make a captured one live longer
than X asked, and a client that dials X trusts only the certificate X signed.

The same checks run as a hivemind record validator inside the DHT process
(:class:`RecordValidator`), so honest DHT nodes refuse to store a forged or overwriting record
and drop one returned by another node; and again when the node reads the list.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from gasloc_p2p.node.discovery.base import PeerInfo
from gasloc_p2p.protocol.auth import Signer, Verifier
from gasloc_p2p.protocol.certs import cert_name
from gasloc_p2p.protocol.membership import RevocationList

log = logging.getLogger(__name__)
RECORD_DOMAIN = "gasloc/record"
SIGNED_KEYS = ("public_key", "expires", "signature")


def _fields(key: str, info: PeerInfo, public_key: bytes, invitation: bytes,
            expires: float) -> list[object]:
    fields: list[object] = [
        key, info.peer_id, info.endpoint, info.protocol_version, info.fingerprint, info.step,
        float(info.tokens_per_s), info.reachable, ",".join(info.codecs), info.algorithm,
        info.cert, public_key, invitation, float(expires)]
    if info.relays:  # (signed only when present: older records still verify)
        fields.append(",".join(info.relays))
    return fields


def signed_value(key: str, info: PeerInfo, signer: Signer, expires: float) -> dict[str, Any]:
    """The DHT value announcing ``info`` (whose peer id must be ``signer``'s) until ``expires``
    (DHT time, seconds)."""
    if info.peer_id != signer.peer_id:
        raise ValueError("a node announces only itself")
    value = info.to_value()
    value.update(public_key=signer.public_key, expires=float(expires),
                 invitation=signer.invitation,
                 signature=signer.sign(RECORD_DOMAIN, _fields(
                     key, info, signer.public_key, signer.invitation, expires)))
    return value


def verify_record(key: str, subkey: Any, value: Any, expiration: float | None,
                  verifier: Verifier, now: float, max_ttl_s: float) -> PeerInfo | None:
    """The announced :class:`PeerInfo` if the record is X's own and live (see the module
    docstring), else None (logged at DEBUG). ``expiration``: what the DHT stores for it."""
    info = PeerInfo.from_value(subkey, value)
    if info is None or not isinstance(subkey, str):
        log.debug("dropping a malformed record under %s", key)
        return None
    try:
        public_key, expires, signature = (value[k] for k in SIGNED_KEYS)
        expires = float(expires)
        invitation = value.get("invitation", b"")
    except (KeyError, TypeError, ValueError):
        log.debug("dropping an unsigned record for %r", subkey[:64])
        return None
    why = None
    if not all(isinstance(x, bytes) for x in (public_key, signature, invitation)):
        why = "malformed key, signature or invitation"
    elif expiration is not None and expires != expiration:
        why = "its expiration is not the signed one"
    elif not math.isfinite(expires) or expires > now + max_ttl_s:
        why = f"expires more than {max_ttl_s:g} s ahead"
    elif (why := _cert_problem(info)) is None:
        why = verifier.verify(subkey, public_key, signature, RECORD_DOMAIN,
                              _fields(key, info, public_key, invitation, expires))
        if why is None:  # a closed swarm: only members' records
            why = verifier.admits(public_key, invitation)
    if why is not None:
        log.debug("dropping the record for %r: %s", subkey[:64], why)
        return None
    return info


def _cert_problem(info: PeerInfo) -> str | None:
    """Why the record's TLS certificate cannot stand for its peer (None: it names it)."""
    try:
        name = cert_name(info.cert)
    except ValueError as exc:
        return str(exc)
    return None if name == info.peer_id else "its certificate names another peer"


def make_validator(key: str, verifier: Verifier, max_ttl_s: float,
                   revoked_key: str = "") -> Any:
    """A hivemind ``RecordValidatorBase`` enforcing :func:`verify_record` on ``key``'s records
    and, under ``revoked_key``, only revocation lists the swarm's owner signed (none outside
    closed swarms); other keys pass. Built here so hivemind is imported only where a DHT
    runs."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase
    from hivemind.utils import MSGPackSerializer, get_dht_time

    key_id = DHTID.generate(source=key).to_bytes()
    revoked_id = DHTID.generate(source=revoked_key).to_bytes() if revoked_key else b""

    class RecordValidator(RecordValidatorBase):
        def validate(self, record: DHTRecord) -> bool:
            if record.key not in (key_id, revoked_id):
                return True
            try:
                subkey = MSGPackSerializer.loads(record.subkey)
                value = MSGPackSerializer.loads(record.value)
            except Exception:  # noqa: BLE001 - any undecodable record is invalid
                return False
            if record.key == revoked_id:
                owner = verifier.admission.owner if verifier.admission is not None else b""
                return bool(owner) and subkey == owner.hex() and RevocationList.from_value(
                    value, owner, record.expiration_time) is not None
            return verify_record(key, subkey, value, record.expiration_time, verifier,
                                 get_dht_time(), max_ttl_s) is not None

        def __reduce__(self) -> tuple[object, ...]:  # pickled into the DHT process by value
            return (make_validator, (key, verifier, max_ttl_s, revoked_key))

    return RecordValidator()
