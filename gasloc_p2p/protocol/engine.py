"""The tensor side of a gossip exchange: snapshot, encode, check, commit (no I/O, no asyncio).

Every method here is synchronous and may take milliseconds to seconds on a large model, so the
async layer (:mod:`gasloc_p2p.node.transport.exchange`) calls them through ``asyncio.to_thread``.
Shared tensors are touched only under the node's :class:`TrainingLock`, which also serialises
the trainer's optimizer steps and round ends.

Built for the device the model trains on. On a GPU the tensor work runs on the engine's own
CUDA stream, ordered against training by events (it waits for the training work queued before
it; training waits for its writes): the lock is held only while kernels are queued. It walks
the fragment in chunks of :func:`chunk_elems` elements (2^24 on a GPU: 74 chunks for a 1B model;
2^18 on a CPU, whose caches prefer small ones), keeps every reduction (finiteness, magnitudes,
the guard's distances and dot products, the correction's norm) on the device and reads them
once per phase, and copies the node's payload once into pinned host memory (one asynchronous
copy per chunk, one event). Kernel launches and host synchronisations per exchange do not grow
with the model size below a chunk (``tests/test_engine_counts.py``).

Payloads of a codec with a room (:mod:`gasloc_p2p.protocol.payloads`: int8, int4, fp4) are
streamed on a GPU (the same bits): nothing payload-sized stays on the device, the check and the
commit each stream both payloads from pinned host memory through chunk-sized staging (about 20
bytes per element of one chunk with the eager temporaries, 0.3 GiB), where the residual codecs
(sign1, half2) keep both payloads on the device from the check to the commit (1/4 byte per
parameter).

A message is the sender's public iterate itself, quantized: ``m_i = Q(p_i)``. Both sides fold
the two decoded messages into the same correction ``c_i = w (D(m_j) - D(m_i)) = -c_j`` (one
IEEE subtraction, negated by swapping its operands, then the same multiplication), so the pair's
sum is kept exactly and no per-peer state exists (docs/algorithm.md, section 4; the per-peer
and error-feedback reference schemes measured no better: docs/results/references.md).

Nothing shared changes before :meth:`ExchangeEngine.commit`: ``prepare`` reads a snapshot and
encodes it, ``check`` parses and validates the peer's payload; only ``commit`` folds both
messages and adds the correction to the anchor and live parameters.
"""

from __future__ import annotations

import contextlib
import hmac
import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch

from gasloc_p2p.core.async_state import AsyncGaslocState, exchange_weight
from gasloc_p2p.core.codecs import CodecSpec, Encoded, NonFiniteError
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.links import Decode, Link, LinkCache, next_state, position_seed, seed_state
from gasloc_p2p.core.wire import (
    RESIDUAL_CODECS,
    SEEDED_CODECS,
    RunIndex,
    payload_buffer,
    payload_digest,
    run_index,
)
from gasloc_p2p.protocol import payloads
from gasloc_p2p.protocol.blame import Ledger, LossGate, PushMeter
from gasloc_p2p.protocol.guard import Ticket, UpdateGuard

ON_CPU_CHUNK = 1 << 18  # 1 MiB of float32 stays in a core's L2 (benchmarks/bench_scale.py)
ON_DEVICE_CHUNK = 1 << 24  # elements per chunk on an accelerator: launches and syncs stay few

# No parameter or delta of a trained network is anywhere near this: a payload that decodes to
# larger values (a finite fp32 offset of 1e30, an int8 block scale of 3e38) is rejected.
MAX_ABS_VALUE = 1e6


@dataclass(eq=False)
class Prepared:
    """One side's half of an exchange between snapshot and commit."""

    peer_id: str
    fragment: Fragment
    rounds0: int  # round ends at the snapshot
    encoded: Encoded  # views of payload (host)
    payload: bytearray | memoryview
    digest: bytes  # SHA-256 of the payload (in the signed Header)
    block: str = ""  # the peer's address block (protocol.guard.address_block)
    clip: float = 1.0  # the guard's factor on the weight, set by ``check`` (1: as is)
    # the most the commit's weight may be before the clip: the weight at the round ends this
    # side had seen at the check (the peer's can only add staleness); set by ``check``
    weight_cap: float = math.inf
    ticket: Ticket | None = None  # the movement the guard reserved for this exchange
    # both payloads on the device, from the check to the commit (each uploaded once)
    on_device: tuple[Encoded, Encoded] | None = None
    # D(theirs) - D(mine) on the push meter's sample (protocol/blame.py), from the check
    pushed: torch.Tensor | None = None
    weight: float = 0.0  # the weight the commit applied (set by ``commit``)
    taken_back: str = ""  # why the loss gate took this side's correction back ("full", "bad")
    # residual payloads: the link whose reference the payload was encoded against
    # (core/links.py); a plain exchange that seeds one sets ``seed`` before the commit
    link: Link | None = None
    seed: bool = False
    peer_digest: bytes = b""  # the peer's payload digest (set by ``check``): the link's chain


class UrgentLock(Protocol):
    """What the engine needs from the node's training lock (the daemon's ``TrainingLock``)."""

    def urgent(self, writes: bool = True) -> AbstractContextManager[object]: ...


class NoLock:
    """For single-threaded drivers (the simulator, tests): nothing to exclude."""

    def urgent(self, writes: bool = True) -> AbstractContextManager[object]:
        return nullcontext()


def chunk_elems(spec: CodecSpec, device: torch.device, chunk: int | None = None) -> int:
    """Elements per chunk: ``chunk`` or the device's default, a whole number of the codec's
    blocks."""
    want = chunk or (ON_CPU_CHUNK if device.type == "cpu" else ON_DEVICE_CHUNK)
    block = spec.block_size or 1
    return max(1, want // block) * block


def read(values: list[torch.Tensor]) -> list[float]:
    """Scalar device tensors as floats: one device-to-host copy, the phase's one sync."""
    if not values:
        return []
    return torch.stack([v.float() for v in values]).to("cpu", copy=True).tolist()


class ExchangeEngine:
    """The fragments and codecs of one node, around its :class:`AsyncGaslocState`.

    ``chunk``: elements per chunk (default: :func:`chunk_elems`'s for the device). No
    fragment-size temporary is allocated on the device besides the two payloads from the check
    to the commit (a few bytes per element at 8-bit and below).
    """

    def __init__(self, state: AsyncGaslocState, theta0: torch.Tensor,
                 fragments: Sequence[Fragment], lock: UrgentLock,
                 chunk: int | None = None, stream_payloads: bool | None = None,
                 kernels: bool | None = None) -> None:
        """theta0: ``[numel]`` initial parameters, the same on every node of the run (kept by
        reference, never modified; a bfloat16 host copy will do: it only anchors the guard's
        screens). ``stream_payloads``: exchanges of a codec with a room in
        :mod:`gasloc_p2p.protocol.payloads` stream both payloads through chunk-sized device
        staging instead of keeping them on the device from the check to the commit (None: on
        a GPU; True: also on a CPU, where the tests check that path against the other byte
        for byte). ``kernels``: streamed exchanges run their room's Triton kernels where it
        has them (None: where they can run; else the room's eager passes, the same bits)."""
        self.state = state
        self.theta0 = theta0
        self.fragments = list(fragments)
        self.lock = lock
        self.chunk = chunk
        self.device = state.theta.device
        self.guard: UpdateGuard | None = None  # bounded updates (see protocol/guard.py)
        # what each commit moved theta by on a private sample (protocol/blame.py), with the
        # guard: who pushed the node uphill, read after a rollback
        self.ledger: Ledger | None = None
        self._sample_at: torch.Tensor | None = None
        # what gossip moved the node by lately, on sampled blocks: bounds a push in time
        self.meter: PushMeter | None = None
        # the meter's sampled blocks as gather indices, per (fragment, codec, block, device)
        self._meter_index: dict[tuple[int, str, int, str], RunIndex] = {}
        self.meter_limit = 8.0  # the meter's bound, in the guard's drift scale
        # the loss of a private batch before and after each commit (protocol/blame.py)
        self.gate: LossGate | None = None
        self.stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda" else None)
        self._base2: dict[int, float] = {}  # fragment -> sum of theta_0^2 (theta_0 is fixed)
        self.stream_payloads = stream_payloads
        self.kernels = payloads.kernels_usable(self.device) if kernels is None else kernels
        # residual payloads' references, one per linked peer and fragment (host memory)
        self.links: LinkCache | None = None
        self._meter_elems: dict[tuple[int, int], torch.Tensor] = {}  # sampled elements

    def streams(self, spec: CodecSpec) -> bool:
        """Whether exchanges of ``spec`` stream their payloads (codecs with a room)."""
        if payloads.room(spec.name) is None or self.stream_payloads is False:
            return False
        return bool(self.stream_payloads) or self.device.type == "cuda"

    def _room(self, spec: CodecSpec) -> tuple[payloads.Room, payloads.Kernels | None]:
        """A streamed codec's room and the kernels the engine runs for it (None: eager)."""
        room = payloads.room(spec.name)
        assert room is not None
        return room, room.kernels if self.kernels else None

    def rounds_since(self, prep: Prepared) -> int:
        return self.state.rounds - prep.rounds0

    def payload_buffer(self, nbytes: int) -> bytearray | memoryview:
        """Where a peer's payload is received: pinned host memory beside a GPU (its upload
        is then asynchronous), a bytearray otherwise."""
        return payload_buffer(nbytes, pin=self.stream is not None)

    # ------------------------------------------------------------------ streams
    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Run on the engine's stream after the training work queued so far; training's
        later work waits for what is queued here (events, no host wait)."""
        if self.stream is None:
            yield
            return
        train = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(train)
        with torch.cuda.stream(self.stream):
            yield
        train.wait_stream(self.stream)

    def _done(self) -> None:
        """Wait (host) for the engine's queued work: once per phase."""
        if self.stream is not None:
            self.stream.synchronize()

    # ------------------------------------------------------------------ phases
    def prepare(self, peer_id: str, fragment_index: int, spec: CodecSpec,
                block: str = "", link: Link | None = None) -> Prepared:
        """Snapshot the public iterate of one fragment and encode it into a fresh payload
        (``block``: the peer's address block, for the guard; ``link``: a residual codec's
        reference, whose chunks are subtracted before encoding).

        Under the training lock, per chunk: ``p`` into scratch (the anchor's chunk uploaded
        from host memory if the state keeps one there), the codec writing into the payload's
        memory (on a device: into device scratch, then one asynchronous copy into the pinned
        payload). Then, without the lock, one wait and one read of the finiteness flag.
        """
        fragment = self.fragments[fragment_index]
        if (spec.name in RESIDUAL_CODECS) != (link is not None):
            raise ValueError(f"{spec.name} payloads are residuals against a link: "
                             f"{'no link given' if link is None else 'a link for a plain one'}")
        if link is not None and link.ref.numel() != fragment.numel:
            raise ValueError(f"link of {link.ref.numel()} elements for fragment "
                             f"{fragment.index} of {fragment.numel}")
        codec, step = spec.codec(), chunk_elems(spec, self.device, self.chunk)
        pin = self.stream is not None
        payload, encoded = Encoded.empty(spec.name, fragment.numel, spec.block_size, pin=pin)
        if link is not None and spec.name in SEEDED_CODECS:  # positions from the link's state
            encoded = encoded.seeded(position_seed(link.state))
        if self.streams(spec):
            return self._prepare_streamed(peer_id, fragment, spec, payload, encoded, block)
        with self.lock.urgent(writes=False), self._on_stream():
            rounds0 = self.state.rounds
            finite = torch.ones((), dtype=torch.bool, device=self.device)
            n0 = min(step, fragment.numel)
            work = torch.empty(n0, device=self.device)
            staged = (Encoded.empty_on(spec.name, n0, spec.block_size, self.device)
                      if self.device.type != "cpu" else None)
            for pos, n, pieces in fragment.chunks(step):
                x = work[:n]
                for start, length, o in pieces:
                    self.state.public_chunk(start, start + length, out=x[o : o + length])
                if link is not None:  # the residual against the pair's reference
                    x.sub_(link.ref[pos : pos + n].to(self.device, non_blocking=True))
                if staged is None:  # straight into the payload's memory
                    codec.encode_into(x, encoded.view(pos, n), finite=finite)
                    continue
                host = encoded.view(pos, n)
                out = staged.view(0, n).placed_as(host)  # a seeded codec's positions
                codec.encode_into(x, out, finite=finite)
                host.data.copy_(out.data, non_blocking=True)
                host.scales.copy_(out.scales, non_blocking=True)
        self._done()
        if not read([finite])[0]:
            raise NonFiniteError("this node's public iterate holds NaN or Inf (or values out of "
                                 f"{spec.name}'s range): nothing is sent")
        return Prepared(peer_id, fragment, rounds0, encoded, payload, payload_digest(payload), block,
                        link=link)

    def _prepare_streamed(self, peer_id: str, fragment: Fragment, spec: CodecSpec,
                          payload: bytearray | memoryview, encoded: Encoded,
                          block: str) -> Prepared:
        """:meth:`prepare` on whole blocks (the codec's room: its eager passes, or one kernel
        per chunk): each chunk encoded from theta's memory itself where it is one piece and
        no anchor is kept (else from one copy; the eager passes zero-pad it to whole blocks),
        into device staging, then one asynchronous copy to the payload."""
        bs, step = spec.block_size, chunk_elems(spec, self.device, self.chunk)
        room, kernels = self._room(spec)
        rows0 = -(-min(step, fragment.numel) // bs)
        with self.lock.urgent(writes=False), self._on_stream():
            rounds0 = self.state.rounds
            finite = torch.ones((), dtype=torch.bool, device=self.device)
            scales = torch.empty(rows0, device=self.device)
            data = torch.empty(rows0, room.block_bytes(bs), dtype=torch.uint8,
                               device=self.device)
            work: torch.Tensor | None = None
            for pos, n, pieces in fragment.chunks(step):
                rows = -(-n // bs)
                start = pieces[0][0]
                itself = (len(pieces) == 1 and self.state.anchor is None
                          and self.state.theta.dtype == torch.float32)
                if itself and (kernels is not None or n == rows * bs):
                    x = self.state.theta[start : start + n]
                else:
                    if work is None:
                        work = torch.empty(rows0 * bs, device=self.device)
                    x = work[: n if kernels is not None else rows * bs]
                    if n < x.numel():
                        x[n:].zero_()
                    for s, length, o in pieces:
                        self.state.public_chunk(s, s + length, out=x[o : o + length])
                if kernels is not None:
                    kernels.encode(x, bs, scales, data.view(-1), finite)
                else:
                    room.encode_rows(x.view(rows, bs), scales[:rows], data[:rows], finite)
                host = encoded.view(pos, n)
                host.scales.copy_(scales[:rows], non_blocking=True)
                host.data.copy_(data.view(-1)[: host.data.numel()], non_blocking=True)
        self._done()
        if not read([finite])[0]:
            raise NonFiniteError("this node's public iterate holds NaN or Inf (or values out of "
                                 f"{spec.name}'s range): nothing is sent")
        return Prepared(peer_id, fragment, rounds0, encoded, payload, payload_digest(payload),
                        block)

    def _upload(self, enc: Encoded, pos: int, n: int, data: torch.Tensor,
                scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Elements ``[pos, pos + n)`` of a payload in host memory into device staging
        (asynchronous from pinned memory; a partial last block zero-padded): [rows, block
        bytes] data and [rows] scales."""
        part = enc.view(pos, n)
        rows, nbytes = part.scales.numel(), part.data.numel()
        flat = data.view(-1)
        flat[:nbytes].copy_(part.data, non_blocking=True)
        if nbytes < rows * data.shape[1]:
            flat[nbytes : rows * data.shape[1]].zero_()
        scales[:rows].copy_(part.scales, non_blocking=True)
        return data[:rows], scales[:rows]

    def _walk(self, fragment: Fragment, spec: CodecSpec, mine: Encoded, theirs: Encoded
              ) -> Iterator[tuple[int, int, list[tuple[int, int, int]], torch.Tensor,
                                  torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Both payloads chunk by chunk on the device (each byte uploaded once per walk):
        (pos, n, pieces, my data, my scales, their data, their scales)."""
        bs, step = spec.block_size, chunk_elems(spec, self.device, self.chunk)
        rows0 = -(-min(step, fragment.numel) // bs)
        bb = self._room(spec)[0].block_bytes(bs)
        staging = [(torch.empty(rows0, bb, dtype=torch.uint8, device=self.device),
                    torch.empty(rows0, device=self.device)) for _ in range(2)]
        for pos, n, pieces in fragment.chunks(step):
            mc, ms = self._upload(mine, pos, n, *staging[0])
            tc, ts = self._upload(theirs, pos, n, *staging[1])
            yield pos, n, pieces, mc, ms, tc, ts

    def check(self, spec: CodecSpec, numel: int, payload: bytes | bytearray | memoryview,
              digest: bytes, prep: Prepared | None = None,
              seen_digest: bytes | None = None) -> Encoded:
        """Parse the peer's payload; ValueError if it is corrupt or would decode to NaN/Inf or
        to values beyond ``MAX_ABS_VALUE``; with ``prep`` (our half) and a guard,
        :class:`ImplausibleUpdate` if the correction it implies is implausibly large (and
        ``prep.clip`` below 1 if it is to be clipped). With ``prep``, both payloads stay on
        the device for the commit (streamed payloads: uploaded again by the commit).

        A bytearray (or pinned memoryview) payload is used in place (the session hands over
        its receive buffer). ``seen_digest``: the SHA-256 the session computed chunk by chunk as
        the bytes arrived (not recomputed here: 0.7 s for a 1B model's int8 payload).
        """
        seen = payload_digest(payload) if seen_digest is None else seen_digest
        if not hmac.compare_digest(seen, digest):
            raise ValueError("payload does not match the SHA-256 its sender signed")
        received = Encoded.from_bytes(spec.name, numel, spec.block_size, payload, copy=False)
        if spec.name in SEEDED_CODECS:  # its positions are ours: the same link state
            if prep is None or prep.encoded.spec != spec:
                raise ValueError(f"a {spec.name} payload is checked against our own half")
            received = received.seeded(prep.encoded.seed)
        if prep is not None:
            prep.peer_digest = digest
        if self.streams(spec):
            self._check_streamed(spec, received, prep)
            return received
        with self._on_stream():
            theirs = received.to(self.device, non_blocking=True)
            mine = prep.encoded.to(self.device, non_blocking=True) if prep is not None else None
            top = spec.codec().magnitude(theirs)
            screened = self.guard is not None and self.guard.rule.enabled
            sums = (self._screen_sums(prep, mine, theirs)
                    if screened and prep is not None and mine is not None else [])
        values = read([top, *sums])  # the phase's one synchronisation
        _refuse_magnitude(values[0])
        if sums:
            assert prep is not None
            prep.clip = self._judge(prep, received, *values[1:])
        if prep is not None and mine is not None:
            prep.on_device = (mine, theirs)
        return received

    def _check_streamed(self, spec: CodecSpec, received: Encoded,
                        prep: Prepared | None) -> None:
        """:meth:`check` with streamed payloads: the magnitude from the scales in host
        memory; the screen's sums with both payloads streamed through device staging (nothing
        payload-sized stays on the device until the commit, which streams them again)."""
        _refuse_magnitude(float(spec.codec().magnitude(received)))  # host memory only
        if prep is None or self.guard is None or not self.guard.rule.enabled:
            return
        fragment, bs = prep.fragment, spec.block_size
        room, kernels = self._room(spec)
        with self._on_stream():
            sums = torch.zeros(4, device=self.device)
            base: torch.Tensor | None = None
            part: torch.Tensor | None = None
            for _pos, n, pieces, mc, ms, tc, ts in self._walk(fragment, spec,
                                                                   prep.encoded, received):
                rows = mc.shape[0]
                if base is None:
                    base = torch.empty(rows * bs, dtype=self.theta0.dtype, device=self.device)
                    part = kernels.scratch(rows * bs, self.device) if kernels else None
                t0 = base[: n if kernels else rows * bs]
                if n < t0.numel():
                    t0[n:].zero_()
                for start, length, o in pieces:  # displacements from theta_0 (bfloat16)
                    t0[o : o + length].copy_(self.theta0[start : start + length],
                                             non_blocking=True)
                if kernels is not None and part is not None:
                    sums += kernels.screen(mc.view(-1), ms, tc.view(-1), ts, t0, bs, part)
                else:
                    sums += room.screen_rows(mc, ms, tc, ts, t0.view(rows, bs))
        prep.clip = self._judge(prep, received, *read(list(sums.unbind())))

    def _screen_sums(self, prep: Prepared, mine_enc: Encoded,
                     theirs_enc: Encoded) -> list[torch.Tensor]:
        """On the device, chunk by chunk: ``||theirs - mine||^2``, ``||mine - t0||^2``,
        ``||theirs - t0||^2`` and ``(mine - t0) . (theirs - t0)`` over the decoded messages
        (what each side will fold, computed identically by the peer)."""
        fragment = prep.fragment
        codec = prep.encoded.spec.codec()
        step = chunk_elems(prep.encoded.spec, self.device, self.chunk)
        a = torch.empty(min(step, fragment.numel), device=self.device)
        b = torch.empty_like(a)
        sums = [torch.zeros((), device=self.device) for _ in range(4)]
        for pos, n, pieces in fragment.chunks(step):
            mine = codec.decode(mine_enc.view(pos, n), a[:n])
            theirs = codec.decode(theirs_enc.view(pos, n), b[:n])
            sums[0] += torch.dist(theirs, mine).square()
            if prep.link is not None:  # residuals: the iterates are the reference plus them
                ref = prep.link.ref[pos : pos + n].to(self.device, non_blocking=True)
                mine.add_(ref)
                theirs.add_(ref)
            for start, length, o in pieces:  # displacements from theta_0 (bfloat16 is fine)
                t0 = self.theta0[start : start + length].to(self.device, non_blocking=True)
                mine[o : o + length].sub_(t0)
                theirs[o : o + length].sub_(t0)
            sums[1] += mine.dot(mine)
            sums[2] += theirs.dot(theirs)
            sums[3] += mine.dot(theirs)
        return sums

    def _judge(self, prep: Prepared, received: Encoded, dist2: float, mine2: float,
               theirs2: float, dot: float) -> float:
        """The guard's verdict from the screen's sums (see :meth:`screen`); reserves the
        exchange's movement in ``prep.ticket``."""
        assert self.guard is not None
        fragment = prep.fragment
        if (mine2 > 0) != (theirs2 > 0):  # no refusal on record: the peer may retry
            raise ValueError("one side has not moved from theta_0 yet: the direction of the "
                             "update cannot be judged")
        if mine2 > 0:  # both moved: compare directions
            self.guard.screen_direction(fragment.index,
                                        dot / (math.sqrt(mine2) * math.sqrt(theirs2)),
                                        fragment.numel)
        root_n = math.sqrt(max(fragment.numel, 1))
        self.release(prep)
        prep.weight_cap = exchange_weight(self.guard.w, self.rounds_since(prep))
        clip, prep.ticket = self.guard.screen(fragment.index, math.sqrt(dist2) / root_n,
                                              prep.peer_id, prep.block,
                                              math.sqrt(self._base2_of(fragment)) / root_n,
                                              prep.weight_cap)
        if self.meter is not None:
            clip *= self._meter_room(prep, received, clip)
        return clip

    def _meter_room(self, prep: Prepared, received: Encoded, clip: float) -> float:
        """The push meter's factor on the weight (1: the exchange fits its bound); keeps the
        sampled difference for the commit to enter."""
        assert self.meter is not None and self.guard is not None
        frag, spec = prep.fragment, prep.encoded.spec
        codec = spec.codec()
        meter = self.meter

        def sample(enc: Encoded) -> torch.Tensor:
            """The meter's blocks of ``enc``, decoded on the host: one gather where ``enc``
            lies (the index made once per fragment, codec and device), a few KiB copied."""
            key = (frag.index, spec.name, spec.block_size, str(enc.data.device))
            index = self._meter_index.get(key)
            if index is None:
                runs = meter.runs(frag.index, frag.numel, spec.block_size)
                index = self._meter_index[key] = run_index(spec.name, spec.block_size, runs,
                                                           enc.data.device)
            return codec.decode(enc.select(index).to("cpu")).float()

        mine = sample(prep.encoded)
        prep.pushed = sample(received) - mine  # a link's reference cancels
        if prep.link is not None:  # the node's iterate on the sample: the reference's too
            mine += prep.link.ref.index_select(0, self._meter_elements(frag, spec.block_size))
        meter.seen(frag.index, spec.block_size, self.state.rounds, mine)
        limit = self.meter_limit * self.guard.drift(frag.index)
        step = prep.weight_cap * clip * prep.pushed
        room = self.meter.room(frag.index, spec.block_size, self.state.rounds, step, limit)
        if room < 1.0 and prep.ticket is not None:
            self.guard.shrink(prep.ticket, room)
            along = self.meter.along(frag.index, spec.block_size, step)
            if room < 0.5 and along >= self.guard.drift(frag.index):
                # a whole drift more along what gossip moved this node by lately, against the
                # bound: a push in one direction, not a pull towards the swarm
                self.guard.demerit(prep.peer_id, prep.block)
        return room

    def _meter_elements(self, frag: Fragment, block_size: int) -> torch.Tensor:
        """The fragment positions of the meter's sampled runs (int64, host), once per
        fragment and block size."""
        key = (frag.index, block_size)
        if key not in self._meter_elems:
            assert self.meter is not None
            runs = self.meter.runs(frag.index, frag.numel, block_size)
            self._meter_elems[key] = torch.cat([torch.arange(s, s + n) for s, n in runs]
                                               or [torch.zeros(0, dtype=torch.int64)])
        return self._meter_elems[key]

    def _base2_of(self, fragment: Fragment) -> float:
        """``||theta_0||^2`` over the fragment, once per fragment (theta_0 never changes)."""
        if fragment.index not in self._base2:
            total = torch.zeros((), dtype=torch.float64)
            for start, length in fragment.ranges:
                piece = self.theta0[start : start + length]
                total += torch.linalg.vector_norm(piece, dtype=torch.float64).square()
            self._base2[fragment.index] = float(total)
        return self._base2[fragment.index]

    def release(self, prep: Prepared) -> None:
        """The exchange of ``prep`` will not commit: the guard gets its reservation back
        (a no-op after the commit, or without a reservation)."""
        if self.guard is not None and prep.ticket is not None:
            self.guard.release(prep.ticket)

    def screen(self, prep: Prepared, received: Encoded) -> float:
        """ImplausibleUpdate if the two decoded messages (what each side will fold, computed
        identically by the peer) are implausibly far apart, or their displacements from
        ``theta_0`` point different ways; else the guard's factor on the weight (1, or below 1
        to clip). Changes nothing. (:meth:`check` does this on the way.)"""
        with self._on_stream():
            sums = self._screen_sums(prep, prep.encoded.to(self.device, non_blocking=True),
                                     received.to(self.device, non_blocking=True))
        return self._judge(prep, received, *read(sums))

    def commit(self, prep: Prepared, received: Encoded, weight: float) -> float:
        """Fold both messages and apply the correction ``c = weight * clip * (D(theirs) -
        D(mine))`` to the correction targets; returns ``||c||_2``. The lock is held while the
        work is queued; one wait and one read follow. With a loss gate, the loss of a private
        batch is measured before and after under the same hold, and a correction that raised
        it beyond what the round has left is taken back on this side (``prep.weight`` 0)."""
        fragment, sent = prep.fragment, prep.encoded
        if received.numel != fragment.numel or received.spec != sent.spec:
            raise ValueError(f"received {received.spec}/{received.numel}, sent "
                             f"{sent.spec}/{fragment.numel}")
        weight = min(weight, prep.weight_cap) * prep.clip  # what the guard judged, at most
        prep.weight = weight
        apply = self._apply_streamed if self.streams(sent.spec) else self._apply
        gate = self.gate if weight != 0 else None
        with self.lock.urgent(), self._on_stream():
            before = self._sample()
            version = self._version()
            ahead = gate.measure(version) if gate is not None else 0.0
            square = apply(prep, received, weight)
            prep.taken_back = gate.judge(
                ahead, self.state.rounds, None if version is None else (version[0],
                                                                        version[1] + 1)
            ) if gate is not None else ""
            if prep.taken_back:
                apply(prep, received, -weight)  # this side takes it back (the peer decides
                prep.weight = 0.0  # for itself, as with a clip)
                square = torch.zeros((), device=self.device)
            moved = self._moved(before)
        norm = self._committed(prep, square, moved)
        self._fold_link(prep, received)
        return norm

    def _fold_link(self, prep: Prepared, received: Encoded) -> None:
        """After a commit: a residual exchange moves its link's reference to the middle of
        the two messages; a plain one marked ``seed`` starts the link there (core/links.py).
        Whatever either side's weight was: the reference follows the messages alone, so both
        ends compute it alike. Host work on the payloads' host memory."""
        if prep.link is None and not prep.seed:
            return
        codec = prep.encoded.spec.codec()
        mine, theirs = prep.encoded, received.to("cpu")

        def decoder(enc: Encoded) -> Decode:
            return lambda pos, n, out: codec.decode(enc.view(pos, n), out)

        if prep.link is not None:
            prep.link.fold(decoder(mine), decoder(theirs), False,
                           next_state(prep.link.state, prep.digest, prep.peer_digest))
        elif self.links is not None:
            link = self.links.slot(prep.peer_id, prep.fragment.index, prep.fragment.numel)
            link.fold(decoder(mine), decoder(theirs), True,
                      seed_state(prep.digest, prep.peer_digest))

    def _version(self) -> tuple[int, int] | None:
        """The parameters' version under the lock (the trainer's holds, the urgent writes;
        None where the lock does not count them): the next urgent write is ``writes + 1``."""
        steps, writes = getattr(self.lock, "steps", None), getattr(self.lock, "writes", None)
        return None if steps is None or writes is None else (steps, writes)

    def _apply(self, prep: Prepared, received: Encoded, weight: float) -> torch.Tensor:
        """Add ``weight * (D(theirs) - D(mine))`` to the correction targets, chunk by chunk
        (under the lock); returns its squared norm (on the device)."""
        fragment, sent = prep.fragment, prep.encoded
        codec = sent.spec.codec()
        step = chunk_elems(sent.spec, self.device, self.chunk)
        mine_enc, theirs_enc = prep.on_device or (
            sent.to(self.device, non_blocking=True),
            received.to(self.device, non_blocking=True))
        mine = torch.empty(min(step, fragment.numel), device=self.device)
        theirs = torch.empty_like(mine)
        square = torch.zeros((), device=self.device)
        for pos, n, pieces in fragment.chunks(step):
            c = codec.decode(mine_enc.view(pos, n), mine[:n])
            torch.sub(codec.decode(theirs_enc.view(pos, n), theirs[:n]), c, out=c)
            c.mul_(weight)
            square += c.dot(c)
            if weight != 0:
                for start, length, o in pieces:
                    self.state.add_chunk(start, c[o : o + length])
        return square

    def _sample(self) -> torch.Tensor | None:
        """theta on the ledger's sample (None without a ledger); under the lock."""
        if self.ledger is None:
            return None
        if self._sample_at is None:
            self._sample_at = self.ledger.positions.to(self.device)
        return self.state.theta.detach().index_select(0, self._sample_at)

    def _moved(self, before: torch.Tensor | None) -> torch.Tensor | None:
        after = self._sample()
        return None if before is None or after is None else after.sub_(before)

    def _committed(self, prep: Prepared, square: torch.Tensor,
                   moved: torch.Tensor | None = None) -> float:
        """After a commit's work is queued: wait for it (the copies back to host-side targets,
        a host anchor, run on our stream), settle the guard's reservation (and enter what the
        commit moved theta by on the ledger's sample), ``||c||_2``."""
        prep.on_device = None
        self._done()
        if self.meter is not None and prep.pushed is not None:
            self.meter.add(prep.fragment.index, prep.encoded.block_size, self.state.rounds,
                           prep.weight * prep.pushed)
        if self.guard is not None and prep.ticket is not None:
            if prep.taken_back:  # moved nothing, earns nothing (and blames nobody: one small
                self.guard.release(prep.ticket)  # batch's verdict is not proof)
            else:
                if self.ledger is not None and moved is not None:
                    self.ledger.record(self.state.rounds, prep.peer_id, prep.block,
                                       moved.cpu())
                self.guard.committed(prep.ticket)
        return math.sqrt(read([square])[0])

    def _apply_streamed(self, prep: Prepared, received: Encoded,
                        weight: float) -> torch.Tensor:
        """:meth:`_apply` with both payloads streamed through device staging: per chunk the
        correction and its square, then the adds (with the room's kernel, added into
        theta in the same pass where theta is the only target and the chunk one piece)."""
        room, kernels = self._room(prep.encoded.spec)
        bs = prep.encoded.block_size
        targets = self.state.correction_targets()
        into = (weight != 0 and len(targets) == 1 and targets[0][1] == 1.0
                and self.state.theta.dtype == torch.float32)
        square = torch.zeros((), device=self.device)
        c: torch.Tensor | None = None
        part: torch.Tensor | None = None
        for _pos, n, pieces, mc, ms, tc, ts in self._walk(
                prep.fragment, prep.encoded.spec, prep.encoded, received):
            if kernels is None:
                c, sq = room.correction_rows(mc, ms, tc, ts, weight, bs)
                square += sq
            else:
                if part is None:
                    part = kernels.scratch(mc.shape[0] * bs, self.device)
                if into and len(pieces) == 1:
                    start = pieces[0][0]
                    square += kernels.correct(mc.view(-1), ms, tc.view(-1), ts, weight, bs,
                                              self.state.theta[start : start + n], True, part)
                    continue
                if c is None:
                    c = torch.empty(mc.shape[0] * bs, device=self.device)
                square += kernels.correct(mc.view(-1), ms, tc.view(-1), ts, weight, bs,
                                          c[:n], False, part)
            if weight != 0:
                assert c is not None
                for start, length, o in pieces:
                    self.state.add_chunk(start, c[o : o + length])
        return square

    def warm_up(self, spec: CodecSpec) -> str | None:
        """Compile the fused kernels for ``spec`` before the first exchange (a second or two
        on a GPU, else spent under the training lock by the first commit): one small
        exchange's kernels on scratch tensors, nothing shared touched. If they do not build
        (Triton needs a C compiler at its first launch), the engine keeps the eager passes
        (the same bits) and the reason is returned for the caller to log."""
        if not (self.streams(spec) and self._room(spec)[1] is not None):
            return None
        dev = self.device
        try:
            with self._on_stream():  # (also makes theta's GPU the current one, as Triton needs)
                self._compile(spec)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - whatever stops Triton, the eager passes remain
            self.kernels = False
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return None

    def _compile(self, spec: CodecSpec) -> None:
        """One small exchange's fused kernels on scratch tensors (:meth:`warm_up`). Triton
        specialises on sizes divisible by 16 and on 16-byte aligned pointers (a fragment's
        piece may start anywhere in theta): both kinds are compiled."""
        bs, dev = spec.block_size, self.device
        room, kernels = self._room(spec)
        assert kernels is not None
        for n, off in ((2 * bs, 0), (2 * bs - 1, 0), (2 * bs, 1)):
            x = torch.zeros(n + off, device=dev)[off:]
            scales = torch.empty(2, device=dev)
            data = torch.empty(2 * room.block_bytes(bs), dtype=torch.uint8, device=dev)
            kernels.encode(x, bs, scales, data, torch.ones((), dtype=torch.bool, device=dev))
            part = kernels.scratch(n, dev)
            kernels.screen(data, scales, data, scales, x.to(self.theta0.dtype), bs, part)
            for add in (True, False):
                kernels.correct(data, scales, data, scales, 0.5, bs, x, add, part)


def _refuse_magnitude(top: float) -> None:
    """ValueError for a payload whose decoded values could reach ``top`` (an upper bound):
    non-finite, or beyond :data:`MAX_ABS_VALUE`."""
    if not math.isfinite(top):
        raise ValueError("payload decodes to non-finite values")
    if top > MAX_ABS_VALUE:
        raise ValueError(f"payload decodes to absurd values (|x| up to {top:.3g} > "
                         f"{MAX_ABS_VALUE:g})")
