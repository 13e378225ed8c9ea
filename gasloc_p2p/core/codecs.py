"""Codecs for flat 1-D tensors on the wire (docs/algorithm.md section 4).

Every codec turns a 1-D float tensor of ``numel`` elements into an :class:`Encoded` payload
and back into float32. Decoding is elementwise with one IEEE rounding per element, so it is
bit-identical on every peer (and at any thread count) given the same payload.

Wire layout (``Encoded.to_bytes``): ``scales`` (float32, little-endian, one per block) then
``data`` (uint8). No padding is sent: a partial last block is padded with zeros only in
memory. Sizes for ``n`` elements and block size ``B``:

- ``fp32``: 4n data bytes. ``fp16``: 2n data bytes (IEEE half, raw bytes).
- ``int8``: ceil(n/B) scales + n bytes; value = q * scale, q in [-127, 127],
  scale = absmax/127.
- ``int4``: ceil(n/B) scales + ceil(n/2) bytes; value = q * scale, q in [-7, 7] stored as a
  two's-complement nibble, scale = absmax/7.
- ``fp4`` (E3M0): ceil(n/B) scales + ceil(n/2) bytes; nibble = sign << 3 | m, value =
  (-1)^sign * scale * 2^(m-7) for m in 1..7 and 0 for m = 0, scale = absmax. Encoding rounds
  to the nearest of {0, 2^-6, ..., 2^0} * absmax in linear space (ties away from zero).

Nibble order: element 2i is the low nibble of byte i, element 2i+1 the high nibble.
Blocks whose absmax is below 2^-100 are sent as zeros (scale 0), so all-zero blocks decode
to exact zeros and no reciprocal can overflow.
"""

from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass

import torch

from gasloc_p2p.core import sparse
from gasloc_p2p.core.wire import (
    BLOCK_CODECS,
    CODEC_NAMES,
    CODECS,
    MIN_ABSMAX,
    PLAIN_CODECS,
    Encoded,
    layout,
)

__all__ = ["BLOCK_CODECS", "CODEC_NAMES", "PLAIN_CODECS", "BlockCodec", "Codec", "CodecSpec",
           "Encoded", "NonFiniteError", "get_codec", "parse_optional"]

_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP16_MAX = 65504.0
# Work on chunks of whole blocks (~4 MB of float32): temporaries stay in cache and are reused,
# whereas full-size temporaries of a 100M-element tensor cost page faults and memory bandwidth.
# On a 2-core EPYC, 2^20 beat 2^18 (more per-op overhead) and 2^22 (cache misses) at 2 threads.
_CHUNK_ELEMS = 1 << 20
# fp4 encoding is a table lookup on float32 bits >> 22 (sign, 8 exponent bits, top mantissa
# bit): that is all nearest rounding to {0, 2^-6, ..., 2^0} needs, for |y| <= 1.
_FP4_INDEX_SHIFT = 22
_F32_BIAS = 127
_F32_MAX = torch.finfo(torch.float32).max


class NonFiniteError(ValueError):
    """Raised by ``Codec.encode`` when the input holds NaN or Inf."""


def _check_input(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        raise ValueError(f"expected a 1-D tensor, got {getattr(x, 'shape', type(x))}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"expected float32, float16 or bfloat16, got {x.dtype}")
    return x.contiguous()


def _raise_non_finite(x: torch.Tensor, codec: str) -> None:
    bad = x.numel() - int(torch.isfinite(x).sum())
    raise NonFiniteError(
        f"{codec} codec: input has {bad} non-finite value(s) (NaN or Inf) of {x.numel()}"
    )


_CODECS: dict[str, type[Codec]] = {}  # name -> class: every concrete codec registers itself


class Codec(abc.ABC):
    """Encodes a 1-D float tensor into an :class:`Encoded` payload and back to float32.

    Instances hold no mutable state, so one may serve several worker threads at once. A
    subclass that sets ``name`` registers itself for :func:`get_codec`; its wire layout is
    its line in :data:`gasloc_p2p.core.wire.CODECS`.
    """

    name: str
    block_size: int  # elements per scale block; 0 for fp32/fp16

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            if cls.name not in CODECS:
                raise TypeError(f"codec {cls.name!r} has no layout in core/wire.py's CODECS")
            _CODECS[cls.name] = cls

    def encode(self, x: torch.Tensor) -> Encoded:
        """Encode ``x`` (1-D float32/float16/bfloat16, [numel]); NonFiniteError on NaN/Inf."""
        x = _check_input(x)
        n_scales, n_data = layout(self.name, x.numel(), self.block_size)
        out = Encoded(self.name, x.numel(), self.block_size,  # on x's device, as x
                      torch.empty(n_data, dtype=torch.uint8, device=x.device),
                      torch.empty(n_scales, dtype=torch.float32, device=x.device))
        self._encode_into(x, out)
        return out

    def encode_into(self, x: torch.Tensor, out: Encoded,
                    finite: torch.Tensor | None = None) -> None:
        """Encode ``x`` into ``out``'s tensors (e.g. views of a wire payload, see
        ``Encoded.empty`` and ``Encoded.view``); same values as :meth:`encode`.

        ``finite``: a bool scalar tensor on ``x``'s device that this call ANDs with "the input
        was finite (and in range)" instead of checking it at once: no host synchronisation, so
        a caller encoding many chunks reads one flag at the end (a payload whose flag is false
        must not be sent).
        """
        if (out.codec, out.block_size, out.numel) != (self.name, self.block_size, x.numel()):
            raise ValueError(f"cannot encode {x.numel()} elements with {self} into {out.codec}/"
                             f"{out.block_size}/{out.numel}")
        self._encode_into(_check_input(x), out, finite=finite)

    def check_decodable(self, enc: Encoded) -> None:
        """ValueError unless ``enc`` decodes to finite values, checked without decoding: for
        block codecs the (already non-negative, finite) scales times the largest code must
        stay finite; fp32/fp16 data are scanned once."""
        if enc.numel == 0:
            return
        if self.block_size:
            if float(enc.scales.amax()) > _F32_MAX / self._max_code:
                raise ValueError(f"{self.name} payload has scales that overflow float32")
            return
        values = enc.data.view(torch.float32 if self.name == "fp32" else torch.float16)
        if not (math.isfinite(float(values.amax())) and math.isfinite(float(values.amin()))):
            raise ValueError("payload decodes to non-finite values")

    def magnitude(self, enc: Encoded) -> torch.Tensor:
        """A float32 scalar tensor (on the payload's device, no synchronisation): an upper bound
        of ``|decode(enc)|``, non-finite if any decoded value would be. Block codecs: the
        largest scale times the largest code (scales are already checked non-negative and
        finite); fp32/fp16: the largest magnitude of the data (NaN-propagating)."""
        if enc.numel == 0:
            return torch.zeros((), device=enc.data.device)
        if self.block_size:
            return enc.scales.amax() * self._max_code
        values = enc.data.view(torch.float32 if self.name == "fp32" else torch.float16)
        return torch.maximum(values.amax(), values.amin().neg()).float()

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode into float32 [numel]: into ``out`` (contiguous float32 [numel]) if given."""
        if (enc.codec, enc.block_size) != (self.name, self.block_size):
            raise ValueError(
                f"payload is {enc.codec}/block {enc.block_size}, "
                f"codec is {self.name}/block {self.block_size}"
            )
        if out is None:
            out = torch.empty(enc.numel, dtype=torch.float32, device=enc.data.device)
        elif out.dtype != torch.float32 or out.shape != (enc.numel,) or not out.is_contiguous():
            raise ValueError(
                f"out must be contiguous float32 [{enc.numel}], got {out.dtype} {list(out.shape)}"
            )
        self._decode(enc.to(out.device), out)  # a received payload may arrive on the host
        return out

    def wire_bytes(self, numel: int) -> int:
        """Exact ``Encoded.nbytes`` for ``numel`` elements, without encoding."""
        n_scales, n_data = layout(self.name, numel, self.block_size)
        return 4 * n_scales + n_data

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"

    _max_code = 1.0  # largest |unscaled value| a block codec's data can hold

    @abc.abstractmethod
    def _encode_into(self, x: torch.Tensor, out: Encoded,
                     finite: torch.Tensor | None = None) -> None: ...

    @abc.abstractmethod
    def _decode(self, enc: Encoded, out: torch.Tensor) -> None: ...


class _RawCodec(Codec):
    """fp32 / fp16: a plain cast, no scales."""

    block_size = 0
    _dtype: torch.dtype

    def _encode_into(self, x: torch.Tensor, out: Encoded,
                     finite: torch.Tensor | None = None) -> None:
        if x.numel() and finite is not None:  # deferred: the caller reads the flag once
            top, bottom = x.amax(), x.amin()  # NaN-propagating, no full-size temporary
            ok = torch.isfinite(top) & torch.isfinite(bottom)
            if self._dtype == torch.float16:
                ok &= torch.maximum(top, -bottom) <= _FP16_MAX
            finite.logical_and_(ok)
        elif x.numel():
            # amax/amin propagate NaN and need no full-size temporary, unlike isfinite().
            hi, lo = float(x.amax()), float(x.amin())
            if not (math.isfinite(hi) and math.isfinite(lo)):
                _raise_non_finite(x, self.name)
            if self._dtype == torch.float16 and max(hi, -lo) > _FP16_MAX:
                raise ValueError(
                    f"fp16 codec: max |x| = {max(hi, -lo):.6g} exceeds the fp16 range "
                    f"{_FP16_MAX}; use fp32 or a scaled codec (int8/int4/fp4)"
                )
        out.data.view(self._dtype).copy_(x)

    def _decode(self, enc: Encoded, out: torch.Tensor) -> None:
        out.copy_(enc.data.view(self._dtype))


class Fp32Codec(_RawCodec):
    name = "fp32"
    _dtype = torch.float32


class Fp16Codec(_RawCodec):
    name = "fp16"
    _dtype = torch.float16


class BlockCodec(Codec):
    """Blockwise absmax codecs: chunking, per-block absmax and the partial last block."""

    _levels: float  # scale = absmax / _levels
    _bits: int  # bits per element on the wire

    def __init__(self, block_size: int = 1024) -> None:
        layout(self.name, 0, block_size)  # validates block_size
        self.block_size = block_size
        self._block_bytes = block_size * self._bits // 8
        self._chunk_blocks = max(1, _CHUNK_ELEMS // block_size)

    def encode_into(self, x: torch.Tensor, out: Encoded, finite: torch.Tensor | None = None,
                    clobber: bool = False) -> None:
        """As :meth:`Codec.encode_into`; ``clobber``: ``x`` is scratch the encoder may
        overwrite (no scratch of its own is allocated)."""
        if (out.codec, out.block_size, out.numel) != (self.name, self.block_size, x.numel()):
            raise ValueError(f"cannot encode {x.numel()} elements with {self} into {out.codec}/"
                             f"{out.block_size}/{out.numel}")
        self._encode_into(_check_input(x), out, finite, clobber)

    def encode_rows(self, xb: torch.Tensor, scales: torch.Tensor, data: torch.Tensor,
                    finite: torch.Tensor, work: torch.Tensor | None = None) -> None:
        """Encode whole blocks ``xb`` [k, bs] into ``scales`` [k] and ``data`` [k * block
        bytes] (uint8), ANDing "every block finite" into ``finite``: the streamed path's rows
        (:mod:`gasloc_p2p.protocol.payloads`), the same math as :meth:`encode`. ``work``:
        scratch [k, bs] (None: ``xb`` is overwritten)."""
        self._encode_blocks(xb, xb, scales, data, work, finite)

    def decode_rows(self, data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """Decode whole blocks: ``data`` [k * block bytes] and ``scales`` [k] into ``out``
        [k, bs] (float32), the same roundings as :meth:`decode`."""
        self._unpack_scaled(data, scales[:, None], out)

    def _blocks_per_pass(self, device: torch.device) -> int:
        """Blocks per pass: cache-sized chunks on a CPU, everything at once on a device
        (kernel launches then do not grow with the input)."""
        return self._chunk_blocks if device.type == "cpu" else 1 << 62

    def _encode_into(self, x: torch.Tensor, out: Encoded, finite: torch.Tensor | None = None,
                     clobber: bool = False) -> None:
        n, bs, bb = x.numel(), self.block_size, self._block_bytes
        n_scales, n_data = layout(self.name, n, bs)
        scales, data = out.scales, out.data
        dev = x.device  # every buffer on the input's device: only to_bytes() goes to host
        full = n // bs  # blocks not needing padding
        per = self._blocks_per_pass(dev)
        work = None if clobber else torch.empty(min(max(full, 1), per), bs, device=dev)
        for b0 in range(0, full, per):
            b1 = min(b0 + per, full)
            xb = x[b0 * bs : b1 * bs].view(-1, bs)
            self._encode_blocks(x, xb, scales[b0:b1], data[b0 * bb : b1 * bb], work, finite)
        if full < n_scales:  # zero padding leaves the block's absmax unchanged
            tail = torch.zeros(1, bs, device=dev)  # float32: encoded in place below
            tail[0, : n - full * bs] = x[full * bs :]
            packed = torch.empty(bb, dtype=torch.uint8, device=dev)
            self._encode_blocks(x, tail, scales[full:], packed, None, finite)
            data[full * bb :] = packed[: n_data - full * bb]

    def _encode_blocks(
        self,
        x: torch.Tensor,
        xb: torch.Tensor,
        scales: torch.Tensor,
        data: torch.Tensor,
        work: torch.Tensor | None,
        finite: torch.Tensor | None = None,
    ) -> None:
        """Encode xb [k, bs] of x into scales [k] and data [k * block_bytes] (uint8), through
        ``work`` (None: in place in ``xb``); ``finite``: AND "every block finite" into it
        instead of raising now."""
        absmax = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_()).float()  # NaN-propagating
        if finite is not None:
            finite.logical_and_(torch.isfinite(absmax).all())
        elif not bool(torch.isfinite(absmax).all()):
            _raise_non_finite(x, self.name)
        ok = absmax >= MIN_ABSMAX
        # tensor / tensor: IEEE division on every device (a CUDA division by a Python scalar
        # multiplies by its reciprocal: scales 1 ulp off the CPU's)
        levels = torch.full_like(absmax, self._levels)
        scales.copy_(torch.where(ok, absmax / levels, 0.0))
        inv = torch.where(ok, levels / absmax, 0.0)
        # in [-levels, levels]
        y = xb.mul_(inv[:, None]) if work is None else torch.mul(xb, inv[:, None],
                                                                 out=work[: xb.shape[0]])
        self._pack(y, data)

    def _decode(self, enc: Encoded, out: torch.Tensor) -> None:
        n, bs, bb = enc.numel, self.block_size, self._block_bytes
        full = n // bs
        per = self._blocks_per_pass(out.device)
        for b0 in range(0, full, per):
            b1 = min(b0 + per, full)
            ob = out[b0 * bs : b1 * bs].view(-1, bs)
            self._unpack_scaled(enc.data[b0 * bb : b1 * bb], enc.scales[b0:b1, None], ob)
        if full < enc.scales.numel():
            packed = torch.zeros(bb, dtype=torch.uint8, device=out.device)
            packed[: enc.data.numel() - full * bb] = enc.data[full * bb :]
            tail = torch.empty(1, bs, device=out.device)
            self._unpack(packed, tail)
            out[full * bs :] = tail[0, : n - full * bs].mul_(enc.scales[full])

    @abc.abstractmethod
    def _pack(self, y: torch.Tensor, data: torch.Tensor) -> None:
        """Quantize y [k, bs] (float32 in [-levels, levels], may be clobbered) into data."""

    @abc.abstractmethod
    def _unpack(self, data: torch.Tensor, out: torch.Tensor) -> None:
        """Write the unscaled values of data into out [k, bs] (float32)."""

    def _unpack_scaled(self, data: torch.Tensor, scales: torch.Tensor,
                       out: torch.Tensor) -> None:
        """``out = unpack(data) * scales`` (scales [k, 1]): code times scale, one rounding."""
        self._unpack(data, out)
        out.mul_(scales)


class Int8Codec(BlockCodec):
    name = "int8"
    levels = _levels = 127.0
    _max_code = 128.0  # a peer may send -128
    _bits = 8

    def _pack(self, y: torch.Tensor, data: torch.Tensor) -> None:
        data.view(torch.int8).view_as(y).copy_(y.round_())  # round half to even

    def _unpack(self, data: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(data.view(torch.int8).view_as(out))

    def _unpack_scaled(self, data: torch.Tensor, scales: torch.Tensor,
                       out: torch.Tensor) -> None:
        # one pass: int8 promotes exactly to float32, then the one rounding of the product
        torch.mul(data.view(torch.int8).view_as(out), scales, out=out)


class _NibbleCodec(BlockCodec):
    """4-bit codecs: two nibbles per byte, decoded through a 256-entry table of pairs."""

    _bits = 4

    def __init__(self, block_size: int = 1024) -> None:
        super().__init__(block_size)
        nib = self._nibble_values()  # float32 [16]
        byte = torch.arange(256)
        self._pair_table = torch.stack([nib[byte & 15], nib[byte >> 4]], dim=1)  # [256, 2]

    @staticmethod
    @abc.abstractmethod
    def _nibble_values() -> torch.Tensor:
        """Unscaled value of each nibble code: float32 [16]."""

    @abc.abstractmethod
    def _codes(self, y: torch.Tensor) -> torch.Tensor:
        """Nibble codes (uint8 in [0, 15], [k, bs]) for y [k, bs] (y may be clobbered)."""

    def _pack(self, y: torch.Tensor, data: torch.Tensor) -> None:
        pairs = self._codes(y).view(-1, 2)
        torch.bitwise_left_shift(pairs[:, 1], 4, out=data).bitwise_or_(pairs[:, 0])

    def _unpack(self, data: torch.Tensor, out: torch.Tensor) -> None:
        table = _on(self._pair_table, out.device)
        torch.index_select(table, 0, data.to(torch.int32), out=out.view(-1, 2))


class Int4Codec(_NibbleCodec):
    name = "int4"
    _levels = 7.0
    _max_code = 8.0  # a peer may send -8

    @staticmethod
    def _nibble_values() -> torch.Tensor:
        c = torch.arange(16, dtype=torch.float32)
        return torch.where(c >= 8, c - 16, c)  # two's complement; -8 is never produced

    def _codes(self, y: torch.Tensor) -> torch.Tensor:
        q = torch.empty(y.shape, dtype=torch.int8, device=y.device).copy_(y.round_())  # round half to even
        return q.view(torch.uint8).bitwise_and_(15)


class Fp4Codec(_NibbleCodec):
    name = "fp4"
    _levels = 1.0

    def __init__(self, block_size: int = 1024) -> None:
        super().__init__(block_size)
        self._code_table = self._build_code_table()

    @staticmethod
    def _nibble_values() -> torch.Tensor:
        c = torch.arange(16)
        m = c & 7
        mag = torch.where(m > 0, torch.exp2(m.float() - 7), 0.0)
        return torch.where(c >= 8, -mag, mag) + 0.0  # + 0.0 turns -0.0 into +0.0

    @staticmethod
    def _build_code_table() -> torch.Tensor:
        """Nibble code for each index (float32 bits >> 22) & 0x3FF: uint8 [1024]."""
        i = torch.arange(1024)
        exp, top_mantissa = (i >> 1) & 0xFF, i & 1
        # Between 2^e and 2^(e+1) the midpoint is 1.5 * 2^e: the top mantissa bit rounds up.
        m = (exp - (_F32_BIAS - 7) + top_mantissa).clamp(1, 7)
        # Below 2^-7 (midpoint of 0 and 2^-6) rounds to 0; [2^-7, 2^-6) gets m = 1 by the clamp.
        code = torch.where(exp >= _F32_BIAS - 7, m | (i >> 9) << 3, 0)
        return code.to(torch.uint8)

    def _codes(self, y: torch.Tensor) -> torch.Tensor:
        idx = y.view(torch.int32).bitwise_right_shift_(_FP4_INDEX_SHIFT).bitwise_and_(0x3FF)
        table = _on(self._code_table, y.device)
        return torch.index_select(table, 0, idx.view(-1)).view(y.shape)


class Sign1Codec(BlockCodec):
    """1 bit per element: its sign, times the block's mean ``|x|`` (the scale that minimises
    the squared error of a sign code). Gossip sends it only as a residual against a reference
    both ends of a link hold (:mod:`gasloc_p2p.core.links`), never a parameter itself. Bits in
    little-endian order: element ``8i + k`` is bit ``k`` of byte ``i``; 1 is ``+scale``. The
    last, partial block's mean is over its own elements."""

    name = "sign1"
    _levels = 1.0
    _bits = 1

    def __init__(self, block_size: int = 4096) -> None:
        super().__init__(block_size)
        bits = torch.arange(256)[:, None].bitwise_right_shift(torch.arange(8)).bitwise_and(1)
        self._byte_table = bits.float().mul_(2.0).sub_(1.0)  # [256, 8] of -1 / +1

    def _encode_into(self, x: torch.Tensor, out: Encoded, finite: torch.Tensor | None = None,
                     clobber: bool = False) -> None:
        super()._encode_into(x, out, finite, clobber)
        n, bs = x.numel(), self.block_size
        if n % bs:  # the padded tail's mean counted its zeros: over its own elements instead
            a = x[n - n % bs :].float().abs()[None]
            mean = a.mean(dim=1)  # as a full block's where it does not overflow
            mean = torch.where(torch.isfinite(mean), mean, a.mul_(1.0 / (n % bs)).sum(dim=1))
            out.scales[-1:].copy_(torch.where(out.scales[-1:] > 0, mean, 0.0))
        if n % 8:  # the last byte's bits past the end are 0 (the padding's signs are not sent)
            out.data[-1:].bitwise_and_((1 << (n % 8)) - 1)

    def _encode_blocks(self, x: torch.Tensor, xb: torch.Tensor, scales: torch.Tensor,
                       data: torch.Tensor, work: torch.Tensor | None,
                       finite: torch.Tensor | None = None) -> None:
        a = xb.float().abs() if work is None else work[: xb.shape[0]].copy_(xb).abs_()
        # the mean as a sum of |x| / bs: no overflow for any finite input (equal to
        # ``mean`` bit for bit where bs is a power of 2); NaN- and Inf-propagating
        mean = a.mul_(1.0 / self.block_size).sum(dim=1)
        if finite is not None:
            finite.logical_and_(torch.isfinite(mean).all())
        elif not bool(torch.isfinite(mean).all()):
            _raise_non_finite(x, self.name)
        ok = mean >= MIN_ABSMAX
        scales.copy_(torch.where(ok, mean, 0.0))
        # a flushed block's bits are all 1: it decodes to +0.0, never -0.0
        self._pack_signs(xb.ge(0).logical_or_(ok.logical_not()[:, None]), data)

    def _pack(self, y: torch.Tensor, data: torch.Tensor) -> None:
        self._pack_signs(y.ge(0), data)

    @staticmethod
    def _pack_signs(signs: torch.Tensor, data: torch.Tensor) -> None:
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8,
                               device=signs.device)
        torch.sum(signs.view(-1, 8).to(torch.uint8).mul_(weights), dim=1, dtype=torch.uint8,
                  out=data)

    def _unpack(self, data: torch.Tensor, out: torch.Tensor) -> None:
        table = _on(self._byte_table, out.device)
        torch.index_select(table, 0, data.to(torch.int32), out=out.view(-1, 8))


class Half2Codec(BlockCodec):
    """Half of each block's elements at 2 bits: the simulator's ``randk2:B/2:B``
    (:mod:`gasloc_p2p.core.sparse`, bit for bit), the payload that beat int8 where bytes set
    the wall clock (docs/results/README.md, home links). Which half is drawn from the
    payload's ``seed`` (a link's state: :func:`gasloc_p2p.core.links.position_seed`, held by
    both ends, never sent) and the block's index: positions ``2 j + h`` with ``h`` one
    seeded bit per block; a last block of ``L`` elements sends ``min(B/2, L)`` of them
    (systematic sampling with a seeded phase). Values: levels ``{-3, -1, 1, 3}`` times the
    block's least-squares scale; the other half decodes to 0. Sent only as a residual
    against a link reference, so a 0 there stands for "as the reference"."""

    name = "half2"
    _levels = 3.0
    _max_code = 3.0
    _bits = 1  # per element of a whole block: half of them at 2 bits

    def __init__(self, block_size: int = 4096) -> None:
        super().__init__(block_size)
        self._spec = sparse.SparseSpec("randk", 2, block_size // 2, block_size)

    def _encode_into(self, x: torch.Tensor, out: Encoded, finite: torch.Tensor | None = None,
                     clobber: bool = False) -> None:
        ok = torch.ones((), dtype=torch.bool, device=x.device) if finite is None else finite
        msg = sparse.encode(self._spec, x, out.seed, out.first_block, ok)
        if finite is None and not bool(ok):
            _raise_non_finite(x, self.name)
        out.scales.copy_(msg.scales)
        out.data.copy_(msg.codes)

    def _decode(self, enc: Encoded, out: torch.Tensor) -> None:
        none = enc.data[:0]
        sparse.decode(sparse.SparsePayload(self._spec, enc.numel, enc.seed, enc.scales,
                                           enc.data, none, enc.first_block, enc.block_ids),
                      out)

    def _pack(self, y: torch.Tensor, data: torch.Tensor) -> None:
        raise NotImplementedError("half2 encodes through core/sparse.py")

    def _unpack(self, data: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError("half2 decodes through core/sparse.py")


@functools.lru_cache(maxsize=32)
def _table_on(table_id: int, table: torch.Tensor, device: torch.device) -> torch.Tensor:
    return table.to(device)


def _on(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A lookup table on ``device`` (copied there once, then cached)."""
    return table if table.device == device else _table_on(id(table), table, device)




def get_codec(name: str, block_size: int | None = None) -> Codec:
    """Codec by name; ``block_size`` (elements per scale; default the name's, 1024 for most)
    is ignored by fp32 and fp16."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODEC_NAMES)}")
    cls = _CODECS[name]
    size = CODECS[name].default_block if block_size is None else block_size
    return cls(size) if issubclass(cls, BlockCodec) else cls()


DEFAULT_BLOCK_SIZE = 1024
MAX_BLOCK_SIZE = 1 << 16  # a block's scratch is block_size floats per chunk; cap what it costs


@dataclass(frozen=True)
class CodecSpec:
    """Which codec and block size a payload uses: the value configs, headers and links share.

    ``block_size`` is elements per scale for the block codecs (int8/int4/fp4: even, in
    [2, 65536]) and 0 for fp32/fp16. All validation lives here; build one with :meth:`of`
    (fills in the block size a name implies) or :meth:`parse` (``"int8:1024"``, ``"fp32"``).
    """

    name: str
    block_size: int

    def __post_init__(self) -> None:
        layout(self.name, 0, self.block_size)  # unknown name, odd or non-zero raw block size
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"{self.name}: block_size {self.block_size} exceeds "
                             f"{MAX_BLOCK_SIZE}")

    @classmethod
    def of(cls, name: str, block_size: int | None = None) -> CodecSpec:
        """``name`` with ``block_size`` (default: the name's own, 1024 for most) if it has
        blocks, else with 0 (fp32/fp16)."""
        if name not in BLOCK_CODECS:
            return cls(name, 0)
        return cls(name, CODECS[name].default_block if block_size is None else block_size)

    @classmethod
    def parse(cls, text: str) -> CodecSpec:
        """``"int8:1024"`` or ``"int8"`` (default block size) or ``"fp32"``; ValueError else."""
        name, sep, block = text.partition(":")
        if not sep:
            return cls.of(name)
        try:
            size = int(block)
        except ValueError:
            raise ValueError(f"bad codec spec {text!r}: block size must be an int") from None
        return cls(name, size)

    @property
    def has_blocks(self) -> bool:
        return self.name in BLOCK_CODECS

    def codec(self) -> Codec:
        """The (shared, stateless) codec object for this spec."""
        return _codec_for(self)

    def __str__(self) -> str:
        return f"{self.name}:{self.block_size}" if self.has_blocks else self.name


def parse_optional(text: str) -> CodecSpec | None:
    """Like :meth:`CodecSpec.parse`, but ``"none"`` (exact float exchange, simulator and
    equivalence tests only: no codec on any wire) gives None."""
    return None if text == "none" else CodecSpec.parse(text)


@functools.lru_cache(maxsize=64)
def _codec_for(spec: CodecSpec) -> Codec:
    return get_codec(spec.name, spec.block_size or DEFAULT_BLOCK_SIZE)
