"""Bit packing for the sparse payloads (:mod:`gasloc_p2p.core.sparse`): b-bit codes, 12-bit
indices and a counter-based integer hash, all vectorised torch integer ops.

Everything here is exact integer arithmetic, so it gives the same bytes on every device and
every torch version (no floating point, no torch random generator).

- Codes of ``b`` bits (b in 1, 2, 4, 8): entry ``e`` lives in byte ``e * b // 8`` at bit
  ``(e * b) % 8`` (first entry in the low bits). A partial last byte is padded with zero bits.
- 12-bit indices: entries ``(a, b)`` of each pair take 3 bytes ``a & 0xFF``,
  ``(a >> 8) | (b & 0xF) << 4``, ``b >> 4``; an odd count is padded with ``b = 0``.
"""

from __future__ import annotations

import functools

import torch

CODE_BITS = (1, 2, 4, 8)
INDEX_BITS = 12
MAX_INDEX = 1 << INDEX_BITS  # chunk positions must be below this to fit 12 bits
_MASK32 = 0xFFFFFFFF


def code_bytes(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits take on the wire."""
    return -(-count * bits // 8)


def index_bytes(count: int) -> int:
    """Bytes that ``count`` 12-bit indices take on the wire (3 per pair)."""
    return 3 * (-(-count // 2))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (uint8 [K], each below ``2**bits``) into uint8 [code_bytes(K, bits)]."""
    if bits == 8:
        return codes.contiguous()
    per = 8 // bits
    pad = -codes.numel() % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    # the shifted codes occupy disjoint bits, so their sum is their bitwise or
    return (codes.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)


@functools.lru_cache(maxsize=16)
def _unpack_table(bits: int, device: torch.device) -> torch.Tensor:
    """uint8 [256, 8 // bits]: the codes held by each byte value."""
    byte = torch.arange(256, dtype=torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32)
    return ((byte[:, None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8).to(device)


def unpack_codes(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of ``data`` (uint8, packed by :func:`pack_codes`): uint8 [count]."""
    if bits == 8:
        return data[:count]
    table = _unpack_table(bits, data.device)
    return table.index_select(0, data.to(torch.int32)).view(-1)[:count]


def pack_indices(idx: torch.Tensor) -> torch.Tensor:
    """Pack positions ``idx`` (integer [K], each in [0, 4096)) into uint8 [index_bytes(K)]."""
    idx = idx.to(torch.int32)
    if idx.numel() % 2:
        idx = torch.cat([idx, idx.new_zeros(1)])
    a, b = idx[0::2], idx[1::2]
    out = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1)
    return out.to(torch.uint8).view(-1)


def unpack_indices(data: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` 12-bit positions of ``data`` (uint8 [index_bytes(count)]): int64."""
    triples = data.view(-1, 3).to(torch.int64)
    a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    return torch.stack([a, b], dim=1).view(-1)[:count]


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each element of ``x`` (int64, values in [0, 2**32)): int64 in
    [0, 2**32). Every product stays below 2**63, so int64 arithmetic is exact everywhere."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def seeded_hash(seed: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``count`` pseudo-random 32-bit values (int64 [count]) determined by ``seed`` alone (any
    Python int): the same on every peer, device and torch version."""
    return seeded_hash_at(seed, torch.arange(count, dtype=torch.int64, device=device))


def seeded_hash_at(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Values ``index`` (int64, non-negative) of the sequence :func:`seeded_hash` draws from
    ``seed``: ``seeded_hash(seed, n)[index]`` without the values in between."""
    folded = seed & ((1 << 64) - 1)
    s = _mix32_int((folded ^ (folded >> 32)) & _MASK32)
    return mix32((index.to(torch.int64) * 0x9E3779B1 + s) & _MASK32)


def _mix32_int(x: int) -> int:
    """:func:`mix32` of one Python int (no tensor: nothing for a device to wait on)."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)
