"""An all-reduce whose result is the same tensor, bit for bit, on every member of the group.

hivemind 1.1.12's butterfly all-reduce (``averaging/allreduce.py``) splits the vector into one
share per member; each member (the share's *reducer*) sums what the others send for its share
and returns to each sender ``averaged - sender's part``, encoded with the payload codec, and the
sender adds that delta to its own part. With a lossy codec (fp4, int4, int8) every member then
holds ``own + Q(mean - own)``, which differs from member to member, and the reducer keeps the
exact ``mean`` of its own share. DiLoCo and Streaming DiLoCo need every replica to take its
outer step with the SAME averaged outer gradient, otherwise the replicas' global copies drift
apart (observed: about 2% of the largest parameter after a minute of fp4 syncs).

:class:`UniformAllReduceRunner` changes what a reducer returns and what a member keeps:

- the reducer encodes each averaged part ONCE (:meth:`encoded_part`, shared by every sender's
  stream) and sends those same bytes to every sender: an all-gather of the quantized reduced
  parts;
- every member, the reducer included, keeps the decoded value of those bytes as its result
  (``return_deltas`` is off: the averager copies the result instead of adding a delta, see
  :func:`run_uniform_allreduce`);
- a member that missed part of the result (a reducer failed mid-way: hivemind would quietly
  keep its own values for that share) fails the round instead, so it applies its own outer
  gradient and is marked off history, the modes' usual failure path.

The inputs are unchanged: each member sends its part for a share encoded with the codec (the
reducer's own part enters its sum unencoded); the mean is thus computed once per share, in one
place, and the bytes it is sent as are what everyone keeps. Deterministic decoding
(``tests/test_codecs.py``) makes the decoded values equal everywhere.

All-gather (a sparse ``--diloco-codec``, SparseLoCo's sync): the "tensor" is each member's
message bytes, viewed as float32s and sent raw; a reducer relays every sender's bytes of each
part of its share, in sender order, and every member copies the relays into one row per
member: each member's whole message, the same bytes in the same order everywhere. The mode
decodes and averages them (:mod:`gasloc_p2p.node.modes.diloco_rounds`). A group larger than
``max_members`` (from this node's own target, :func:`.dht.gather_cap`) fails before the rows
are allocated (a leader picks the group).

Wire bytes: every encoded part a member sends (inputs and averaged parts) is counted once per
send in :class:`~gasloc_p2p.node.averaging.compression.CodecCompression`'s counters; received parts
are counted on decode. Members running hivemind's stock runner must never meet members running
this one: :func:`~gasloc_p2p.node.averaging.averaging_prefix` carries
:data:`GROUP_TAG` in the group key.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

GROUP_TAG = "u1"  # in the group key: the uniform all-reduce, version 1
GATHER_RELAY_BYTES = 1 << 21  # all-gather: a reducer's relay of one part, all members' bytes


@functools.cache
def runner_class() -> Any:
    """:class:`UniformAllReduceRunner`, built lazily (importing hivemind takes a second)."""
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.averaging.partition import AllreduceException, BannedException
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import amap_in_executor

    class UniformAllReduceRunner(AllReduceRunner):
        """hivemind's runner, but every member keeps the reducer's one encoding of the mean."""

        def __init__(self, *, compression: Any, **kwargs: Any) -> None:
            self.gathers = bool(getattr(compression, "gathers", False))
            if self.gathers:  # a relay carries every member's part: keep it small
                members = max(len(kwargs["ordered_peer_ids"]), 1)
                kwargs["part_size_bytes"] = max(1024, GATHER_RELAY_BYTES // members) // 4 * 4
            super().__init__(compression=compression, **kwargs)
            self.codec = compression  # a CodecCompression (same codec group-wide: group key)
            self.tensor_part_container.return_deltas = False  # results, not deltas
            self._encoded: dict[int, asyncio.Future[Any]] = {}  # part index -> message
            if self.gathers:
                self._init_gather()

        # ------------------------------------------------------------ all-gather
        def _init_gather(self) -> None:
            """All-gather (a sparse ``--diloco-codec``): the "tensor" is this member's message
            bytes (as float32s); a reducer relays every sender's bytes of each part of its
            share, in sender order, and every member copies them into :attr:`rows`: each
            member's whole message. Nothing is summed that anyone keeps."""
            container = self.tensor_part_container
            self.senders = len(self.sender_peer_ids)
            self.total = container.total_size
            self.rows = torch.zeros(self.senders, self.total)  # every member's message
            self.filled = 0  # values of rows received, per member row
            self._inputs: dict[tuple[int, int], torch.Tensor] = {}  # (part, sender) -> part
            self._where: dict[tuple[int, int], tuple[int, int]] = {}  # (peer, part) -> span
            start = 0
            for peer_index, parts in enumerate(container._input_parts_by_peer):
                for part_index, (part, _) in enumerate(parts):  # in vector order
                    self._where[(peer_index, part_index)] = (start, part.numel())
                    start += part.numel()
            register = container.register_processed_part

            def take(peer_index: int, part_index: int, part: torch.Tensor) -> None:
                """A reducer's relay: every sender's bytes of one part, into the rows."""
                begin, numel = self._where[(peer_index, part_index)]
                own = container._input_parts_by_peer[peer_index][part_index][0]
                if part is own:  # a failed reducer: hivemind keeps the local part (counted)
                    register(peer_index, part_index, part)
                    return
                if part.numel() != numel * self.senders:
                    raise AllreduceException(f"a relay of {part.numel()} values for a part of "
                                             f"{numel} and {self.senders} senders")
                self.rows[:, begin:begin + numel] = part.view(self.senders, numel)
                self.filled += numel
                register(peer_index, part_index, own)

            container.register_processed_part = take

        def _relay(self, part_index: int) -> Any:
            """Every sender's bytes of this reducer's part ``part_index``, in sender order (each
            sender's part arrived before the reducer finished the part)."""
            try:
                parts = [self._inputs.pop((part_index, s)) for s in range(self.senders)]
            except KeyError:
                raise AllreduceException(f"a sender's part {part_index} is missing") from None
            relay = torch.cat(parts)
            return self.codec.encode_part(relay)

        def messages(self) -> list[tuple[str, bytes]]:
            """(peer id, message bytes) of every sender, in sender order (the group's, the
            same on every member), once the runner finished."""
            if self.filled != self.total:
                raise AllreduceException(f"{self.total - self.filled} of {self.total} gathered "
                                         "values did not arrive")
            return [(peer.to_base58() if hasattr(peer, "to_base58") else str(peer),
                     bytes(row.view(torch.uint8).numpy()))
                    for peer, row in zip(self.sender_peer_ids, self.rows, strict=True)]

        async def encoded_part(self, part_index: int, averaged: torch.Tensor) -> Any:
            """The averaged part ``part_index`` of this reducer's share, encoded once.

            Memory: at most this reducer's share of the vector, encoded, until the runner ends.
            """
            future = self._encoded.get(part_index)
            if future is None:
                loop = asyncio.get_running_loop()
                future = (loop.run_in_executor(None, self._relay, part_index) if self.gathers
                          else loop.run_in_executor(None, self.codec.encode_part, averaged))
                self._encoded[part_index] = future
            return await asyncio.shield(future)  # one sender's cancellation spares the rest

        async def _communicate_with_peer(self, peer_id: Any) -> None:
            if peer_id != self.peer_id:  # the stock path: results arrive already encoded
                await super()._communicate_with_peer(peer_id)
                return
            peer_index = self.ordered_peer_ids.index(peer_id)
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, part in enumerate(self.parts_for_local_averaging):
                if self.gathers:
                    self._inputs[(part_index, sender_index)] = part
                averaged = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, part, weight=self.weight)
                msg = await self.encoded_part(part_index, averaged)
                self.tensor_part_container.register_processed_part(
                    peer_index, part_index, self.codec.decode_part(msg))

        async def _accumulate_parts_streaming(self, stream: AsyncIterator[Any],
                                              sender_index: int) -> AsyncIterator[Any]:
            """Sum a sender's parts of this reducer's share; answer each with the shared
            encoding of the mean."""
            shapes = self.tensor_part_reducer.part_shapes
            part_index = 0
            try:
                async for index, tensor_part, weight in amap_in_executor(
                        lambda item: self._decode_input(item, shapes, sender_index),
                        _numbered(stream), max_prefetch=self.tensor_part_container.prefetch):
                    if index != part_index:  # cannot happen: amap keeps the order
                        raise AllreduceException("parts out of order")
                    try:
                        averaged = await self.tensor_part_reducer.accumulate_part(
                            sender_index, part_index, tensor_part, weight=weight)
                        part_index += 1
                    except BannedException:
                        break  # banned in the background: its results are not needed
                    msg = await self.encoded_part(part_index - 1, averaged)
                    self.codec.count_sent(len(msg.buffer))
                    yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART,
                                                      tensor_part=msg)
            finally:
                if part_index != self.tensor_part_reducer.num_parts:
                    await self._ban_sender(self.sender_peer_ids[sender_index])

        def _decode_input(self, item: tuple[int, Any], shapes: Sequence[torch.Size],
                          sender_index: int = -1) -> tuple[int, torch.Tensor, float]:
            """A sender's part: our codec only, the size this share's part must have (an
            all-gather keeps its bytes for the relay)."""
            index, msg = item
            part = msg.tensor_part
            if index >= len(shapes) or tuple(part.size) != tuple(shapes[index]):
                raise AllreduceException(f"part {index} has size {list(part.size)}")
            if part.compression != self.codec.compression_type:
                raise AllreduceException(f"part {index} uses compression {part.compression}")
            weight = float(msg.weight)
            if not 0.0 <= weight <= 1.0:  # the project's members all weigh 1
                raise AllreduceException(f"part {index} has weight {weight}")
            if self.gathers and len(part.buffer) != 4 * shapes[index].numel():
                raise AllreduceException(f"part {index} has {len(part.buffer)} bytes")
            tensor = self.codec.extract(part)
            if self.gathers:
                self._inputs[(index, sender_index)] = tensor
            return index, tensor, weight

    return UniformAllReduceRunner


async def _numbered(stream: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    index = 0
    async for item in stream:
        yield index, item
        index += 1


async def run_uniform_allreduce(averager: Any, tensors: Sequence[torch.Tensor], group_info: Any,
                                group_id: bytes | None = None, max_members: int | None = None,
                                **kwargs: Any) -> list[tuple[str, bytes]] | None:
    """``DecentralizedAverager._run_allreduce_inplace_`` with :class:`UniformAllReduceRunner`:
    ``tensors`` are overwritten with the group's result, and only when every share of it
    arrived (otherwise AllreduceException: the round fails and nothing changes). An
    all-gather leaves ``tensors`` as they are and returns every sender's (peer id, message
    bytes), in sender order; it holds every member's message, so a group larger than
    ``max_members`` (from this node's own target: a leader picks the group) fails before
    anything is allocated."""
    from hivemind.averaging.allreduce import AveragingMode
    from hivemind.averaging.partition import AllreduceException

    group_id = group_info.group_id if group_id is None else group_id
    members = len(group_info.peer_ids)
    if getattr(kwargs.get("compression"), "gathers", False) and max_members is not None \
            and members > max_members:
        raise AllreduceException(f"a group of {members} for an all-gather; this node gathers "
                                 f"at most {max_members} messages")
    runner = runner_class()(p2p=averager._p2p, servicer_type=type(averager),
                            prefix=averager.prefix, tensors=tensors, group_id=group_id,
                            ordered_peer_ids=group_info.peer_ids, **kwargs)
    averager._running_groups[group_id].set_result(runner)
    if runner.modes[group_info.peer_ids.index(averager.peer_id)] == AveragingMode.AUX:
        async for _ in runner:
            raise ValueError("aux peers should not receive averaged tensors")
        return None
    results = [result async for result in runner]
    missing = runner.tensor_part_container.failed_size
    if missing or len(results) != len(tensors):
        raise AllreduceException(f"{missing} of {runner.tensor_part_container.total_size} "
                                 "averaged values did not arrive")
    if runner.gathers:
        return runner.messages()
    for tensor, result in zip(tensors, results, strict=True):
        tensor.copy_(result)
    return None
