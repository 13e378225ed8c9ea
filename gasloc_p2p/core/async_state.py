"""GASLoC asynchronous node state (docs/algorithm.md, section 2): what one daemon node keeps.

State: live parameters ``theta`` (the model's flat buffer, trained by the inner optimizer, on
the training device), and the outer state on ``host`` (by default theta's device; the daemon
puts it in pinned host memory when training on a GPU, as PRIME and torchft do): the anchor
``a`` (parameters at the start of the current round) and the outer optimizer's named state
(:mod:`gasloc_p2p.core.outer`). The public iterate ``p = a + eta (theta - a)`` is what the node
would propose if its round ended now. A gossip exchange adds the same correction to ``a`` and
``theta``, so the local drift ``theta - a`` is untouched and ``p`` moves by exactly the
correction.

No model-sized buffer exists that the configured algorithm never reads: with ``eta = 1`` the
public iterate is ``theta`` itself and the anchor is kept only where the outer optimizer reads
it (``local``, or when a mode asks for it: DiLoCo's global copy); the optimizer keeps state
only when ``gamma > 0``.

The round end belongs to the outer optimizer (:class:`~gasloc_p2p.core.outer.OuterOptimizer`,
chosen by :func:`~gasloc_p2p.core.outer.make_outer` from ``eta``, ``gamma`` and the form):
this module walks the vector in chunks, hands it each chunk of the anchor, theta and its state
on theta's device, stores what it returns and sets ``a <- theta``.

Staleness: an exchange during which more than :data:`MAX_STALENESS` round ends happened (both
sides together) applies its weight divided by ``1 + staleness - MAX_STALENESS``
(docs/results/staleness.md: the other policies measured no better).

Every operation that mixes host and device buffers walks the vector in :data:`TRANSFER_ELEMS`
chunks with asynchronous copies (pinned host memory) and synchronises once at its end. On one
device the chunks change nothing: elementwise math gives the same bits in any chunking.

Threading: the caller serialises ``apply_correction``, ``round_end`` and the inner optimizer step
(the daemon holds one lock around them); reading ``public_iterate`` takes a snapshot.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gasloc_p2p.core.flat import Fragment, host_buffer
from gasloc_p2p.core.options import check_outer_step, need, opt
from gasloc_p2p.core.outer import OuterOptimizer, make_outer, momentum_forms

MOMENTUM_FORMS = momentum_forms()  # the registry's forms when flags are built
MAX_STALENESS = 1  # round ends (both sides) an exchange may span at full weight
TRANSFER_ELEMS = 1 << 24  # elements per host<->device step of the outer state (64 MiB fp32)


@dataclass(frozen=True)
class AsyncConfig:
    """eta: outer lr; gamma: outer momentum (0: plain averaging, no state); w: gossip weight
    (1/2 = exact pair average); momentum: the outer optimizer's form at ``gamma > 0``, a name
    in :mod:`gasloc_p2p.core.outer`'s registry ("mixed" or "local")."""

    eta: float = opt(1.0, "outer learning rate (1: plain averaging of the drift)")
    gamma: float = opt(0.0, "outer momentum (0: none; docs/results: no gain at 121k params)")
    w: float = opt(0.5, "gossip weight (0.5 = exact pair average)", advanced=True)
    momentum: str = opt("mixed", "round-end momentum form", choices=MOMENTUM_FORMS,
                        advanced=True)

    def validate(self) -> None:
        check_outer_step(self.eta, self.gamma)
        need(0.0 < self.w <= 0.5, "w", self.w, "a pairwise gossip weight needs (0, 0.5]")
        need(self.momentum in momentum_forms(), "momentum", self.momentum,
             f"choose one of {momentum_forms()}")

    def outer(self) -> OuterOptimizer:
        """This configuration's outer optimizer, without state (see :func:`make_outer`)."""
        return make_outer(self.eta, self.gamma, self.momentum)

    @property
    def reads_anchor(self) -> bool:
        """Whether the round end or the public iterate read the anchor (else it is theta's
        twin and is not kept)."""
        return self.outer().reads_anchor


def exchange_weight(w: float, staleness: int, allowance: int = MAX_STALENESS) -> float:
    """Gossip weight for an exchange spanning ``staleness`` round ends (sum over both sides);
    ``allowance``: the round ends it may span at full weight (the simulator's
    ``--max-staleness``; the daemon uses :data:`MAX_STALENESS`).

    Both peers know both counts at commit time, so they compute the same weight and the
    corrections stay exact negatives.
    """
    if staleness <= allowance:
        return w
    return w / (1 + staleness - allowance)


def spans(numel: int, step: int = TRANSFER_ELEMS) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive chunks of at most ``step`` elements."""
    for start in range(0, numel, step):
        yield start, min(numel, start + step)


class AsyncGaslocState:
    """One node's outer state. ``theta`` aliases the live parameters (not copied)."""

    def __init__(self, theta: torch.Tensor, theta0: torch.Tensor, cfg: AsyncConfig,
                 host: torch.device | str | None = None, keep_anchor: bool = False) -> None:
        """theta: ``[numel]`` live flat parameters; theta0: ``[numel]`` common initial values
        (where the outer state starts, e.g. ``mixed``'s ``zprev``); host: where the outer
        state lives (default: theta's device); keep_anchor: keep the anchor even where the
        outer optimizer does not read it (a DiLoCo mode's global copy)."""
        cfg.validate()
        if theta.shape != theta0.shape or theta.dim() != 1:
            raise ValueError("theta and theta0 must be 1-D tensors of the same size")
        self.cfg = cfg
        self.theta = theta
        self.host = torch.device(host) if host is not None else theta.device
        self.outer = cfg.outer()
        self.anchor: torch.Tensor | None = None
        if keep_anchor or self.outer.reads_anchor:
            self.anchor = host_buffer(theta.numel(), theta, self.host)
            self.transfer(self.anchor, theta)
        self.outer.allocate(theta, self.host, theta0)
        self.rounds = 0  # round ends so far; an exchange records how many happen during it

    # ------------------------------------------------------------------ placement
    @property
    def split(self) -> bool:
        """Whether the outer state lives on another device than theta (copies are chunked)."""
        return self.host != self.theta.device

    def transfer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` across devices in chunks, then one synchronisation."""
        if dst.device == src.device:
            dst.copy_(src)
            return
        for s, e in spans(dst.numel()):
            dst[s:e].copy_(src[s:e], non_blocking=True)
        self.sync()

    def sync(self) -> None:
        """Wait for this state's asynchronous copies (no-op on one device)."""
        for dev in (self.theta.device, self.host):
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()

    def on_device(self, buf: torch.Tensor, s: int, e: int) -> torch.Tensor:
        """``buf[s:e]`` on theta's device (an asynchronous copy if ``buf`` lives elsewhere)."""
        piece = buf[s:e]
        return piece if piece.device == self.theta.device else piece.to(
            self.theta.device, non_blocking=True)

    def to_host(self, dst: torch.Tensor, s: int, e: int, src: torch.Tensor) -> None:
        """``dst[s:e] = src`` (``src`` on theta's device; asynchronous to pinned memory)."""
        dst[s:e].copy_(src, non_blocking=True)

    def reset_outer(self) -> None:
        """Restart the outer optimizer's state at the current public iterate (a node that
        adopted parameters without the state, or the consensus toy's workers that start
        apart), written into the state's buffers chunk by chunk."""
        self.outer.reset(lambda out: self.public_iterate(out=out))

    # ------------------------------------------------------------------ reads
    def public_chunk(self, s: int, e: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``p[s:e]`` on theta's device: ``lerp(a, theta, eta)``, or ``theta[s:e]`` itself
        (not a copy) when no anchor is kept and ``out`` is None."""
        theta = self.theta[s:e]
        if self.anchor is None:
            return theta if out is None else out.copy_(theta)
        anchor = self.on_device(self.anchor, s, e)
        if out is None:
            return torch.lerp(anchor, theta, self.cfg.eta)
        return torch.lerp(anchor, theta, self.cfg.eta, out=out)

    def public_iterate(self, fragment: Fragment | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Snapshot of ``p = a + eta (theta - a)`` (compact ``[fragment.numel]`` if given), on
        ``out``'s device if given (a host ``out`` gets chunked copies), else theta's."""
        if fragment is None:
            fragment = Fragment(0, [(0, self.theta.numel())])
        if out is None:
            out = torch.empty(fragment.numel, dtype=self.theta.dtype, device=self.theta.device)
        pos = 0
        for start, length in fragment.ranges:
            for s, e in spans(length):
                p = self.public_chunk(start + s, start + e)
                out[pos + s: pos + e].copy_(p, non_blocking=out.device != p.device)
            pos += length
        if out.device != self.theta.device:
            self.sync()
        return out

    # ------------------------------------------------------------------ writes
    def correction_targets(self) -> list[tuple[torch.Tensor, float]]:
        """Buffers a gossip correction is added to, with its scale: the anchor (when kept) and
        the live parameters (so ``p`` moves by it and the drift is untouched). Research forms
        (the simulator's A2CiD2) add their own."""
        anchor = [(self.anchor, 1.0)] if self.anchor is not None else []
        return [*anchor, (self.theta, 1.0)]

    def add_chunk(self, s: int, c: torch.Tensor, alpha: float = 1.0) -> None:
        """Add ``alpha c`` (on theta's device) to every correction target at ``[s, s + len)``;
        host targets go through the device and back asynchronously (:meth:`sync` after the
        last chunk)."""
        e = s + c.numel()
        for buf, scale in self.correction_targets():
            if buf.device == c.device:
                buf[s:e].add_(c, alpha=alpha * scale)
            else:
                piece = self.on_device(buf, s, e).add_(c, alpha=alpha * scale)
                self.to_host(buf, s, e, piece)

    def apply_correction(self, correction: torch.Tensor, fragment: Fragment | None = None) -> None:
        """Add a gossip correction (compact over ``fragment``, on theta's device)."""
        if fragment is None:
            fragment = Fragment(0, [(0, self.theta.numel())])
        pos = 0
        for start, length in fragment.ranges:
            self.add_chunk(start, correction[pos: pos + length])
            pos += length
        if self.split:
            self.sync()

    def round_end(self) -> None:
        """Outer update at the end of this node's round of inner steps, chunk by chunk (on one
        device the chunks give the same bits as one pass)."""
        if self.anchor is None and not self.outer.state:  # eta 1, no state: theta is p already
            self.rounds += 1
            return
        with torch.no_grad():
            for s, e in spans(self.theta.numel()):
                self._round_end_chunk(s, e)
        if self.split:
            self.sync()
        self.rounds += 1

    def _round_end_chunk(self, s: int, e: int) -> None:
        theta = self.theta[s:e]
        anchor = self.on_device(self.anchor, s, e) if self.anchor is not None else None
        state = {name: self.on_device(buf, s, e) for name, buf in self.outer.state.items()}
        for name, values in self.outer.round_end_chunk(anchor, theta, state).items():
            self._store(self.outer.state[name], s, e, values)
        if self.anchor is not None:
            self._store(self.anchor, s, e, theta)

    def _store(self, buf: torch.Tensor, s: int, e: int, values: torch.Tensor) -> None:
        if buf.device == values.device:
            buf[s:e].copy_(values)
        else:
            self.to_host(buf, s, e, values)
