"""A malicious gossip node for bench_byzantine.py (never part of the package).

Usage: python benchmarks/byzantine_node.py ATTACK [gasloc-node arguments...]

Runs the real daemon with the real protocol, but every public iterate it sends (and serves)
is ``theta_0 + f(p - theta_0)``: ``scaled`` (f = 10x), ``signflip`` (f = -1x), ``random``
(Gaussian noise of 3x the delta's RMS), or ``cycle`` (one of the three at random per exchange).
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gasloc_p2p import cli  # noqa: E402
from gasloc_p2p.protocol.engine import ExchangeEngine  # noqa: E402

ATTACKS = ("scaled", "signflip", "random")


def attack(name: str, delta: torch.Tensor, rng: random.Random) -> torch.Tensor:
    if name == "cycle":
        name = rng.choice(ATTACKS)
    if name == "scaled":
        return 10 * delta
    if name == "signflip":
        return -delta
    rms = float(delta.norm()) / math.sqrt(max(delta.numel(), 1))
    noise = torch.randn(delta.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    return 3 * rms * noise


def install(name: str) -> None:
    original = ExchangeEngine.__init__
    rng = random.Random(0)

    def init(self: ExchangeEngine, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        real, theta0 = self.state.public_iterate, self.theta0

        def public_iterate(fragment: Any = None, out: torch.Tensor | None = None) -> torch.Tensor:
            p = real(fragment, out)
            base = theta0 if fragment is None else fragment.gather(theta0)
            return base + attack(name, p - base, rng)

        self.state.public_iterate = public_iterate  # type: ignore[method-assign]

    ExchangeEngine.__init__ = init  # type: ignore[method-assign]


if __name__ == "__main__":
    install(sys.argv[1])
    sys.exit(cli.main(sys.argv[2:]))
