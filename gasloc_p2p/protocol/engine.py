"""The tensor side of a gossip exchange: snapshot, encode, check, commit (no I/O, no asyncio).

Every method here is synchronous and may take milliseconds to seconds on a large model, so the
async layer (:mod:`gasloc_p2p.node.transport.exchange`) calls them through ``asyncio.to_thread``. Shared
tensors are touched only under the node's :class:`TrainingLock`, which also serialises the
trainer's optimizer steps and round ends.

Nothing changes before :meth:`ExchangeEngine.commit`: ``prepare`` reads a snapshot and encodes it
against the link's reference (or ``theta_0`` when the link is new or must be reset), ``check``
parses and validates the peer's payload; only ``commit`` folds both messages into the link and
adds the correction to the anchor and live parameters.
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch

from gasloc_p2p.core.async_state import AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec, Encoded
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.references import ReferenceTable, decode
from gasloc_p2p.protocol.guard import UpdateGuard

# No parameter or delta of a trained network is anywhere near this: a payload that decodes to
# larger values (a finite fp32 offset of 1e30, an int8 block scale of 3e38) is rejected.
MAX_ABS_VALUE = 1e6


@dataclass(frozen=True, eq=False)
class Prepared:
    """One side's half of an exchange between snapshot and commit."""

    peer_id: str
    fragment: Fragment
    link_version: int  # this side's version before the exchange
    reset: bool  # restart the link from theta_0 at commit (the versions differed)
    rounds0: int  # round ends at the snapshot
    encoded: Encoded
    payload: bytes
    crc32: int


class UrgentLock(Protocol):
    """What the engine needs from the node's training lock (the daemon's ``TrainingLock``)."""

    def urgent(self) -> AbstractContextManager[object]: ...


class NoLock:
    """For single-threaded drivers (the simulator, tests): nothing to exclude."""

    def urgent(self) -> AbstractContextManager[object]:
        return nullcontext()


class ExchangeEngine:
    """References, fragments and codecs of one node, around its :class:`AsyncGaslocState`."""

    def __init__(self, state: AsyncGaslocState, theta0: torch.Tensor,
                 fragments: Sequence[Fragment], lock: UrgentLock,
                 reference_capacity: int) -> None:
        """theta0: ``[numel]`` float32 initial parameters, the same on every node of the run."""
        self.state = state
        self.theta0 = theta0
        self.fragments = list(fragments)
        self.lock = lock
        self.refs = ReferenceTable(theta0, capacity=reference_capacity)
        self._refs_lock = threading.Lock()  # the LRU is touched from several worker threads
        self.guard: UpdateGuard | None = None  # bounded updates (see protocol/guard.py)

    def link_version(self, peer_id: str) -> int:
        with self._refs_lock:
            return self.refs.version(peer_id)

    def rounds_since(self, prep: Prepared) -> int:
        return self.state.rounds - prep.rounds0

    def prepare(self, peer_id: str, fragment_index: int, spec: CodecSpec,
                reset: bool) -> Prepared:
        """Snapshot the public iterate of one fragment and encode ``Q(p - ref_out)``.

        With ``reset`` (or no link yet) the reference is ``theta_0``. Only this exchange can
        change the link (one exchange per peer in flight), so ``ref_out`` is read unlocked.
        """
        fragment = self.fragments[fragment_index]
        covers_all = fragment.ranges == ((0, self.theta0.numel()),)
        with self.lock.urgent():
            public = self.state.public_iterate(None if covers_all else fragment)
            rounds0 = self.state.rounds
        with self._refs_lock:
            version = self.refs.version(peer_id)
            known = peer_id in self.refs
            reference = self.refs.get(peer_id).ref_out if known and not reset else self.theta0
        encoded = spec.codec().encode(_sub_fragment_(public, reference, fragment))
        payload = encoded.to_bytes()
        return Prepared(peer_id, fragment, version, reset, rounds0, encoded, payload,
                        zlib.crc32(payload))

    def check(self, spec: CodecSpec, numel: int, payload: bytes | bytearray,
              crc32: int, prep: Prepared | None = None) -> Encoded:
        """Parse the peer's payload; ValueError if it is corrupt, decodes to NaN/Inf or to
        values beyond ``MAX_ABS_VALUE``; with ``prep`` (our half) and a guard,
        :class:`ImplausibleUpdate` if the correction it implies is implausibly large."""
        if zlib.crc32(payload) != crc32:
            raise ValueError("payload CRC32 mismatch")
        received = Encoded.from_bytes(spec.name, numel, spec.block_size, payload)
        values = spec.codec().decode(received)
        # amax/amin propagate NaN and allocate nothing, unlike isfinite() (3x slower here)
        if numel:
            hi, lo = float(values.amax()), float(values.amin())
            if not (math.isfinite(hi) and math.isfinite(lo)):
                raise ValueError("payload decodes to non-finite values")
            if max(hi, -lo) > MAX_ABS_VALUE:
                raise ValueError(f"payload decodes to absurd values (|x| up to "
                                 f"{max(hi, -lo):.3g} > {MAX_ABS_VALUE:g})")
        if prep is not None and self.guard is not None and self.guard.rule.enabled:
            self.screen(prep, received, values)
        return received

    def screen(self, prep: Prepared, received: Encoded, values: torch.Tensor) -> None:
        """ImplausibleUpdate if ``||ref_in' - ref_out'||`` (the references after this commit,
        which the peer computes identically) is beyond the guard's limit; changes nothing."""
        assert self.guard is not None
        fragment = prep.fragment
        with self._refs_lock:
            link = self.refs.get(prep.peer_id) if prep.peer_id in self.refs else None
        ref_out, ref_in = ((self.theta0, self.theta0) if link is None or prep.reset
                           else (link.ref_out, link.ref_in))
        base = fragment.gather(self.theta0)  # gather copies
        mine = fragment.gather(ref_out).add_(decode(prep.encoded))
        theirs = fragment.gather(ref_in).add_(values)
        root_n = math.sqrt(max(fragment.numel, 1))
        distance = float((theirs - mine).norm()) / root_n
        mine.sub_(base)
        theirs.sub_(base)
        own = max(float(mine.norm()), float(base.norm())) / root_n
        self.guard.screen(fragment.index, distance, own)
        norms = float(mine.norm()) * float(theirs.norm())
        if norms > 1e-30:  # both moved: compare directions
            self.guard.screen_direction(fragment.index, float(mine.dot(theirs)) / norms)

    def commit(self, prep: Prepared, received: Encoded, weight: float,
               pinned: Iterable[str] = ()) -> float:
        """Fold both messages into the link and apply the correction; returns ``||c||_2``.

        ``pinned``: peers with exchanges in flight, moved to the LRU's recent end first so that
        creating this link never evicts (and resets) a link another exchange is using.
        """
        with self.lock.urgent():
            with self._refs_lock:
                for other in pinned:
                    if other != prep.peer_id and other in self.refs:
                        self.refs.get(other)
                link = self.refs.get(prep.peer_id)
            if prep.reset:
                link.reset(self.theta0)
            correction = link.commit(prep.encoded, received, prep.fragment, weight)
            if weight > 0:
                self.state.apply_correction(correction, prep.fragment)
        norm = float(correction.norm())
        if self.guard is not None and weight > 0:  # the pair distance, without w
            self.guard.accept(prep.fragment.index,
                              norm / (weight * math.sqrt(max(prep.fragment.numel, 1))))
        return norm


def _sub_fragment_(compact: torch.Tensor, buf: torch.Tensor, fragment: Fragment) -> torch.Tensor:
    """``compact -= buf[fragment]`` in place without gathering a copy; returns ``compact``."""
    pos = 0
    for start, length in fragment.ranges:
        compact[pos : pos + length].sub_(buf[start : start + length])
        pos += length
    return compact
