"""The codecs' wire format: payload layout and the :class:`Encoded` value (docs/algorithm.md s. 4).

Wire layout (``Encoded.to_bytes``): ``scales`` (float32, little-endian, one per block) then
``data`` (uint8). No padding is sent: a partial last block is padded with zeros only in
memory. Sizes for ``n`` elements and block size ``B``:

- ``fp32``: 4n data bytes. ``fp16``: 2n data bytes (IEEE half, raw bytes).
- ``int8``: ceil(n/B) scales + n bytes.
- ``int4`` and ``fp4``: ceil(n/B) scales + ceil(n/2) bytes.
- ``sign1``: ceil(n/B) scales + ceil(n/8) bytes.
- ``half2``: ceil(n/B) scales + B/8 bytes per whole block (B/2 codes of 2 bits) + for a last
  block of L elements ceil(2 min(B/2, L) / 8) bytes.

The value of each code is documented in :mod:`gasloc_p2p.core.codecs`.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import hashlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gasloc_p2p.core.codecs import CodecSpec

@dataclass(frozen=True)
class Layout:
    """What the wire format knows of a codec (its values are the codec class's business,
    :mod:`gasloc_p2p.core.codecs`): ``bits`` per element of a whole block (of every element
    without blocks); ``blocks``: a float32 scale per block precedes the data, and a block
    size is a multiple of ``8 / bits`` elements, so every block starts on a byte;
    ``default_block``: the block size the name implies; ``residual``: sent only against a
    reference both ends of a link hold (:mod:`gasloc_p2p.core.links`), never as parameters;
    ``seeded``: each block sends the half of its elements a seed both ends hold picks (with
    the block's index), at 2 bits (a whole block's data is B bits), and a last block of ``L``
    elements ``min(B/2, L)`` of them (the simulator's randk rule, :mod:`gasloc_p2p.core.sparse`)."""

    bits: int
    blocks: bool = True
    default_block: int = 1024
    residual: bool = False
    seeded: bool = False


# One line per codec; a new codec is this line and its class in core/codecs.py.
CODECS: dict[str, Layout] = {
    "fp32": Layout(32, blocks=False, default_block=0),
    "fp16": Layout(16, blocks=False, default_block=0),
    "int8": Layout(8),
    "int4": Layout(4),
    "fp4": Layout(4),
    "sign1": Layout(1, default_block=4096, residual=True),  # a scale per 1024: 3% of the bytes
    "half2": Layout(1, default_block=4096, residual=True, seeded=True),
}
# blocks whose absmax (or mean |x|) is below this are sent as zeros (scale 0): levels / absmax
# would overflow float32, and such blocks carry no signal
MIN_ABSMAX = 2.0**-100
CODEC_BITS: dict[str, int] = {name: c.bits for name, c in CODECS.items()}
CODEC_NAMES: tuple[str, ...] = tuple(CODECS)
BLOCK_CODECS = frozenset(name for name, c in CODECS.items() if c.blocks)
RESIDUAL_CODECS = frozenset(name for name, c in CODECS.items() if c.residual)
SEEDED_CODECS = frozenset(name for name, c in CODECS.items() if c.seeded)
PLAIN_CODECS: tuple[str, ...] = tuple(c for c in CODEC_NAMES if c not in RESIDUAL_CODECS)


def _data_offset(codec: str, start: int) -> int:
    """The byte of a payload's data where element ``start`` begins (on a byte boundary)."""
    return start * CODEC_BITS[codec] // 8


def layout(codec: str, numel: int, block_size: int) -> tuple[int, int]:
    """Return (number of float32 scales, number of data bytes) for ``numel`` elements."""
    if codec not in CODEC_NAMES:
        raise ValueError(f"unknown codec {codec!r}; valid codecs: {', '.join(CODEC_NAMES)}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    bits = CODEC_BITS[codec]
    if codec in BLOCK_CODECS:
        multiple = max(2, 8 // bits)
        if block_size < multiple or block_size % multiple:
            raise ValueError(f"{codec}: block_size must be a positive multiple of {multiple}, "
                             f"got {block_size}")
        if codec in SEEDED_CODECS:
            full, last = divmod(numel, block_size)
            return -(-numel // block_size), -(-(full * block_size + 2 * min(block_size // 2,
                                                                             last)) // 8)
        return -(-numel // block_size), -(-numel * bits // 8)
    if block_size != 0:
        raise ValueError(f"{codec} has no blocks: block_size must be 0, got {block_size}")
    return 0, numel * bits // 8


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("the codec wire format is little-endian; big-endian hosts unsupported")


def raw_bytes(t: torch.Tensor) -> bytes:
    """Copy the memory of a contiguous CPU tensor into ``bytes``, without numpy."""
    t = t.contiguous().cpu()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


DIGEST_BYTES = 32  # SHA-256
DIGEST_LEAF = 1 << 22  # bytes per leaf of a payload's digest tree
_DIGEST_TAG = b"gasloc-payload-tree-v1"
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))


@functools.cache
def _hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for the leaves of a large payload (hashlib releases the GIL while it hashes)."""
    return concurrent.futures.ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="digest")


def _leaf(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _root(nbytes: int, leaves: list[bytes]) -> bytes:
    return hashlib.sha256(_DIGEST_TAG + nbytes.to_bytes(8, "little") + b"".join(leaves)).digest()


def payload_digest(data: bytes | bytearray | memoryview) -> bytes:
    """The digest of a payload that a sender signs in its Header, so a payload changed on the
    path (a CRC can be kept by re-choosing 4 bytes) never matches: SHA-256 over a tag, the
    length and the SHA-256 of each :data:`DIGEST_LEAF`-byte leaf. The leaves of a large
    payload are hashed in parallel (one SHA-256 of 1.2 GB took 985 ms on one core of an H200's
    host); :class:`PayloadHasher` computes the same digest chunk by chunk."""
    view = memoryview(data).cast("B")
    n = view.nbytes
    leaves = [view[i:i + DIGEST_LEAF] for i in range(0, n, DIGEST_LEAF)]
    if len(leaves) > 1 and _HASH_THREADS > 1:
        return _root(n, list(_hash_pool().map(_leaf, leaves)))
    return _root(n, [_leaf(leaf) for leaf in leaves])


class PayloadHasher:
    """:func:`payload_digest` of bytes that arrive in pieces (as a receiver reads chunks off the
    wire, hashing each while the rest is in flight); any split gives the same digest."""

    def __init__(self) -> None:
        self._leaves: list[bytes] = []
        self._leaf = hashlib.sha256()
        self._in_leaf = 0
        self._total = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, DIGEST_LEAF - self._in_leaf)
            self._leaf.update(view[:take])
            self._in_leaf += take
            self._total += take
            view = view[take:]
            if self._in_leaf == DIGEST_LEAF:
                self._leaves.append(self._leaf.digest())
                self._leaf, self._in_leaf = hashlib.sha256(), 0

    def digest(self) -> bytes:
        tail = [self._leaf.digest()] if self._in_leaf else []
        return _root(self._total, self._leaves + tail)


def payload_buffer(nbytes: int, pin: bool = False) -> bytearray | memoryview:
    """A zeroed buffer for a wire payload: a bytearray, or with ``pin`` a writable memoryview
    of pinned host memory (CUDA copies into and out of it run asynchronously)."""
    if not pin:
        return bytearray(nbytes)
    tensor = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    array: Any = tensor.numpy()
    return memoryview(array)  # keeps the tensor's storage alive


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no boolean equality
class RunIndex:
    """Where runs of elements lie in an Encoded's tensors: byte positions in ``data`` and
    scale positions in ``scales`` (int64), and the runs' element count."""

    data: torch.Tensor
    scales: torch.Tensor
    numel: int


def run_index(codec: str, block_size: int, runs: list[tuple[int, int]],
              device: torch.device | str = "cpu") -> RunIndex:
    """The :class:`RunIndex` of ``runs`` (``(start, length)``, in order; each starts on a
    block boundary, and only the last may end short of one) in payloads of ``codec``."""
    data: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    for i, (start, n) in enumerate(runs):
        n_scales, n_data = layout(codec, n, block_size)
        if block_size and (start % block_size or (n % block_size and i < len(runs) - 1)):
            raise ValueError(f"run [{start}, {start + n}) is not whole blocks of {block_size}")
        if block_size:
            d0 = _data_offset(codec, start)
            scales.append(torch.arange(start // block_size, start // block_size + n_scales))
        else:
            d0 = start * (n_data // max(n, 1))
        data.append(torch.arange(d0, d0 + n_data))
    empty = torch.zeros(0, dtype=torch.int64)
    return RunIndex(torch.cat(data).to(device) if data else empty.to(device),
                    torch.cat(scales).to(device) if scales else empty.to(device),
                    sum(n for _, n in runs))


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no boolean equality
class Encoded:
    """One encoded flat tensor: ``scales`` float32 [n_blocks], ``data`` uint8 [n_bytes].

    A seeded codec's (:data:`SEEDED_CODECS`) positions come from ``seed`` (never on the wire:
    both ends derive it) and each block's index in the whole payload: ``first_block`` for a
    view, ``block_ids`` (int64 [n_blocks]) for a selection of blocks."""

    codec: str
    numel: int
    block_size: int
    data: torch.Tensor
    scales: torch.Tensor
    seed: int = 0
    first_block: int = 0
    block_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n_scales, n_data = layout(self.codec, self.numel, self.block_size)
        for name, t, dtype, size in (
            ("data", self.data, torch.uint8, n_data),
            ("scales", self.scales, torch.float32, n_scales),
        ):
            if t.dtype != dtype or t.dim() != 1 or t.numel() != size or not t.is_contiguous():
                raise ValueError(
                    f"{self.codec} Encoded.{name}: expected contiguous {dtype} [{size}], "
                    f"got {t.dtype} {list(t.shape)}"
                )

    @property
    def spec(self) -> CodecSpec:
        """The codec and block size this payload was encoded with."""
        from gasloc_p2p.core.codecs import CodecSpec  # codecs imports this module

        return CodecSpec(self.codec, self.block_size)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Encoded:
        """This payload with its tensors on ``device`` (self if already there); from pinned
        host memory with ``non_blocking`` the copy is asynchronous on the current stream."""
        if self.data.device == torch.device(device):
            return self
        ids = self.block_ids
        return Encoded(self.codec, self.numel, self.block_size,
                       self.data.to(device, non_blocking=non_blocking),
                       self.scales.to(device, non_blocking=non_blocking), self.seed,
                       self.first_block, None if ids is None else ids.to(device))

    def seeded(self, seed: int) -> Encoded:
        """This payload (the same memory) with the seed of its positions (seeded codecs)."""
        return dataclasses.replace(self, seed=seed)

    def placed_as(self, other: Encoded) -> Encoded:
        """This payload (the same memory) with ``other``'s seed and first block: scratch that
        stands in for a part of a payload while a seeded codec encodes it."""
        return dataclasses.replace(self, seed=other.seed, first_block=other.first_block)

    @property
    def nbytes(self) -> int:
        """Exact wire size in bytes: data bytes + 4 bytes per scale."""
        return self.data.numel() + 4 * self.scales.numel()

    def to_bytes(self) -> bytes:
        """Serialize as scales bytes then data bytes (``nbytes`` long)."""
        _require_little_endian()
        return raw_bytes(self.scales) + raw_bytes(self.data)

    def view(self, start: int, numel: int) -> Encoded:
        """Elements ``[start, start + numel)`` as an Encoded over the same memory (no copy).

        ``start`` must be a multiple of the block size (block codecs), so the slice owns whole
        blocks; ``start + numel`` must be a block boundary or the end.
        """
        bs = self.block_size
        if bs and start % bs or start < 0 or start + numel > self.numel or (
                self.block_ids is not None):
            raise ValueError(f"bad view [{start}, {start + numel}) of {self}")
        if not bs:
            width = self.data.numel() // max(self.numel, 1)
            return Encoded(self.codec, numel, 0, self.data[start * width:(start + numel) * width],
                           self.scales)
        n_scales, n_data = layout(self.codec, numel, bs)
        d0 = _data_offset(self.codec, start)
        s0 = start // bs
        return Encoded(self.codec, numel, bs, self.data[d0 : d0 + n_data],
                       self.scales[s0 : s0 + n_scales], self.seed, self.first_block + s0)

    def select(self, index: RunIndex) -> Encoded:
        """The runs of ``index`` (:func:`run_index`) as one Encoded, copied out in two gathers
        (decoding it gives the runs' elements in order, bit for bit as decoding each)."""
        if index.numel and index.data.device != self.data.device:
            raise ValueError(f"run index on {index.data.device}, payload on {self.data.device}")
        if self.block_ids is not None:
            raise ValueError(f"a selection of a selection of {self.codec}")
        scales = self.scales.index_select(0, index.scales) if self.block_size else self.scales
        ids = (index.scales.to(scales.device) + self.first_block
               if self.codec in SEEDED_CODECS else None)
        return Encoded(self.codec, index.numel, self.block_size,
                       self.data.index_select(0, index.data), scales, self.seed,
                       self.first_block, ids)

    @classmethod
    def empty(cls, codec: str, numel: int, block_size: int,
              pin: bool = False) -> tuple[bytearray | memoryview, Encoded]:
        """A wire payload and an Encoded whose tensors are views of it: encoding into the
        views fills the payload, with no ``to_bytes`` copy. ``pin``: in pinned (page-locked)
        host memory, so a device copies into it asynchronously (a memoryview of it)."""
        _require_little_endian()
        n_scales, n_data = layout(codec, numel, block_size)
        payload = payload_buffer(4 * n_scales + n_data, pin)
        return payload, cls._over(codec, numel, block_size, payload, n_scales)

    @classmethod
    def empty_on(cls, codec: str, numel: int, block_size: int,
                 device: torch.device | str) -> Encoded:
        """An uninitialised Encoded on ``device`` (one allocation there, nothing on the
        host): the engine's staging area for a chunk before it is copied to the host."""
        n_scales, n_data = layout(codec, numel, block_size)
        raw = torch.empty(4 * n_scales + n_data, dtype=torch.uint8, device=device)
        return cls(codec, numel, block_size, raw[4 * n_scales :],
                   raw[: 4 * n_scales].view(torch.float32))

    @classmethod
    def _over(cls, codec: str, numel: int, block_size: int, buf: bytearray | memoryview,
              n_scales: int) -> Encoded:
        raw = (torch.frombuffer(buf, dtype=torch.uint8) if len(buf)
               else torch.empty(0, dtype=torch.uint8))
        return cls(codec, numel, block_size, raw[4 * n_scales :], raw[: 4 * n_scales].view(
            torch.float32))

    @classmethod
    def from_bytes(
        cls, codec: str, numel: int, block_size: int, buf: bytes | bytearray | memoryview,
        copy: bool = True,
    ) -> Encoded:
        """Parse ``to_bytes`` output; ValueError on a wrong length or bad scales.

        ``copy=False`` (``buf`` must be a bytearray or a writable memoryview, e.g. of
        :func:`payload_buffer`, the caller will neither resize nor reuse): the tensors are
        views of ``buf``.
        """
        _require_little_endian()
        n_scales, n_data = layout(codec, numel, block_size)
        expected, got = 4 * n_scales + n_data, memoryview(buf).nbytes
        if got != expected:
            raise ValueError(
                f"{codec} payload for numel={numel}, block_size={block_size} must be "
                f"{expected} bytes, got {got}"
            )
        # bytearray copy: the payload must not alias a buffer the transport will reuse.
        owned = (buf if not copy and isinstance(buf, bytearray | memoryview)
                 and not memoryview(buf).readonly else bytearray(buf))
        enc = cls._over(codec, numel, block_size, owned, n_scales)
        # A scale from a peer feeds straight into the references: reject NaN/Inf/negative.
        if n_scales and not bool((torch.isfinite(enc.scales) & (enc.scales >= 0)).all()):
            raise ValueError(f"{codec} payload has non-finite or negative scales")
        return enc

