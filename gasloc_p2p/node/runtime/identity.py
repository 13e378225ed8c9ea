"""Who a node is and which swarm it belongs to: its key, and its membership credential.

A node's membership follows from its flags (:meth:`NetworkConfig.admission_problem` refuses
the combinations that make no sense):

- ``--invitation FILE``: a member of the owner's closed swarm that the invitation names; its
  key is the one in the file (the owner made it) or ``--identity-file``'s (the owner signed
  its public key);
- ``--owner-key FILE``, or no credential at all on a node that starts a swarm: the owner of a
  closed swarm (its key is created if missing, by default under ``$XDG_DATA_HOME``), a member
  by its own invitation;
- ``--swarm-key FILE`` alone: any holder of the shared secret;
- ``--open``: anyone.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gasloc_p2p.node.config_network import NetworkConfig
from gasloc_p2p.protocol.auth import Signer, load_or_create_identity
from gasloc_p2p.protocol.membership import (
    Admission,
    Invitation,
    load_or_create_owner_key,
    public_bytes,
    read_invitation,
)

log = logging.getLogger(__name__)
OWNER_INVITATION_DAYS = 365.0  # the owner's own node renews this at every start


def default_owner_key_path() -> str:
    """Where a node that starts a closed swarm keeps its owner key by default."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return os.path.join(base, "gasloc_p2p", "owner.key")


@dataclass(frozen=True)
class Membership:
    """A node's signer (key, swarm secret, admission rule, own invitation) and, for the
    start-up log, what kind of member it is and the owner key's file (owners only)."""

    signer: Signer
    role: str  # "owner", "member", "keyed" or "open"
    owner_key_path: str = ""

    @property
    def owner_id(self) -> str:
        """The owner's public key, hex (empty outside closed swarms)."""
        admission = self.signer.admission
        return admission.owner.hex() if admission is not None else ""


def build_membership(net: NetworkConfig, joining: bool) -> Membership:
    """The node's :class:`Membership` from its network flags (validated before)."""
    secret = net.swarm_secret()

    def own_key(admission: Admission | None, invitation: bytes) -> Signer:
        if net.identity_file:
            return load_or_create_identity(net.identity_file, secret, admission, invitation)
        return Signer(swarm_key=secret, admission=admission, invitation=invitation)

    if net.invitation:
        invitation, identity = read_invitation(net.invitation)
        admission = Admission(invitation.owner)
        if identity:
            signer = Signer.from_private_bytes(identity, secret, admission,
                                               invitation.to_bytes())
        else:
            signer = own_key(admission, invitation.to_bytes())
            if signer.public_key != invitation.member:
                raise ValueError(f"--invitation={net.invitation} is for another key than "
                                 f"--identity-file={net.identity_file or '(none)'}")
        why = admission.admits(signer.public_key, invitation.to_bytes(), time.time())
        if why is not None:
            raise ValueError(f"--invitation={net.invitation}: {why}")
        return Membership(signer, "member")
    if net.owner_key or not (secret or joining or net.open_swarm):
        path = net.owner_key or default_owner_key_path()
        owner = load_or_create_owner_key(path)
        admission = Admission(public_bytes(owner))
        signer = own_key(admission, b"")
        invitation = Invitation.issue(owner, signer.public_key,
                                      time.time() + OWNER_INVITATION_DAYS * 86400)
        return Membership(_with_invitation(signer, invitation.to_bytes()), "owner", path)
    return Membership(own_key(None, b""), "keyed" if secret else "open")


def _with_invitation(signer: Signer, invitation: bytes) -> Signer:
    key = Ed25519PrivateKey.from_private_bytes(signer.private_bytes())
    return Signer(key, signer.swarm_key, signer.admission, invitation)
