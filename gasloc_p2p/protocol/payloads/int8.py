"""int8's room: its three fused Triton kernels, for the engine on a GPU.

int8's encode and decode are ``Int8Codec``'s (``core/codecs.py``); its streamed eager passes
are :class:`gasloc_p2p.protocol.payloads.Room`'s, on that codec's block math. The eager passes
read and write each chunk about 20 times: on an H200, 76.7 ms of kernels per exchange at 1.2B
parameters, 31.8x a device copy of the model's float32 bytes (target: 5x); these kernels took
7.1 ms, 3.0x (docs/results/gpu.md). Each kernel here makes one pass:

- :func:`encode`: a block's absolute maximum, its scale and its codes from one read of the
  values (5 bytes an element: 4 read, 1 written), and the "every block finite" flag;
- :func:`screen`: the guard's four sums over both decoded messages and ``theta_0`` (4 bytes an
  element), one partial per program, summed in a fixed order;
- :func:`correct`: ``c = weight (D(theirs) - D(mine))``, added straight into ``theta`` where it
  is the only correction target (10 bytes an element), and ``||c||^2``.

The values are the eager codec's bit for bit: the scale and the factor are IEEE divisions
(``div_rn``), each decoded value one product, the correction one subtraction and one product
(compiled with floating-point contraction off, so no fused multiply-add changes a rounding and
``c_i = -c_j`` holds to the bit), codes rounded half to even (adding and subtracting
``1.5 * 2^23``, exact below ``2^22``; a code is at most 127). ``tests/test_streamed.py`` checks
payloads, states and norms against the eager path byte for byte (on a GPU, or on a CPU under
``TRITON_INTERPRET=1``). Sums (the screen's, ``||c||^2``) are summed in another order than
eager ones: the same on both sides of an exchange, not the same bits as the eager path's.

Used by :class:`~gasloc_p2p.protocol.engine.ExchangeEngine` on CUDA where Triton is installed
(PyTorch's CUDA wheels bring it); elsewhere the eager passes run. Compiling the eager passes
with ``torch.compile`` (shape-polymorphic) was measured on an H100: bit-exact, but 1.8 s per
exchange at 1.2B parameters against 76 ms eagerly (docs/results/gpu.md).
"""

from __future__ import annotations

import os

import torch

from gasloc_p2p.core.codecs import Int8Codec
from gasloc_p2p.core.wire import MIN_ABSMAX

try:
    import triton
    import triton.language as tl
except ImportError:  # PyTorch's CPU wheels come without Triton
    triton = None

AVAILABLE = triton is not None
LEVELS = Int8Codec.levels  # 127: scale = absmax / LEVELS
ROUNDER = 12582912.0  # 1.5 * 2^23: (y + R) - R rounds |y| < 2^22 half to even in float32
ELEMS = 4096  # elements per program of the screen and the correction
WARPS = 8
NO_FMA = {"enable_fp_fusion": False}  # every product and sum rounded on its own, as eagerly


def usable(device: torch.device) -> bool:
    """Whether the fused kernels run for tensors on ``device``: a GPU with Triton, or any
    device under Triton's interpreter (``TRITON_INTERPRET=1``, the tests on a CPU)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _encode(x_ptr, scales_ptr, codes_ptr, finite_ptr, n, min_absmax,
                BS: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                LEVELS: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        idx = row * BS + offs
        mask = (offs < BS) & (idx < n)  # a partial last block counts as zero-padded
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        a = tl.abs(x)
        absmax = tl.max(a, axis=0)
        bad = tl.sum(((x != x) | (a == float("inf"))).to(tl.int32), axis=0)
        ok = absmax >= min_absmax
        levels = tl.full((), LEVELS, tl.float32)
        scale = tl.where(ok, tl.div_rn(absmax, levels), 0.0)
        factor = tl.where(ok, tl.div_rn(levels, absmax), 0.0)
        q = (x * factor + ROUND) - ROUND
        tl.store(codes_ptr + idx, q.to(tl.int8), mask=mask)
        tl.store(scales_ptr + row, scale)
        tl.store(finite_ptr, tl.zeros((), tl.uint8), mask=bad > 0)

    @triton.jit
    def _decoded(mc_ptr, ms_ptr, tc_ptr, ts_ptr, idx, mask, BS: tl.constexpr):
        row = idx // BS
        m = (tl.load(mc_ptr + idx, mask=mask, other=0).to(tl.float32)
             * tl.load(ms_ptr + row, mask=mask, other=0.0))
        t = (tl.load(tc_ptr + idx, mask=mask, other=0).to(tl.float32)
             * tl.load(ts_ptr + row, mask=mask, other=0.0))
        return m, t

    @triton.jit
    def _screen(mc_ptr, ms_ptr, tc_ptr, ts_ptr, t0_ptr, part_ptr, n,
                BS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        m, t = _decoded(mc_ptr, ms_ptr, tc_ptr, ts_ptr, idx, mask, BS)
        base = tl.load(t0_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        d = t - m
        dm = m - base
        dt = t - base
        tl.store(part_ptr + pid * 4, tl.sum(d * d, axis=0))
        tl.store(part_ptr + pid * 4 + 1, tl.sum(dm * dm, axis=0))
        tl.store(part_ptr + pid * 4 + 2, tl.sum(dt * dt, axis=0))
        tl.store(part_ptr + pid * 4 + 3, tl.sum(dm * dt, axis=0))

    @triton.jit
    def _correct(mc_ptr, ms_ptr, tc_ptr, ts_ptr, out_ptr, part_ptr, n, weight,
                 BS: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
        pid = tl.program_id(0)
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        m, t = _decoded(mc_ptr, ms_ptr, tc_ptr, ts_ptr, idx, mask, BS)
        c = (t - m) * weight
        if ADD:
            theta = tl.load(out_ptr + idx, mask=mask, other=0.0)
            tl.store(out_ptr + idx, theta + c, mask=mask)
        else:
            tl.store(out_ptr + idx, c, mask=mask)
        tl.store(part_ptr + pid, tl.sum(c * c, axis=0))


def _programs(n: int) -> int:
    return -(-n // ELEMS)


def encode(x: torch.Tensor, bs: int, scales: torch.Tensor, codes: torch.Tensor,
           finite: torch.Tensor) -> None:
    """Int8-encode the ``n`` contiguous values of ``x`` (float32) into ``scales`` (float32,
    at least ``ceil(n / bs)``) and ``codes`` (int8 or its bytes, at least ``n``), as
    ``Int8Codec`` does; clears ``finite`` (a bool scalar) if a block holds NaN or Inf."""
    n = x.numel()
    rows = -(-n // bs)
    _encode[(rows,)](x, scales, codes.view(torch.int8), finite.view(torch.uint8), n,
                     MIN_ABSMAX, BS=bs, BLOCK=triton.next_power_of_2(bs), ROUND=ROUNDER,
                     LEVELS=LEVELS, num_warps=4, **NO_FMA)


def screen(mc: torch.Tensor, ms: torch.Tensor, tc: torch.Tensor, ts: torch.Tensor,
           t0: torch.Tensor, bs: int, part: torch.Tensor) -> torch.Tensor:
    """The guard's four sums (as ``streamed.screen_rows``) over the ``n = t0.numel()`` values
    of both int8 messages (codes, scales), in ``part`` (float32, at least ``4 * ceil(n /
    ELEMS)``): float32 [4]."""
    n = t0.numel()
    g = _programs(n)
    _screen[(g,)](mc.view(torch.int8), ms, tc.view(torch.int8), ts, t0, part, n, BS=bs,
                  BLOCK=ELEMS, num_warps=WARPS, **NO_FMA)
    return part[: 4 * g].view(g, 4).sum(0)


def correct(mc: torch.Tensor, ms: torch.Tensor, tc: torch.Tensor, ts: torch.Tensor,
            weight: float, bs: int, out: torch.Tensor, add: bool,
            part: torch.Tensor) -> torch.Tensor:
    """``c = weight (D(theirs) - D(mine))`` over the ``n = out.numel()`` values: added into
    ``out`` (``add``: the live parameters, float32) or written there; returns ``||c||^2``
    (float32 scalar; ``part``: float32, at least ``ceil(n / ELEMS)``)."""
    n = out.numel()
    g = _programs(n)
    _correct[(g,)](mc.view(torch.int8), ms, tc.view(torch.int8), ts, out, part, n, weight,
                   BS=bs, BLOCK=ELEMS, ADD=add, num_warps=WARPS, **NO_FMA)
    return part[:g].sum()


def scratch(numel: int, device: torch.device) -> torch.Tensor:
    """The partial sums of :func:`screen` or :func:`correct` over ``numel`` values."""
    return torch.empty(4 * _programs(numel), device=device)


class Int8Kernels:
    """int8's :class:`~gasloc_p2p.protocol.payloads.Kernels` (the functions above, looked up
    at each call)."""

    def encode(self, x: torch.Tensor, bs: int, scales: torch.Tensor, data: torch.Tensor,
               finite: torch.Tensor) -> None:
        encode(x, bs, scales, data, finite)

    def screen(self, md: torch.Tensor, ms: torch.Tensor, td: torch.Tensor, ts: torch.Tensor,
               t0: torch.Tensor, bs: int, part: torch.Tensor) -> torch.Tensor:
        return screen(md, ms, td, ts, t0, bs, part)

    def correct(self, md: torch.Tensor, ms: torch.Tensor, td: torch.Tensor, ts: torch.Tensor,
                weight: float, bs: int, out: torch.Tensor, add: bool,
                part: torch.Tensor) -> torch.Tensor:
        return correct(md, ms, td, ts, weight, bs, out, add, part)

    def scratch(self, numel: int, device: torch.device) -> torch.Tensor:
        return scratch(numel, device)

    def usable(self, device: torch.device) -> bool:
        return usable(device)


KERNELS = Int8Kernels()
