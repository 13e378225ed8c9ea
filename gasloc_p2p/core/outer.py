"""Outer optimizers: the step a node takes with a round's drift, one class per rule.

An outer optimizer turns what a round of inner steps produced into the parameters of the next
round (docs/algorithm.md sections 2 and 3), as torchft passes its outer optimizer to
``DiLoCo`` as one object. Each class has a registry :attr:`~OuterOptimizer.name`, its named
state buffers (:attr:`~OuterOptimizer.buffers`, in the order the class declares: the order of
a state download's body) and two forms of its step:

- the asynchronous round end, :meth:`~OuterOptimizer.round_end_chunk`: the node state
  (:class:`~gasloc_p2p.core.async_state.AsyncGaslocState`) walks the vector in chunks and
  hands it the anchor ``a`` (None where the node keeps none), the live parameters ``theta``
  and the state's chunks, all on the training device; it writes the new ``theta`` and returns
  the state's new chunks (the node state stores them and sets ``a <- theta``);
- the gradient form of the DiLoCo family, :meth:`~OuterOptimizer.step_fragment`: a fragment
  of the global copy ``a`` and the all-reduced outer gradient ``g = a - mean(theta)``.

The state is flat, ``[numel]`` per buffer in the parameters' layout (a fragment's state is its
slice), in host memory pinned beside a GPU (:func:`~gasloc_p2p.core.flat.host_buffer`),
created by the class (:meth:`~OuterOptimizer.allocate`); a class that keeps none has none.

The built-in classes (``p = a + eta (theta - a)`` is the public iterate):

- ``average`` (:class:`PlainAverage`): ``theta <- p``. No state. What ``gamma = 0`` selects.
- ``mixed`` (:class:`MixedMomentum`, GASLoC's): ``z = p``; ``theta <- z + gamma (z - zprev)``;
  ``zprev <- z``. State ``zprev``, from ``theta_0``.
- ``local`` (:class:`LocalNesterov`, DiLoCo's Nesterov on the own drift): ``d = a - theta``;
  ``m <- gamma m + d``; ``theta <- a - eta (d + gamma m)``. State ``momentum``, from zero.
  Its gradient form is ``torch.optim.SGD(lr=eta, momentum=gamma, nesterov=True)``.

:func:`make_outer` picks the class from the configuration's ``(eta, gamma, form)``: ``gamma =
0`` is plain averaging whatever the form. Adding an outer optimizer is one class and one
:func:`register` line; it then runs in the simulator, the daemon's round ends, checkpoints,
rollbacks and state downloads (tests/test_outer_registry.py registers a toy one from a
test).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch

from gasloc_p2p.core.flat import Fragment, host_buffer
from gasloc_p2p.core.options import check_outer_step

#: Writes the iterate a state restarts at into a ``[numel]`` buffer (see :meth:`reset`).
Fill = Callable[[torch.Tensor], object]
State = Mapping[str, torch.Tensor]


class OuterOptimizer:
    """One outer step rule (module docstring). Constructed with its settings only; the state
    exists after :meth:`allocate` (the plan and a download's receiver need no tensors)."""

    name: ClassVar[str] = ""
    buffers: ClassVar[tuple[str, ...]] = ()  # named state, in the declared (wire) order
    selectable: ClassVar[bool] = True  # a --momentum form (plain averaging: gamma 0 picks it)

    def __init__(self, eta: float, gamma: float) -> None:
        """eta: outer learning rate in (0, 2]; gamma: momentum in [0, 1)."""
        check_outer_step(eta, gamma)
        self.eta, self.gamma = eta, gamma
        self.state: dict[str, torch.Tensor] = {}

    @property
    def reads_anchor(self) -> bool:
        """Whether the round end reads the anchor (else, at ``eta = 1``, the public iterate
        is ``theta`` itself and the node keeps no anchor)."""
        return self.eta != 1.0

    def allocate(self, like: torch.Tensor, host: torch.device,
                 start: torch.Tensor) -> OuterOptimizer:
        """Create the state: one ``[like.numel()]`` buffer of ``like``'s dtype per name on
        ``host`` (pinned beside a GPU), set by :meth:`reset` from ``start`` (``theta_0``);
        returns self."""
        self.state = {name: host_buffer(like.numel(), like, host) for name in self.buffers}
        self.reset(lambda out: out.copy_(start.to(out.device, out.dtype)))
        return self

    def reset(self, fill: Fill) -> None:
        """(Re)start the state, as at a node's start, from the iterate ``fill`` writes into a
        buffer: ``theta_0`` at start, the adopted iterate for a node that took a peer's state
        without this one. Here: every buffer at zero."""
        for buf in self.state.values():
            buf.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The named buffers themselves (not copies), in the declared order."""
        return dict(self.state)

    def load_state_dict(self, state: State) -> None:
        """Copy ``state`` (one tensor per name, shaped as the own buffer, any device) into the
        own buffers; ValueError before any copy if a name or a shape differs."""
        if set(state) != set(self.buffers):
            raise ValueError(f"the {self.name} outer optimizer keeps {list(self.buffers)}, "
                             f"not {sorted(state)}")
        for name in self.buffers:
            if state[name].shape != self.state[name].shape:
                raise ValueError(f"outer state {name} has {state[name].numel()} values, this "
                                 f"model {self.state[name].numel()}")
        for name in self.buffers:
            self.state[name].copy_(state[name])

    def round_end_chunk(self, anchor: torch.Tensor | None, theta: torch.Tensor,
                        state: State) -> dict[str, torch.Tensor]:
        """The asynchronous round end on one chunk ``[L]`` (all on theta's device; ``anchor``
        None when the node keeps none): writes the new ``theta`` in place and returns the
        state's new chunks by name (the caller stores them)."""
        raise NotImplementedError

    def step_fragment(self, frag: Fragment, anchor: torch.Tensor, grad: torch.Tensor,
                      state: State | None = None) -> torch.Tensor:
        """The gradient form: the outer step of fragment ``frag`` of the flat global copy
        ``anchor`` with the averaged outer gradient ``grad`` (compact ``[frag.numel]``, moved
        to the anchor's device), updating ``anchor`` and the state (default: the own; a
        downloaded one for a resync) in place on the fragment; returns the new global fragment
        (a compact copy). Here: the round end with ``theta = a - grad``."""
        state = self.state if state is None else state
        global_ = frag.gather(anchor)
        theta = global_ - grad.to(global_.device, global_.dtype)
        new = self.round_end_chunk(global_, theta, {k: frag.gather(v) for k, v in state.items()})
        _put(frag, state, new)
        frag.copy_(anchor, theta)
        return theta


def _put(frag: Fragment, state: State, new: State) -> None:
    """Write each new compact fragment of ``new`` into ``state``'s flat buffer of that name."""
    for name, values in new.items():
        frag.copy_(state[name], values)


def _public(anchor: torch.Tensor | None, theta: torch.Tensor, eta: float) -> torch.Tensor:
    """``p = lerp(a, theta, eta)`` as a new tensor (``theta``'s copy when no anchor is kept)."""
    return torch.lerp(anchor, theta, eta) if anchor is not None else theta.clone()


OUTER_OPTIMIZERS: dict[str, type[OuterOptimizer]] = {}


def register(cls: type[OuterOptimizer]) -> type[OuterOptimizer]:
    """Add ``cls`` to the registry under its name (a class decorator)."""
    OUTER_OPTIMIZERS[cls.name] = cls
    return cls


def momentum_forms() -> tuple[str, ...]:
    """The ``--momentum`` values: the registered classes a form can select."""
    return tuple(name for name, cls in OUTER_OPTIMIZERS.items() if cls.selectable)


def make_outer(eta: float, gamma: float, form: str) -> OuterOptimizer:
    """The outer optimizer of a configuration, without state: plain averaging at ``gamma =
    0`` whatever the form, else the registered ``form``."""
    if gamma == 0.0:
        return PlainAverage(eta, 0.0)
    if form not in momentum_forms():
        raise ValueError(f"unknown outer momentum form {form!r}: one of {momentum_forms()}")
    return OUTER_OPTIMIZERS[form](eta, gamma)


def restore_problem(own: OuterOptimizer, name: str, state: State) -> str:
    """Why ``own`` cannot resume the state ``state`` saved by the outer optimizer ``name``
    ("" if it can). The same class takes its own buffers; a class that keeps none ignores a
    saved state, and one that keeps some restarts it (:meth:`OuterOptimizer.reset`) when the
    saved class kept none (``gamma`` changed from or to 0); two classes with state never mix
    (``mixed``'s ``zprev`` is no ``local`` momentum)."""
    if name == own.name:
        if set(state) != set(own.buffers):
            return (f"its {name} outer optimizer's state holds {sorted(state)}, this node's "
                    f"{list(own.buffers)}")
        return ""
    if not own.buffers or not state:
        return ""
    return f"it was saved by the {name!r} outer optimizer, this node runs {own.name!r}"


@register
class PlainAverage(OuterOptimizer):
    """``theta <- p``: the drift scaled by ``eta`` and gossip's averaging; no state."""

    name = "average"
    selectable = False

    def round_end_chunk(self, anchor: torch.Tensor | None, theta: torch.Tensor,
                        state: State) -> dict[str, torch.Tensor]:
        if anchor is not None:  # else theta is p already
            theta.copy_(torch.lerp(anchor, theta, self.eta))
        return {}

    def step_fragment(self, frag: Fragment, anchor: torch.Tensor, grad: torch.Tensor,
                      state: State | None = None) -> torch.Tensor:
        """``a_f <- a_f - eta g`` (at ``eta = 1`` the mean of the members' parameters)."""
        global_ = frag.gather(anchor)
        global_.sub_(grad.to(global_.device, global_.dtype), alpha=self.eta)
        frag.copy_(anchor, global_)
        return global_


@register
class MixedMomentum(OuterOptimizer):
    """GASLoC's momentum on the mixed iterates: ``z = p; theta <- z + gamma (z - zprev)``."""

    name = "mixed"
    buffers = ("zprev",)

    def reset(self, fill: Fill) -> None:
        """``zprev`` at the iterate (no momentum jump at the next round end)."""
        fill(self.state["zprev"])

    def round_end_chunk(self, anchor: torch.Tensor | None, theta: torch.Tensor,
                        state: State) -> dict[str, torch.Tensor]:
        z = _public(anchor, theta, self.eta)
        torch.lerp(state["zprev"], z, 1.0 + self.gamma, out=theta)  # z + gamma (z - zprev)
        return {"zprev": z}


@register
class LocalNesterov(OuterOptimizer):
    """Nesterov SGD on the node's own drift (never extrapolates received corrections): with
    the all-reduced outer gradient in place of the drift, DiLoCo's outer step."""

    name = "local"
    buffers = ("momentum",)

    @property
    def reads_anchor(self) -> bool:
        return True  # the drift a - theta

    def round_end_chunk(self, anchor: torch.Tensor | None, theta: torch.Tensor,
                        state: State) -> dict[str, torch.Tensor]:
        assert anchor is not None, "the local form reads the anchor"
        # m <- gamma m + (a - theta);  theta <- lerp(a, theta, eta) - eta gamma m
        m = state["momentum"].mul(self.gamma).add_(anchor).sub_(theta)
        torch.lerp(anchor, theta, self.eta, out=theta)
        theta.add_(m, alpha=-self.eta * self.gamma)
        return {"momentum": m}

    def step_fragment(self, frag: Fragment, anchor: torch.Tensor, grad: torch.Tensor,
                      state: State | None = None) -> torch.Tensor:
        """``m <- gamma m + g; a <- a - eta (g + gamma m)``: ``torch.optim.SGD(lr=eta,
        momentum=gamma, nesterov=True)`` (dampening 0) on the fragment."""
        state = self.state if state is None else state
        m = frag.gather(state["momentum"])
        global_ = frag.gather(anchor)
        grad = grad.to(global_.device, global_.dtype)
        m.mul_(self.gamma).add_(grad)
        global_.sub_(grad + self.gamma * m, alpha=self.eta)
        _put(frag, state, {"momentum": m})
        frag.copy_(anchor, global_)
        return global_
