"""One exchange as a sans-I/O state machine, for either role (the Exchange stream of gasloc.proto).

A shell (the gRPC client and servicer, or :class:`~gasloc_p2p.protocol.memory.MemoryExchange`)
feeds an :class:`ExchangeSession` what happened, and runs the actions it returns:

- events: :meth:`~ExchangeSession.start` (initiator), :meth:`~ExchangeSession.receive` (a
  message arrived), :meth:`~ExchangeSession.timed_out` and :meth:`~ExchangeSession.closed` (the
  awaited message did not come), and the results of actions: ``prepared``, ``admitted`` /
  ``refused``, ``checked`` / ``check_failed``, ``payload_sent``, ``applied``;
- actions: :class:`Send` a message, :class:`Prepare` (snapshot + encode), :class:`Admit` (ask
  the shell's admission control), :class:`SendPayload` (stream our payload, concurrently with
  reading), :class:`Check` (parse the peer's payload), :class:`FlushPayload` (wait until our
  payload is written), :class:`Apply` (commit: fold into the link, add the correction), and
  :class:`Done` with the :class:`Outcome`.

:meth:`~ExchangeSession.expecting` names the message the session waits for and its timeout
(None: run the pending actions first). A protocol violation raises :class:`ExchangeError`;
the shell then asks :meth:`~ExchangeSession.fail` what to tell the peer. Nothing is applied
before :class:`Apply`, which the initiator gets right after its ``Commit`` message and the
responder once it has read that ``Commit``.

Order on the stream: initiator Header -> responder Header (or Reject) -> the initiator's Header
again, signed over the responder's fresh nonce; then both payloads (Chunks) cross, each side sends Ready (with its round ends
since its snapshot) once it holds the peer's payload; the initiator sends Commit; both apply
with the same weight. The responder sends its payload only after that second Header: its
signature over a nonce the responder just chose proves the initiator holds its key now, so a
recorded Header replayed by someone else reads nothing. (Without keys, as in the simulator,
there is no second Header, and the responder's payload follows its Header at once.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gasloc_p2p.core.async_state import MAX_STALENESS, exchange_weight
from gasloc_p2p.core.codecs import CodecSpec, Encoded
from gasloc_p2p.core.wire import RESIDUAL_CODECS, PayloadHasher
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.actions import (
    Action,
    Admit,
    Apply,
    Check,
    Done,
    FlushPayload,
    Outcome,
    Prepare,
    Send,
    SendPayload,
)
from gasloc_p2p.protocol.auth import new_nonce
from gasloc_p2p.protocol.engine import ExchangeEngine, Prepared
from gasloc_p2p.protocol.guard import ImplausibleUpdate, NotNow
from gasloc_p2p.protocol.messages import (
    BAD_REQUEST,
    BUSY,
    COMMIT_DOMAIN,
    INTERNAL,
    LINK_OUT_OF_STEP,
    MAX_CHUNK_BYTES,
    PROTOCOL_VERSION,
    REFUSED,
    UNAUTHENTICATED,
    ExchangeError,
    Identity,
    ImplausiblePayload,
    PeerAborted,
    ProtocolError,
    Rejected,
    abort,
    accepted_codecs,
    check_header,
    check_header_auth,
    check_reply_header,
    commit_fields,
    header_codec,
    make_header,
    reject,
    sign_header,
)


@dataclass(frozen=True)
class Timeouts:
    """Seconds to wait for the peer's Header, for any one message of the transfer, for Commit;
    ``send_s``: how much longer than one message our own payload may still take to go out once
    the peer's arrived (its time on the slowest link the node plans for: links are often
    faster down than up)."""

    header_s: float
    chunk_s: float
    commit_s: float
    send_s: float = 0.0


@dataclass(frozen=True)
class Rules:
    """What one node sends, accepts and how it weighs exchanges: shared by all its sessions."""

    me: Identity
    codec: CodecSpec  # what this node sends when it initiates
    accepted: frozenset[CodecSpec]  # what it accepts in a peer's header
    w: float  # the gossip weight at staleness 0 (1/2: the pair average)
    timeouts: Timeouts
    max_staleness: int = MAX_STALENESS  # round ends at full weight (the simulator may vary it)

    @classmethod
    def build(cls, me: Identity, codec: CodecSpec, w: float, timeouts: Timeouts,
              max_staleness: int = MAX_STALENESS) -> Rules:
        return cls(me, codec, accepted_codecs(codec), w, timeouts, max_staleness)

    @property
    def links(self) -> bool:
        """This node sends residuals against links (its codec is one: half2, sign1)."""
        return self.codec.name in RESIDUAL_CODECS

    @property
    def plain(self) -> CodecSpec:
        """What this node sends where it has no link: its codec, or int8 (which seeds one)."""
        return SEED_CODEC if self.links else self.codec

    def weight(self, staleness: int) -> float:
        """The exchange's gossip weight; both sides know both round counts, so they agree."""
        return exchange_weight(self.w, staleness, self.max_staleness)


SEED_CODEC = CodecSpec.of("int8")  # a links node's plain payload: it seeds a pair's link


class Role(enum.Enum):
    INITIATOR = "initiator"
    RESPONDER = "responder"


class Stage(enum.Enum):
    HEADER = "header"  # reading the peer's Header
    ADMIT = "admit"  # responder: the shell's admission decides
    PREPARING = "preparing"  # our snapshot is being encoded
    TRANSFER = "transfer"  # payloads cross, Ready both ways
    FLUSH = "flush"  # our payload is being written out
    COMMIT = "commit"  # responder: reading Commit
    APPLYING = "applying"  # decided: the shell applies
    DONE = "done"
    REJECTED = "rejected"  # responder: refused with Reject
    FAILED = "failed"


class ExchangeSession:
    """The protocol state of one exchange (see the module docstring for events and actions).

    ``engine`` is only read here (fragments, round counts); its heavy work is
    requested through actions so the shell can run it off its event loop.
    """

    def __init__(self, rules: Rules, engine: ExchangeEngine, role: Role, peer_id: str = "",
                 fragment: int = 0, peer_links: bool = False) -> None:
        self.rules = rules
        # links: the initiator's peer keeps links too (its record names a residual codec);
        # seed: this side asks (initiator) or agrees (responder) to seed the pair's link
        self.peer_links = peer_links
        self._seed = False
        self.engine = engine
        self.role = role
        self.stage = Stage.PREPARING if role is Role.INITIATOR else Stage.HEADER
        self.peer_id = peer_id
        self.fragment = fragment
        self.problem: ExchangeError | None = None  # why a responder rejected
        self._prep: Prepared | None = None
        self._mine: pb.Header | None = None
        self._peer: pb.Header | None = None
        self._await_header = False  # responder: the initiator re-sends its Header (its proof)
        # the peer's payload, allocated at its announced (checked) size
        self._buf: bytearray | memoryview = bytearray()
        self._filled = 0
        self._hash = PayloadHasher()  # of the payload bytes received so far (as they arrive)
        self._received: Encoded | None = None
        self._my_rounds: int | None = None
        self._peer_rounds: int | None = None
        self._staleness = 0
        # authentication (rules.me.signer set): our nonce and the last Header we sent
        self._nonce = new_nonce() if rules.me.signer is not None else b""
        self._sent: pb.Header | None = None

    @classmethod
    def initiator(cls, rules: Rules, engine: ExchangeEngine, peer_id: str,
                  fragment: int, peer_links: bool = False) -> ExchangeSession:
        """``peer_links``: the peer keeps links too (its record names a residual codec)."""
        return cls(rules, engine, Role.INITIATOR, peer_id, fragment, peer_links)

    @classmethod
    def responder(cls, rules: Rules, engine: ExchangeEngine) -> ExchangeSession:
        return cls(rules, engine, Role.RESPONDER)

    # ----------------------------------------------------------------- what to wait for
    def expecting(self) -> tuple[str, float] | None:
        """``(what, timeout_s)`` of the message to read next, or None (no read now)."""
        t = self.rules.timeouts
        if self.stage is Stage.HEADER:
            side = "responder" if self.role is Role.INITIATOR else "initiator"
            return f"the {side}'s Header", t.header_s
        if self.stage is Stage.TRANSFER:  # once the peer's payload is in, its Ready follows
            # the end of ours, which may still be on its way up
            return "payload", t.chunk_s + (0.0 if self.receiving_payload else t.send_s)
        if self.stage is Stage.COMMIT:
            return "Commit", t.commit_s
        return None

    @property
    def receiving_payload(self) -> bool:
        """The peer's payload is announced and not complete yet (the minimum rate applies)."""
        return (self.stage is Stage.TRANSFER and self._peer is not None
                and self._received is None and self._filled < self._peer.payload_bytes)

    @property
    def payload_received(self) -> int:
        return self._filled

    @property
    def peer_codec(self) -> str:
        return self._peer.codec if self._peer is not None else ""

    def timed_out(self) -> list[Action]:
        what, timeout_s = self.expecting() or ("a message", 0.0)
        hint = (" (the payload deadline follows the slowest link the node plans for: "
                "--min-link-mbps)" if what == "payload" else "")
        raise ProtocolError(f"no {what} within {timeout_s:g} s{hint}")

    def closed(self) -> list[Action]:
        what, _ = self.expecting() or ("a message", 0.0)
        raise ProtocolError(f"stream closed while waiting for {what}")

    # ----------------------------------------------------------------- events
    def start(self) -> list[Action]:
        """Initiator: snapshot and encode (a residual against our link with the peer where
        both keep links and ours exists; else plain, asking to seed one where both keep
        them)."""
        assert self.role is Role.INITIATOR and self.stage is Stage.PREPARING
        if not self.rules.links:
            return [Prepare(self.peer_id, self.fragment, self.rules.codec)]
        links = self.engine.links
        link = (links.get(self.peer_id, self.fragment)
                if links is not None and self.peer_links else None)
        if link is not None:
            return [Prepare(self.peer_id, self.fragment, self.rules.codec, link)]
        self._seed = self.peer_links and links is not None
        return [Prepare(self.peer_id, self.fragment, self.rules.plain)]

    def prepared(self, prep: Prepared) -> list[Action]:
        assert self.stage is Stage.PREPARING
        self._prep = prep
        header = make_header(self.rules.me, prep, len(self.engine.fragments), self._seed)
        signer = self.rules.me.signer
        if signer is not None:  # the initiator's first Header: no peer nonce yet
            sign_header(header, signer, self._nonce,
                        self._peer.nonce if self._peer is not None else b"")
        self._mine = header.header
        self._sent = header.header
        if self.role is Role.INITIATOR:
            self.stage = Stage.HEADER
            return [Send(header)]
        self.stage = Stage.TRANSFER
        if self.role is Role.RESPONDER and signer is not None:
            # the payload waits for the initiator's Header signed over our fresh nonce: a
            # replayed Header (an outsider's recording) gets our Header and nothing else
            self._await_header = True
            return [Send(header)]
        return [Send(header), SendPayload(prep.payload, prep.encoded.spec)]

    def receive(self, msg: pb.ExchangeMsg) -> list[Action]:
        kind = msg.WhichOneof("kind")
        if self.stage is Stage.HEADER:
            if self.role is Role.INITIATOR:
                return self._reply_header(msg, kind)
            return self._first_header(msg, kind)
        if self.stage is Stage.TRANSFER:
            return self._transfer(msg, kind)
        if self.stage is Stage.COMMIT:
            if kind == "abort":
                raise PeerAborted(msg.abort.code, msg.abort.message)
            if kind != "commit":
                raise ProtocolError(f"expected Commit, got {kind}")
            self._check_commit(msg.commit.signature)
            return [self._apply()]
        raise ProtocolError(f"unexpected {kind} in stage {self.stage.value}")

    def admitted(self) -> list[Action]:
        assert self.stage is Stage.ADMIT and self._peer is not None
        h = self._peer
        self.stage = Stage.PREPARING
        spec = header_codec(h)
        link = (self.engine.links.get(h.peer_id, h.fragment_index)
                if spec.name in RESIDUAL_CODECS and self.engine.links is not None else None)
        if spec.name in RESIDUAL_CODECS and link is None:  # evicted since the header's check
            return self._reject(ExchangeError(LINK_OUT_OF_STEP, "no link with you any more"))
        return [Prepare(h.peer_id, h.fragment_index, spec, link)]

    def refused(self) -> list[Action]:
        return self._reject(ExchangeError(BUSY, "at the inbound limit or already exchanging "
                                                "with you"))

    def checked(self, received: Encoded) -> list[Action]:
        """The peer's payload is valid: send Ready with our round ends since the snapshot."""
        assert self._prep is not None
        self._received = received
        self._my_rounds = self.engine.rounds_since(self._prep)
        ready = pb.ExchangeMsg(ready=pb.Ready(rounds_since_snapshot=self._my_rounds))
        return [Send(ready), *self._maybe_flush()]

    @property
    def prep(self) -> Prepared | None:
        """This side's half once prepared (the guard's reservation rides on it)."""
        return self._prep

    def check_failed(self, exc: Exception) -> list[Action]:
        """Abort (before Ready, so the peer cannot commit either): a bad or implausible
        payload."""
        if isinstance(exc, ImplausibleUpdate):
            raise ImplausiblePayload(str(exc))
        if isinstance(exc, NotNow):  # our state, not the peer's payload: it may come back
            raise ExchangeError(BUSY, str(exc))
        raise ProtocolError(f"bad payload: {exc}")

    def payload_sent(self) -> list[Action]:
        assert self.stage is Stage.FLUSH
        assert self._my_rounds is not None and self._peer_rounds is not None
        self._staleness = self._my_rounds + self._peer_rounds
        if self.role is Role.RESPONDER:
            self.stage = Stage.COMMIT
            return []
        commit = pb.Commit()
        signer = self.rules.me.signer
        if signer is not None:
            assert self._sent is not None and self._peer is not None
            commit.signature = signer.sign(COMMIT_DOMAIN, commit_fields(self._sent, self._peer))
        return [Send(pb.ExchangeMsg(commit=commit)), self._apply()]

    def applied(self, correction_norm: float) -> list[Action]:
        assert self.stage is Stage.APPLYING and self._prep is not None
        assert self._received is not None
        self.stage = Stage.DONE
        prep = self._prep
        return [Done(Outcome(prep.peer_id, prep.fragment.index, self._staleness,
                             self.rules.weight(self._staleness) * prep.clip, correction_norm,
                             len(prep.payload), self._received.nbytes, prep.fragment.numel,
                             prep.clip, prep.ticket is not None and prep.ticket.clipped))]

    def fail(self, exc: BaseException, transport_lost: bool = False) -> list[Action]:
        """The exchange failed with ``exc`` (nothing applied): what to tell the peer.

        Nothing when the commit was already decided, when the peer ended it (Abort, Reject) or
        when the stream is gone (``transport_lost``); else an Abort with the error's code.
        """
        if self.stage in (Stage.APPLYING, Stage.DONE, Stage.REJECTED, Stage.FAILED):
            return []
        self.stage = Stage.FAILED
        if transport_lost or isinstance(exc, PeerAborted | Rejected):
            return []
        code = exc.code if isinstance(exc, ExchangeError) else INTERNAL
        return [Send(abort(code, str(exc)))]

    # ----------------------------------------------------------------- stages
    def _first_header(self, msg: pb.ExchangeMsg, kind: str | None) -> list[Action]:
        if kind != "header":
            return self._reject(ExchangeError(BAD_REQUEST, "the first message must be a Header"))
        h = msg.header
        signer = self.rules.me.signer
        if signer is not None and h.protocol_version == PROTOCOL_VERSION:
            # who is asking first: a non-member learns that it is refused, nothing else
            problem = check_header_auth(h, signer, b"")
            if problem is not None:
                return self._reject(problem, REFUSED)
        problem = check_header(h, self.rules.me, self.engine.fragments, self.rules.accepted)
        if problem is None and h.link_state:
            problem = self._link_in_step(h)
        if problem is not None:
            return self._reject(problem)
        self._peer, self.peer_id, self.fragment = h, h.peer_id, h.fragment_index
        self._seed = h.link_seed and self.rules.links and self.engine.links is not None
        self.stage = Stage.ADMIT
        return [Admit(h.peer_id)]

    def _link_in_step(self, h: pb.Header) -> ExchangeError | None:
        """A residual payload needs our link with its sender at the same state; else we
        refuse, the sender drops its side on our Reject and its next exchange seeds a new
        link (which overwrites ours). We change nothing here: a first Header is signed over
        no nonce of ours, so it may be a replay (a member that received it once)."""
        links = self.engine.links
        if links is not None and links.state(h.peer_id, h.fragment_index) == h.link_state:
            return None
        return ExchangeError(LINK_OUT_OF_STEP, "this node holds another state of our link "
                                               "(or none): seed a new one")

    def _reject(self, problem: ExchangeError, text: str = "") -> list[Action]:
        """Refuse with ``problem`` (kept for our log); the peer reads ``text`` if given."""
        self.problem = problem
        self.stage = Stage.REJECTED
        return [Send(reject(problem.code, text or problem.message))]

    def _reply_header(self, msg: pb.ExchangeMsg, kind: str | None) -> list[Action]:
        if kind == "reject":
            if msg.reject.code == LINK_OUT_OF_STEP and self.engine.links is not None:
                self.engine.links.drop(self.peer_id, self.fragment)  # the next one seeds
            raise Rejected(msg.reject.code, msg.reject.message)
        if kind != "header":
            raise ProtocolError(f"expected Header or Reject, got {kind}")
        assert self._mine is not None and self._prep is not None
        problem = check_reply_header(msg.header, self._mine, self.rules.me, self.engine.fragments,
                                     self.rules.accepted)
        if problem is None and self.rules.me.signer is not None:  # it owns the dialed id
            problem = check_header_auth(msg.header, self.rules.me.signer, self._nonce)
        if problem is not None:
            raise problem
        if msg.header.peer_id != self.peer_id:
            raise ProtocolError(f"dialed {self.peer_id!r}, answered by {msg.header.peer_id!r}")
        self._peer = msg.header
        self.stage = Stage.TRANSFER
        signer = self.rules.me.signer
        if signer is None:
            return [SendPayload(self._prep.payload, self._prep.encoded.spec)]
        # prove our key over the responder's fresh nonce: it sends its payload only then
        proof = pb.ExchangeMsg()
        proof.header.CopyFrom(self._mine)
        self._sent = sign_header(proof, signer, self._nonce, self._peer.nonce).header
        return [Send(proof), SendPayload(self._prep.payload, self._prep.encoded.spec)]

    def _transfer(self, msg: pb.ExchangeMsg, kind: str | None) -> list[Action]:
        assert self._peer is not None
        if kind == "header" and self._await_header:
            self._peer = self._replacement_header(msg.header, self._peer)
            self._await_header = False  # the initiator proved its key: our payload
            assert self._prep is not None
            return [SendPayload(self._prep.payload, self._prep.encoded.spec)]
        if kind == "chunk" and self._received is None and not self._await_header:
            return self._chunk(msg.chunk.data, self._peer)
        if kind == "ready" and self._peer_rounds is None:
            self._peer_rounds = msg.ready.rounds_since_snapshot
            return self._maybe_flush()
        if kind == "abort":
            raise PeerAborted(msg.abort.code, msg.abort.message)
        raise ProtocolError(f"unexpected {kind} during the transfer")

    def _chunk(self, data: bytes, peer: pb.Header) -> list[Action]:
        if not data or len(data) > MAX_CHUNK_BYTES:
            raise ProtocolError(f"chunk of {len(data)} B (limit {MAX_CHUNK_BYTES})")
        if self._filled + len(data) > peer.payload_bytes:
            raise ProtocolError(f"payload exceeds the announced {peer.payload_bytes} B")
        if not self._filled:
            # check_header bounded the size by our fragment; pinned memory beside a GPU
            self._buf = self.engine.payload_buffer(peer.payload_bytes)
        self._buf[self._filled : self._filled + len(data)] = data
        self._filled += len(data)
        self._hash.update(data)  # while the rest is on the wire
        if self._filled < peer.payload_bytes:
            return []
        return [Check(header_codec(peer), peer.fragment_numel, self._buf, peer.payload_digest,
                      self._prep, self._hash.digest())]

    def _replacement_header(self, new: pb.Header, old: pb.Header) -> pb.Header:
        problem = check_header(new, self.rules.me, self.engine.fragments, self.rules.accepted)
        if problem is None and (new.peer_id, new.fragment_index, new.codec, new.block_size) != (
                old.peer_id, old.fragment_index, old.codec, old.block_size):
            problem = ProtocolError("the re-sent Header changed peer, fragment or codec")
        if problem is None:
            assert self.rules.me.signer is not None  # only keyed sessions await a second one
            problem = check_header_auth(new, self.rules.me.signer, self._nonce)
            if problem is None and new.public_key != old.public_key:
                problem = ProtocolError("the re-sent Header changed key", UNAUTHENTICATED)
        if problem is not None:
            raise problem
        return new

    def _maybe_flush(self) -> list[Action]:
        if self._received is None or self._peer_rounds is None:
            return []
        self.stage = Stage.FLUSH
        t = self.rules.timeouts
        return [FlushPayload(t.chunk_s + t.send_s)]

    def _check_commit(self, signature: bytes) -> None:
        """Responder: the Commit must be signed by the initiator for this very stream."""
        signer = self.rules.me.signer
        if signer is None:
            return
        assert self._peer is not None and self._sent is not None
        why = signer.verify(self._peer.peer_id, self._peer.public_key, signature,
                            COMMIT_DOMAIN, commit_fields(self._peer, self._sent))
        if why is not None:
            raise ProtocolError(f"commit: {why}", UNAUTHENTICATED)

    def _apply(self) -> Apply:
        assert self._prep is not None and self._received is not None
        assert self._peer is not None
        # a plain exchange seeds the pair's link where both headers asked for it
        self._prep.seed = self._seed and self._peer.link_seed and self._prep.link is None
        self.stage = Stage.APPLYING
        return Apply(self._prep, self._received, self.rules.weight(self._staleness),
                     self._staleness)
