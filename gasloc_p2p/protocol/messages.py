"""Wire-level helpers for the Exchange stream: messages, header checks, errors, rate limiting.

The message types are the generated ones from ``proto/gasloc/v1/gasloc.proto``. Errors carry a
:class:`RejectCode` value so they can travel in-band as ``Reject``/``Abort`` messages.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from gasloc_p2p.core.codecs import BLOCK_CODECS, PLAIN_CODECS, CodecSpec
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.links import STATE_BYTES
from gasloc_p2p.core.wire import DIGEST_BYTES, RESIDUAL_CODECS
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.auth import Signer, Verifier, peer_id_of
from gasloc_p2p.protocol.engine import Prepared
from gasloc_p2p.safelog import safe

# 3: signed headers, commits and requests (protocol/auth.py); 4: the responder's payload waits
# for the initiator's proof of key; 5: payloads are Q(p) (no per-peer references, no link
# versions); 6: payload SHA-256, requests bound to their target; 7: TLS, certificates in the
# signed records, requests carry a challenge the server issued
PROTOCOL_VERSION = 8
MAX_CHUNK_BYTES = 1 << 20  # protocol limit on one Chunk's payload (1 MiB)
# Block sizes a responder accepts besides its own: a peer's header never picks another one, so
# it cannot make this node allocate (or cache codecs for) sizes of its choosing.
STANDARD_BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)

BUSY = pb.BUSY
VERSION_MISMATCH = pb.VERSION_MISMATCH
FINGERPRINT_MISMATCH = pb.FINGERPRINT_MISMATCH
RUN_MISMATCH = pb.RUN_MISMATCH
BAD_REQUEST = pb.BAD_REQUEST
INTERNAL = pb.INTERNAL
UNAUTHENTICATED = pb.UNAUTHENTICATED
LINK_OUT_OF_STEP = pb.LINK_OUT_OF_STEP
REFUSED = "refused"  # all a caller that is not a member reads (the reason stays in our log)


def code_name(code: int) -> str:
    return str(pb.RejectCode.Name(code)) if code in pb.RejectCode.values() else str(code)


class ExchangeError(Exception):
    """An exchange failed; nothing was applied. ``code`` is a ``RejectCode`` value."""

    def __init__(self, code: int, message: str) -> None:
        # the message may come from the peer (Reject, Abort): escaped, it cannot forge log lines
        super().__init__(f"{code_name(code)}: {safe(message, 200)}")
        self.code = code
        self.message = message


class Rejected(ExchangeError):
    """The responder refused to start (``Reject``)."""


class PeerAborted(ExchangeError):
    """The peer sent ``Abort``."""


class ProtocolError(ExchangeError):
    """The peer broke the protocol (order, sizes, CRC, timeouts): we abort."""

    def __init__(self, message: str, code: int = BAD_REQUEST) -> None:
        super().__init__(code, message)


class ImplausiblePayload(ProtocolError):
    """The peer's payload implies an implausibly large correction (the bounded-update guard):
    we abort before Commit and back the peer off."""


class MessageStream(Protocol):
    """What both ends of a bidirectional gRPC stream offer (call object / servicer context)."""

    async def read(self) -> Any: ...

    async def write(self, message: Any) -> None: ...


@dataclass(frozen=True)
class Identity:
    """Who this node is, as peers see it in every header.

    ``signer`` (the node's key; ``peer_id`` is then its id): headers and commits are signed
    and peers' signatures required. None only where nothing crosses a network (the simulator,
    in-memory protocol tests).
    """

    run_id: str
    fingerprint: str
    peer_id: str
    signer: Signer | None = field(default=None, compare=False, repr=False)

    @classmethod
    def keyed(cls, run_id: str, fingerprint: str, signer: Signer) -> Identity:
        return cls(run_id, fingerprint, signer.peer_id, signer)


def make_header(me: Identity, prep: Prepared, fragment_count: int,
                link_seed: bool = False) -> pb.ExchangeMsg:
    """Our Header for ``prep``: a residual payload names its link's state; ``link_seed``
    asks (or agrees) to seed a link with this plain exchange."""
    enc = prep.encoded
    return pb.ExchangeMsg(header=pb.Header(
        protocol_version=PROTOCOL_VERSION, run_id=me.run_id, model_fingerprint=me.fingerprint,
        peer_id=me.peer_id, codec=enc.codec, block_size=enc.block_size,
        fragment_index=prep.fragment.index, fragment_count=fragment_count,
        fragment_numel=prep.fragment.numel, payload_bytes=len(prep.payload),
        payload_digest=prep.digest, rounds=prep.rounds0,
        link_state=prep.link.state if prep.link is not None else b"", link_seed=link_seed))


HEADER_DOMAIN = "gasloc/header"
COMMIT_DOMAIN = "gasloc/commit"


def header_fields(h: pb.Header, peer_nonce: bytes) -> list[object]:
    """What a header's signature covers: every field but the signature, and the other side's
    nonce."""
    fields = [h.protocol_version, h.run_id, h.model_fingerprint, h.peer_id, h.codec,
              h.block_size, h.fragment_index, h.fragment_count, h.fragment_numel,
              h.payload_bytes, h.payload_digest, h.rounds, h.public_key, h.nonce, h.invitation,
              peer_nonce]
    # the link fields only where set: a header without them verifies as before they existed
    return fields + ([h.link_state, h.link_seed] if h.link_state or h.link_seed else [])


def sign_header(msg: pb.ExchangeMsg, signer: Signer, nonce: bytes,
                peer_nonce: bytes) -> pb.ExchangeMsg:
    """``msg`` (a Header) with our key, ``nonce`` and signature set."""
    h = msg.header
    h.public_key, h.nonce, h.invitation = signer.public_key, nonce, signer.invitation
    h.signature = signer.sign(HEADER_DOMAIN, header_fields(h, peer_nonce))
    return msg


def check_header_auth(h: pb.Header, verifier: Verifier, peer_nonce: bytes) -> ExchangeError | None:
    """Why ``h`` is not signed by the key of its ``peer_id``, a member of this swarm (None:
    it is)."""
    if len(h.nonce) != 16:
        return ExchangeError(UNAUTHENTICATED, "header without a 16-byte nonce")
    why = verifier.verify(h.peer_id, h.public_key, h.signature, HEADER_DOMAIN,
                          header_fields(h, peer_nonce))
    if why is None:
        why = verifier.admits(h.public_key, h.invitation)
    return None if why is None else ExchangeError(UNAUTHENTICATED, f"header: {why}")


def commit_fields(initiator: pb.Header, responder: pb.Header) -> list[object]:
    return [initiator.nonce, responder.nonce, initiator.payload_digest, responder.payload_digest,
            initiator.peer_id, responder.peer_id]


INFO_DOMAIN = "gasloc/info"
STATE_DOMAIN = "gasloc/state"
RELAY_DOMAIN = "gasloc/relay"


def info_fields(r: pb.InfoRequest) -> list[object]:
    fields: list[object] = [r.probe_endpoint, r.probe_cert, r.auth.timestamp, r.auth.target,
                            r.auth.nonce, r.auth.invitation]
    if r.punch_endpoint or r.punch_local:  # (signed as before without them)
        fields += [r.punch_endpoint, r.punch_local]
    return fields


def state_fields(r: pb.StateRequest) -> list[object]:
    return [r.protocol_version, r.run_id, r.model_fingerprint, r.auth.timestamp, r.auth.target,
            r.auth.nonce, r.auth.invitation]


def relay_fields(r: pb.RelayRequest) -> list[object]:
    return [r.target_peer, r.token, r.auth.timestamp, r.auth.target, r.auth.nonce,
            r.auth.invitation]


def _stamp(auth: pb.Auth, signer: Signer, now: float, target: str, challenge: bytes) -> None:
    auth.public_key, auth.timestamp = signer.public_key, now
    auth.target, auth.nonce, auth.invitation = target, challenge, signer.invitation


def sign_info_request(r: pb.InfoRequest, signer: Signer, now: float, target: str,
                      challenge: bytes) -> pb.InfoRequest:
    """``r`` signed for the node whose peer id is ``target``, with the ``challenge`` it
    issued."""
    _stamp(r.auth, signer, now, target, challenge)
    r.auth.signature = signer.sign(INFO_DOMAIN, info_fields(r))
    return r


def sign_state_request(r: pb.StateRequest, signer: Signer, now: float, target: str,
                       challenge: bytes) -> pb.StateRequest:
    """``r`` signed for the node whose peer id is ``target``, with the ``challenge`` it
    issued."""
    _stamp(r.auth, signer, now, target, challenge)
    r.auth.signature = signer.sign(STATE_DOMAIN, state_fields(r))
    return r


def sign_relay_request(r: pb.RelayRequest, signer: Signer, now: float, target: str,
                       challenge: bytes) -> pb.RelayRequest:
    """``r`` signed for the relay whose peer id is ``target``, with the ``challenge`` it
    issued."""
    _stamp(r.auth, signer, now, target, challenge)
    r.auth.signature = signer.sign(RELAY_DOMAIN, relay_fields(r))
    return r


class ReplayCache:
    """Nonces of requests accepted within the last ``window_s`` (bounded: when ``limit`` are
    held, new requests are refused until old ones expire, never forgotten early)."""

    def __init__(self, window_s: float, limit: int = 1 << 16) -> None:
        self.window_s, self.limit = window_s, limit
        self._seen: dict[bytes, float] = {}  # nonce -> time it expires (insertion order)

    def fresh(self, nonce: bytes, now: float) -> str | None:
        """Why ``nonce`` is refused (None: it is new, and now remembered)."""
        for old, until in list(self._seen.items()):
            if until > now:
                break
            del self._seen[old]
        if nonce in self._seen:
            return "replayed request"
        if len(self._seen) >= self.limit:
            return "too many requests; retry later"
        self._seen[nonce] = now + self.window_s
        return None


CHALLENGE_BYTES = 40  # expiry (8) + random (16) + MAC (16)


class Challenges:
    """The nonces a node issues for signed requests (Info, DownloadState).

    Issuing keeps no state: a challenge is its expiry, 16 random bytes and a MAC of both under
    a secret of this node, so handing them out to anyone (every Info reply carries one) costs
    no memory. A signed request must carry one this node issued, unexpired, and each is
    accepted once (remembered until it expires, at most ``limit`` at a time).
    """

    def __init__(self, lifetime_s: float = 60.0, limit: int = 1 << 16) -> None:
        self.lifetime_s = lifetime_s
        self._secret = os.urandom(32)
        self._used = ReplayCache(lifetime_s, limit)

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._secret, body, hashlib.sha256).digest()[:16]

    def issue(self, now: float) -> bytes:
        body = struct.pack(">d", now + self.lifetime_s) + os.urandom(16)
        return body + self._mac(body)

    def redeem(self, challenge: bytes, now: float) -> str | None:
        """Why ``challenge`` is refused (None: this node issued it, it is live and unused;
        it is used from now on)."""
        if len(challenge) != CHALLENGE_BYTES:
            return "request without a challenge from this node"
        body, mac = challenge[:24], challenge[24:]
        if not hmac.compare_digest(mac, self._mac(body)):
            return "request with a challenge this node did not issue"
        if not struct.unpack(">d", body[:8])[0] > now:
            return "request with an expired challenge (ask again)"
        return self._used.fresh(challenge, now)


def check_request_auth(auth: pb.Auth, verifier: Verifier, domain: str, fields: list[object],
                       now: float, skew_s: float, me: str,
                       challenges: Challenges | None = None) -> str | None:
    """Why a unary request's ``auth`` is not acceptable (None: it is): it must be signed, for
    ``me`` (this node's peer id), within ``skew_s`` of ``now``, with a challenge from
    ``challenges`` not used before. The caller's peer id is ``peer_id_of(auth.public_key)``:
    any key is acceptable, unless the swarm has a key."""
    if not auth.public_key:
        return "unauthenticated request"
    if not abs(auth.timestamp - now) <= skew_s:  # also rejects NaN
        return f"request time {auth.timestamp:.0f} is more than {skew_s:g} s off"
    if auth.target != me:
        return "request for another node"
    why = verifier.verify(peer_id_of(auth.public_key), auth.public_key, auth.signature, domain,
                          fields)
    if why is None:
        why = verifier.admits(auth.public_key, auth.invitation)
    if why is None and challenges is not None:  # only signed requests use a challenge up
        why = challenges.redeem(auth.nonce, now)
    return why


def reject(code: int, message: str) -> pb.ExchangeMsg:
    return pb.ExchangeMsg(reject=pb.Reject(code=cast(pb.RejectCode, code), message=message[:200]))


def abort(code: int, message: str) -> pb.ExchangeMsg:
    return pb.ExchangeMsg(abort=pb.Abort(code=cast(pb.RejectCode, code), message=message[:200]))


def accepted_codecs(own: CodecSpec) -> frozenset[CodecSpec]:
    """The codec specs a node accepts in a peer's header: every plain codec, with the
    standard block sizes and the node's own; a residual codec only if it is the node's own
    (it keeps links), at its own block size."""
    sizes = {*STANDARD_BLOCK_SIZES, *((own.block_size,) if own.has_blocks else ())}
    plain = frozenset(CodecSpec(name, size if name in BLOCK_CODECS else 0)
                      for name in PLAIN_CODECS for size in sizes)
    return plain | ({own} if own.name in RESIDUAL_CODECS else set())


def header_codec(h: pb.Header) -> CodecSpec:
    """The codec a header announces; ValueError if it names none."""
    return CodecSpec(h.codec, h.block_size)


def check_header(h: pb.Header, me: Identity, fragments: Sequence[Fragment],
                 accepted: Collection[CodecSpec]) -> ExchangeError | None:
    """Why a peer's header is unacceptable (an error to send back), or None if it is fine."""
    if h.protocol_version != PROTOCOL_VERSION:
        return ExchangeError(VERSION_MISMATCH, f"protocol {h.protocol_version}, "
                                               f"this node speaks {PROTOCOL_VERSION}")
    if h.run_id != me.run_id:
        return ExchangeError(RUN_MISMATCH, f"run {h.run_id!r}, this node is in {me.run_id!r}")
    if h.model_fingerprint != me.fingerprint:
        return ExchangeError(FINGERPRINT_MISMATCH, f"model {h.model_fingerprint[:12]}, this "
                                                   f"node runs {me.fingerprint[:12]}")
    if not h.peer_id or h.peer_id == me.peer_id:
        return ExchangeError(BAD_REQUEST, f"bad sender peer id {h.peer_id!r}")
    frags = fragments
    if h.fragment_count != len(frags) or h.fragment_index >= len(frags):
        return ExchangeError(BAD_REQUEST, f"fragment {h.fragment_index}/{h.fragment_count}, "
                                          f"this node has {len(frags)} fragments")
    if h.fragment_numel != frags[h.fragment_index].numel:
        return ExchangeError(BAD_REQUEST, f"fragment numel {h.fragment_numel} != "
                                          f"{frags[h.fragment_index].numel}")
    try:
        spec = header_codec(h)
    except ValueError as exc:
        return ExchangeError(BAD_REQUEST, str(exc))
    if spec not in accepted:
        return ExchangeError(BAD_REQUEST, f"codec {spec} not accepted (block sizes "
                                          f"{', '.join(map(str, STANDARD_BLOCK_SIZES))} or ours)")
    codec = spec.codec()
    if (spec.name in RESIDUAL_CODECS) != (len(h.link_state) == STATE_BYTES) or (
            h.link_seed and spec.name in RESIDUAL_CODECS):
        return ExchangeError(BAD_REQUEST, f"{spec.name} with a link state of "
                                          f"{len(h.link_state)} bytes"
                                          f"{' and a seed' if h.link_seed else ''}: a residual "
                                          f"payload names its link's {STATE_BYTES}-byte state, "
                                          "a plain one none")
    if len(h.payload_digest) != DIGEST_BYTES:
        return ExchangeError(BAD_REQUEST, f"payload digest of {len(h.payload_digest)} bytes, "
                                          f"not {DIGEST_BYTES}")
    if h.payload_bytes != codec.wire_bytes(h.fragment_numel):
        return ExchangeError(BAD_REQUEST, f"payload {h.payload_bytes} B, {h.codec} needs "
                                          f"{codec.wire_bytes(h.fragment_numel)} B")
    return None


def check_reply_header(h: pb.Header, mine: pb.Header, me: Identity,
                       fragments: Sequence[Fragment],
                       accepted: Collection[CodecSpec]) -> ExchangeError | None:
    """The responder's header must also echo our fragment and codec."""
    problem = check_header(h, me, fragments, accepted)
    if problem is None and (h.fragment_index, h.codec, h.block_size, h.link_state) != (
            mine.fragment_index, mine.codec, mine.block_size, mine.link_state):
        problem = ExchangeError(BAD_REQUEST, "reply header names another fragment, codec or "
                                             "link state")
    return problem


def chunks(payload: bytes | bytearray | memoryview, size: int) -> Iterator[bytes]:
    """Consecutive slices of at most ``size`` (<= 1 MiB) bytes."""
    size = min(size, MAX_CHUNK_BYTES)
    view = memoryview(payload)
    for start in range(0, len(payload), size):
        yield bytes(view[start : start + size])
