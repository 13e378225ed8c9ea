"""Two exchange sessions wired back to back in memory: the protocol without sockets.

:class:`MemoryExchange` plays both shells of one exchange: it delivers each session's messages
to the other and runs their actions synchronously on the two nodes' engines. The simulator uses
it for its asynchronous exchanges (split in two: :meth:`MemoryExchange.open` at the simulated
start, :meth:`MemoryExchange.finish` when the payloads have crossed), and tests use it to run
the protocol without gRPC. The tensors it produces are the ones the daemon's gRPC shell
produces on the same inputs: the same session, the same engine calls, in the same order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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
from gasloc_p2p.protocol.engine import ExchangeEngine
from gasloc_p2p.protocol.messages import MAX_CHUNK_BYTES, chunks
from gasloc_p2p.protocol.session import ExchangeSession, Rules


@dataclass
class _Side:
    session: ExchangeSession
    engine: ExchangeEngine
    todo: deque[Action] = field(default_factory=deque)
    inbox: deque[pb.ExchangeMsg] = field(default_factory=deque)  # what the peer sent us
    held: list[pb.ExchangeMsg] = field(default_factory=list)  # our payload, not yet delivered
    outcome: Outcome | None = None


class MemoryExchange:
    """One exchange between two engines, initiator first; raises what a session raises."""

    def __init__(self, initiator: tuple[Rules, ExchangeEngine],
                 responder: tuple[Rules, ExchangeEngine], fragment: int,
                 chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        (rules_i, engine_i), (rules_r, engine_r) = initiator, responder
        peer = rules_r.me.peer_id
        # the responder keeps links where its codec is a residual one (a record says so)
        self.sides = (_Side(ExchangeSession.initiator(rules_i, engine_i, peer, fragment,
                                                      rules_r.links), engine_i),
                      _Side(ExchangeSession.responder(rules_r, engine_r), engine_r))
        self.chunk_bytes = chunk_bytes
        self._release = False  # payload chunks go straight to the peer (after open)

    def open(self) -> None:
        """Headers both ways and both snapshots; the payloads stay in flight."""
        self.sides[0].todo.extend(self.sides[0].session.start())
        self._pump()

    def finish(self) -> tuple[Outcome, Outcome]:
        """Deliver the payloads; Ready, Commit and both applies. Returns (initiator, responder)."""
        self._release = True
        for me, other in (self.sides, self.sides[::-1]):
            other.inbox.extend(me.held)
            me.held.clear()
        self._pump()
        first, second = self.sides[0].outcome, self.sides[1].outcome
        if first is None or second is None:
            raise RuntimeError("the exchange stopped before both sides applied")
        return first, second

    def run(self) -> tuple[Outcome, Outcome]:
        """The whole exchange at once (no time passes between snapshot and commit)."""
        self.open()
        return self.finish()

    def _pump(self) -> None:
        progress = True
        while progress:
            progress = False
            for me, other in (self.sides, self.sides[::-1]):
                while me.todo:
                    progress = True
                    me.todo.extend(self._execute(me, other, me.todo.popleft()))
                if me.inbox and me.session.expecting() is not None:
                    progress = True
                    me.todo.extend(me.session.receive(me.inbox.popleft()))

    def _execute(self, me: _Side, other: _Side, act: Action) -> list[Action]:
        s = me.session
        if isinstance(act, Send):
            other.inbox.append(act.msg)
            return []
        if isinstance(act, Prepare):
            return s.prepared(me.engine.prepare(act.peer_id, act.fragment, act.codec,
                                                link=act.link))
        if isinstance(act, Admit):
            return s.admitted()
        if isinstance(act, SendPayload):
            pieces = [pb.ExchangeMsg(chunk=pb.Chunk(data=piece))
                      for piece in chunks(act.payload, self.chunk_bytes)]
            (other.inbox if self._release else me.held).extend(pieces)
            return []
        if isinstance(act, Check):
            try:
                received = me.engine.check(act.codec, act.numel, act.payload, act.digest,
                                            act.prep, act.seen_digest)
            except ValueError as exc:
                return s.check_failed(exc)
            return s.checked(received)
        if isinstance(act, FlushPayload):  # delivered already: the peer has read all of it
            return s.payload_sent()
        if isinstance(act, Apply):
            return s.applied(me.engine.commit(act.prep, act.received, act.weight))
        assert isinstance(act, Done)
        me.outcome = act.outcome
        return []
