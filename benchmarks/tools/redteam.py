"""Member attacks that know the defence (issue 39): the attackers of ``bench_redteam``.

Every attack speaks the real protocol with valid signatures and Commits, as a member holding
the swarm's credentials (the benchmark's swarm is open: any key may join, which is the same
for a member minting keys). Each push is the victim's own public iterate (from a state
download at most ``refresh_s`` old) plus ``k`` times the victim's drift scale along one fixed
random direction ``u`` (:func:`benchmarks.tools.sybil.direction`): the victim's displacement
from ``theta_0`` is its own plus a small push, so the direction test passes, and ``k`` just
under the guard's soft factor (:data:`FULL`) keeps each exchange unclipped. The drift scale is
what the victim judges by (its progress log's ``guard drift``: an attacker training beside
the swarm with the same settings measures about the same on itself).

- ``fresh-keys``: a new key for every exchange (issue 23's attack);
- ``farm-push``: ``keys`` identities first earn trust with ``farm`` exchanges each that echo
  the victim's own iterate (they move it by nothing), then all push at full rate (issue 39:
  12 keys took three honest nodes from loss 2.21 to about 1e8 in 10 minutes);
- ``member-push``: one invited member (one key), trusted the same way, pushing at full rate;
- ``slow-push``: one trusted key, one push per victim round at a fraction of the soft limit,
  tuned to stay under every per-exchange and per-round threshold, so only a bound over many
  rounds can see it;
- ``orthogonal``: ``farm-push`` along the part of ``u`` orthogonal to the victim's own
  displacement from ``theta_0`` (no projection on what honest training does);
- ``ascent``: one invited member pushing at full rate along the *ascent* direction of the
  loss at the victim's iterate (the gradient on the attacker's own training batches, unit
  RMS) instead of a fixed random one: the attack that aims at the loss, which a push along a
  random direction barely moves, while each push stays as small as the others;
- ``ascent-slow``: the same, one push of 2 drifts a victim round (under every per-exchange
  and per-round threshold, and slow enough for the node's own descent to mask a rise);
- ``rewind``: one invited member pushing at full rate towards the victim's own iterate of a
  minute ago: undoing its progress along the path it took, where its loss surely rises.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import torch

from benchmarks.tools.fuzz_streams import Target
from benchmarks.tools.sybil import DEADLINE_S, Tally, direction, exchange, victim_drift
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.node.transport.tls import fetch_certificate, secure_channel
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.guard import GuardRule
from gasloc_p2p.tools.nodes import NodeChild


@dataclass(frozen=True)
class Attack:
    """One attacker: ``keys`` identities (0: a fresh one per exchange), ``farm`` trust-earning
    echoes per key, push ``k`` drifts, ``gap_s`` between one key's pushes to a victim (0: as
    fast as the victim answers; negative: one victim round, read from its log), and whether
    where the push aims: ``fixed`` (``u``), ``orthogonal`` (``u`` less its part along the
    victim's displacement from theta_0), ``ascent`` (the loss's gradient at the victim's
    iterate) or ``rewind`` (towards the victim's iterate of ``REWIND_S`` ago)."""

    name: str
    keys: int
    farm: int
    k: float
    gap_s: float = 0.0
    aim: str = "fixed"


FULL = 0.95 * GuardRule().factor  # a push just under the soft limit: the most unclipped
ATTACKS = {a.name: a for a in (
    Attack("fresh-keys", keys=0, farm=0, k=FULL),
    Attack("farm-push", keys=12, farm=8, k=FULL),
    Attack("member-push", keys=1, farm=8, k=FULL),
    Attack("slow-push", keys=1, farm=8, k=2.0, gap_s=-1.0),
    Attack("orthogonal", keys=12, farm=8, k=FULL, aim="orthogonal"),
    Attack("ascent", keys=1, farm=8, k=FULL, aim="ascent"),
    Attack("ascent-slow", keys=1, farm=8, k=2.0, gap_s=-1.0, aim="ascent"),
    Attack("rewind", keys=1, farm=8, k=FULL, aim="rewind"),
)}
REWIND_S = 60.0


class Ascent:
    """The loss's ascent direction at a given iterate, unit RMS: the gradient on ``batches``
    of the attacker's own training batches (a member trains on the run's data like anyone)."""

    def __init__(self, batches: int = 2, seed: int = 4242) -> None:
        import argparse

        from benchmarks.swarm_eval import TINY
        from gasloc_p2p.core.flat import FlatParams
        from gasloc_p2p.model import build_model
        from gasloc_p2p.node.runtime.trainer import load_data
        from gasloc_p2p.node.settings import build_config

        cfg = build_config(argparse.Namespace(**TINY), environ={})
        self.model = build_model(cfg.train.gpt(), cfg.train.seed)
        self.flat = FlatParams(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.data = load_data(cfg.train, seed).train
        self.shape = (cfg.train.batch_size, cfg.train.seq_len)
        self.batches = batches
        self.generator = torch.Generator().manual_seed(seed)
        self._lock = asyncio.Lock()

    def _direction(self, at: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.flat.buffer.copy_(at)
        self.model.zero_grad(set_to_none=True)
        for _ in range(self.batches):
            x, y = self.data.batch(*self.shape, self.generator)
            _, loss = self.model(x, y)
            (loss / self.batches).backward()
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                       for p in self.params]).float()
        return g / g.pow(2).mean().sqrt().clamp_min(1e-30)

    async def direction(self, at: torch.Tensor) -> torch.Tensor:
        """The unit-RMS ascent direction at ``at`` (one computation at a time)."""
        async with self._lock:
            return await asyncio.to_thread(self._direction, at)


class Victim:
    """What the attacker keeps about one victim: its channel, its latest iterate."""

    def __init__(self, node: NodeChild, run_id: str, theta0: torch.Tensor) -> None:
        self.node, self.run_id, self.theta0 = node, run_id, theta0
        self.base: torch.Tensor | None = None
        self.fetched = 0.0
        self._lock = asyncio.Lock()

    async def iterate(self, refresh_s: float) -> torch.Tensor | None:
        """The victim's public iterate, at most ``refresh_s`` old (one download at a time)."""
        async with self._lock:
            if self.base is None or time.monotonic() - self.fetched > refresh_s:
                try:
                    self.base = (await asyncio.to_thread(self.node.download_state,
                                                         self.run_id))[1]
                    self.fetched = time.monotonic()
                except Exception:  # noqa: BLE001 - busy serving others: the old one
                    await asyncio.sleep(0.5)
            return self.base


def unit(v: torch.Tensor) -> torch.Tensor:
    """``v`` scaled to unit RMS (float32)."""
    v = v.double()
    return (v / v.pow(2).mean().sqrt().clamp_min(1e-30)).float()


def orthogonal_to(u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The part of ``u`` orthogonal to ``d``, unit RMS."""
    d = d.double()
    return unit(u.double() - d * (d @ u.double()) / max(float(d @ d), 1e-30))


def payload_of(base: torch.Tensor, push: torch.Tensor, offset: float) -> bytes:
    return CodecSpec("fp32", 0).codec().encode(base + offset * push).to_bytes()


async def run_attack(attack: Attack, victims: list[NodeChild], run_id: str,
                     theta0: torch.Tensor, until: float, tally: Tally, w: float = 0.5,
                     refresh_s: float = 2.0, inner_steps: int = 10) -> None:
    """Every key against every victim, one exchange in flight per (key, victim), until
    ``until``. ``tally.pushed`` counts the pushes committed (``w * offset``), not the farming
    echoes; ``tally.vectors`` sums them per victim as vectors (``w * offset * direction``)."""
    u = direction(theta0.numel())
    signers: list[Signer | None] = [Signer() for _ in range(attack.keys)] or [None]
    ascent = Ascent() if attack.aim == "ascent" else None
    aimed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # victim: (base, its direction)
    seen: dict[str, list[tuple[float, torch.Tensor]]] = {}  # victim: its iterates, oldest first

    async def aim(name: str, base: torch.Tensor) -> torch.Tensor | None:
        """Where to push a victim whose iterate is ``base`` (None: nothing to aim at yet)."""
        if attack.aim == "fixed":
            return u
        if attack.aim == "orthogonal":
            return orthogonal_to(u, base - theta0)
        if name in aimed and aimed[name][0] is base:  # once per iterate downloaded
            return aimed[name][1]
        if ascent is not None:
            push = await ascent.direction(base)
        else:  # rewind: towards the newest iterate at least REWIND_S old
            history = seen.setdefault(name, [])
            if not history or history[-1][1] is not base:
                history.append((time.monotonic(), base))
            old = [b for t, b in history if t <= time.monotonic() - REWIND_S] or [history[0][1]]
            while len(history) > 2 and history[1][0] <= time.monotonic() - REWIND_S:
                history.pop(0)
            if old[-1] is base:
                return None
            push = unit(old[-1] - base)
        aimed[name] = (base, push)
        return push

    async def one(node: NodeChild, signer: Signer | None) -> None:
        victim = Victim(node, run_id, theta0)
        info = await asyncio.to_thread(node.info)
        cert = await asyncio.to_thread(fetch_certificate, node.endpoint)
        target = Target(run_id, info.model_fingerprint, theta0.numel(), DEADLINE_S)
        farmed = 0
        async with secure_channel(node.endpoint, cert, [
                ("grpc.max_send_message_length", 64 << 20)]) as channel:
            while time.monotonic() < until:
                drift = victim_drift(node)
                base = await victim.iterate(refresh_s)
                if drift <= 0 or base is None or not node.alive:
                    await asyncio.sleep(1.0)
                    continue
                farming = signer is not None and farmed < attack.farm
                offset = 0.0 if farming else attack.k * drift
                push = await aim(node.name, base)
                if push is None:
                    await asyncio.sleep(1.0)
                    continue
                payload = payload_of(base, push, offset)
                try:
                    outcome = await exchange(channel, target, payload, signer)
                except grpc.RpcError as exc:
                    outcome = f"rpc {exc.code()}"
                tally.outcomes[("farm " if farming else "") + outcome] += 1
                if outcome == "committed":
                    if farming:
                        farmed += 1
                        continue
                    tally.pushed[node.name] += w * offset
                    tally.add_vector(node.name, w * offset * push)
                await asyncio.sleep(_gap(attack, node, inner_steps) if outcome == "committed"
                                    else 0.05)

    await asyncio.gather(*(one(v, s) for v in victims for s in signers))


def _gap(attack: Attack, node: NodeChild, inner_steps: int) -> float:
    if attack.gap_s >= 0:
        return attack.gap_s
    return max(0.2, inner_steps * _step_s(node))


def _step_s(node: NodeChild) -> float:
    """The victim's seconds per step, from its progress log (1 s until it says)."""
    import re

    found = re.findall(r"tok/s (\d+)", node.err.read_text(errors="replace"))
    return 512 / float(found[-1]) if found and float(found[-1]) > 0 else 1.0
