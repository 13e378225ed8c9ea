"""The round logic of the DiLoCo modes (docs/algorithm.md section 3), trainer thread only.

DiLoCo is Streaming DiLoCo with one fragment (the whole model) and no overlap: both
``--algorithm diloco`` and ``--algorithm streaming-diloco`` run :class:`DilocoRounds`. The model
is split into fragments (DiLoCo: one; Streaming DiLoCo: strided layers, the simulator's split
``layer_fragments(spans, layer_index, --fragments, "strided")``, plus one fragment of non-layer
tensors). Fragment ``f`` syncs every H inner steps at its own offset ``f H // parts``; the
schedule and the per-fragment math are the core's (:mod:`gasloc_p2p.core.streaming`), shared
with the simulator. After each inner step the trainer thread calls :meth:`DilocoRounds.
after_step`, which

1. starts the syncs due now: under the training lock it takes the fragment's outer gradient
   ``anchor_f - theta_f`` and a digest of ``(anchor_f, buffer_f)``, then hands the all-reduce
   to a background thread (hivemind averaging, see :mod:`gasloc_p2p.node.averaging`), and
   training goes on;
2. lands the syncs started ``--tau`` steps ago (at once with ``tau`` 0: DiLoCo's blocking
   all-reduce): waits for the result if it is not there yet (the stall is recorded per
   fragment: the cost overlap hides), then under the lock takes the fragment's outer step
   (the outer optimizer's gradient form: Nesterov, plain averaging at gamma 0) with the mean
   gradient (or its own when the group failed: the failed sync is recorded and
   training goes on, as in torchft) and merges ``theta_f <- alpha theta_f + (1 - alpha)
   anchor_f`` (``--merge-alpha``).

A member that applies its own gradient while others average drifts away from them for good:
plain DiLoCo has no way back. So each member also gathers its digest, epoch and gRPC endpoint;
after a successful sync every member picks the same reference (the highest epoch, then the
largest set of matching digests, then the peer id), and a member whose fragment is off its
group's history downloads the reference's state and adopts that fragment, as hivemind's
optimizer loads state from peers when it falls behind. "Off" is decided by digests of
``(anchor_f, buffer_f)``, whatever the payload codec: the all-reduce gives every member the same
averaged outer gradient bit for bit, lossy codecs included (:mod:`gasloc_p2p.node.averaging.
uniform`), so members in step hold equal fragments. Each fragment keeps its own epoch (outer
steps along the shared history, never going down).

A sparse ``--diloco-codec`` (``topkB:K``, ``denseB``) replaces the all-reduce with SparseLoCo's
all-gather (:meth:`DilocoRounds._gather`): the outer gradient enters the fragment's error
feedback, the node sends the message taken from it, and every member averages every member's
message in the group's order, as the simulator does (``core.streaming``), bit for bit.

State lives in the node's :class:`AsyncGaslocState`: ``anchor`` holds every fragment's global
copy and the state's outer optimizer (:mod:`gasloc_p2p.core.outer`; DiLoCo's Nesterov, the
"local" form, whose ``momentum`` is every fragment's Nesterov buffer; none at gamma 0) its
buffers, in the parameters' layout, so checkpoints, resume and late-join downloads are the
gossip mode's; ``rounds`` is the sum of the fragments' epochs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gasloc_p2p.core import sparse
from gasloc_p2p.core.async_state import AsyncGaslocState
from gasloc_p2p.core.compress import ErrorFeedback, mean_of
from gasloc_p2p.core.flat import Fragment
from gasloc_p2p.core.outer import State
from gasloc_p2p.core.sparse import SparsePayload
from gasloc_p2p.core.streaming import FragmentSchedule, fragment_outer_grad, merge_fragment
from gasloc_p2p.node.averaging.base import Averager, AveragingResult
from gasloc_p2p.node.config import DilocoConfig
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.stats import FragmentStats, TrainStats

log = logging.getLogger(__name__)
DIGEST_PARTS = 8  # contiguous chunks per tensor in the digest
MAX_FEEDBACK = 1e6  # largest |value| of a restored accumulator (the checkpoint's own limit)
DIGEST_REL_TOL = 1e-4  # relative to the chunk's norm: far above float32 rounding of averaging

#: endpoint -> (epoch, anchor [numel], outer state {name: [numel]}) of that node; blocking.
FetchState = Callable[[str], tuple[int, torch.Tensor, State]]


def state_digest(tensors: Sequence[torch.Tensor | None],
                 parts: int = DIGEST_PARTS) -> list[float]:
    """Per contiguous chunk of each tensor: (sum, L2 norm) in float64; ``2 * parts`` floats per
    tensor (None: no tensor, nothing). Equal states give digests equal up to rounding; see
    :func:`digests_match`."""
    out: list[float] = []
    for t in tensors:
        if t is None:
            continue
        for chunk in torch.tensor_split(t.detach(), parts):
            out.append(float(chunk.sum(dtype=torch.float64)))
            out.append(float(torch.linalg.vector_norm(chunk, dtype=torch.float64)))
    return out


def digests_match(a: Sequence[float], b: Sequence[float], rel_tol: float = DIGEST_REL_TOL) -> bool:
    """Whether two digests describe the same state: every chunk sum within ``rel_tol`` of the
    chunk's norm (float32 rounding moves a sum by about 1e-7 of the norm, one missed or extra
    outer step by far more)."""
    if len(a) != len(b):
        return False
    for i in range(0, len(a), 2):
        scale = max(a[i + 1], b[i + 1], 1e-30)
        if not abs(a[i] - b[i]) <= rel_tol * scale:
            return False
    return True


def choose_reference(members: Mapping[str, Mapping[str, Any]]) -> str:
    """The member whose state the group keeps: the highest epoch (the longest history, as
    hivemind prefers the peer with the highest epoch to load state from), then most members
    with a matching digest, then the largest peer id. Every member computes the same answer."""

    def key(pid: str) -> tuple[int, int, str]:
        mine = members[pid]["digest"]
        support = sum(digests_match(mine, m["digest"]) for m in members.values())
        return int(members[pid]["epoch"]), support, pid

    return max(members, key=key)


@dataclass(eq=False)
class _Sync:
    """A fragment's sync in flight."""

    start_step: int  # virtual: inner step + the node's phase shift
    own: torch.Tensor  # [fragment numel] this node's outer gradient
    digest: list[float]
    epoch: int
    started: float  # time.monotonic()
    future: concurrent.futures.Future[AveragingResult | None]


class DilocoRounds:
    """The per-step hook of a DiLoCo node (module docstring); trainer thread only."""

    def __init__(self, state: AsyncGaslocState, fragments: Sequence[Fragment], H: int,
                 tau: int, lock: TrainingLock, averagers: Sequence[Averager], cfg: DilocoConfig,
                 train_stats: TrainStats, stop: threading.Event,
                 peer_count: Callable[[], int], endpoint: Callable[[], str],
                 fetch_state: FetchState | None = None) -> None:
        """``averagers``: one per fragment (each fragment under its own group key), or one
        shared by all (one key: nodes out of phase still meet, see :meth:`land`; a sync that
        starts while another is in flight waits for it); ``H``: inner steps between two syncs
        of a fragment; ``peer_count``: compatible peers known now, this node excluded;
        ``endpoint``: this node's gRPC address; ``fetch_state``: download another node's state
        (None: never resynchronize). ``state`` keeps its anchor (the global copies) and its
        outer optimizer takes ``cfg``'s step (``diloco_eta``, ``diloco_gamma``)."""
        if (state.outer.eta, state.outer.gamma) != (cfg.diloco_eta, cfg.diloco_gamma):
            raise ValueError(f"the state's outer step (eta {state.outer.eta}, gamma "
                             f"{state.outer.gamma}) is not the DiLoCo configuration's "
                             f"({cfg.diloco_eta}, {cfg.diloco_gamma})")
        self.state = state
        self.fragments = list(fragments)
        self.schedule = FragmentSchedule(H, tau, len(self.fragments))
        self.shared = len(averagers) == 1 < len(self.fragments)
        if len(averagers) != len(fragments) and not self.shared:
            raise ValueError(f"{len(fragments)} fragments need as many averagers, or one")
        self.width = max(frag.numel for frag in self.fragments)  # a shared averager's size
        self.shift = 0  # virtual step = inner step + shift: the phase the group agreed on
        self.lock = lock
        self.averagers = list(averagers)
        self.cfg = cfg
        self.train_stats = train_stats
        self.stop = stop
        self.peer_count = peer_count
        self.endpoint = endpoint
        self.fetch_state = fetch_state
        self.epochs = [0] * len(self.fragments)
        # a sparse --diloco-codec: syncs all-gather messages; each fragment's error feedback
        # (SparseLoCo's accumulator, on the anchor's device: the host) made at its first sync
        self.sparse = cfg.sparse_spec()
        self.feedback: dict[int, ErrorFeedback] = {}
        self._feedback_lock = threading.Lock()  # a sync's thread against a checkpoint's copy
        self.stats = [FragmentStats(self.schedule.offset(f), frag.numel)
                      for f, frag in enumerate(self.fragments)]
        self.pending: dict[int, _Sync] = {}
        # One all-reduce per averager at a time, in the order the syncs started: each waits for
        # the one before it on its averager. (A lock is not enough: a later sync could take it
        # first, and on a shared averager its group would meet the others' earlier fragment.)
        self._last: list[concurrent.futures.Future[AveragingResult | None] | None] = [
            None] * len(self.averagers)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(self.fragments), thread_name_prefix="streaming-avg")

    # ------------------------------------------------------------------ trainer thread
    def after_step(self) -> None:
        """Start the syncs due after the step just done, then land those whose overlap ended."""
        step = self.train_stats.step + self.shift
        for f in self.schedule.due(step):
            self.begin(f, step)
        for f in [f for f, s in self.pending.items()
                  if self.schedule.lands_at(s.start_step) <= self.train_stats.step + self.shift]:
            self.land(f)

    def begin(self, f: int, step: int) -> None:
        """Snapshot fragment ``f``'s outer gradient and start its all-reduce in the background
        (``step``: the virtual step, the inner step plus :attr:`shift`)."""
        if f in self.pending:  # cannot happen with tau < H; keep one sync per fragment
            self.land(f)
        frag, st = self.fragments[f], self.state
        with self.lock.urgent(writes=False), torch.no_grad():
            own = fragment_outer_grad(frag, self.anchor, st.theta)  # on the anchor's device
            digest = self._digest(frag, self.anchor, st.outer.state)
        epoch = self.epochs[f]
        slot = 0 if self.shared else f
        future = self._pool.submit(self._average, f, own, digest, epoch, step, self._last[slot])
        self._last[slot] = future
        self.pending[f] = _Sync(step, own, digest, epoch, time.monotonic(), future)
        self.stats[f].last_start_step = step

    def land(self, f: int) -> None:
        """Wait for fragment ``f``'s sync, take its outer step and merge it (see the module)."""
        sync = self.pending.pop(f)
        t0 = time.monotonic()
        try:
            result = sync.future.result()  # the averager gives up at its deadlines or on stop
        except Exception as exc:  # a bug in the averager: fail soft, as a failed group
            result = AveragingResult.failed(f"{type(exc).__name__}: {exc}")
        waited = time.monotonic() - t0
        own = result.own if result is not None and result.own is not None else sync.own
        reference = self._reference(result) if result is not None and result.ok else None
        if result is not None and reference is not None:
            result = self._align(f, sync, result, reference[1])
            reference = reference if result.ok else None
        in_step = reference is not None and self._in_step(sync, *reference)
        grad = result.averaged if result is not None and result.averaged is not None else own
        frag, st = self.fragments[f], self.state
        with self.lock.urgent(), torch.no_grad():
            new_global = st.outer.step_fragment(frag, self.anchor, grad)
            merge_fragment(frag, st.theta, new_global, self.cfg.merge_alpha)
            self.epochs[f] = (int(reference[1]["epoch"]) + 1 if in_step and reference
                              else sync.epoch + 1)
            st.rounds = self.train_stats.rounds = sum(self.epochs)
        self._record(f, result, waited, time.monotonic() - sync.started)
        if reference is not None and not in_step:
            log.warning("fragment %d's state (epoch %d) differs from its group's (reference "
                        "epoch %s): resynchronizing it", f, sync.epoch, reference[1]["epoch"])
            self._resync(f, reference[1], grad)

    def finish(self) -> None:
        """Drop the syncs in flight (the node is stopping: their averaging gives up on ``stop``)
        and wait for the background threads; safe to call twice."""
        self.pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ helpers
    @property
    def anchor(self) -> torch.Tensor:
        """The global copies of every fragment (the state keeps them for a DiLoCo mode)."""
        assert self.state.anchor is not None, "a DiLoCo state keeps its anchor"
        return self.state.anchor

    @staticmethod
    def _digest(frag: Fragment, anchor: torch.Tensor, outer: State) -> list[float]:
        """The digest of fragment ``frag`` of a state: its anchor, then each outer buffer."""
        return state_digest([frag.gather(anchor), *(frag.gather(t) for t in outer.values())])

    def _averager(self, f: int) -> Averager:
        return self.averagers[0 if self.shared else f]

    def _average(self, f: int, own: torch.Tensor, digest: list[float], epoch: int, vstep: int,
                 after: concurrent.futures.Future[AveragingResult | None] | None
                 ) -> AveragingResult | None:
        """All-reduce ``own`` in a background thread, once the sync started before it on the
        same averager (``after``) is done; None when no group is possible."""
        if after is not None:
            concurrent.futures.wait([after])  # done, failed or cancelled: the averager is free
        peers = self.peer_count()
        if peers + 1 < self.cfg.min_group_size:
            return None
        gather = {"epoch": epoch, "digest": digest, "endpoint": self.endpoint(), "fragment": f,
                  "vstep": vstep}
        averager = self._averager(f)
        sent, received = averager.bytes_sent(), averager.bytes_received()
        if self.sparse is not None:
            result = self._gather(f, own, gather, peers + 1, averager)
        else:
            if self.shared:  # zero-padded to the largest fragment
                own = torch.cat([own, own.new_zeros(self.width - own.numel())])
            result = averager.average(own, gather, peers + 1, self.stop)
            if result.averaged is not None and self.shared:
                result = dataclasses.replace(result,
                                             averaged=result.averaged[:self.fragments[f].numel])
        self.stats[f].bytes_sent += averager.bytes_sent() - sent
        self.stats[f].bytes_received += averager.bytes_received() - received
        return result

    def _gather(self, f: int, delta: torch.Tensor, gather: Mapping[str, Any], target: int,
                averager: Averager) -> AveragingResult:
        """A sparse sync (SparseLoCo): ``delta`` enters fragment ``f``'s error feedback, the
        message taken from it goes to every groupmate, and the mean of every member's decoded
        message, summed in the group's order, is the outer gradient: the same bits on every
        member. Whatever happens, ``own`` is this node's decoded message (what it applies if
        the group failed: the rest of ``delta`` waits in the accumulator for a later sync).
        A groupmate's message is validated like any peer payload (size from our own fragment,
        finite bounded scales, indices in range and increasing) before anything decodes it."""
        spec, numel = self.sparse, self.fragments[f].numel
        assert spec is not None
        with self._feedback_lock:
            ef = self.feedback.get(f)
            if ef is None:
                ef = self.feedback[f] = ErrorFeedback(spec, numel, 1.0, delta.device)
            message = ef.compress(delta)
        mine = sparse.decode(message).to(delta.dtype)
        result = averager.allgather(message.to_bytes(), gather, target, self.stop)
        if not result.ok:
            return result.with_own(mine)
        size = spec.wire_bytes(numel)
        try:  # a shared averager's messages are padded to the largest fragment's
            payloads = [SparsePayload.from_bytes(spec, numel, memoryview(m)[:size])
                        for m in result.messages]
        except ValueError as exc:
            return AveragingResult.failed(f"a groupmate's message: {exc}").with_own(mine)
        if len(payloads) != len(result.gathered):
            return AveragingResult.failed("messages and members differ").with_own(mine)
        mean = mean_of(payloads).to(delta.dtype)
        if not bool(torch.isfinite(mean).all()):
            return AveragingResult.failed("the messages' mean is not finite").with_own(mine)
        return AveragingResult(mean, result.gathered, own=mine)

    def _align(self, f: int, sync: _Sync, result: AveragingResult,
               ref: Mapping[str, Any]) -> AveragingResult:
        """Adopt the reference member's schedule phase; a group whose members synced different
        fragments (a shared averager, nodes out of phase) counts as failed."""
        delta = (int(ref.get("vstep", sync.start_step)) - sync.start_step) % self.schedule.H
        if delta:  # forward only: the slots skipped sync one period later
            self.shift += delta
            for other in self.pending.values():
                other.start_step += delta  # their overlap still counts tau inner steps
            log.info("moved this node's sync schedule %d steps forward, in phase with its "
                     "group", delta)
        fragments = {g.get("fragment") for g in result.gathered.values()}
        if fragments != {f}:
            return AveragingResult.failed(f"fragment mismatch: group synced {sorted(map(str, fragments))}")
        return result

    def _reference(self, result: AveragingResult) -> tuple[str, Mapping[str, Any]] | None:
        members = {pid: g for pid, g in result.gathered.items()
                   if isinstance(g, Mapping) and {"epoch", "digest", "endpoint"} <= set(g)}
        if len(members) != len(result.gathered):
            log.warning("a groupmate sent malformed sync metadata; not checking sync this time")
            return None
        ref = choose_reference(members)  # DiLoCo's rule: epoch, then digest support, peer id
        return ref, members[ref]

    def _in_step(self, sync: _Sync, ref: str, meta: Mapping[str, Any]) -> bool:
        """Whether this member's fragment follows the reference's history (see module)."""
        return ref == self.averagers[0].peer_id or digests_match(sync.digest, meta["digest"])

    def _record(self, f: int, result: AveragingResult | None, waited: float,
                seconds: float) -> None:
        s = self.stats[f]
        s.wait_s += waited
        if result is None:
            s.solo += 1
            return
        s.averaging_s += seconds
        if result.ok:
            s.ok += 1
            s.last_group_size = result.group_size
        else:
            s.failed += 1
            kind = result.error.split(":")[0] or "unknown"
            s.failures[kind] = s.failures.get(kind, 0) + 1
            log.debug("fragment %d: sync failed after %.2f s (%s): applied the own outer "
                      "gradient", f, seconds, result.error)

    def _resync(self, f: int, ref: Mapping[str, Any], grad: torch.Tensor) -> None:
        """Adopt fragment ``f`` of the reference member's anchor and outer state."""
        if self.fetch_state is None:
            return
        frag, st, s = self.fragments[f], self.state, self.stats[f]
        try:
            _, anchor, outer = self.fetch_state(str(ref["endpoint"]))
        except Exception as exc:  # keep our own state; the next sync checks again
            s.resync_failures += 1
            log.warning("state download from %s failed: %s", ref["endpoint"], exc)
            return
        if anchor.shape != self.anchor.shape or set(outer) != set(st.outer.buffers) or any(
                t.shape != anchor.shape for t in outer.values()):
            s.resync_failures += 1
            log.warning("state from %s does not fit this node (%d params, this model %d; "
                        "outer state %s, here %s)", ref["endpoint"], anchor.numel(),
                        self.anchor.numel(), sorted(outer), list(st.outer.buffers))
            return
        if digests_match(self._digest(frag, anchor, outer), ref["digest"]):
            # downloaded before the reference landed this sync: take its step here
            st.outer.step_fragment(frag, anchor, grad, outer)
        with self.lock.urgent(), torch.no_grad():
            frag.copy_(self.anchor, frag.gather(anchor))
            for name, t in outer.items():
                frag.copy_(st.outer.state[name], frag.gather(t))
            merge_fragment(frag, st.theta, frag.gather(anchor), self.cfg.merge_alpha)
            self.epochs[f] = int(ref["epoch"]) + 1
            st.rounds = self.train_stats.rounds = sum(self.epochs)
        s.resyncs += 1
        log.info("fragment %d: adopted the state of %s at epoch %d", f, ref["endpoint"],
                 self.epochs[f])

    # ------------------------------------------------------------------ checkpoints
    def feedback_state(self) -> dict[str, torch.Tensor]:
        """Each fragment's error-feedback accumulator (what its messages left out so far), a
        copy by fragment index, for the node's checkpoint."""
        with self._feedback_lock:
            return {str(f): ef.error.clone() for f, ef in sorted(self.feedback.items())}

    def restore_feedback(self, saved: Mapping[str, Any]) -> None:
        """Take back :meth:`feedback_state`'s accumulators. One that does not fit this node
        (another payload, fragment size or split; non-finite or huge values) is dropped with a
        warning: its fragment starts from zero, as a fresh node's."""
        if self.sparse is None:
            if saved:
                log.warning("the checkpoint's error feedback is unused: --diloco-codec %s "
                            "sends no sparse messages", self.cfg.diloco_codec)
            return
        for key, t in saved.items():
            f = int(key) if str(key).isdigit() else -1
            if not 0 <= f < len(self.fragments) or not isinstance(t, torch.Tensor) \
                    or t.dtype != torch.float32 or t.shape != (self.fragments[f].numel,) \
                    or not bool(torch.isfinite(t).all()) \
                    or (t.numel() and float(t.abs().max()) > MAX_FEEDBACK):
                log.warning("the checkpoint's error feedback for fragment %s does not fit this "
                            "node: that fragment's starts from zero", key)
                continue
            with self._feedback_lock:
                ef = ErrorFeedback(self.sparse, self.fragments[f].numel, 1.0,
                                   self.anchor.device)
                ef.error.copy_(t)
                self.feedback[f] = ef

    # ------------------------------------------------------------------ views
    def set_epoch(self, rounds: int) -> None:
        """After adopting a peer's state at start-up: its ``rounds`` (the sum of its fragment
        epochs) spread over the fragments in their sync order, as nodes in step have them."""
        parts = len(self.fragments)
        with self.lock.urgent():
            self.epochs = [rounds // parts + (1 if f < rounds % parts else 0)
                           for f in range(parts)]
            self.state.rounds = self.train_stats.rounds = rounds

    def snapshot(self) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
        """(rounds, anchor copy, the outer state's copies by name) under the lock: what
        DownloadState serves."""
        with self.lock.urgent(writes=False):
            st = self.state
            return (st.rounds, self.anchor.clone(),
                    {name: t.clone() for name, t in st.outer.state_dict().items()})

    def bytes_sent(self, f: int) -> int:
        return self.stats[f].bytes_sent

    def info_fields(self) -> dict[str, Any]:
        """The streaming fields of the Info reply: totals, and one entry per fragment."""
        ss = self.stats
        last = max(range(len(ss)), key=lambda f: ss[f].last_start_step)
        return {
            "averaging_rounds_ok": sum(s.ok for s in ss),
            "averaging_rounds_failed": sum(s.failed for s in ss),
            "averaging_rounds_solo": sum(s.solo for s in ss),
            "last_group_size": ss[last].last_group_size,
            "total_averaging_s": sum(s.wait_s for s in ss),
            "outer_epoch": sum(self.epochs), "resyncs": sum(s.resyncs for s in ss),
            "bytes_sent": sum(s.bytes_sent for s in ss),
            "bytes_received": sum(s.bytes_received for s in ss),
            "fragment_syncs": [
                {"index": f, "offset": s.offset, "numel": s.numel, "syncs_ok": s.ok,
                 "syncs_failed": s.failed, "syncs_solo": s.solo,
                 "last_start_step": s.last_start_step, "epoch": self.epochs[f],
                 "bytes_sent": self.bytes_sent(f), "wait_s": s.wait_s, "resyncs": s.resyncs}
                for f, s in enumerate(ss)]}

    def progress_text(self) -> str:
        parts = " ".join(f"f{f}:{s.ok}/{s.failed}/{s.solo}" for f, s in enumerate(self.stats))
        wait = sum(s.wait_s for s in self.stats)
        sent = sum(self.bytes_sent(f) for f in range(len(self.fragments)))
        group = max(self.stats, key=lambda s: s.last_start_step).last_group_size
        return (f"diloco epochs {self.epochs} syncs ok/failed/solo {parts} | group {group} | "
                f"stalled {wait:.2f} s | sent {sent / 1e6:.2f} MB")

