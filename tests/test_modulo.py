"""Modulo payloads (core/modulo.py) and their simulated exchanges (sim/modulo_exchange.py)."""

from __future__ import annotations

import pytest
import torch

from gasloc_p2p.core import modulo
from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.modulo import Distances, ModuloPayload, ModuloSpec
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.modulo_exchange import ModuloExchanger


def test_text_forms_and_sizes() -> None:
    assert ModuloSpec.parse("mod3") == ModuloSpec(3)
    assert ModuloSpec.parse("mod3:1365") == ModuloSpec(3, 1365)
    assert ModuloSpec.parse("mod2:100:2048") == ModuloSpec(2, 100, 2048)
    for text in ("mod3", "mod3:1365", "mod2:100:2048", "mod4:2048:2048"):
        assert ModuloSpec.parse(str(ModuloSpec.parse(text))) == ModuloSpec.parse(text)
    for bad in ("mod", "mod9", "mod3:0", "mod3:5000", "mod3:1:2:3", "modx"):
        with pytest.raises(ValueError):
            ModuloSpec.parse(bad)
    # 8192 + 100 elements: 3 chunks; 1365 + 1365 + 100 entries of 3 bits; a step per chunk
    spec = ModuloSpec(3, 1365)
    assert spec.entries(8292) == 2830
    assert spec.wire_bytes(8292) == 12 + (2830 * 3 + 7) // 8
    # 3 bits on a third of the coordinates: 8x below int8's byte per coordinate
    assert 7.9 < 1_000_000 / spec.wire_bytes(1_000_000) < 8.1


def _pair(n: int, distance: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g) * 0.05
    return p, p + torch.randn(n, generator=g) * distance


# 3 bits and more at margin 1.5: a distance up to the measured largest plus a step of rounding
# stays inside the window (1 + 1.5 / 4 < 1.5), so nothing wraps
@pytest.mark.parametrize("spec", [ModuloSpec(3), ModuloSpec(3, 1000), ModuloSpec(5, 300, 1024)])
def test_the_receiver_recovers_the_senders_rounding_bit_for_bit(spec: ModuloSpec) -> None:
    p, own = _pair(10_000, 1e-4)
    chunks = -(-p.numel() // spec.chunk)
    largest = (own - p).abs().max()
    steps = modulo.steps_for(spec, p, torch.full((chunks,), float(largest)))
    payload, q = modulo.encode(spec, p, steps, seed=7, generator=torch.Generator().manual_seed(1))
    got = modulo.lift(payload, own)
    pos = modulo.positions(spec, p.numel(), 7)
    assert pos.numel() == spec.entries(p.numel()) == got.numel()
    # within the window (1.5 largest distances) every coordinate comes back exact
    assert bool((got == q).all())
    # and the rounding is within one step of the true value
    step = steps[pos // spec.chunk]
    assert bool(((q - p[pos]).abs() <= step).all())


def test_a_coordinate_beyond_the_window_wraps_by_whole_periods() -> None:
    spec = ModuloSpec(2)
    p = torch.zeros(4096)
    steps = torch.tensor([1.0])
    payload, q = modulo.encode(spec, p, steps, seed=0, generator=torch.Generator().manual_seed(0))
    own = torch.zeros(4096)
    own[0] = 3.0  # 3 steps away: beyond 2^(b-1) = 2 steps
    got = modulo.lift(payload, own)
    assert bool((got[1:] == q[1:]).all())
    assert (got[0] - q[0]).item() == 4.0  # one period of 2^b steps


def test_steps_follow_the_distance_and_have_a_floor() -> None:
    spec = ModuloSpec(3, margin=4.0)
    p = torch.full((8192,), 0.5)
    steps = modulo.steps_for(spec, p, torch.tensor([1e-3, 0.0]))
    assert steps[0].item() == pytest.approx(1e-3)  # 4 largest distances = 2^(3-1) steps
    assert steps[1].item() == pytest.approx(0.5 * 2.0**-20)
    with pytest.raises(ValueError, match="distances"):
        modulo.steps_for(spec, p, torch.ones(3))


def test_a_peers_payload_is_validated() -> None:
    spec = ModuloSpec(3, 100)
    ok = ModuloPayload(spec, 5000, 0, torch.ones(2), torch.zeros(200, dtype=torch.int64))
    modulo.validate(ok, limit=10.0)
    bad = [
        ModuloPayload(spec, 5000, 0, torch.ones(3), ok.codes),  # a step too many
        ModuloPayload(spec, 5000, 0, ok.steps, torch.zeros(201, dtype=torch.int64)),
        ModuloPayload(spec, 5000, 0, torch.tensor([1.0, float("nan")]), ok.codes),
        ModuloPayload(spec, 5000, 0, torch.tensor([1.0, 0.0]), ok.codes),
        ModuloPayload(spec, 5000, 0, torch.tensor([1.0, 11.0]), ok.codes),  # above the limit
        ModuloPayload(spec, 5000, 0, ok.steps, torch.full((200,), 8, dtype=torch.int64)),
    ]
    for payload in bad:
        with pytest.raises(ValueError):
            modulo.validate(payload, limit=10.0)


def _states(n: int, numel: int) -> list[AsyncGaslocState]:
    theta0 = torch.zeros(numel)
    cfg = AsyncConfig(eta=1.0, gamma=0.0, w=0.5)
    states = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        states.append(AsyncGaslocState(torch.randn(numel, generator=g) * 1e-3, theta0, cfg))
    return states


def test_a_simulated_exchange_keeps_the_pairs_sum_unless_a_coordinate_wraps() -> None:
    numel = 9000
    states = _states(2, numel)
    frag = Fragment(0, [(0, numel)])
    ex = ModuloExchanger(states, [frag], ModuloSpec(4), 0.5, seed=1)
    assert ex.pending_bytes(ex.begin(0, 1, 0)) == numel + 4 * 9  # first: int8 plain
    ex.commit(ex.begin(0, 1, 0))
    assert ex.stats["int8_exchanges"] == 1
    assert ex.distances[0].get(0) is not None and ex.distances[1].get(0) is not None
    kept = 0
    for _ in range(8):
        before, wrapped = states[0].theta + states[1].theta, ex.stats["wrapped"]
        pend = ex.begin(0, 1, 0)
        assert ex.pending_bytes(pend) == ModuloSpec(4).wire_bytes(numel) == numel // 2 + 4 * 3
        ex.commit(pend)
        drift = (states[0].theta + states[1].theta - before).abs().max().item()
        if ex.stats["wrapped"] == wrapped:
            kept += 1
            assert drift < 1e-8  # float32 rounding of the two additions only
        else:  # a wrapped coordinate is off by a period: the sum moves there
            assert drift > 1e-6
    assert kept >= 6 and ex.stats["sent"] == 8 * 2 * numel


def test_distances_are_the_largest_per_chunk_over_the_sent_positions() -> None:
    d = Distances()
    spec = ModuloSpec(3, 2, 4)
    own = torch.zeros(6)
    pos = torch.tensor([0, 2, 4, 5])
    d.measure(3, spec, 6, pos, torch.tensor([3.0, 4.0, 1.0, 1.0]), own)
    got = d.get(3)
    assert got is not None
    assert torch.equal(got, torch.tensor([4.0, 1.0]))


def test_the_simulator_takes_modulo_codecs_for_gossip_only() -> None:
    SimConfig(codec="mod3:1365").validate()
    with pytest.raises(Exception, match="gossip payloads"):
        SimConfig(codec="mod3", algorithm="diloco").validate()
    with pytest.raises(Exception, match="modulo one"):
        SimConfig(codec="mod9").validate()
