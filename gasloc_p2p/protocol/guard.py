"""Bounded updates: limits on what peers may move a node by, which no peer can move (no I/O).

A gossip correction is ``c = -w (ref_out - ref_in)`` after both messages are folded in, so its
size is known once the peer's payload is checked, before anything is applied. Both sides hold
the same references, so both see the same ``||ref_in - ref_out||``; a side whose guard refuses
aborts before ``Commit`` and neither applies. ``c_i = -c_j`` stays exact unless a side scales
its weight (below), which honest nodes near consensus rarely do.

**Every limit is a multiple of this node's own drift scale**, anchored where no peer can move
it. The node measures its own drift: the RMS of what its own inner steps moved it over a round
(gossip excluded, :class:`gasloc_p2p.core.drift.DriftProbe`), the median of its last
``window`` rounds. That measurement alone is not enough: a peer cannot change what an AdamW
step does to given parameters, but it can move the parameters somewhere the node's own steps
are larger (pushed into a bad region, a node's steps grew from 0.009 to 0.6-1.9 RMS a round
while its limits, a multiple of them, grew with them: issue 39). So the scale is the smaller
of the measured drift and an *anchor*: AdamW moves a coordinate by about its learning rate a
step at most, so ``sum(lr)`` over the round's steps (the node's own schedule: the *step bound*)
bounds honest movement without reading any state; the node tracks the fraction of that bound
its drift uses (the median over ``window`` rounds, at most 1) and keeps the smallest such
fraction it has seen: the anchor only ever shrinks, and follows the schedule (warm-up, decay)
through the step bound. A push that makes the node's own steps larger raises the measured
drift, never the anchor. (The rule before issue 23 took the median of the peers' own accepted
distances and a multiple of this node's displacement from ``theta_0``: an attacker staying
inside the limit ratcheted both up; the rule before issue 39, the measured drift alone, was
raised through the node's own training.)

Per fragment, on the RMS of ``ref_in - ref_out`` (the pair's distance, without ``w``):

- up to the *soft* limit (``factor`` drifts, on what the exchange moves the node by: see
  :meth:`UpdateGuard.screen` for stale exchanges) the exchange commits as is; up to the *hard*
  limit with its weight scaled by ``soft / distance`` (clipped: an honest node far away, one
  that trained alone before it found the swarm or is back from a partition, is pulled in over
  a few exchanges and rounds); beyond it, it is refused and the peer, and the newcomers of its
  address block, backed off. The hard limit is the most of ``hard_factor`` drifts, twice the
  node's own path (the sum of its drifts since it started: two honest nodes from one
  ``theta_0`` are at most their two paths apart) and ``hard_base`` times the RMS of
  ``theta_0`` (a node 20 steps old met one 500 steps old at 1.4 times it, 15 of its drifts),
  none of which a peer can move. The budget, not the hard limit, bounds what a clipped
  exchange can do (an attacker beyond the soft limit gains nothing over one at it); the hard
  limit refuses what no honest node can be;
- a key's weight ramps from ``1 / trust_after`` to 1 over the first ``trust_after`` rounds of
  this node after its first committed exchange with it: a fresh identity (they are free) moves
  it little, and trust takes rounds of this node's clock to earn, not a burst of echoes (12
  keys earned theirs in under 10 seconds when every exchange counted: issue 39). Rounds, not
  exchanges: an attacker commits every round and earns it in ``trust_after`` rounds either
  way, while an honest peer on a home link, whose exchange spans several rounds, stayed a
  newcomer for the whole run when trust counted one commit a round (its weight x0.01-0.04 at
  0.5 Mbit/s: issue 40's shaped runs);
- a key blamed for a rise of this node's loss (:mod:`gasloc_p2p.protocol.blame`, after a
  rollback) loses its trust and, for good, three quarters of its weight per blame
  (:meth:`UpdateGuard.demerit`); its address block's newcomers share a budget cut the same
  way;
- **the movement budget**: all committed exchanges of one round together move this node by at
  most ``round_budget`` drifts (the sum of their ``w * factor * distance``); those with keys
  still earning their trust by at most ``newcomer_budget`` drifts, and those of one address
  block (``/24`` for IPv4, ``/48`` for IPv6) among them by ``block_budget``. An exchange
  beyond what is left is scaled to fit, or refused without penalty when almost nothing is
  left; a newcomer's then commits at weight 0 (it earns its key trust without moving this
  node: an attacker spending the newcomers' budget must not keep honest peers from ever
  earning theirs; one that earns trust for its own keys this way is bounded by
  ``round_budget``). Whatever number of identities and exchanges an attacker uses, what it can move a node
  by per round is bounded by a multiple of the node's own progress: ``block_budget`` drifts
  with a fresh key per exchange from one block, ``newcomer_budget`` from many, and
  ``round_budget`` for keys that earned trust. Newcomers together also move it by at most
  ``newcomer_total`` drifts over about ``newcomer_rounds`` rounds (a sum that decays by
  ``1 / newcomer_rounds`` per round): a bound per round is not a bound in time, and a push in
  one fixed direction adds up. Honest peers on one network (a LAN, a
  docker-compose swarm, one host) share a block only until they are trusted.

Independently of the size, the peer's displacement from ``theta_0`` must be *significantly*
positively correlated with this node's: its cosine with ours must be at least ``min_z /
sqrt(n)`` over a fragment of ``n`` elements (and at least ``min_cosine``, off by default). For
a direction independent of ours the cosine is about ``N(0, 1/n)``, so ``cos * sqrt(n)`` is a
z-score: noise passes with probability about 3e-5 and a sign-flipped honest move fails when
the honest one passes, at any model size (two honest nodes of a 99.5M-parameter Llama measured
cosine 0.015, a z-score of 150). A sideways push passes this test at any size below the soft
limit; that limit, not the cosine, bounds it, and it does not grow with ``n``.

:class:`LossWatch` adds the node's own check after the fact: a finite loss far above its
recent losses rolls the node back like a non-finite one.

Values are plain floats: the engine computes them (tensor work, in a worker thread).
"""

from __future__ import annotations

import ipaddress
import math
import statistics
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

NEWCOMERS = "*"  # the budget all keys still earning their trust share (not an address block)
MAX_PEERS = 4096  # keys whose trust is remembered; the least recently set forgotten first


class ImplausibleUpdate(ValueError):
    """A peer's payload would move this node by an implausible amount; nothing was applied."""


class NotNow(ValueError):
    """The exchange cannot be judged or afforded now (no completed round yet, or this round's
    movement budget spent); nothing was applied and the peer is not to blame."""


def address_block(host: str) -> str:
    """The address block limits and backoffs apply to: ``a.b.c.0/24`` for IPv4, the ``/48``
    for IPv6, the host string itself for a name or anything unparsable."""
    host = host.removeprefix("ipv4:").removeprefix("ipv6:").strip("[]")
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    prefix = 24 if addr.version == 4 else 48
    return str(ipaddress.ip_network(f"{addr}/{prefix}", strict=False))


@dataclass(frozen=True)
class GuardRule:
    """Thresholds of :class:`UpdateGuard` (see the module docstring); lengths in own drifts."""

    factor: float = 4.0  # soft limit: clip beyond this many own drifts
    hard_factor: float = 16.0  # refuse beyond this many own drifts, twice the own path,
    hard_base: float = 4.0  # and this many times the RMS of theta_0, whichever is most
    window: int = 16  # rounds of own drift the median covers
    round_budget: float = 4.0  # movement per round, all peers together
    newcomer_budget: float = 0.5  # of which keys still earning their trust, all together
    newcomer_total: float = 1.0  # and over the last ``newcomer_rounds`` (decaying sum)
    newcomer_rounds: int = 64
    block_budget: float = 0.25  # of which such keys from one address block
    trust_after: int = 8  # rounds after its first commit before a key has its full weight
    min_z: float = 4.0  # the cosine must be >= min_z / sqrt(n) (negative: no such test)
    min_cosine: float = -1.0  # and >= this fixed value (-1: off)

    def min_direction(self, numel: int) -> float:
        """The smallest acceptable cosine over a fragment of ``numel`` elements (-1: none)."""
        z = self.min_z / math.sqrt(max(numel, 1)) if self.min_z >= 0 else -1.0
        return max(self.min_cosine, z)

    @property
    def enabled(self) -> bool:
        return self.factor > 0


@dataclass
class Ticket:
    """The movement one exchange reserved from its round's budget (returned if it fails)."""

    fragment: int
    key: str
    block: str
    movement: float  # RMS, the budget's unit times the drift
    round: int
    clipped: bool


DEMERIT = 0.25  # a blamed key's weight (and its block's newcomer budget) per blame


class _Recent(OrderedDict[str, int]):
    """A bounded map (least recently set forgotten first)."""

    def put(self, key: str, value: int) -> None:
        self.pop(key, None)
        if value:
            self[key] = value
            while len(self) > MAX_PEERS:
                self.popitem(last=False)


class UpdateGuard:
    """This node's own drift per fragment, the round's spent budget, and the peers' trust.

    ``w``: the exchange weight the budget assumes (the node's configured pair weight, an
    upper bound of the weight it commits with). Thread-safe: screening and committing run in
    the engine's worker threads, the round end in the trainer's.
    """

    def __init__(self, rule: GuardRule, w: float = 0.5) -> None:
        self.rule = rule
        self.w = w
        self._drifts: dict[int, deque[float]] = {}  # fragment -> own drift of recent rounds
        self._ratios: dict[int, deque[float]] = {}  # ... as fractions of their step bounds
        self._anchor: dict[int, float] = {}  # fragment -> least median fraction: only shrinks
        self._bound = 0.0  # the step bound of the latest round (sum of its learning rates)
        self._path: dict[int, float] = {}  # fragment -> sum of own drifts since the start
        self._round = 0
        self._spent: dict[int, float] = {}  # fragment -> movement reserved this round
        self._spent_block: dict[tuple[int, str], float] = {}
        self._long: dict[int, float] = {}  # fragment -> newcomers' movement, decaying per round
        self._known = _Recent()  # key -> the round of its first commit here (+1), 0: none
        self._demerits = _Recent()  # key -> times blamed for a rise of the loss
        self._block_demerits = _Recent()  # address block -> times its keys were blamed
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ own drift
    def round_end(self, drifts: dict[int, float], step_bound: float = 0.0) -> None:
        """This node ended a round in which its own steps moved fragment ``f`` by
        ``drifts[f]`` (RMS), ``step_bound`` the sum of the round's inner learning rates (0:
        unknown; the measured drift alone is the scale): a new budget starts."""
        with self._lock:
            if math.isfinite(step_bound) and step_bound > 0:
                self._bound = step_bound
            for fragment, value in drifts.items():
                if not (math.isfinite(value) and value > 0):
                    continue
                window = self.rule.window
                self._drifts.setdefault(fragment, deque(maxlen=window)).append(value)
                if step_bound > 0:
                    ratios = self._ratios.setdefault(fragment, deque(maxlen=window))
                    ratios.append(min(value / step_bound, 1.0))
                    self._anchor[fragment] = min(self._anchor.get(fragment, 1.0),
                                                 statistics.median(ratios))
                # the path stays the measured one: it only widens the hard limit (what no
                # honest node can be), never the budget or the soft limit
                self._path[fragment] = self._path.get(fragment, 0.0) + value
            self._round += 1
            self._spent.clear()
            self._spent_block.clear()
            keep = 1 - 1 / max(self.rule.newcomer_rounds, 1)
            for fragment in self._long:
                self._long[fragment] *= keep

    def drift(self, fragment: int) -> float:
        """This node's drift scale on ``fragment`` (the limits' unit; 0: none measured): the
        median of its own recent drifts, at most its anchor times the step bound."""
        with self._lock:
            return self._scale(fragment)

    def _scale(self, fragment: int) -> float:
        recent = self._drifts.get(fragment)
        if not recent:
            return 0.0
        measured = statistics.median(recent)
        anchor = self._anchor.get(fragment)
        return measured if anchor is None or self._bound <= 0 else min(
            measured, anchor * self._bound)

    def measured(self, fragment: int) -> float:
        """The median of this node's own recent drifts, unanchored (logs, benchmarks)."""
        with self._lock:
            recent = list(self._drifts.get(fragment, ()))
        return statistics.median(recent) if recent else 0.0

    def limits(self, fragment: int, base: float = 0.0) -> tuple[float, float]:
        """The soft (clip beyond) and hard (refuse beyond) RMS distances for ``fragment``
        (``base``: the RMS of ``theta_0`` over it)."""
        d = self.drift(fragment)
        with self._lock:
            path = self._path.get(fragment, 0.0)
        r = self.rule
        return r.factor * d, max(r.hard_factor * d, 2 * path, r.hard_base * base)

    # ------------------------------------------------------------------ screening
    def screen(self, fragment: int, distance: float, key: str = "", block: str = "",
               base: float = 0.0, weight: float | None = None) -> tuple[float, Ticket]:
        """The factor on the exchange's weight (1: as is; below 1: clipped, a newcomer's
        share, or what the budget has left) and the budget it reserved (give it back with
        :meth:`release` unless the exchange commits). ImplausibleUpdate beyond the hard limit
        (or for a non-finite distance); NotNow before this node has a drift or once the
        round's budget is spent. ``base``: the RMS of ``theta_0`` over the fragment.

        ``weight``: the most the exchange will commit with (at most ``w``; the caller holds
        it to that): a stale exchange, weighed down for the round ends it spans, moves the
        node by ``weight * distance``, so the soft limit, which bounds one exchange's
        movement to ``w * soft``, clips it only beyond ``soft * w / weight``. An int8
        exchange on a home link spans 4-5 of this node's rounds: weighed down to a quarter,
        then clipped as if it were not, it moved the node by a twentieth of what it could.
        The hard limit stays on the distance. A peer cannot raise the weight (its rounds only
        add staleness), so this moves no bound on what it can do."""
        d = self.drift(fragment)
        soft, hard = self.limits(fragment, base)
        r = self.rule
        if d <= 0:
            raise NotNow("this node has not finished a round of its own yet: no limits to "
                         "judge an update by")
        if not distance <= hard:  # also catches NaN
            raise ImplausibleUpdate(f"implausible update: RMS distance {distance:.3g} on "
                                    f"fragment {fragment} beyond the limit")
        w = self.w if weight is None else min(max(weight, 0.0), self.w)
        reach = soft * self.w / w if w > 0 else math.inf  # the distance beyond which it clips
        clipped = distance > reach
        with self._lock:
            factor = min(1.0, reach / distance) if distance > 0 else 1.0
            earned = self._earned(key)
            factor *= min(1.0, earned) * DEMERIT ** self._demerits.get(key, 0)
            movement = w * factor * distance
            left = r.round_budget * d - self._spent.get(fragment, 0.0)
            if earned < 1:  # a newcomer: newcomers share a budget, and per address block
                blamed = DEMERIT ** self._block_demerits.get(block, 0)
                left = min(left, r.newcomer_budget * d - self._spent_block.get(
                    (fragment, NEWCOMERS), 0.0), blamed * r.block_budget * d
                    - self._spent_block.get((fragment, block), 0.0),
                    r.newcomer_total * d - self._long.get(fragment, 0.0))
            else:
                block = ""  # trusted keys spend the round's budget only
            if movement > left:
                if left <= 0.1 * movement and earned >= 1:
                    raise NotNow("this node's gossip budget for the round is spent")
                # a newcomer's exchange commits even when nothing is left, at weight 0: it
                # earns the key trust without moving this node (an attacker spending the
                # newcomers' budget must not keep honest peers from ever earning theirs)
                left = left if left > 0.1 * movement else 0.0
                factor *= left / movement
                movement = left
            self._spent[fragment] = self._spent.get(fragment, 0.0) + movement
            for b in (block, NEWCOMERS) if block else ():
                self._spent_block[(fragment, b)] = (
                    self._spent_block.get((fragment, b), 0.0) + movement)
            if block:
                self._long[fragment] = self._long.get(fragment, 0.0) + movement
            return factor, Ticket(fragment, key, block, movement, self._round, clipped)

    def release(self, ticket: Ticket) -> None:
        """The exchange did not commit: its reserved movement returns to the budget."""
        with self._lock:
            if ticket.round != self._round or ticket.movement == 0:
                return
            f = ticket.fragment
            self._spent[f] = max(0.0, self._spent.get(f, 0.0) - ticket.movement)
            for b in ((f, ticket.block), (f, NEWCOMERS)) if ticket.block else ():
                self._spent_block[b] = max(0.0, self._spent_block.get(b, 0.0) - ticket.movement)
            if ticket.block:
                self._long[f] = max(0.0, self._long.get(f, 0.0) - ticket.movement)
            ticket.movement = 0.0

    def shrink(self, ticket: Ticket, ratio: float) -> None:
        """The exchange of ``ticket`` will move the node by ``ratio`` of what it reserved:
        the rest returns to the round's budget."""
        if ratio >= 1:
            return
        extra = Ticket(ticket.fragment, ticket.key, ticket.block,
                       ticket.movement * (1 - max(ratio, 0.0)), ticket.round, ticket.clipped)
        ticket.movement -= extra.movement
        self.release(extra)

    def _earned(self, key: str) -> float:
        """The share of its weight ``key`` has earned: ``(1 + level) / trust_after``, the level
        0 before its first commit, then the rounds since (at least 1), at most 1 in all."""
        first = self._known.get(key, 0)
        level = 0 if not first else max(1, self._round + 1 - first)
        return min(1.0, (1 + level) / max(self.rule.trust_after, 1))

    def committed(self, ticket: Ticket) -> None:
        """The exchange committed: its reservation is spent for good, and its key's clock of
        trust starts (at its first commit) or is remembered for longer (later ones: the map
        forgets the keys that committed least recently first, so keys minted in bulk evict
        each other, not the peers this node exchanges with)."""
        with self._lock:
            ticket.movement = 0.0  # a later release gives nothing back
            self._known.put(ticket.key, self._known.get(ticket.key, 0) or self._round + 1)

    def demerit(self, key: str, block: str = "") -> None:
        """``key`` was blamed for a rise of this node's loss: it starts over as a newcomer and
        keeps, for good, ``DEMERIT`` of its weight per blame; newcomers of ``block`` share a
        budget cut the same way."""
        with self._lock:
            self._known.pop(key, None)
            self._demerits.put(key, self._demerits.get(key, 0) + 1)
            if block:
                self._block_demerits.put(block, self._block_demerits.get(block, 0) + 1)

    def demerits(self, key: str) -> int:
        with self._lock:
            return self._demerits.get(key, 0)

    def trusted(self, key: str) -> bool:
        """Whether ``key`` has its full weight here."""
        with self._lock:
            return self._earned(key) >= 1

    def spent(self, fragment: int) -> float:
        """Movement reserved so far this round on ``fragment``, in own drifts."""
        d = self.drift(fragment)
        with self._lock:
            return self._spent.get(fragment, 0.0) / d if d > 0 else 0.0

    def screen_direction(self, fragment: int, cosine: float, numel: int) -> None:
        """ImplausibleUpdate if the peer's displacement from ``theta_0`` is not significantly
        aligned with ours over ``numel`` elements (a sign-flipped or random delta): honest
        nodes share ``theta_0`` and the data's distribution, so theirs are correlated."""
        if not self.rule.enabled:
            return
        least = self.rule.min_direction(numel)
        if not cosine >= least:  # also catches NaN
            raise ImplausibleUpdate(f"implausible update: its displacement from theta_0 has "
                                    f"cosine {cosine:.3g} with ours on fragment {fragment} "
                                    f"(minimum {least:.3g} over {numel} elements)")


class LossWatch:
    """A training loss implausibly far above the node's own recent ones.

    Two rules, each a reason for the trainer to roll back to its last good state:

    - a *jump*: a finite loss above ``jump`` times the median of the last ``window`` accepted
      losses (once ``warmup`` of them are known): honest training never doubles its loss from
      one step to the next; a push that does is undone at the next step;
    - a *rise* (when ``rise`` > 0): the loss's moving average (over about ``smooth`` steps)
      stays above ``1 + rise`` times the lowest it reached over the last ``memory`` steps.
      A push tuned to stay under every limit raised the loss steadily without ever doubling
      it (issue 39: from 2.21 to about 1e8 in 10 minutes, no rollback); honest training's
      average falls or wanders within a few noise widths of its recent best. The state kept
      for a rollback is one the loss judged near its best (:meth:`near_best`), so a rollback
      returns to before the rise.

    ``jump <= 0``: no jump rule (non-finite losses are always implausible).
    """

    def __init__(self, jump: float = 2.0, window: int = 32, warmup: int = 8,
                 rise: float = 0.0, smooth: int = 64, memory: int = 512) -> None:
        self.jump, self.warmup = jump, warmup
        self.rise, self.smooth = rise, smooth
        self._recent: deque[float] = deque(maxlen=window)
        self._averages: deque[float] = deque(maxlen=memory)  # the moving average, per step
        self._average = math.nan

    def implausible(self, loss: float) -> bool:
        """Whether ``loss`` must be rolled back (non-finite, or a jump); a plausible one is
        remembered (and moves the average the rise rule reads)."""
        if not math.isfinite(loss):
            return True
        if (self.jump > 0 and len(self._recent) >= self.warmup
                and loss > self.jump * statistics.median(self._recent)):
            return True
        self._recent.append(loss)
        a = 1.0 / max(self.smooth, 1)
        self._average = loss if math.isnan(self._average) else (1 - a) * self._average + a * loss
        self._averages.append(self._average)
        return False

    def _best(self) -> float:
        return min(self._averages) if len(self._averages) >= self.smooth else math.nan

    def risen(self) -> bool:
        """Whether the moving average stays ``rise`` above its recent best (the rise rule)."""
        best = self._best()
        return self.rise > 0 and math.isfinite(best) and self._average > (1 + self.rise) * best

    def near_best(self) -> bool:
        """Whether the loss is near its recent best (within half the rise): a state fit to
        keep for a rollback (always, without the rise rule or while warming up)."""
        best = self._best()
        return (self.rise <= 0 or not math.isfinite(best)
                or self._average <= (1 + self.rise / 2) * best)

    def reset(self) -> None:
        """Forget the recent losses (after a rollback: a loss that stays high is then
        accepted once the watch has warmed up again). The rise rule's history stays, its
        average back at the best: the state returned to is judged against the same best."""
        self._recent.clear()
        best = self._best()
        if math.isfinite(best):
            self._average = best
            self._averages.append(best)

    def rebase(self) -> None:
        """Take the current average as the best (a rise that was the node's own doing: the
        rise rule judges what comes next against it)."""
        self._averages.clear()
        self._averages.extend([self._average] * self.smooth)

    def limit(self) -> float:
        """The loss beyond which a step is rolled back now (inf while warming up)."""
        if self.jump <= 0 or len(self._recent) < self.warmup:
            return math.inf
        return self.jump * statistics.median(self._recent)
