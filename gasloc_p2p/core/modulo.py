"""Modulo payloads (issue 40; Moniqua, Lu and De Sa 2020): only the low bits of a lattice code
travel, and the receiver recovers the rest from its own public iterate, which is close to the
sender's.

A payload covers a public iterate ``p`` (float32 ``[numel]``) in chunks of ``chunk`` elements;
``k`` positions of each chunk travel (every one for a dense spec; otherwise the systematic
random positions of ``randk``, from a seed both sides share: :func:`gasloc_p2p.core.sparse.
seeded_positions`). Each chunk has a step ``d > 0`` (float32, on the wire). The sender rounds
``p / d`` stochastically to an integer ``q`` and sends ``c = q mod 2^b``. A receiver holding
``p'`` with ``|q d - p'| < 2^(b-1) d`` recovers ``q = c + 2^b round((p' / d - c) / 2^b)``
exactly (:func:`lift`), so it decodes the sender's ``Q(p) = q d`` bit for bit, as the sender
does, and the pair's corrections ``w (Q(p_j) - Q(p_i))`` and ``w (Q(p_i) - Q(p_j))`` are exact
negatives: the pair's sum is kept. A coordinate farther than that wraps: it decodes ``2^b d``
away, the only loss, bounded by the step.

The step follows the pair's distance: ``d = margin * D / 2^(b-1)``, with ``D`` the largest
distance of the chunk this node measured at its last exchange (:class:`Distances`), so a
coordinate wraps only beyond ``margin`` times that (less the rounding). The largest, not the
RMS: a coordinate that wrapped decodes at the window's edge, so the next window is ``margin``
times wider and takes it back; sized by the RMS, a wrapped coordinate stayed wrapped while the
window shrank (measured: tests/test_modulo.py). A node with no measurement yet sends its first
exchange in another codec (the simulator: int8).

Bytes for ``C`` chunks and ``K`` entries: ``4 C + ceil(K b / 8)``: 3 bits on a third of the
positions is about 1 bit per parameter, 8x below int8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gasloc_p2p.core import sparse
from gasloc_p2p.core.sparse import DEFAULT_CHUNK, MAX_CHUNK, SparseSpec

BITS = (1, 2, 3, 4, 5, 6, 7, 8)
DEFAULT_MARGIN = 1.5
# The step's floor relative to the chunk's largest |p|: q stays below 2^20 in magnitude, so
# p / d and q d keep their integer parts exact in float32.
_MIN_STEP_RATIO = 2.0**-20
_TINY = 2.0**-100


@dataclass(frozen=True)
class ModuloSpec:
    """``bits`` per sent value, ``k`` positions sent per chunk of ``chunk`` (dense: all),
    ``margin``: the window (half a period, ``2^(b-1)`` steps) over the largest distance
    measured in the chunk.

    Text form: ``mod3`` (dense, 3 bits), ``mod3:1365`` (1365 of every 4096), ``mod3:1365:2048``.
    """

    bits: int
    k: int = DEFAULT_CHUNK
    chunk: int = DEFAULT_CHUNK
    margin: float = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"modulo bits must be one of {BITS}, got {self.bits}")
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise ValueError(f"chunk must be in [1, {MAX_CHUNK}], got {self.chunk}")
        if not 1 <= self.k <= self.chunk:
            raise ValueError(f"k must be in [1, chunk={self.chunk}], got {self.k}")
        if not (math.isfinite(self.margin) and self.margin > 0):
            raise ValueError(f"margin must be a positive number, got {self.margin}")

    @classmethod
    def parse(cls, text: str) -> ModuloSpec:
        """``mod3``, ``mod3:1365``, ``mod3:1365:2048``; ValueError else."""
        head, _, rest = text.partition(":")
        try:
            if not head.startswith("mod"):
                raise ValueError
            bits = int(head[3:])
            nums = [int(p) for p in rest.split(":")] if rest else []
        except ValueError:
            raise ValueError(f"bad modulo codec {text!r}: expected e.g. mod3, mod3:1365") from None
        if len(nums) > 2:
            raise ValueError(f"bad modulo codec {text!r}: at most k and a chunk size")
        chunk = nums[1] if len(nums) == 2 else DEFAULT_CHUNK
        return cls(bits, nums[0] if nums else chunk, chunk)

    def __str__(self) -> str:
        if self.dense:
            return f"mod{self.bits}" + ("" if self.chunk == DEFAULT_CHUNK else
                                        f":{self.chunk}:{self.chunk}")
        return f"mod{self.bits}:{self.k}" + ("" if self.chunk == DEFAULT_CHUNK else
                                             f":{self.chunk}")

    @property
    def dense(self) -> bool:
        return self.k == self.chunk

    @property
    def positions_spec(self) -> SparseSpec:
        """The sparse spec whose positions this one sends (randk, or dense)."""
        return SparseSpec("dense" if self.dense else "randk", 8, self.k, self.chunk)

    def entries(self, numel: int) -> int:
        return self.positions_spec.counts(numel)[3]

    def wire_bytes(self, numel: int) -> int:
        """Exact payload size: one float32 step per chunk and ``bits`` per sent entry."""
        chunks = -(-numel // self.chunk)
        return 4 * chunks + -(-self.entries(numel) * self.bits // 8)


@dataclass(frozen=True, eq=False)
class ModuloPayload:
    """One side's message: ``steps`` float32 [chunks], ``codes`` int64 [K] in [0, 2^b) at the
    positions the seed selects (the simulator's form; the wire packs the codes)."""

    spec: ModuloSpec
    numel: int
    seed: int
    steps: torch.Tensor
    codes: torch.Tensor


def positions(spec: ModuloSpec, numel: int, seed: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions sent (int64 [K], increasing), the same on both sides."""
    return sparse.seeded_positions(spec.positions_spec, numel, seed, torch.device(device))


def steps_for(spec: ModuloSpec, p: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """Per-chunk steps (float32 [chunks]) for ``p`` from the chunks' largest distances:
    ``margin distance / 2^(b-1)``, no finer than the chunk's largest ``|p|`` times 2^-20."""
    chunks = -(-p.numel() // spec.chunk)
    if distance.shape != (chunks,):
        raise ValueError(f"distances are {tuple(distance.shape)}, expected ({chunks},)")
    absmax = _chunked(p.abs(), spec.chunk).amax(dim=1)
    step = distance.to(p.device, torch.float32) * (spec.margin / 2 ** (spec.bits - 1))
    return torch.maximum(step, absmax * _MIN_STEP_RATIO).clamp_min_(_TINY)


def encode(spec: ModuloSpec, p: torch.Tensor, steps: torch.Tensor, seed: int,
           generator: torch.Generator | None = None) -> tuple[ModuloPayload, torch.Tensor]:
    """(payload, ``Q(p)`` at the sent positions: float32 [K]). Stochastic rounding draws from
    ``generator`` (this side's own: the rounding is the sender's business)."""
    p = p.detach().float()
    pos = positions(spec, p.numel(), seed, p.device)
    step = steps[pos // spec.chunk]
    u = torch.rand(pos.numel(), generator=generator, device=p.device)
    q = torch.floor(p[pos] / step + u)
    codes = torch.remainder(q, 2**spec.bits).to(torch.int64)
    return ModuloPayload(spec, p.numel(), seed, steps.float(), codes), q * step


def lift(payload: ModuloPayload, own: torch.Tensor) -> torch.Tensor:
    """The sender's ``Q(p)`` at the sent positions (float32 [K]), recovered next to this side's
    own public iterate ``own`` (float [numel])."""
    spec = payload.spec
    if own.numel() != payload.numel:
        raise ValueError(f"payload covers {payload.numel} elements, own state {own.numel()}")
    pos = positions(spec, payload.numel, payload.seed, own.device)
    step = payload.steps.to(own.device)[pos // spec.chunk]
    m = float(2**spec.bits)
    code = payload.codes.to(own.device, torch.float32)
    q = code + m * torch.round((own.float()[pos] / step - code) / m)
    return q * step


def validate(payload: ModuloPayload, limit: float) -> None:
    """ValueError unless a peer's payload has the sizes its spec implies and finite, positive
    steps no larger than ``limit`` (a decoded value is then within ``2^(b-1)`` steps of the
    receiver's own)."""
    spec, n = payload.spec, payload.numel
    chunks = -(-n // spec.chunk)
    if payload.steps.shape != (chunks,) or payload.codes.shape != (spec.entries(n),):
        raise ValueError(f"{spec} payload tensors do not match {n} elements")
    s = payload.steps
    if chunks and not bool((torch.isfinite(s) & (s > 0) & (s <= limit)).all()):
        raise ValueError(f"{spec} payload has non-finite, non-positive or too large steps")
    c = payload.codes
    if c.numel() and not bool(((c >= 0) & (c < 2**spec.bits)).all()):
        raise ValueError(f"{spec} payload has codes out of range")


class Distances:
    """A node's per-chunk largest distance to its partners, one vector per fragment (host
    memory, 4 bytes per chunk): what its steps are sized by, measured at every exchange."""

    def __init__(self) -> None:
        self.largest: dict[int, torch.Tensor] = {}

    def get(self, fragment: int) -> torch.Tensor | None:
        return self.largest.get(fragment)

    def measure(self, fragment: int, spec: ModuloSpec, numel: int, pos: torch.Tensor,
                theirs: torch.Tensor, own: torch.Tensor) -> None:
        """After an exchange: the largest ``|theirs - own[pos]|`` over each chunk's sent
        positions (``theirs``: the partner's decoded values at ``pos``)."""
        chunks = -(-numel // spec.chunk)
        gap = (theirs.float() - own.float()[pos]).abs()
        top = torch.zeros(chunks, device=gap.device).scatter_reduce_(
            0, pos // spec.chunk, gap, "amax", include_self=True)
        self.largest[fragment] = top.cpu()


def _chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    n = x.numel()
    rows = -(-n // chunk)
    if rows * chunk == n:
        return x.view(rows, chunk)
    out = torch.zeros(rows * chunk, dtype=x.dtype, device=x.device)
    out[:n] = x
    return out.view(rows, chunk)
