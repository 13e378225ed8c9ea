"""Exchange atomicity under faults at every stage: kill, abort or timeout on either side.

A driver runs two real sessions back to back (as :class:`MemoryExchange` does) and injects one
fault when a given message reaches a given side. The protocol's promise: both sides end
untouched, or both applied the exact negatives of one correction (the pair's sum is kept); the
one window two parties cannot close (the responder fails after sending Ready, so never reads
``Commit``) leaves the initiator applied and the responder untouched. No per-peer state exists,
so the pair's next exchange works as any other.
"""

from __future__ import annotations

import pytest
import torch

from gasloc_p2p.protocol.memory import MemoryExchange
from gasloc_p2p.protocol.messages import INTERNAL, ExchangeError
from tests.session_helpers import node

FAULTS = ("kill", "abort", "timeout")
# (side receiving the message: 0 initiator / 1 responder, message kind, n-th of that kind)
STAGES = {
    "header-at-responder": (1, "header", 1),
    "header-at-initiator": (0, "header", 1),
    "mid-payload-at-responder": (1, "chunk", 3),
    "mid-payload-at-initiator": (0, "chunk", 3),
    "ready-at-responder": (1, "ready", 1),
    "ready-at-initiator": (0, "ready", 1),
    "commit-at-responder": (1, "commit", 1),
}
# The responder has sent its Ready: the initiator may commit before hearing of the fault.
RESPONDER_AFTER_READY = ("ready-at-responder", "commit-at-responder")


def state(engine) -> dict[str, object]:
    s = engine.state
    assert s.outer.state
    return {"theta": s.theta.clone(), "anchor": s.anchor.clone(),
            **{name: t.clone() for name, t in s.outer.state.items()}}


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    def eq(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, tuple):
            return isinstance(y, tuple) and all(eq(p, q) for p, q in zip(x, y, strict=True))
        return x == y
    return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)


class FaultyExchange(MemoryExchange):
    """One exchange with one injected fault; ``run_faulty`` returns who applied."""

    def __init__(self, a, b, fragment: int, fault: str, at: tuple[int, str, int]) -> None:
        super().__init__(a, b, fragment, chunk_bytes=4096)
        self.fault, self.at = fault, at
        self.seen: dict[tuple[int, str], int] = {}
        self.fired = False
        self.dead = [False, False]  # the side's session ended (failed or done)
        self.lost = False  # the stream is gone (kill): a waiting side sees it closed

    def run_faulty(self) -> tuple[bool, bool]:
        self._release = True
        self.sides[0].todo.extend(self.sides[0].session.start())
        progress = True
        while progress:
            progress = False
            for k in (0, 1):
                progress |= self._step(k)
            if not progress:  # somebody waits for a message that will not come
                for k in (0, 1):
                    me = self.sides[k]
                    if not self.dead[k] and me.session.expecting() is not None:
                        self._guard(k, me.session.closed if self.lost else me.session.timed_out)
                        progress = True
                        break
        assert self.fired, f"the fault point {self.at} was never reached"
        return self.sides[0].outcome is not None, self.sides[1].outcome is not None

    def _step(self, k: int) -> bool:
        me, other = self.sides[k], self.sides[1 - k]
        if self.dead[k]:
            return False
        if me.todo:
            self._guard(k, lambda: me.todo.extend(self._execute(me, other, me.todo.popleft())))
            return True
        if me.inbox and me.session.expecting() is not None:
            msg = me.inbox.popleft()
            kind = msg.WhichOneof("kind")
            n = self.seen[(k, kind)] = self.seen.get((k, kind), 0) + 1
            if not self.fired and (k, kind, n) == self.at:
                self.fired = True
                self._inject(k)
            else:
                self._guard(k, lambda: me.todo.extend(me.session.receive(msg)))
            return True
        return False

    def _inject(self, k: int) -> None:
        me = self.sides[k]
        if self.fault == "kill":  # the process dies: the stream is gone, nothing more is sent
            self.lost = True
            me.session.fail(ConnectionError("killed"), transport_lost=True)
            self.dead[k] = True
        elif self.fault == "abort":  # this side gives up on its own (e.g. its stop)
            self._send_fail(k, ExchangeError(INTERNAL, "injected abort"))
        else:  # the message arrived too late: the waiting side timed out
            self._guard(k, me.session.timed_out)

    def _guard(self, k: int, fn) -> None:
        try:
            result = fn()
            if result is not None and not isinstance(result, list):
                return
        except ExchangeError as exc:
            self._send_fail(k, exc, transport_lost=self.lost)
        if self.sides[k].outcome is not None:
            self.dead[k] = True

    def _send_fail(self, k: int, exc: Exception, transport_lost: bool = False) -> None:
        for act in self.sides[k].session.fail(exc, transport_lost=transport_lost):
            if not self.lost:
                self.sides[1 - k].inbox.append(act.msg)
        self.dead[k] = True


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_at_any_stage_leaves_both_sides_consistent(stage, fault):
    a, b = node("A", 1), node("B", 2)
    MemoryExchange(a, b, 0).run()  # a link with history, not a fresh one
    before = state(a[1]), state(b[1])
    applied = FaultyExchange(a, b, 1, fault, STAGES[stage]).run_faulty()
    after = state(a[1]), state(b[1])
    if applied == (False, False):
        assert same(before[0], after[0]) and same(before[1], after[1])
    elif applied == (True, True):  # exact negatives (up to the adds' rounding): the sum kept
        moved_a = after[0]["theta"] - before[0]["theta"]  # type: ignore[operator]
        moved_b = after[1]["theta"] - before[1]["theta"]  # type: ignore[operator]
        assert moved_a.abs().max() > 0
        torch.testing.assert_close(moved_a, -moved_b, rtol=0, atol=1e-6)
    else:  # only the window the protocol documents: the responder fails after its Ready
        assert applied == (True, False) and stage in RESPONDER_AFTER_READY, applied
        assert same(before[1], after[1]) and not same(before[0], after[0])
    # whatever happened, the pair's next exchange commits on both sides
    out_b, out_a = MemoryExchange(b, a, 0).run()
    assert out_a.weight == out_b.weight > 0
    for engine in (a[1], b[1]):
        assert torch.isfinite(engine.state.theta).all()


def test_the_fault_driver_without_a_fault_commits_both():
    a, b = node("A", 1), node("B", 2)
    ex = FaultyExchange(a, b, 1, "kill", (1, "never", 1))
    ex.fired = True  # no fault point
    assert ex.run_faulty() == (True, True)
