"""A malicious gossip node for bench_byzantine.py (never part of the package).

Usage: python -m benchmarks.byzantine_node ATTACK REPORT.json [gasloc-node arguments...]

Runs the real daemon with the real protocol, but every payload it sends in an exchange encodes
``theta_0 + f(p - theta_0)`` instead of its public iterate ``p``: ``scaled`` (f = 10x),
``signflip`` (f = -1x), ``random`` (Gaussian noise of 3x the delta's RMS), or ``cycle`` (one
of the three at random per exchange). The attack is applied to what the engine encodes (the
reference scheme's sender), so it reaches the wire whatever the scheme. REPORT.json is
rewritten after every exchange: per attack, how many payloads were prepared and how many
exchanges committed (an honest peer accepted them).
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from gasloc_p2p import cli
from gasloc_p2p.protocol.engine import ExchangeEngine

ATTACKS = ("scaled", "signflip", "random")


def attack(name: str, delta: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """f(delta) of one attack (``delta``: a chunk of p - theta_0)."""
    if name == "scaled":
        return 10 * delta
    if name == "signflip":
        return -delta
    rms = float(delta.norm()) / math.sqrt(max(delta.numel(), 1))
    return 3 * rms * torch.randn(delta.shape, generator=gen)


class EvilSender:
    """Wraps a reference scheme's sender: rewrites the chunk before it is encoded."""

    def __init__(self, real: Any, theta0: torch.Tensor, name: str, seed: int) -> None:
        self.real, self.theta0, self.name = real, theta0, name
        self.gen = torch.Generator().manual_seed(seed)
        self.used = False

    def encode(self, pos: int, pieces: list[Any], x: torch.Tensor, codec: Any, out: Any) -> None:
        base = torch.empty_like(x)
        for start, length, o in pieces:
            base[o : o + length] = self.theta0[start : start + length]
        x.copy_(base + attack(self.name, x - base, self.gen))
        self.used = True
        self.real.encode(pos, pieces, x, codec, out)


def install(name: str, report: Path) -> None:
    prepare, commit = ExchangeEngine.prepare, ExchangeEngine.commit
    rng = random.Random(0)
    kinds: dict[int, str] = {}  # id(Prepared) -> attack
    counts = {a: {"prepared": 0, "committed": 0} for a in ATTACKS}
    lock, serial = threading.Lock(), threading.Lock()

    def save() -> None:
        report.write_text(json.dumps(counts))

    def evil_prepare(self: ExchangeEngine, *args: Any, **kwargs: Any) -> Any:
        kind = rng.choice(ATTACKS) if name == "cycle" else name
        refs, real = self.refs, type(self.refs).sender

        made: list[EvilSender] = []

        def sender(*a: Any, **k: Any) -> EvilSender:
            made.append(EvilSender(real(refs, *a, **k), self.theta0, kind,
                                   rng.randrange(1 << 30)))
            return made[-1]

        with serial:  # one patched prepare at a time: concurrent ones would swap attacks
            refs.sender = sender  # type: ignore[method-assign]
            try:
                prep = prepare(self, *args, **kwargs)
            finally:
                del refs.sender
        applied = {m.name for m in made if m.used}  # what reached the payload
        assert applied == {kind}, (applied, kind)
        with lock:
            kinds[id(prep)] = kind
            counts[kind]["prepared"] += 1
            save()
        return prep

    def evil_commit(self: ExchangeEngine, prep: Any, *args: Any, **kwargs: Any) -> float:
        norm = commit(self, prep, *args, **kwargs)
        with lock:
            kind = kinds.pop(id(prep), None)
            if kind is not None:
                counts[kind]["committed"] += 1
                save()
        return norm

    ExchangeEngine.prepare = evil_prepare  # type: ignore[method-assign]
    ExchangeEngine.commit = evil_commit  # type: ignore[method-assign]


if __name__ == "__main__":
    install(sys.argv[1], Path(sys.argv[2]))
    sys.exit(cli.main(sys.argv[3:]))
