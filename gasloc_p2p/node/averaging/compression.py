"""The project's codecs (:mod:`gasloc_p2p.core.codecs`) as a hivemind compression.

hivemind's all-reduce compresses each part a peer sends with the averager's ``compression``
object, and the receiver picks the decoder by the part's ``CompressionType`` enum, looking it up
in hivemind's process-wide table of built-in codecs (the reducer also re-encodes the averaged
delta it sends back with the same enum). The enum has no free value, so :func:`install` puts a
:class:`CodecCompression` in the slot of ``QUANTILE_8BIT`` (which the project never uses) inside
the averager's own process (:meth:`HivemindAverager` forks it); the group key includes the codec
name, so every member of a group decodes that slot with the same codec.

A sparse codec's all-gather uses the same slot for raw bytes (``CodecCompression(None)``:
the node encodes its message itself; :mod:`.uniform` relays it).

Each encoded part is ``Encoded.to_bytes()`` (scales then data, see :mod:`gasloc_p2p.core.wire`);
the bytes put on the wire and taken off it are added to two counters shared with the node's
process. The all-reduce (:mod:`.uniform`) encodes each averaged part once and sends the same
bytes to every groupmate: it uses the uncounted :meth:`~CodecCompression.encode_part` and counts
each send itself.
"""

from __future__ import annotations

import functools
import multiprocessing
from typing import Any

import torch

from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.compress import parse_codec
from gasloc_p2p.core.sparse import SparseSpec
from gasloc_p2p.core.wire import Encoded, raw_bytes

SLOT = "QUANTILE_8BIT"  # the CompressionType value CodecCompression takes over


@functools.cache
def compression_class() -> Any:
    """:class:`CodecCompression`: built lazily (importing hivemind takes a second)."""
    from hivemind.compression import CompressionBase, CompressionInfo
    from hivemind.proto import runtime_pb2

    class CodecCompression(CompressionBase):
        """Encodes float32 parts with a project codec; counts the encoded bytes sent and
        received."""

        compression_type = runtime_pb2.CompressionType.Value(SLOT)

        def __init__(self, spec: CodecSpec | None) -> None:
            """``spec`` None: the all-gather's raw bytes (:attr:`gathers`)."""
            self.spec = spec
            self.codec = spec.codec() if spec is not None else None
            self.gathers = spec is None
            self.sent = multiprocessing.Value("q", 0)  # shared with the forked averager
            self.received = multiprocessing.Value("q", 0)

        def compress(self, tensor: torch.Tensor, info: CompressionInfo,
                     allow_inplace: bool = False) -> Any:
            msg = self.encode_part(tensor)
            self.count_sent(len(msg.buffer))
            return msg

        def extract(self, serialized_tensor: Any) -> torch.Tensor:
            _add(self.received, len(serialized_tensor.buffer))
            return self.decode_part(serialized_tensor)

        def encode_part(self, tensor: torch.Tensor) -> Any:
            """``tensor`` (any shape) as a hivemind ``Tensor`` message; not counted."""
            flat = tensor.detach().reshape(-1).float()
            if self.codec is None:  # the all-gather's message bytes, as they are
                data = raw_bytes(flat.view(torch.uint8))
            else:
                data = self.codec.encode(flat).to_bytes()
            return runtime_pb2.Tensor(compression=self.compression_type, buffer=data,
                                      size=tensor.shape, dtype="float32",
                                      requires_grad=tensor.requires_grad)

        def decode_part(self, serialized_tensor: Any) -> torch.Tensor:
            """The float32 tensor of an :meth:`encode_part` message; not counted. Raises
            ValueError when the buffer's length does not match the declared size. All-gather
            (:attr:`gathers`): the buffer's bytes as a flat float32 tensor of whatever length
            they have (a part, or a reducer's relay of every member's part): the runner
            checks its size (:mod:`.uniform`)."""
            if self.codec is None:
                buf = serialized_tensor.buffer
                if len(buf) % 4:
                    raise ValueError(f"a gathered part of {len(buf)} bytes (not float32s)")
                return (torch.frombuffer(bytearray(buf), dtype=torch.float32) if buf
                        else torch.empty(0))
            assert self.spec is not None
            shape = torch.Size(serialized_tensor.size)
            enc = Encoded.from_bytes(self.spec.name, shape.numel(), self.spec.block_size,
                                     serialized_tensor.buffer)
            return self.codec.decode(enc).reshape(shape)

        def count_sent(self, nbytes: int) -> None:
            _add(self.sent, nbytes)

        def estimate_compression_ratio(self, info: CompressionInfo) -> float:
            if self.codec is None:
                return 1.0
            numel = max(info.descriptor.numel(), 1)
            return self.codec.wire_bytes(numel) / (4 * numel)

        def bytes_sent(self) -> int:
            return int(self.sent.value)

        def bytes_received(self) -> int:
            return int(self.received.value)

        def __repr__(self) -> str:
            return f"CodecCompression({self.spec if self.spec is not None else 'gather'})"

    return CodecCompression


def _add(counter: Any, nbytes: int) -> None:
    with counter.get_lock():
        counter.value += nbytes


def make_compression(codec: str) -> Any:
    """A :class:`CodecCompression` for ``codec`` (fp32 | fp16 | int8 | int4 | fp4, default
    block size), or for an all-gather's raw message bytes (a sparse codec: the node encodes
    its message itself, see :mod:`gasloc_p2p.node.modes.diloco_rounds`)."""
    if isinstance(parse_codec(codec), SparseSpec):
        return compression_class()(None)
    return compression_class()(CodecSpec.of(codec))


def install(compression: Any) -> None:
    """Make hivemind decode (and re-encode) the :data:`SLOT` parts with ``compression``, in this
    process. Call it in the averager's process only."""
    from hivemind.compression import serialization

    serialization._BASE_COMPRESSION_TYPES[SLOT] = compression
