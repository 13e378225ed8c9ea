"""Payloads streamed through the device in whole blocks: one room per codec, one registry line.

On a GPU the engine (:mod:`gasloc_p2p.protocol.engine`) keeps nothing payload-sized on the
device: the check and the commit each stream both payloads from pinned host memory through
chunk-sized staging, and a codec's :class:`Room` does a chunk's work on ``[rows, block]``
views: its encoder, the guard's four sums and the correction ``weight (D(theirs) - D(mine))``.
The engine walks the codec's wire layout (:func:`gasloc_p2p.core.wire.layout`: scales, then
``bits`` per element of data) and never branches on a codec's name.

A room's eager passes are its codec's own block math (:class:`~gasloc_p2p.core.codecs.Codec`
in ``core/codecs.py``, where every path encodes and decodes: the values are the other path's
bit for bit, ``tests/test_streamed.py``); a room may add :class:`Kernels` (Triton, one pass per
phase) for a GPU, as int8's does (:mod:`gasloc_p2p.protocol.payloads.int8`). Kernels live here,
not in ``core/`` (which imports torch and the standard library only).

A new codec streams with a line in :data:`ROOMS`. Residual codecs (against a link's reference)
do not stream: their prepare subtracts the reference chunk by chunk on the other path.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gasloc_p2p.core.codecs import BlockCodec, CodecSpec
from gasloc_p2p.core.wire import BLOCK_CODECS, RESIDUAL_CODECS, layout
from gasloc_p2p.protocol.payloads import int8

# device bytes per element of one chunk an exchange adds at most (gasloc-node plan), at 8 bits
# per element (every streamed codec has at most 8): the commit's data of both payloads and,
# where theta is not its only target, the correction (1 + 1 + 4); the check's data and
# theta_0's bfloat16 chunk (4); scales are 4/block_size
STAGING_BYTES = 6
# the eager passes' staging and temporaries (at most two float32 chunks at once besides them)
EAGER_STAGING_BYTES = 20


class Kernels(Protocol):
    """A room's fused passes over flat chunks of ``n`` values (no zero padding needed)."""

    def encode(self, x: torch.Tensor, bs: int, scales: torch.Tensor, data: torch.Tensor,
               finite: torch.Tensor) -> None: ...

    def screen(self, md: torch.Tensor, ms: torch.Tensor, td: torch.Tensor, ts: torch.Tensor,
               t0: torch.Tensor, bs: int, part: torch.Tensor) -> torch.Tensor: ...

    def correct(self, md: torch.Tensor, ms: torch.Tensor, td: torch.Tensor, ts: torch.Tensor,
                weight: float, bs: int, out: torch.Tensor, add: bool,
                part: torch.Tensor) -> torch.Tensor: ...

    def scratch(self, numel: int, device: torch.device) -> torch.Tensor: ...

    def usable(self, device: torch.device) -> bool: ...


class Room:
    """One codec's streamed work. Data rows are ``uint8 [rows, block bytes]``, scales
    ``float32 [rows]``; the eager passes take values zero-padded to whole blocks."""

    def __init__(self, name: str, kernels: Kernels | None = None) -> None:
        if name in RESIDUAL_CODECS:
            raise ValueError(f"{name} is a residual codec: its payloads do not stream")
        if name not in BLOCK_CODECS:
            raise ValueError(f"{name} has no blocks: its payloads do not stream")
        self.name = name
        self.kernels = kernels

    def codec(self, block_size: int) -> BlockCodec:
        """The shared codec object (its lookup tables built and placed on a device once)."""
        codec = CodecSpec.of(self.name, block_size).codec()
        assert isinstance(codec, BlockCodec)
        return codec

    def block_bytes(self, block_size: int) -> int:
        return layout(self.name, block_size, block_size)[1]

    # -------------------------------------------------------------- eager passes
    def encode_rows(self, xb: torch.Tensor, scales: torch.Tensor, data: torch.Tensor,
                    finite: torch.Tensor) -> None:
        """Encode ``xb`` [k, bs] (float32, left unchanged) into ``scales`` [k] and ``data``
        [k, block bytes], as the codec does; ANDs "every block finite" into ``finite``."""
        self.codec(xb.shape[1]).encode_rows(xb, scales, data.view(-1), finite,
                                            torch.empty_like(xb))

    def decode_rows(self, data: torch.Tensor, scales: torch.Tensor,
                    block_size: int) -> torch.Tensor:
        """The decoded values, float32 [k, bs]: code times scale, the codec's rounding."""
        out = torch.empty(scales.numel(), block_size, device=scales.device)
        self.codec(block_size).decode_rows(data.view(-1), scales, out)
        return out

    def screen_rows(self, md: torch.Tensor, ms: torch.Tensor, td: torch.Tensor,
                    ts: torch.Tensor, t0: torch.Tensor) -> torch.Tensor:
        """The guard's four sums over decoded messages (data, scales; theta_0 [k, bs] in any
        float dtype): ``||t - m||^2``, ``||m - t0||^2``, ``||t - t0||^2``,
        ``(m - t0).(t - t0)`` as float32 [4]."""
        bs = t0.shape[1]
        mine = self.decode_rows(md, ms, bs).view(-1)
        theirs = self.decode_rows(td, ts, bs).view(-1)
        dist2 = torch.dist(theirs, mine).square()
        base = t0.view(-1)
        mine.sub_(base)
        theirs.sub_(base)
        return torch.stack([dist2, mine.dot(mine), theirs.dot(theirs), mine.dot(theirs)])

    def correction_rows(self, md: torch.Tensor, ms: torch.Tensor, td: torch.Tensor,
                        ts: torch.Tensor, weight: float,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``c = weight * (D(theirs) - D(mine))`` (float32 [k * bs]) and ``||c||^2``: the
        other path's roundings (each decoded value, the difference, the product)."""
        c = self.decode_rows(td, ts, block_size).view(-1)
        c.sub_(self.decode_rows(md, ms, block_size).view(-1)).mul_(weight)
        return c, c.dot(c)


# the registry: a codec streams where it has a line here
ROOMS: dict[str, Room] = {
    "int8": Room("int8", int8.KERNELS),
    "int4": Room("int4"),
    "fp4": Room("fp4"),
}


def kernels_usable(device: torch.device) -> bool:
    """Whether some room's kernels run on ``device`` (the engine's default)."""
    return any(r.kernels is not None and r.kernels.usable(device) for r in ROOMS.values())


def room(name: str) -> Room | None:
    """The room of codec ``name``, or None where its payloads do not stream."""
    return ROOMS.get(name)
