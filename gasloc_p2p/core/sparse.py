"""Sparse and low-bit payloads (issue 24): chunked top-k, random-k with a shared seed, dense.

A payload covers a flat tensor of ``numel`` elements, cut into chunks of ``chunk`` elements (the
last one may be shorter, of length ``L``). Each chunk sends exactly ``min(k, L)`` entries, so
the entry count ``K`` and the wire size follow from ``(spec, numel)`` alone: a receiver knows
both before it reads a byte, and no count a peer sends decides an allocation.

Selection (``SparseSpec.select``):

- ``topk``: the ``k`` entries of largest magnitude of each chunk; their positions travel as
  12-bit indices (``chunk <= 4096``), strictly increasing within a chunk.
- ``randk``: ``k`` positions per chunk from a seed both sides derive (nothing on the wire):
  with ``r = hash(seed, chunk) mod L``, positions ``(j L + r) // k`` for ``j < k`` (systematic
  sampling with a random phase: distinct, sorted, each position included with probability
  exactly ``k / L``). The hash is integer arithmetic (:mod:`gasloc_p2p.core.bitpack`).
- ``dense``: every position (``k = chunk``), no indices, no seed: a dense low-bit codec.

Values: ``bits`` per entry, one float32 scale ``s`` per chunk; decoded value = level * s, one
float32 rounding, so every peer decodes the same bits.

- 8: two's-complement code q in [-128, 127], level q; the encoder uses s = absmax / 127.
- 4: two's-complement nibble q in [-8, 7], level q; s = absmax / 7.
- 2: code c in 0..3, level 2c - 3; the encoder fits s by least squares (``_quantize2``).
- 1: code c in 0..1, level 2c - 1; s = mean |value| (the least-squares scale for signs).

Chunks whose absmax is below 2^-100 send scale 0 (they decode to zeros).

Wire layout (``SparsePayload.to_bytes``): scales (float32, little-endian, one per chunk), then
the value codes (:func:`~gasloc_p2p.core.bitpack.pack_codes`), then (topk only) the indices
(:func:`~gasloc_p2p.core.bitpack.pack_indices`). Bytes for ``C`` chunks and ``K`` entries:
``4 C + ceil(K bits / 8) + (topk: 3 ceil(K / 2))``.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch

from gasloc_p2p.core import bitpack
from gasloc_p2p.core.wire import MIN_ABSMAX
from gasloc_p2p.core.wire import raw_bytes as _raw_bytes

SELECTIONS = ("topk", "randk", "dense")
VALUE_BITS = bitpack.CODE_BITS
DEFAULT_CHUNK = 4096
MAX_CHUNK = 1 << 16
_F32_MAX = torch.finfo(torch.float32).max
_LEVELS = {8: 127.0, 4: 7.0}  # encoder: scale = absmax / levels
_MAX_LEVEL = {8: 128.0, 4: 8.0, 2: 3.0, 1: 1.0}  # largest |level| a peer's code can carry
# Elements per encoding pass on a CPU: cache-sized, as the block codecs (core/codecs.py).
_PASS_ELEMS = 1 << 20


@dataclass(frozen=True)
class SparseSpec:
    """Which sparse payload: ``select`` (topk, randk, dense), ``bits`` per value (1, 2, 4, 8),
    ``k`` entries per chunk (dense: ``k = chunk``), ``chunk`` elements per chunk.

    Text form (``parse``/``str``): ``topk2:41`` (top-41 of every 4096 elements, 2-bit values),
    ``randk8:123``, ``topk2:20:2048`` (chunk 2048), ``dense2`` or ``dense2:256`` (chunk 256).
    """

    select: str
    bits: int
    k: int
    chunk: int = DEFAULT_CHUNK

    def __post_init__(self) -> None:
        if self.select not in SELECTIONS:
            raise ValueError(f"unknown selection {self.select!r}; choose from {SELECTIONS}")
        if self.bits not in VALUE_BITS:
            raise ValueError(f"value bits must be one of {VALUE_BITS}, got {self.bits}")
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise ValueError(f"chunk must be in [1, {MAX_CHUNK}], got {self.chunk}")
        if self.select == "topk" and self.chunk > bitpack.MAX_INDEX:
            raise ValueError(f"topk: chunk {self.chunk} exceeds {bitpack.MAX_INDEX} (12-bit "
                             "indices)")
        if not 1 <= self.k <= self.chunk or (self.select == "dense" and self.k != self.chunk):
            raise ValueError(f"k must be in [1, chunk={self.chunk}] (dense: k = chunk), got "
                             f"{self.k}")

    @classmethod
    def parse(cls, text: str) -> SparseSpec:
        """``topk2:41``, ``randk8:123:2048``, ``dense2``, ``dense2:256``; ValueError else."""
        head, _, rest = text.partition(":")
        select = head.rstrip("0123456789")
        try:
            bits = int(head[len(select):])
            nums = [int(p) for p in rest.split(":")] if rest else []
        except ValueError:
            raise ValueError(f"bad sparse codec {text!r}: expected e.g. topk2:41, randk8:123, "
                             "dense2") from None
        if select == "dense":
            if len(nums) > 1:
                raise ValueError(f"bad sparse codec {text!r}: dense takes one chunk size")
            chunk = nums[0] if nums else DEFAULT_CHUNK
            return cls("dense", bits, chunk, chunk)
        if len(nums) not in (1, 2):
            raise ValueError(f"bad sparse codec {text!r}: {select} needs k (and a chunk)")
        return cls(select, bits, nums[0], nums[1] if len(nums) == 2 else DEFAULT_CHUNK)

    def __str__(self) -> str:
        if self.select == "dense":
            return f"dense{self.bits}" + ("" if self.chunk == DEFAULT_CHUNK else f":{self.chunk}")
        tail = "" if self.chunk == DEFAULT_CHUNK else f":{self.chunk}"
        return f"{self.select}{self.bits}:{self.k}{tail}"

    @property
    def density(self) -> float:
        return self.k / self.chunk

    def counts(self, numel: int) -> tuple[int, int, int, int]:
        """(chunks, full chunks, length of the last chunk, entries K) for ``numel`` elements."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        chunks = -(-numel // self.chunk)
        full = numel // self.chunk
        last = numel - full * self.chunk
        return chunks, full, last, full * self.k + min(self.k, last)

    def layout(self, numel: int) -> tuple[int, int, int]:
        """Wire bytes of (scales, value codes, indices) for ``numel`` elements."""
        chunks, _, _, entries = self.counts(numel)
        idx = bitpack.index_bytes(entries) if self.select == "topk" else 0
        return 4 * chunks, bitpack.code_bytes(entries, self.bits), idx

    def wire_bytes(self, numel: int) -> int:
        """Exact payload size in bytes for ``numel`` elements."""
        return sum(self.layout(numel))


@dataclass(frozen=True, eq=False)
class SparsePayload:
    """One encoded flat tensor: ``scales`` float32 [chunks], ``codes`` uint8 (packed values),
    ``index`` uint8 (packed 12-bit positions; empty unless topk), and the ``seed`` of randk
    (never on the wire: both sides derive it). randk positions depend on each chunk's index
    in the whole tensor: ``first_chunk`` is the first one's (a part of a larger payload), or
    ``chunk_ids`` lists them all (int64 [chunks], a selection of chunks)."""

    spec: SparseSpec
    numel: int
    seed: int
    scales: torch.Tensor
    codes: torch.Tensor
    index: torch.Tensor
    first_chunk: int = 0
    chunk_ids: torch.Tensor | None = None

    def ids(self) -> torch.Tensor:
        """The index of each chunk in the whole tensor: int64 [chunks]."""
        if self.chunk_ids is not None:
            return self.chunk_ids
        n = self.scales.numel()
        return torch.arange(self.first_chunk, self.first_chunk + n, device=self.scales.device)

    @property
    def nbytes(self) -> int:
        return self.scales.numel() * 4 + self.codes.numel() + self.index.numel()

    def to_bytes(self) -> bytes:
        """Scales, codes, then indices (``nbytes`` long, little-endian scales)."""
        if sys.byteorder != "little":
            raise RuntimeError("the wire format is little-endian; big-endian hosts unsupported")
        parts = (self.scales.contiguous().view(torch.uint8), self.codes, self.index)
        return b"".join(_raw_bytes(p) for p in parts)

    @classmethod
    def from_bytes(cls, spec: SparseSpec, numel: int, buf: bytes | bytearray | memoryview,
                   seed: int = 0) -> SparsePayload:
        """Parse and validate a peer's payload for a fragment of ``numel`` elements (the
        receiver's own size): the length is checked against ``spec`` before anything is
        allocated; then :func:`validate`. ValueError on anything malformed."""
        if sys.byteorder != "little":
            raise RuntimeError("the wire format is little-endian; big-endian hosts unsupported")
        n_scales, n_codes, n_index = spec.layout(numel)
        got = memoryview(buf).nbytes
        if got != n_scales + n_codes + n_index:
            raise ValueError(f"{spec} payload for {numel} elements must be "
                             f"{n_scales + n_codes + n_index} bytes, got {got}")
        raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if got else torch.empty(
            0, dtype=torch.uint8)
        payload = cls(spec, numel, seed, raw[:n_scales].view(torch.float32),
                      raw[n_scales:n_scales + n_codes], raw[n_scales + n_codes:])
        validate(payload)
        return payload


def validate(payload: SparsePayload) -> None:
    """ValueError unless a (peer's) payload decodes to finite values at valid positions: sizes
    match the spec, scales are finite, non-negative and cannot overflow, and (topk) every
    index is inside its chunk and strictly increasing within it (so unique)."""
    spec, numel = payload.spec, payload.numel
    chunks, full, last, entries = spec.counts(numel)
    sizes = (payload.scales.numel() * 4, payload.codes.numel(), payload.index.numel())
    if sizes != spec.layout(numel) or payload.scales.dtype != torch.float32:
        raise ValueError(f"{spec} payload tensors do not match {numel} elements")
    s = payload.scales
    if chunks and not bool((torch.isfinite(s) & (s >= 0)
                            & (s <= _F32_MAX / _MAX_LEVEL[spec.bits])).all()):
        raise ValueError(f"{spec} payload has non-finite, negative or overflowing scales")
    if spec.select != "topk" or not entries:
        return
    idx = bitpack.unpack_indices(payload.index, entries)
    rows = [(idx[: full * spec.k].view(full, spec.k), spec.chunk)] if full else []
    if last:
        rows.append((idx[full * spec.k:].view(1, -1), last))
    for r, length in rows:
        if bool((r >= length).any()) or (r.shape[1] > 1 and not bool((r[:, 1:] > r[:, :-1]).all())):
            raise ValueError(f"{spec} payload has indices out of range or not increasing")


@functools.lru_cache(maxsize=16)
def _level_table(bits: int, device: torch.device) -> torch.Tensor:
    """float32 [2**bits]: the level of each code."""
    c = torch.arange(1 << bits, dtype=torch.int32)
    if bits in (8, 4):  # two's complement
        c = torch.where(c >= 1 << (bits - 1), c - (1 << bits), c)
    else:
        c = 2 * c - (3 if bits == 2 else 1)
    return c.to(torch.float32).to(device)


def _positions_in_chunks(spec: SparseSpec, ids: torch.Tensor, length: int, k: int,
                         seed: int) -> torch.Tensor:
    """randk/dense positions (int64 [rows, k]) inside chunks of ``length`` elements whose
    indices in the whole tensor are ``ids`` (int64 [rows])."""
    j = torch.arange(k, dtype=torch.int64, device=ids.device)
    if spec.select == "dense":
        return j.expand(ids.numel(), k)
    phase = bitpack.seeded_hash_at(seed, ids) % length
    return (j[None, :] * length + phase[:, None]) // k


def _topk_rows(a: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (int64 [rows, k], unsorted) of the k largest values of each row of ``a``
    ([rows, length], int32 bit patterns of non-negative floats: same order, and integer topk
    ran 1.3-1.7x faster than float topk here). Exact: every top-k entry lies in one of the k
    strided groups with the largest maxima, so the top-k of those groups' members is the
    row's top-k (ties broken arbitrarily); two small top-k calls cost less than one over the
    row (measured 1.4x at k = 41 and 1.5x at k = 123 of 4096)."""
    rows, length = a.shape
    groups = max(512, 1 << max(0, (4 * k - 1).bit_length()))  # a power of two >= 4k
    if groups * 2 > length or length % groups:
        return a.topk(k, dim=1, sorted=False).indices
    size = length // groups  # members per group: g, g + groups, g + 2 groups, ...
    best = a.view(rows, size, groups).amax(dim=1).topk(k, dim=1, sorted=False).indices
    members = best[:, None, :] + (torch.arange(size, device=a.device) * groups)[None, :, None]
    members = members.view(rows, size * k)
    pick = a.gather(1, members).topk(k, dim=1, sorted=False).indices
    return members.gather(1, pick)


def _quantize(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8 [rows, k]) and scales (float32 [rows]) of the values ``v`` [rows, k]."""
    if bits == 1:
        scale = v.abs().mean(dim=1)
        return (v >= 0).to(torch.uint8), torch.where(scale >= MIN_ABSMAX, scale, 0.0)
    if bits == 2:
        return _quantize2(v)
    absmax = v.abs().amax(dim=1)
    ok = absmax >= MIN_ABSMAX
    levels = torch.full_like(absmax, _LEVELS[bits])
    scale = torch.where(ok, absmax / levels, 0.0)
    y = v * torch.where(ok, levels / absmax, 0.0)[:, None]  # in [-levels, levels]
    q = y.round_().to(torch.int8)  # round half to even
    return (q.view(torch.uint8) & 0xF if bits == 4 else q.view(torch.uint8)), scale


def _codes2(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """2-bit codes of ``v`` [rows, k] for levels (2c - 3) * scale: the nearest level."""
    ok = scale >= MIN_ABSMAX
    y = v * torch.where(ok, 1.0 / torch.where(ok, scale, 1.0), 0.0)[:, None]
    return y.add_(4.0).mul_(0.5).floor_().clamp_(0, 3)


def _quantize2(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-bit levels {-3, -1, 1, 3} * s: s starts at 0.8 mean |v| and is refitted twice by
    least squares for the nearest-level codes (a short Lloyd iteration). Relative L2 error,
    measured: 0.35 on Gaussian data (the optimal 4-level quantizer: 0.34), 0.10 on the top 1%
    of a Gaussian chunk, where absmax / 3 gives 0.76 and 0.33."""
    scale = v.abs().mean(dim=1).mul_(0.8)
    for _ in range(2):
        levels = _codes2(v, scale).mul_(2.0).sub_(3.0)
        scale = (v * levels).sum(dim=1) / (levels * levels).sum(dim=1)  # >= 0: signs agree
    scale = torch.where(scale >= MIN_ABSMAX, scale, 0.0)
    return _codes2(v, scale).to(torch.uint8), scale


def encode(spec: SparseSpec, x: torch.Tensor, seed: int = 0, first_chunk: int = 0,
           finite: torch.Tensor | None = None) -> SparsePayload:
    """Encode ``x`` (1-D float32/float16/bfloat16 [numel], on any device) with ``spec``; randk
    positions come from ``seed`` and the chunks' indices (``x``'s first chunk is number
    ``first_chunk`` of a larger tensor). ValueError if ``x`` holds NaN or Inf (nothing is
    sent), or with ``finite`` (a bool scalar tensor on ``x``'s device) AND "finite" into it
    instead (no host synchronisation: the caller reads it once)."""
    if x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"expected a 1-D float tensor, got {x.dtype} {list(x.shape)}")
    chunks, full, last, entries = spec.counts(x.numel())
    dev, k = x.device, spec.k
    codes = torch.empty(entries, dtype=torch.uint8, device=dev)
    scales = torch.empty(chunks, dtype=torch.float32, device=dev)
    index = torch.empty(entries if spec.select == "topk" else 0, dtype=torch.int64, device=dev)
    deferred = finite is not None
    if finite is None:
        finite = torch.ones((), dtype=torch.bool, device=dev)
    # dense 2-bit runs a dozen passes per row: smaller passes stay in cache (1.3x, measured)
    elems = _PASS_ELEMS // 4 if spec.select == "dense" else _PASS_ELEMS
    per = max(1, elems // spec.chunk) if dev.type == "cpu" else max(full, 1)
    passes = [(c0, min(c0 + per, full), spec.chunk, k) for c0 in range(0, full, per)]
    if last:
        passes.append((full, full + 1, last, min(k, last)))
    work = None  # |x| of a pass (topk), reused: cache-sized passes stay in cache
    for c0, c1, length, kk in passes:
        xb = x[c0 * spec.chunk: c0 * spec.chunk + (c1 - c0) * length].view(c1 - c0, length)
        xb = xb.float()
        finite &= torch.isfinite(xb.amax()) & torch.isfinite(xb.amin())
        lo, hi = c0 * k, c0 * k + (c1 - c0) * kk
        ids = torch.arange(first_chunk + c0, first_chunk + c1, device=dev)
        if spec.select == "dense":
            vals = xb
        elif spec.select == "topk":
            if work is None or work.numel() < xb.numel():
                work = torch.empty(xb.numel(), dtype=torch.float32, device=dev)
            a = torch.abs(xb, out=work[:xb.numel()].view_as(xb)).view(torch.int32)
            pos = _topk_rows(a, kk).sort(dim=1).values
            index[lo:hi] = pos.view(-1)
            vals = xb.gather(1, pos)
        elif _halves(spec) and length == spec.chunk:  # strided reads, no index
            pairs = xb.view(c1 - c0, kk, 2)
            vals = torch.where(_odd_half(spec, seed, ids)[:, None], pairs[:, :, 1],
                               pairs[:, :, 0])
        else:
            vals = xb.gather(1, _positions_in_chunks(spec, ids, length, kk, seed))
        q, s = _quantize(vals, spec.bits)
        codes[lo:hi] = q.view(-1)
        scales[c0:c1] = s
    if not deferred and not bool(finite):
        raise ValueError(f"{spec}: input has non-finite values (NaN or Inf)")
    packed_index = bitpack.pack_indices(index) if spec.select == "topk" else index.to(torch.uint8)
    return SparsePayload(spec, x.numel(), seed, scales, bitpack.pack_codes(codes, spec.bits),
                         packed_index, first_chunk)


def positions(payload: SparsePayload) -> torch.Tensor:
    """Global positions of the payload's entries: int64 [K], strictly increasing."""
    spec = payload.spec
    entries = spec.counts(payload.numel)[3]
    dev, k = payload.scales.device, spec.k
    if spec.select == "topk":
        local = bitpack.unpack_indices(payload.index, entries)
        chunk_of = torch.arange(entries, device=dev) // k  # the last chunk's entries: // k too
        return local + chunk_of * spec.chunk
    return seeded_positions(spec, payload.numel, payload.seed, dev, payload.ids())


def seeded_positions(spec: SparseSpec, numel: int, seed: int, device: torch.device,
                     ids: torch.Tensor | None = None) -> torch.Tensor:
    """randk's (or dense's) positions for ``numel`` elements and ``seed``: int64 [K],
    increasing, the same on every peer (also the modulo payloads' positions); ``ids``: the
    chunks' indices in a larger tensor whose positions decide (default 0, 1, ...)."""
    if spec.select == "topk":
        raise ValueError("topk positions are chosen by the sender, not by a seed")
    chunks, full, last, _ = spec.counts(numel)
    if spec.select == "dense":
        return torch.arange(numel, device=device)
    k = spec.k
    if ids is None:
        ids = torch.arange(chunks, device=device)
    # offsets broadcast per chunk row (no division per entry)
    rows = _positions_in_chunks(spec, ids[:full], spec.chunk, k, seed)
    parts = [rows.add_(torch.arange(full, device=device)[:, None] * spec.chunk).view(-1)]
    if last:
        tail = _positions_in_chunks(spec, ids[full:], last, min(k, last), seed)
        parts.append(tail.view(-1) + full * spec.chunk)
    return torch.cat(parts)


def values(payload: SparsePayload) -> torch.Tensor:
    """Decoded values of the payload's entries, in the order of :func:`positions`: float32 [K]
    (level * chunk scale, one rounding: the same bits on every peer)."""
    spec = payload.spec
    _, full, last, entries = spec.counts(payload.numel)
    dev = payload.codes.device
    table = _byte_levels(spec.bits, dev)  # float32 [256, per]: the levels of each byte
    out = table.index_select(0, payload.codes.to(torch.int32)).view(-1)[:entries]
    body = out[: full * spec.k].view(full, spec.k)
    body.mul_(payload.scales[:full, None])
    if last:
        out[full * spec.k:].mul_(payload.scales[full])
    return out


@functools.lru_cache(maxsize=16)
def _byte_levels(bits: int, device: torch.device) -> torch.Tensor:
    """float32 [256, 8 // bits]: the levels of the codes each byte value holds."""
    codes = bitpack.unpack_codes(torch.arange(256, dtype=torch.uint8), bits, 256 * 8 // bits)
    levels = _level_table(bits, torch.device("cpu"))[codes.to(torch.int64)]
    return levels.view(256, 8 // bits).to(device)


def decode(payload: SparsePayload, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense float32 [numel] tensor the payload stands for (zeros where nothing was sent),
    written into ``out`` if given."""
    if payload.spec.select == "dense":  # every position: no zero fill, no scatter
        vals = values(payload)
        return vals if out is None else out.copy_(vals)
    spec = payload.spec
    if out is None:
        out = torch.empty(payload.numel, dtype=torch.float32, device=payload.scales.device)
    if _halves(spec):  # whole chunks: a strided write per parity, no index
        _, full, last, _ = spec.counts(payload.numel)
        vals = values(payload)
        ids = payload.ids()
        odd = _odd_half(spec, payload.seed, ids[:full])[:, None]
        pairs = out[: full * spec.chunk].view(full, spec.k, 2)
        body = vals[: full * spec.k].view(full, spec.k)
        zero = body.new_zeros(())
        torch.where(odd, zero, body, out=pairs[:, :, 0])
        torch.where(odd, body, zero, out=pairs[:, :, 1])
        if last:
            tail = out[full * spec.chunk:].zero_()
            k = min(spec.k, last)
            tail[_positions_in_chunks(spec, ids[full:], last, k, payload.seed).view(-1)] = (
                vals[full * spec.k:])
        return out
    out.zero_()
    out[positions(payload)] = values(payload)
    return out


def _halves(spec: SparseSpec) -> bool:
    """randk of half of each chunk: positions ``2 j + h`` in a whole chunk (``h`` 0 or 1)."""
    return spec.select == "randk" and 2 * spec.k == spec.chunk


def _odd_half(spec: SparseSpec, seed: int, ids: torch.Tensor) -> torch.Tensor:
    """Whether each whole chunk (indices ``ids``) sends its odd positions (bool [rows]): with
    ``r`` the chunk's phase, ``(2 k j + r) // k = 2 j + r // k``."""
    return bitpack.seeded_hash_at(seed, ids) % spec.chunk >= spec.k


def magnitude(payload: SparsePayload) -> float:
    """An upper bound of ``|decode(payload)|`` (a float; 0 for an empty payload)."""
    if not payload.scales.numel():
        return 0.0
    top = float(payload.scales.amax()) * _MAX_LEVEL[payload.spec.bits]
    return top if math.isfinite(top) else math.inf
