"""The int8 exchange's tensor work on whole blocks, for payloads streamed through the device.

On a GPU the engine (:mod:`gasloc_p2p.protocol.engine`) keeps nothing payload-sized on the
device: the check and the commit each stream both int8 payloads from pinned host memory
through chunk-sized staging, and these functions do a chunk's work on ``[rows, block]`` views
(a partial last block zero-padded, which adds nothing to any sum). Where the payloads used to
stay on the device from the check to the commit (2 bytes per parameter, 2.5 GiB at 1.2B
parameters), a chunk's staging and temporaries are about 20 bytes per element of one chunk.

The values are the eager codec's, bit for bit (each decoded value is one product, the
correction one subtraction and one product): ``tests/test_streamed.py`` compares payloads and
states with the engine's other path byte for byte. Temporaries are reused in place, at most
two float32 chunks at once.

Compiling these functions with ``torch.compile`` (shape-polymorphic) was measured on an H100:
bit-exact, but its kernels took 1.8 s per exchange at 1.2B parameters against 76 ms for the
eager passes (docs/results/gpu.md), so nothing here is compiled.
"""

from __future__ import annotations

import torch

LEVELS = 127.0  # Int8Codec's
MIN_ABSMAX = 2.0**-100  # codecs._MIN_ABSMAX: smaller blocks are sent as zeros


def encode_rows(xb: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor,
                finite: torch.Tensor) -> None:
    """Int8-encode ``xb`` [k, bs] into ``scales`` [k] and ``codes`` [k, bs] (int8), as
    ``Int8Codec`` does; ANDs "every block finite" into ``finite``."""
    absmax = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg()).float()  # NaN-propagating
    finite.logical_and_(torch.isfinite(absmax).all())
    ok = absmax >= MIN_ABSMAX
    levels = torch.full_like(absmax, LEVELS)  # tensor / tensor: IEEE division everywhere
    scales.copy_(torch.where(ok, absmax / levels, 0.0))
    y = torch.mul(xb, torch.where(ok, levels / absmax, 0.0)[:, None])
    codes.copy_(y.round_())  # round half to even; the cast of an integral value is exact


def decode_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes * scales`` as float32 [k, bs]: code times scale, one rounding."""
    return codes.float().mul_(scales[:, None])


def screen_rows(mc: torch.Tensor, ms: torch.Tensor, tc: torch.Tensor, ts: torch.Tensor,
                t0: torch.Tensor) -> torch.Tensor:
    """The guard's four sums over decoded messages (codes [k, bs], scales [k], theta_0 [k, bs]
    in any float dtype): ``||t - m||^2``, ``||m - t0||^2``, ``||t - t0||^2``,
    ``(m - t0).(t - t0)`` as float32 [4]."""
    mine, theirs = decode_rows(mc, ms).view(-1), decode_rows(tc, ts).view(-1)
    dist2 = torch.dist(theirs, mine).square()
    base = t0.view(-1)
    mine.sub_(base)
    theirs.sub_(base)
    return torch.stack([dist2, mine.dot(mine), theirs.dot(theirs), mine.dot(theirs)])


def correction_rows(mc: torch.Tensor, ms: torch.Tensor, tc: torch.Tensor, ts: torch.Tensor,
                    weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``c = weight * (D(theirs) - D(mine))`` (float32 [k * bs]) and ``||c||^2``: the eager
    commit's roundings (each decoded value, the difference, the product)."""
    c = decode_rows(tc, ts).view(-1)
    c.sub_(decode_rows(mc, ms).view(-1)).mul_(weight)
    return c, c.dot(c)
