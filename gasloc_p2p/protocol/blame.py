"""Who pushed a node uphill: a ledger of what each key's committed exchanges moved it by.

A push that stays under every per-exchange and per-round limit still adds up over rounds, and
the node's loss shows it before its parameters say who did it. So the node keeps, for the
exchanges of its recent rounds, what each one moved it by on a private random sample of
coordinates (drawn from the OS's randomness: no peer knows where it is looked at; a few
thousand floats an exchange). When the node rolls back because its loss rose and stayed up
(:class:`gasloc_p2p.protocol.guard.LossWatch`), the *rise* is what moved it since the state it
returns to; the keys whose exchanges since then moved it along the rise are blamed:

- a key's summed moves must be significantly aligned with the rise: cosine at least ``min_z
  / sqrt(samples)`` (for a direction independent of the rise the cosine is about ``N(0, 1 /
  samples)``: honest corrections, which pull towards the swarm's mean, rarely pass), and
- its projection on the rise must be at least ``min_share`` of the rise (a key that moved the
  node by a negligible amount is not the cause).

Identities are free, so blame is not the defence on its own: the rollback undoes the push,
and a blamed key loses its trust and, for good, most of its weight
(:meth:`gasloc_p2p.protocol.guard.UpdateGuard.demerit`); keys it mints start as newcomers,
whose movement is budgeted apart.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

SAMPLES = 2048  # coordinates of the ledger's sample
KEEP = 4096  # committed exchanges remembered (the oldest dropped first)


@dataclass(frozen=True)
class Entry:
    """One committed exchange: the node's round, the key and block, its move on the sample."""

    round: int
    key: str
    block: str
    moved: torch.Tensor  # float32 [samples], host


class Ledger:
    """The recent committed exchanges of one node, sampled (thread-safe appends)."""

    def __init__(self, numel: int, samples: int = SAMPLES, keep: int = KEEP) -> None:
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        k = min(samples, numel)
        self.positions = (torch.randperm(numel, generator=gen)[:k] if numel <= 4 * k
                          else torch.randint(numel, (k,), generator=gen)).sort().values
        self._entries: deque[Entry] = deque(maxlen=keep)
        self.last_round = -1  # the round of the latest committed exchange (-1: none yet)

    def record(self, round_: int, key: str, block: str, moved: torch.Tensor) -> None:
        """Exchange with ``key`` committed in round ``round_``, moving the sample by ``moved``."""
        self._entries.append(Entry(round_, key, block, moved.detach().float().cpu()))
        self.last_round = max(self.last_round, round_)

    def moved_since(self, round_: int) -> bool:
        """Whether an exchange committed in round ``round_`` or later (entries dropped for
        room count too)."""
        return self.last_round >= round_

    def culprits(self, since_round: int, rise: torch.Tensor, min_z: float = 4.0,
                 min_share: float = 0.02) -> list[tuple[str, str]]:
        """``(key, block)`` of every key blamed for ``rise`` (the node's move on the sample
        since round ``since_round``'s state; see the module docstring)."""
        rise = rise.detach().double().cpu()
        norm2 = float(rise @ rise)
        if not norm2 > 0:
            return []
        moved: dict[tuple[str, str], torch.Tensor] = {}
        for e in list(self._entries):
            if e.round >= since_round:
                key = (e.key, e.block)
                moved[key] = moved.get(key, torch.zeros_like(rise)) + e.moved.double()
        least = min_z / math.sqrt(max(rise.numel(), 1))
        out = []
        for who, m in moved.items():
            along = float(m @ rise)
            size = math.sqrt(float(m @ m))
            if size > 0 and along / (size * math.sqrt(norm2)) >= least \
                    and along / norm2 >= min_share:
                out.append(who)
        return out


class PushMeter:
    """What gossip moved this node by lately, on private sampled blocks: a bound in time.

    Per-exchange and per-round limits bound a push's rate, not its sum: a push along one
    direction that fits every round's budget adds up (issue 39: about 0.3 RMS along the
    attacker's direction after 3 minutes, 30 times the swarm's consensus distance). So the
    node keeps ``G``, the sum of the corrections committed here, decaying by ``1 / rounds``
    per round of this node, on ``blocks`` whole payload blocks per fragment drawn from the
    OS's randomness (no peer knows them; decoding them costs a few thousand elements an
    exchange, on the host). An exchange may move ``G`` only as far as ``limit`` (RMS; the
    guard's unit times a factor): honest corrections pull a node towards its peers, now one
    way, now another, and their sum stays near the swarm's spread; a push in one direction
    reaches the limit and then moves the node by no more than the decay per round.
    """

    def __init__(self, blocks: int = 16, rounds: int = 32, back_share: float = 0.0,
                 back_rounds: int = 0) -> None:
        self.blocks, self.rounds = blocks, rounds
        # of the path of the node's own steps over the last ``back_rounds`` (0: ``rounds``):
        # how far gossip may move it back along that path (``room``; 0: no bound)
        self.back_share = back_share
        self.back_rounds = back_rounds or rounds
        self._seed = int.from_bytes(os.urandom(8), "little")
        # (fragment, bs) -> (round, the node's own payload on the sample less what gossip
        # moved it by up to then, what gossip moved it by up to then), oldest first: the
        # path of its own steps and gossip's
        self._path: dict[tuple[int, int],
                         deque[tuple[int, torch.Tensor, torch.Tensor | None]]] = {}
        self._moved: dict[tuple[int, int], torch.Tensor] = {}  # gossip's moves, summed
        self._runs: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (fragment, bs) -> runs
        self._sum: dict[tuple[int, int], torch.Tensor] = {}  # (fragment, bs) -> G, float64
        self._at: dict[tuple[int, int], int] = {}  # (fragment, bs) -> the round G was at

    def runs(self, fragment: int, numel: int, block_size: int) -> list[tuple[int, int]]:
        """``(start, length)`` of the sampled blocks of a fragment of ``numel`` elements."""
        key = (fragment, block_size)
        if key not in self._runs:
            width = block_size or 1024
            count = max(1, -(-numel // width))
            gen = torch.Generator().manual_seed(self._seed + 7919 * fragment)
            picks = torch.randperm(count, generator=gen)[: self.blocks].sort().values.tolist()
            self._runs[key] = [(b * width, min(width, numel - b * width)) for b in picks]
        return self._runs[key]

    def _sum_at(self, key: tuple[int, int], size: int, round_: int) -> torch.Tensor:
        g = self._sum.get(key)
        if g is None:
            g = self._sum[key] = torch.zeros(size, dtype=torch.float64)
        elapsed = round_ - self._at.get(key, round_)
        if elapsed > 0:
            g.mul_((1 - 1 / max(self.rounds, 1)) ** elapsed)
        self._at[key] = round_
        return g

    def seen(self, fragment: int, block_size: int, round_: int, mine: torch.Tensor) -> None:
        """This node's own payload on the sample, at an exchange of round ``round_``: the
        points of its path (one a round kept, over the last ``back_rounds``, with what gossip had
        moved it by: 66 copies of the sample per fragment; none without a bound back)."""
        if self.back_share <= 0:
            return
        key = (fragment, block_size)
        path = self._path.setdefault(key, deque())
        if not path or path[-1][0] != round_:
            moved = self._moved.get(key)
            own = mine.double() if moved is None else mine.double() - moved
            path.append((round_, own, None if moved is None else moved.clone()))
        while path and path[0][0] < round_ - self.back_rounds:
            path.popleft()

    def back(self, fragment: int, block_size: int) -> torch.Tensor | None:
        """Back along the path of this node's own steps over the last ``back_rounds`` (from where
        they took it to where it was; what gossip moved it by left out, so a push across
        cannot lengthen the path and turn its direction away from the node's progress);
        None before a path of a quarter of ``back_rounds``."""
        path = self._path.get((fragment, block_size))
        if not path or path[-1][0] - path[0][0] < self.back_rounds // 4:
            return None
        return path[0][1] - path[-1][1]

    def _gossip_since_path(self, key: tuple[int, int]) -> torch.Tensor | None:
        """What gossip moved this node by since the oldest point of its path."""
        path, moved = self._path.get(key), self._moved.get(key)
        if not path or moved is None:
            return None
        then = path[0][2]
        return moved if then is None else moved - then

    def room(self, fragment: int, block_size: int, round_: int, step: torch.Tensor,
             limit: float) -> float:
        """The largest ``f`` in [0, 1] such that ``G + f * step`` stays within ``limit`` RMS
        (or, where ``G`` is beyond it already, does not grow), and such that what gossip
        moved the node by over its path (:meth:`back`) plus ``f * step``, back along that
        path, stays within ``back_share`` of the path's length; ``step`` is the exchange's
        correction on the sample at its full weight.

        The second bound is for a push towards where the node was (issue 39's ``rewind``):
        on the plateau a node's steps are mostly jitter about the swarm's mean, its net
        progress per round a small part of its drift, so a push back along its path of a
        fraction of a drift a round, inside the first bound, undoes much of its progress,
        and each such push lowers the loss of the commit it rides on (it averages the node's
        recent iterates): no test of the loss sees it. Its price: honest averaging takes a
        node's jitter out, which is partly back along this path, and the bound holds that
        too (clean swarms 1.032x their loss side by side: docs/security.md), so it is off
        unless ``back_share`` is set."""
        key = (fragment, block_size)
        g = self._sum_at(key, step.numel(), round_)
        f = self._room(g, step, limit)
        back = self.back(fragment, block_size) if self.back_share > 0 else None
        if back is not None and f > 0:
            length = float(back.norm())
            since = self._gossip_since_path(key)
            if length > 0:
                u = back / length
                su = float(step.double() @ u)
                gu = 0.0 if since is None else float(since @ u)
                if su > 0:  # this step goes back: within what is left of the share
                    f = min(f, max(0.0, (self.back_share * length - gu) / su))
        return f

    def _room(self, g: torch.Tensor, step: torch.Tensor, limit: float) -> float:
        s = step.double()
        n = max(s.numel(), 1)
        bound2 = limit * limit * n
        a, b, c = float(s @ s), 2 * float(g @ s), float(g @ g) - bound2
        if a <= 0 or c + b + a <= 0:
            return 1.0  # fits whole
        if c >= 0:  # beyond already: only what shrinks G (the gain is at most -b / 2a)
            return max(0.0, min(1.0, -b / (2 * a)))
        return max(0.0, min(1.0, (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))

    def along(self, fragment: int, block_size: int, step: torch.Tensor,
              min_z: float = 4.0) -> float:
        """How far ``step`` goes along ``G`` (RMS units; 0 unless its cosine with ``G`` is at
        least ``min_z / sqrt(samples)``, a significant alignment): a push on in the
        direction gossip has moved this node lately, as a push in one fixed direction is (an
        honest correction is about independent of ``G``)."""
        g = self._sum.get((fragment, block_size))
        if g is None:
            return 0.0
        s = step.double()
        gg, ss, gs = float(g @ g), float(s @ s), float(g @ s)
        n = max(s.numel(), 1)
        if gg <= 0 or ss <= 0 or gs / math.sqrt(gg * ss) < min_z / math.sqrt(n):
            return 0.0
        return gs / math.sqrt(gg) / math.sqrt(n)

    def add(self, fragment: int, block_size: int, round_: int, moved: torch.Tensor) -> None:
        """A commit moved the node by ``moved`` on the sample."""
        key = (fragment, block_size)
        self._sum_at(key, moved.numel(), round_).add_(moved.double())
        total = self._moved.get(key)
        if total is None:
            total = self._moved[key] = torch.zeros(moved.numel(), dtype=torch.float64)
        total.add_(moved.double())

    def level(self, fragment: int = 0) -> float:
        """``G``'s RMS on a fragment (its largest over block sizes; 0: none yet)."""
        sums = [g for (f, _), g in self._sum.items() if f == fragment]
        return max((float(g.square().mean().sqrt()) for g in sums), default=0.0)


class LossGate:
    """A bound on what gossip does to the *loss*, measured (issue 39). Every limit on a push's
    size leaves a push aimed where the loss curves: along a gradient of the attacker's own
    batches, a push of 1.9 drifts raised the loss by 2-9 nats where a random one of the same
    size moved it by 0.02 (``benchmarks/probe_curvature.py``). So the node measures the loss
    of a private held-out batch (``loss``: drawn from its own data with the OS's randomness;
    no peer knows it) before and after each commit, under the same hold of the training
    lock, and the rises of one round together stay within ``share`` of the loss: a commit
    beyond that is taken back on this side (counted *bad* when its rise alone exceeds the
    whole allowance, *full* when it found the allowance spent). Nobody is blamed for it: in
    clean swarms 4-10% of honest commits were taken back, most of them *bad* (a quarter batch
    is a noisy judge), and blame is for good. A commit that lowers the loss costs nothing and
    earns no credit. Thread-safe."""

    def __init__(self, loss: Callable[[], float], share: float) -> None:
        self.loss, self.share = loss, share
        self._round = -1
        self._spent = 0.0
        self.taken_back = 0  # commits taken back (logs)
        self.bad = 0  # of which their rise alone exceeded a round's allowance
        self.measured = 0  # forward passes spent (logs, benchmarks)
        self._known: tuple[object, float] | None = None  # (the parameters' version, loss)
        self._lock = threading.Lock()

    def measure(self, version: object = None) -> float:
        """The private batch's loss now (under the training lock); ``version`` names the
        parameters' state (None: unknown): a state measured after the last commit is not
        measured again (commits back to back cost one pass each, not two)."""
        known = self._known
        if version is not None and known is not None and known[0] == version:
            return known[1]
        self.measured += 1
        return self.loss()

    def judge(self, before: float, round_: int, version: object = None) -> str:
        """After a commit (still under the lock): "" if it stays (its rise charged to round
        ``round_``), else why it goes: "full" (the round's allowance is spent) or "bad".
        ``version``: what the parameters' version will be once this commit is done (kept
        or taken back: taken back, the loss is ``before``'s, to rounding)."""
        after = self.loss()
        self.measured += 1
        rise = after - before
        self._known = None if version is None else (version, after)
        with self._lock:
            if round_ != self._round:
                self._round, self._spent = round_, 0.0
            allowed = self.share * abs(before)
            if not math.isfinite(rise) or rise > allowed:
                verdict = "bad"
            elif rise > 0 and self._spent + rise > allowed:
                verdict = "full"
            else:
                self._spent += max(rise, 0.0)
                return ""
            self.taken_back += 1
            self.bad += verdict == "bad"
        if version is not None and math.isfinite(before):
            self._known = (version, before)
        return verdict
