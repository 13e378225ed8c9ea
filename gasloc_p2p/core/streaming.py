"""Streaming DiLoCo (docs/algorithm.md section 3): fragments, staggered syncs, overlap, merge.

DiLoCo is the special case of one fragment (the whole model) and no overlap (``tau`` 0): the
simulator and the daemon run both through this module.

Parameters are split into fragments; fragment ``f`` syncs every ``H`` steps at a staggered
offset. A sync started at step ``t`` all-reduces the fragment's (optionally 4-bit) outer
gradients, applies the outer optimizer's gradient form (:meth:`~gasloc_p2p.core.outer.
OuterOptimizer.step_fragment`: Nesterov, or plain averaging at ``gamma`` 0) to the shared
global copy, and lands ``tau`` inner steps later as
``theta_f <- alpha * local + (1 - alpha) * global``.

The schedule (:class:`FragmentSchedule`) and the per-fragment math (:func:`fragment_outer_grad`,
the outer optimizer's ``step_fragment``, :func:`merge_fragment`) are the one implementation both
drivers use: :class:`StreamingDiloco` (the simulator's lock-step workers) and the node daemon's
DiLoCo modes (:mod:`gasloc_p2p.node.modes.diloco_rounds`), where the all-reduce runs in the
background during the overlap. Both keep the global copies of all fragments in one flat
``anchor`` buffer and the outer optimizer's state (the Nesterov ``momentum``; none at ``gamma``
0) in flat buffers of the same layout, so a fragment's state is its slice of those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gasloc_p2p.core.async_state import spans
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.compress import ErrorFeedback, mean_of, parse_codec
from gasloc_p2p.core.flat import Fragment, host_buffer
from gasloc_p2p.core.modulo import ModuloSpec
from gasloc_p2p.core.options import check_outer_step
from gasloc_p2p.core.outer import make_outer
from gasloc_p2p.core.sparse import SparseSpec


@dataclass(frozen=True)
class StreamingConfig:
    """H: steps between syncs of one fragment; tau: overlap in inner steps (0 = blocking);
    alpha: weight of the local copy in the merge; codec: codec of outer gradients ("none" sends
    them unquantized in the buffer's dtype; a sparse codec such as ``topk2:41`` is all-gathered
    with SparseLoCo's error feedback, decay ``ef_beta``)."""

    H: int = 10
    tau: int = 1
    alpha: float = 0.0
    eta: float = 0.7
    gamma: float = 0.9
    codec: str = "fp4"
    ef_beta: float = 1.0

    def validate(self) -> None:
        check_schedule(self.H, self.tau, self.alpha)
        check_outer_step(self.eta, self.gamma)
        parse_codec(self.codec)  # ValueError for an unknown codec
        if not 0.0 <= self.ef_beta <= 1.0:
            raise ValueError(f"ef_beta={self.ef_beta} must be in [0, 1]")


def check_schedule(H: int, tau: int, alpha: float) -> None:
    """ValueError unless ``H >= 1``, ``0 <= tau < H`` (a sync lands before the fragment's
    next one starts) and ``0 <= alpha <= 1``."""
    if H < 1 or tau < 0 or tau >= H:
        raise ValueError(f"need H >= 1 and 0 <= tau < H, got H={H} tau={tau}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1]")


@dataclass(frozen=True)
class FragmentSchedule:
    """When each of ``parts`` fragments syncs: fragment ``f`` starts after inner steps
    ``offset(f) + k H`` (``k >= 1`` when the offset is 0) and lands ``tau`` steps later."""

    H: int
    tau: int
    parts: int

    def offset(self, f: int) -> int:
        """Staggered phase of fragment ``f`` within the period ``H``: ``f H // parts``."""
        return (f * self.H) // self.parts

    def starts(self, f: int, step: int) -> bool:
        """Whether fragment ``f``'s sync starts after inner step ``step`` (1-based count)."""
        off = self.offset(f)
        return step > off and (step - off) % self.H == 0

    def due(self, step: int) -> list[int]:
        """Fragments whose sync starts after inner step ``step``, in fragment order."""
        return [f for f in range(self.parts) if self.starts(f, step)]

    def lands_at(self, start_step: int) -> int:
        """The inner step after which a sync started after ``start_step`` merges."""
        return start_step + self.tau

    def min_gap(self) -> int:
        """Fewest inner steps between two consecutive sync starts (0: some start together).
        With ``tau < min_gap()`` at most one sync is in flight at any time."""
        offsets = [self.offset(f) for f in range(self.parts)]
        return min(b - a for a, b in zip(offsets, [*offsets[1:], offsets[0] + self.H],
                                         strict=True))


def fragment_outer_grad(frag: Fragment, anchor: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """This worker's outer gradient on ``frag``: ``anchor_f - theta_f`` (compact
    ``[frag.numel]``), on the anchor's device: with the anchor in (pinned) host memory and
    theta on a GPU, each chunk is subtracted on the GPU and copied back asynchronously, with
    one synchronisation at the end (the all-reduce runs on the host)."""
    if anchor.device == theta.device:
        return frag.gather(anchor) - frag.gather(theta)
    out = host_buffer(frag.numel, theta, anchor.device)
    pos = 0
    for start, length in frag.ranges:
        for s, e in spans(length):
            a = anchor[start + s: start + e].to(theta.device, non_blocking=True)
            out[pos + s: pos + e].copy_(a.sub_(theta[start + s: start + e]), non_blocking=True)
        pos += length
    _sync(theta.device)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def merge_fragment(frag: Fragment, theta: torch.Tensor, new_global: torch.Tensor,
                   alpha: float) -> None:
    """The landing merge, in place: ``theta_f <- alpha * theta_f + (1 - alpha) * new_global``
    (``new_global`` compact, on any device: moved to theta's chunk by chunk)."""
    if new_global.device == theta.device:
        frag.copy_(theta, torch.lerp(new_global, frag.gather(theta), alpha))
        return
    pos = 0
    for start, length in frag.ranges:
        for s, e in spans(length):
            g = new_global[pos + s: pos + e].to(theta.device, non_blocking=True)
            view = theta[start + s: start + e]
            torch.lerp(g, view, alpha, out=view)
        pos += length
    _sync(theta.device)


class StreamingDiloco:
    """The shared outer state of ``n`` lock-step workers: the global copy and the outer
    optimizer's state, flat (a fragment's is its slice)."""

    def __init__(self, theta0: torch.Tensor, fragments: Sequence[Fragment],
                 cfg: StreamingConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.fragments = list(fragments)
        self.schedule = FragmentSchedule(cfg.H, cfg.tau, len(self.fragments))
        self.global_params = theta0.detach().clone()
        # DiLoCo's outer optimizer: Nesterov ("local": buffers from zero, flat layout), plain
        # averaging at gamma 0
        self.outer = make_outer(cfg.eta, cfg.gamma, "local").allocate(
            self.global_params, self.global_params.device, self.global_params)
        spec = parse_codec(cfg.codec)
        self.codec = spec.codec() if isinstance(spec, CodecSpec) else None
        if isinstance(spec, ModuloSpec):  # config validation refuses it before this
            raise ValueError(f"{spec} is a gossip payload; DiLoCo takes a block or sparse codec")
        self.sparse = spec if isinstance(spec, SparseSpec) else None
        # sparse codecs: one error-feedback accumulator per (worker, fragment), on first use
        self.feedback: dict[tuple[int, int], ErrorFeedback] = {}
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}  # fragment -> (land step, global)

    @property
    def allgather(self) -> bool:
        """Whether syncs are all-gathers of per-worker messages (sparse codecs: each worker
        sends its message to every other) rather than all-reduces."""
        return self.sparse is not None

    def offset(self, f: int) -> int:
        """Staggered phase of fragment ``f`` within the period ``H``."""
        return self.schedule.offset(f)

    def due(self, step: int) -> list[int]:
        """Fragments whose sync starts after inner step ``step`` (1-based count of steps done)."""
        return self.schedule.due(step)

    def begin(self, f: int, step: int, thetas: torch.Tensor) -> int:
        """Start fragment ``f``'s sync from ``thetas: [n, numel]``; returns bytes per worker sent."""
        frag = self.fragments[f]
        grads = torch.zeros(frag.numel, dtype=self.global_params.dtype,
                            device=self.global_params.device)
        if self.sparse is not None:
            return self._begin_sparse(f, step, thetas)
        nbytes = 0
        for row in thetas:  # each worker quantizes its own outer gradient, the sum is in fp32
            delta = fragment_outer_grad(frag, self.global_params, row)
            if self.codec is None:  # exact ("none"): for equivalence tests in float64
                grads.add_(delta)
                nbytes = delta.numel() * delta.element_size()
                continue
            enc = self.codec.encode(delta)
            grads.add_(self.codec.decode(enc).to(grads.dtype))
            nbytes = enc.nbytes
        grads.div_(thetas.shape[0])
        new_global = self.outer.step_fragment(frag, self.global_params, grads)
        self.pending[f] = (self.schedule.lands_at(step), new_global)
        return nbytes

    def _begin_sparse(self, f: int, step: int, thetas: torch.Tensor) -> int:
        """A sparse sync: every worker feeds its outer gradient to its accumulator and sends
        the message; all apply the mean of the decoded messages (SparseLoCo)."""
        frag, spec = self.fragments[f], self.sparse
        assert spec is not None
        messages = []
        for w, row in enumerate(thetas):
            ef = self.feedback.get((w, f))
            if ef is None:
                ef = self.feedback[(w, f)] = ErrorFeedback(spec, frag.numel, self.cfg.ef_beta,
                                                           self.global_params.device)
            messages.append(ef.compress(fragment_outer_grad(frag, self.global_params, row)))
        mean = mean_of(messages).to(self.global_params.dtype)
        new_global = self.outer.step_fragment(frag, self.global_params, mean)
        self.pending[f] = (self.schedule.lands_at(step), new_global)
        return messages[0].nbytes

    def land(self, step: int, thetas: torch.Tensor) -> list[int]:
        """Merge every sync whose overlap ends at ``step`` into ``thetas`` in place."""
        landed = [f for f, (at, _) in self.pending.items() if at == step]
        for f in landed:
            _, new_global = self.pending.pop(f)
            for row in thetas:
                merge_fragment(self.fragments[f], row, new_global, self.cfg.alpha)
        return landed
