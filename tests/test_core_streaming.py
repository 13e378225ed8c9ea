"""Streaming DiLoCo against DiLoCo, and its fragment schedule."""

from __future__ import annotations

import torch

from gasloc_p2p.core.flat import Fragment, whole
from gasloc_p2p.core.streaming import StreamingConfig, StreamingDiloco
from tests import toy

ETA, GAMMA, run_diloco = toy.ETA, toy.GAMMA, toy.run_diloco


def test_one_fragment_no_overlap_alpha0_equals_diloco():
    n, rounds, H = 4, 10, 5
    ref = run_diloco(n, rounds, H)
    thetas, ws = toy.workers(n)
    cfg = StreamingConfig(H=H, tau=0, alpha=0.0, eta=ETA, gamma=GAMMA, codec="none")
    sd = StreamingDiloco(toy.theta0(), [whole(toy.numel())], cfg)
    for step in range(1, rounds * H + 1):
        for w in ws:
            w.inner(1)
        for f in sd.due(step):
            sd.begin(f, step, thetas)
        sd.land(step, thetas)
        if step % H == 0:
            for i in range(n):
                torch.testing.assert_close(thetas[i], ref[step // H - 1], rtol=0, atol=1e-10)


def test_staggered_schedule_and_overlap():
    frags = [Fragment(0, [(0, 3)]), Fragment(1, [(3, 3)]), Fragment(2, [(6, 3)])]
    sd = StreamingDiloco(torch.zeros(9), frags, StreamingConfig(H=6, tau=2, codec="fp32"))
    starts = {f: [s for s in range(1, 25) if f in sd.due(s)] for f in range(3)}
    assert starts == {0: [6, 12, 18, 24], 1: [8, 14, 20], 2: [10, 16, 22]}
    thetas = torch.ones(2, 9)
    sd.begin(0, 6, thetas)
    assert sd.land(7, thetas) == [] and torch.equal(thetas, torch.ones(2, 9))  # still in flight
    assert sd.land(8, thetas) == [0]
    assert not torch.equal(thetas[:, :3], torch.ones(2, 3)) and torch.equal(thetas[:, 3:], torch.ones(2, 6))


def test_merge_alpha_keeps_local_share():
    frag = whole(4)
    cfg = StreamingConfig(H=2, tau=1, alpha=0.5, eta=1.0, gamma=0.0, codec="fp32")
    sd = StreamingDiloco(torch.zeros(4), [frag], cfg)
    thetas = torch.ones(2, 4)  # both workers drifted by +1: global moves to 1
    sd.begin(0, 2, thetas)
    thetas += 2.0  # overlap: local steps go on to 3
    sd.land(3, thetas)
    assert torch.equal(thetas, torch.full((2, 4), 2.0))  # 0.5 * 3 + 0.5 * 1
