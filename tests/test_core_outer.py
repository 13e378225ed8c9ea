"""The outer optimizers (gasloc_p2p/core/outer.py) against their formulas, bit for bit.

The values are dyadic (multiples of 1/8, ``eta`` and ``gamma`` of a few bits) in float64, so
every formula below is exact in floating point: the formula written out with ``+ - *`` and the
class's own operations (``lerp``, fused updates, chunked) must give the same bits, and
``torch.equal`` checks the rule itself, not a tolerance. A second test pins the round end's
operations on random values (what makes the simulator's runs reproducible across versions).
"""

from __future__ import annotations

import pytest
import torch

from gasloc_p2p.core.async_state import MOMENTUM_FORMS, AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.flat import Fragment, whole
from gasloc_p2p.core.outer import (
    OUTER_OPTIMIZERS,
    LocalNesterov,
    MixedMomentum,
    PlainAverage,
    make_outer,
    momentum_forms,
    restore_problem,
)
from gasloc_p2p.sim.config import MOMENTUM_FORMS as SIM_FORMS

N, ETA, GAMMA = 24, 0.75, 0.5
F64 = torch.float64


def dyadic(seed: int, n: int = N) -> torch.Tensor:
    """``n`` values k / 8 with ``|k| <= 64`` (float64: every formula here stays exact)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 65, (n,), generator=gen).to(F64) / 8


def rounds(cfg: AsyncConfig, count: int = 3):
    """A node state from ``theta_0`` through ``count`` rounds (drift, a correction); yields
    (anchor, theta, the state) where a round ends: the caller ends it."""
    theta0 = dyadic(0)
    st = AsyncGaslocState(theta0.clone(), theta0, cfg)
    for r in range(count):
        st.theta.add_(dyadic(10 + r))
        st.apply_correction(dyadic(20 + r) / 4)
        anchor = st.anchor.clone() if st.anchor is not None else st.theta.clone()
        yield anchor, st.theta.clone(), st


@pytest.mark.parametrize("eta", [1.0, ETA])
@pytest.mark.parametrize("form", ["mixed", "local"])
def test_plain_averaging_is_the_public_iterate_whatever_the_form(eta, form):
    cfg = AsyncConfig(eta=eta, gamma=0.0, momentum=form)
    for a, theta, st in rounds(cfg):
        assert isinstance(st.outer, PlainAverage) and st.outer.state == {}
        st.round_end()
        p = a + eta * (theta - a)
        assert torch.equal(st.theta, p)
        assert st.anchor is None if eta == 1.0 else torch.equal(st.anchor, p)


@pytest.mark.parametrize("eta", [1.0, ETA])
def test_mixed_momentum(eta):
    zprev = dyadic(0)  # theta_0
    for a, theta, st in rounds(AsyncConfig(eta=eta, gamma=GAMMA, momentum="mixed")):
        assert torch.equal(st.outer.state["zprev"], zprev)
        st.round_end()
        z = a + eta * (theta - a)
        assert torch.equal(st.theta, z + GAMMA * (z - zprev))
        assert torch.equal(st.outer.state["zprev"], z)
        zprev = z


@pytest.mark.parametrize("eta", [1.0, ETA])
def test_local_nesterov(eta):
    m = torch.zeros(N, dtype=F64)
    for a, theta, st in rounds(AsyncConfig(eta=eta, gamma=GAMMA, momentum="local")):
        assert torch.equal(st.outer.state["momentum"], m)
        st.round_end()
        d = a - theta
        m = GAMMA * m + d
        assert torch.equal(st.theta, a - eta * (d + GAMMA * m))
        assert torch.equal(st.outer.state["momentum"], m) and torch.equal(st.anchor, st.theta)


FRAG = Fragment(0, [(2, 5), (13, 7)])  # strided: two runs, the rest untouched


def gradient_steps(outer, steps: int = 3):
    """The gradient form on FRAG: yields (anchor before, compact gradient, the state's
    compact slices before) and checks every position outside FRAG stays as it was."""
    anchor = dyadic(1)
    outer.allocate(anchor, anchor.device, dyadic(2))
    outside = torch.ones(N, dtype=torch.bool)
    for start, length in FRAG.ranges:
        outside[start:start + length] = False
    for r in range(steps):
        grad = dyadic(30 + r, FRAG.numel) / 2
        before, state = anchor.clone(), {k: FRAG.gather(v) for k, v in outer.state.items()}
        new = outer.step_fragment(FRAG, anchor, grad)
        assert torch.equal(new, FRAG.gather(anchor))
        assert torch.equal(anchor[outside], before[outside])
        yield FRAG.gather(before), grad, state, FRAG.gather(anchor)


def test_gradient_forms():
    """DiLoCo's step on a fragment: Nesterov SGD, plain averaging at gamma 0, and the mixed
    form's (derived from its round end with ``theta = a - g``)."""
    local = LocalNesterov(ETA, GAMMA)
    m = torch.zeros(FRAG.numel, dtype=F64)
    for a, g, state, new in gradient_steps(local):
        assert torch.equal(state["momentum"], m)
        m = GAMMA * m + g
        assert torch.equal(new, a - ETA * (g + GAMMA * m))
    for a, g, state, new in gradient_steps(PlainAverage(ETA, 0.0)):
        assert state == {} and torch.equal(new, a - ETA * g)
    mixed = MixedMomentum(ETA, GAMMA)
    for a, g, state, new in gradient_steps(mixed):
        z = a + ETA * ((a - g) - a)
        assert torch.equal(new, z + GAMMA * (z - state["zprev"]))
        assert torch.equal(FRAG.gather(mixed.state["zprev"]), z)


def test_nesterov_gradient_form_equals_torch_sgd():
    anchor = torch.randn(N, dtype=F64, generator=torch.Generator().manual_seed(3))
    p = torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([p], lr=ETA, momentum=GAMMA, nesterov=True)
    outer = LocalNesterov(ETA, GAMMA).allocate(anchor, anchor.device, anchor)
    for r in range(4):
        g = torch.randn(N, dtype=F64, generator=torch.Generator().manual_seed(40 + r))
        p.grad = g.clone()
        sgd.step()
        outer.step_fragment(whole(N), anchor, g)
    torch.testing.assert_close(anchor, p.detach(), rtol=0, atol=1e-14)


@pytest.mark.parametrize("cfg", [AsyncConfig(eta=0.7), AsyncConfig(eta=0.7, gamma=0.5),
                                 AsyncConfig(gamma=0.5),
                                 AsyncConfig(eta=0.7, gamma=0.7, momentum="local")])
def test_round_end_operations_are_pinned_on_random_values(cfg):
    """The order of operations each class takes (what the simulator's reproducibility and the
    hashes taken before the refactor rest on), written out with the same torch calls."""
    gen = torch.Generator().manual_seed(5)
    theta0 = torch.randn(1000, generator=gen)
    st = AsyncGaslocState(theta0.clone(), theta0, cfg)
    zprev, m = theta0.clone(), torch.zeros(1000)
    for _ in range(3):
        st.theta.add_(torch.randn(1000, generator=gen) * 0.1)
        a = st.anchor.clone() if st.anchor is not None else st.theta.clone()
        theta = st.theta.clone()
        st.round_end()
        if cfg.gamma == 0.0:
            want = torch.lerp(a, theta, cfg.eta)
        elif cfg.momentum == "mixed":
            z = torch.lerp(a, theta, cfg.eta)
            want, zprev = torch.lerp(zprev, z, 1.0 + cfg.gamma), z
        else:
            m = m.mul(cfg.gamma).add_(a).sub_(theta)
            want = torch.lerp(a, theta, cfg.eta).add_(m, alpha=-cfg.eta * cfg.gamma)
        assert torch.equal(st.theta, want)


def test_the_factory_and_the_registry():
    assert MOMENTUM_FORMS == momentum_forms() == ("mixed", "local")  # --momentum's choices
    assert SIM_FORMS == ("mixed", "local", "acid")
    assert set(OUTER_OPTIMIZERS) == {"average", "mixed", "local"}
    for form in momentum_forms():
        assert isinstance(make_outer(0.7, 0.0, form), PlainAverage)  # gamma 0: plain averaging
    assert isinstance(make_outer(0.7, 0.5, "mixed"), MixedMomentum)
    assert isinstance(AsyncConfig(gamma=0.9, momentum="local").outer(), LocalNesterov)
    with pytest.raises(ValueError, match="unknown outer momentum form"):
        make_outer(0.7, 0.5, "average")  # what gamma 0 picks, not a form
    with pytest.raises(ValueError, match="choose one of"):
        AsyncConfig(gamma=0.5, momentum="nesterov").validate()
    # which buffers exist: the anchor where the step reads it, state only at gamma > 0
    assert not AsyncConfig().reads_anchor and AsyncConfig(eta=0.7).reads_anchor
    assert AsyncConfig(gamma=0.5, momentum="local").reads_anchor
    assert (LocalNesterov.buffers, MixedMomentum.buffers, PlainAverage.buffers) == (
        ("momentum",), ("zprev",), ())


def test_state_is_restarted_loaded_and_refused_by_name():
    theta = dyadic(0)
    st = AsyncGaslocState(theta.clone(), theta, AsyncConfig(eta=ETA, gamma=GAMMA))
    st.theta.add_(1.0)
    st.reset_outer()  # at the public iterate: no momentum jump at the next round end
    assert torch.equal(st.outer.state["zprev"], st.public_iterate())
    local = LocalNesterov(ETA, GAMMA).allocate(theta, theta.device, theta)
    local.state["momentum"].fill_(3.0)
    local.reset(lambda out: out.fill_(9.0))
    assert torch.equal(local.state["momentum"], torch.zeros(N, dtype=F64))  # from zero
    for bad in ({"zprev": theta}, {"momentum": theta[:3]}):
        with pytest.raises(ValueError):
            local.load_state_dict(bad)
        assert torch.equal(local.state["momentum"], torch.zeros(N, dtype=F64))  # untouched
    local.load_state_dict({"momentum": theta})
    assert torch.equal(local.state["momentum"], theta)
    # resuming another optimizer's state: only across gamma 0 (nothing to carry over)
    mixed, plain = MixedMomentum(ETA, GAMMA), PlainAverage(ETA, 0.0)
    assert restore_problem(local, "local", {"momentum": theta}) == ""
    assert restore_problem(local, "average", {}) == ""  # gamma was 0: restarted
    assert restore_problem(plain, "mixed", {"zprev": theta}) == ""  # gamma is 0: ignored
    assert "'mixed' outer optimizer, this node runs 'local'" in restore_problem(
        local, "mixed", {"zprev": theta})
    assert "holds ['x', 'zprev'], this node's ['zprev']" in restore_problem(
        mixed, "mixed", {"zprev": theta, "x": theta})
    assert restore_problem(mixed, "mixed", {})  # its own name, its state missing
