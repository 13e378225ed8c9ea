"""The tensor side of a gossip exchange: snapshot, encode, check, commit (no I/O, no asyncio).

Every method here is synchronous and may take milliseconds to seconds on a large model, so the
async layer (:mod:`gasloc_p2p.node.transport.exchange`) calls them through ``asyncio.to_thread``.
Shared tensors are touched only under the node's :class:`TrainingLock`, which also serialises
the trainer's optimizer steps and round ends.

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

import math
import zlib
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch

from gasloc_p2p.core.async_state import AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec, Encoded
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.protocol.guard import UpdateGuard

# Scratch of the fused loops: 2^18 float32 (1 MiB) stays in a core's L2; bigger chunks were
# slower on a 2-core EPYC, smaller ones paid per-op overhead (see benchmarks/bench_scale.py).
CHUNK_ELEMS = 1 << 18

# No parameter or delta of a trained network is anywhere near this: a payload that decodes to
# larger values (a finite fp32 offset of 1e30, an int8 block scale of 3e38) is rejected.
MAX_ABS_VALUE = 1e6


@dataclass(eq=False)
class Prepared:
    """One side's half of an exchange between snapshot and commit."""

    peer_id: str
    fragment: Fragment
    rounds0: int  # round ends at the snapshot
    encoded: Encoded  # views of payload
    payload: bytearray
    crc32: int
    clip: float = 1.0  # the guard's factor on the weight, set by ``check`` (1: not clipped)


class UrgentLock(Protocol):
    """What the engine needs from the node's training lock (the daemon's ``TrainingLock``)."""

    def urgent(self) -> AbstractContextManager[object]: ...


class NoLock:
    """For single-threaded drivers (the simulator, tests): nothing to exclude."""

    def urgent(self) -> AbstractContextManager[object]:
        return nullcontext()


class ExchangeEngine:
    """The fragments and codecs of one node, around its :class:`AsyncGaslocState`.

    Tensor work is fused and chunked (``CHUNK_ELEMS`` at a time, through cache-sized scratch):
    ``prepare`` reads anchor and live parameters once and writes the payload in place (off
    the host: each chunk is encoded on the device, then its bytes are copied once); ``check``
    validates without decoding; ``commit`` decodes each message once, straight into the
    correction's add. No fragment-size temporary is allocated besides the two payloads.
    """

    def __init__(self, state: AsyncGaslocState, theta0: torch.Tensor,
                 fragments: Sequence[Fragment], lock: UrgentLock) -> None:
        """theta0: ``[numel]`` initial parameters, the same on every node of the run (kept by
        reference, never modified; a bfloat16 copy will do: it only anchors the guard's
        screens)."""
        self.state = state
        self.theta0 = theta0
        self.fragments = list(fragments)
        self.lock = lock
        self.guard: UpdateGuard | None = None  # bounded updates (see protocol/guard.py)

    def rounds_since(self, prep: Prepared) -> int:
        return self.state.rounds - prep.rounds0

    def prepare(self, peer_id: str, fragment_index: int, spec: CodecSpec) -> Prepared:
        """Snapshot the public iterate of one fragment and encode it into a fresh payload.

        One pass per chunk under the training lock: ``p = lerp(a, theta, eta)`` into scratch,
        then the codec writing into the payload's memory.
        """
        fragment = self.fragments[fragment_index]
        codec, step = spec.codec(), chunk_elems(spec)
        payload, encoded = Encoded.empty(spec.name, fragment.numel, spec.block_size)
        device = self.state.theta.device
        work = torch.empty(min(step, fragment.numel), device=device)
        # Off the host, a chunk is encoded on the device, then its bytes cross once.
        staged = (spec.codec().encode(torch.zeros(min(step, fragment.numel), device=device))
                  if stages_on_device(device) else None)
        anchor, theta, eta = self.state.anchor, self.state.theta, self.state.cfg.eta
        with self.lock.urgent():
            rounds0 = self.state.rounds
            for pos, n, pieces in fragment.chunks(step):
                x = work[:n]
                for start, length, o in pieces:
                    torch.lerp(anchor[start : start + length], theta[start : start + length],
                               eta, out=x[o : o + length])
                if staged is None:  # straight into the payload's memory
                    codec.encode_into(x, encoded.view(pos, n))
                else:
                    out = staged.view(0, n)
                    codec.encode_into(x, out)
                    host = encoded.view(pos, n)
                    host.data.copy_(out.data)
                    host.scales.copy_(out.scales)
        return Prepared(peer_id, fragment, rounds0, encoded, payload, zlib.crc32(payload))

    def check(self, spec: CodecSpec, numel: int, payload: bytes | bytearray,
              crc32: int, prep: Prepared | None = None) -> Encoded:
        """Parse the peer's payload; ValueError if it is corrupt or would decode to NaN/Inf or
        to values beyond ``MAX_ABS_VALUE``; with ``prep`` (our half) and a guard,
        :class:`ImplausibleUpdate` if the correction it implies is implausibly large (and
        ``prep.clip`` below 1 if it is to be clipped).

        A bytearray payload is used in place (the session hands over its receive buffer).
        """
        if zlib.crc32(payload) != crc32:
            raise ValueError("payload CRC32 mismatch")
        received = Encoded.from_bytes(spec.name, numel, spec.block_size, payload, copy=False)
        received = received.to(self.state.theta.device)  # bytes cross once, decoded there
        spec.codec().check_decodable(received)
        if prep is not None and self.guard is not None and self.guard.rule.enabled:
            prep.clip = self.screen(prep, received)
        elif numel:  # the absolute bound, without a decode where the scales tell it
            self._bounded(spec, received)
        return received

    @staticmethod
    def _bounded(spec: CodecSpec, received: Encoded) -> None:
        codec = spec.codec()
        if spec.block_size:  # |x| <= scale * the largest code
            top = float(received.scales.amax()) * float(getattr(codec, "_max_code", 1.0))
        else:
            top = float(codec.decode(received).abs().amax())
        if top > MAX_ABS_VALUE:
            raise ValueError(f"payload decodes to absurd values (|x| up to {top:.3g} > "
                             f"{MAX_ABS_VALUE:g})")

    def screen(self, prep: Prepared, received: Encoded) -> float:
        """ImplausibleUpdate if the two decoded messages (what each side will fold, computed
        identically by the peer) are implausibly far apart, or their displacements from
        ``theta_0`` point different ways; else the guard's factor on the weight (1, or below 1
        to clip). Changes nothing."""
        assert self.guard is not None
        fragment, codec, step = prep.fragment, prep.encoded.spec.codec(), chunk_elems(
            prep.encoded.spec)
        # Chunk by chunk through three cache-sized buffers (no fragment-size temporary): the
        # decoded messages, then their displacements from theta_0.
        a = torch.empty(min(step, fragment.numel), device=self.state.theta.device)
        b, base = torch.empty_like(a), torch.empty_like(a)
        self._bounded(prep.encoded.spec, received)  # block codecs: from the scales alone
        dist2 = mine2 = theirs2 = base2 = dot = 0.0
        for pos, n, pieces in fragment.chunks(step):
            mine = codec.decode(prep.encoded.view(pos, n), a[:n])
            theirs = codec.decode(received.view(pos, n), b[:n])
            t0 = base[:n]
            for start, length, o in pieces:
                t0[o : o + length].copy_(self.theta0[start : start + length])  # bf16 ok
            dist2 += float(torch.dist(theirs, mine)) ** 2
            mine.sub_(t0)
            theirs.sub_(t0)
            mine2 += float(mine.dot(mine))
            theirs2 += float(theirs.dot(theirs))
            base2 += float(t0.dot(t0))
            dot += float(mine.dot(theirs))
        root_n = math.sqrt(max(fragment.numel, 1))
        if (mine2 > 0) != (theirs2 > 0):  # no refusal on record: the peer may retry
            raise ValueError("one side has not moved from theta_0 yet: the direction of the "
                             "update cannot be judged")
        clip = self.guard.screen(fragment.index, math.sqrt(dist2) / root_n,
                                 math.sqrt(max(mine2, base2)) / root_n, prep.peer_id)
        if mine2 > 0:  # both moved: compare directions
            self.guard.screen_direction(fragment.index,
                                        dot / (math.sqrt(mine2) * math.sqrt(theirs2)),
                                        fragment.numel)
        return clip

    def commit(self, prep: Prepared, received: Encoded, weight: float) -> float:
        """Fold both messages and apply the correction ``c = weight * clip * (D(theirs) -
        D(mine))``; returns ``||c||_2``."""
        fragment, sent = prep.fragment, prep.encoded
        if received.numel != fragment.numel or received.spec != sent.spec:
            raise ValueError(f"received {received.spec}/{received.numel}, sent "
                             f"{sent.spec}/{fragment.numel}")
        codec, step = sent.spec.codec(), chunk_elems(sent.spec)
        weight *= prep.clip
        mine = torch.empty(min(step, fragment.numel), device=self.state.theta.device)
        theirs = torch.empty_like(mine)
        targets = self.state.correction_targets()
        squares = []  # per chunk, read once at the end (no device sync per chunk)
        with self.lock.urgent():
            for pos, n, pieces in fragment.chunks(step):
                c = codec.decode(sent.view(pos, n), mine[:n])
                torch.sub(codec.decode(received.view(pos, n), theirs[:n]), c, out=c)
                c.mul_(weight)
                squares.append(torch.dot(c, c))
                if weight > 0:
                    for start, length, o in pieces:
                        for buf, scale in targets:
                            buf[start : start + length].add_(c[o : o + length], alpha=scale)
        # summed in float64 in chunk order, as one float per chunk always was
        norm = math.sqrt(sum(torch.stack(squares).tolist()) if squares else 0.0)
        if self.guard is not None and weight > 0 and prep.clip == 1.0:  # distance without w
            self.guard.accept(fragment.index,
                              norm / (weight * math.sqrt(max(fragment.numel, 1))))
        return norm


def stages_on_device(device: torch.device) -> bool:
    """Whether ``prepare`` encodes each chunk into device memory and then copies its bytes to
    the host payload (every device but the host itself, whose payload it writes directly)."""
    return device.type != "cpu"


def chunk_elems(spec: CodecSpec) -> int:
    """Elements per chunk of the fused loops: about ``CHUNK_ELEMS``, whole blocks of the
    message."""
    block = spec.block_size or 1
    return max(1, CHUNK_ELEMS // block) * block
