"""The node's training loop: AdamW inner steps and GASLoC round ends, in a worker thread.

One explicit loop (nanoGPT style): sample a batch from this node's shard, forward, backward and
AdamW step, all under the :class:`TrainingLock` (a gossip correction must not land between the
forward and the backward: it would change tensors autograd saved). Every ``H`` steps the outer
update: GASLoC's ``AsyncGaslocState.round_end`` inside that step's lock hold, or the
``round_end`` callback a mode injects (DiLoCo: after the step, without the lock, which it takes
itself around its network wait). The event loop never runs any of this.

The training device holds what training needs: parameters, gradients, AdamW state and
activations. Everything else model-sized lives in host memory, pinned beside a GPU (see
:meth:`Trainer.placement`): the outer state (anchor, the outer optimizer's named buffers,
:mod:`gasloc_p2p.core.outer`), ``theta_0`` (bfloat16) and the rollback copy; checkpoints and
state snapshots are copied to the host piece by piece, never deep-copied on the device. On
CUDA the step's loss is read one step late (no host wait per step), batches go through pinned
memory, AdamW is fused and float32 matrix products may use TF32.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState, spans
from gasloc_p2p.core.drift import DriftProbe
from gasloc_p2p.core.flat import FlatParams, Fragment, host_buffer, layer_fragments, whole
from gasloc_p2p.core.options import ConfigError
from gasloc_p2p.core.outer import State, restore_problem
from gasloc_p2p.data import BPETokenizer, TrainingData, load_training_data
from gasloc_p2p.model import layer_index
from gasloc_p2p.model_spec import BuiltModel, build, skeleton
from gasloc_p2p.node.config import TrainConfig
from gasloc_p2p.node.config_train import out_of_memory
from gasloc_p2p.node.runtime import checkpoint as ckpt_files
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.ranks import RankGroup, RankLost, Replica, rank_device, rows_on
from gasloc_p2p.node.runtime.sharded import (
    Sharded,
    layer_stack,
    optimizer_names,
    shard_model,
)
from gasloc_p2p.node.stats import ExchangeStats, TrainStats
from gasloc_p2p.protocol.guard import LossWatch
from gasloc_p2p.train import (
    AdamWConfig,
    InnerLoop,
    LRSchedule,
    StepConfig,
    evaluate,
    resolve_device,
)
from gasloc_p2p.train.optim import BackwardAdamW, gradients_at_once

log = logging.getLogger(__name__)
_EMA = 0.9  # smoothing of step time and throughput


def inner_settings(cfg: TrainConfig) -> tuple[LRSchedule, AdamWConfig]:
    """This node's inner schedule and optimizer (the cosine spans ``--lr-horizon-steps``)."""
    schedule = LRSchedule(lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                          min_lr_ratio=cfg.min_lr_ratio, horizon_steps=cfg.lr_horizon_steps)
    return schedule, AdamWConfig(weight_decay=cfg.weight_decay, decay_vectors=cfg.decay_vectors)


def load_data(cfg: TrainConfig, seed: int) -> TrainingData:
    """This node's tokenizer, training batches and the fixed validation batches (the same on
    every node). Streamed data (JSON Lines / Parquet) is read lazily."""
    return load_training_data(cfg.data, cfg.tokenizer, cfg.data_field, seq_len=cfg.seq_len,
                              batch_size=cfg.batch_size * cfg.grad_accum,
                              eval_batches=cfg.eval_batches, shard=cfg.shard_spec(), seed=seed,
                              data_sha256=cfg.data_sha256)


def build_node_model(cfg: TrainConfig, vocab_size: int) -> BuiltModel:
    """The model ``--model`` names, checked against the tokenizer and ``--seq-len`` (CPU)."""
    built = build(cfg.model, cfg.gpt(vocab_size), cfg.seed)
    if built.vocab_size < vocab_size:
        raise ValueError(f"--model {cfg.model}: vocabulary {built.vocab_size} is smaller than "
                         f"the tokenizer's {vocab_size}; use a matching --tokenizer")
    if cfg.seq_len > built.max_seq_len:
        raise ValueError(f"--seq-len={cfg.seq_len} exceeds the model's context "
                         f"{built.max_seq_len}")
    return built


def build_replica(cfg: TrainConfig, vocab_size: int, device: torch.device,
                  ranks: RankGroup | None = None,
                  ) -> tuple[BuiltModel, FlatParams, InnerLoop, Sharded | None]:
    """The node's model on ``device``: one flat parameter buffer (built on the host, then
    moved: the device never holds two copies), activation checkpointing as asked, and the
    inner loop (AdamW). On a rank of a multi-rank node (``ranks``; a collective: every rank
    builds its replica at the same time) through DDP, or with ``--sharding fsdp`` sharded
    over the ranks (:mod:`.sharded`): the flat buffer then stays on the host, a full copy of
    the parameters apart from the model's rows (rank 0's, which the exchange engine and the
    outer state work on)."""
    how = StepConfig(cfg.precision, cfg.grad_accum, cfg.compile)
    if ranks is not None and cfg.sharding == "fsdp":
        return _sharded_replica(cfg, vocab_size, device, ranks, how)
    built = build_node_model(cfg, vocab_size)
    set_activation_checkpointing(built.module, cfg.activation_checkpointing)
    flat = FlatParams(built.module).to(device)
    built.module.to(device)  # the module's non-parameter buffers
    inner = InnerLoop(built.module, *inner_settings(cfg), how=how,
                      data_parallel=ranks is not None)
    return built, flat, inner, None


def _sharded_replica(cfg: TrainConfig, vocab_size: int, device: torch.device,
                     ranks: RankGroup, how: StepConfig,
                     ) -> tuple[Any, FlatParams, InnerLoop, Sharded]:
    """:func:`build_replica` with ``--sharding fsdp``. Rank 0 builds the model on the host
    (theta_0: its flat buffer stays there as the node's full copy); the other ranks build it
    on the meta device (names and shapes, no storage: no rank but rank 0 ever holds the whole
    model) and take their rows and the module's buffers from rank 0."""
    if ranks.leader:
        built: Any = build_node_model(cfg, vocab_size)
        module = built.module
    else:
        built, module = None, skeleton(cfg.model, cfg.gpt(vocab_size))
    set_activation_checkpointing(module, cfg.activation_checkpointing)
    flat = FlatParams(module)  # rank 0: the full copy, on the host; else only the layout
    shard_model(module, device, ranks.world)
    # the module holds its rows now; rank 0's copy goes to pinned memory beside a GPU (its
    # fills and hand-backs copy every parameter between the host and the device)
    flat.release(pin=ranks.leader and device.type == "cuda")
    sharded = Sharded(module, flat.spans, ranks.rank, ranks.world)
    sharded.materialize(flat.buffer if ranks.leader else None, device)
    inner = InnerLoop(module, *inner_settings(cfg), how=how, sharded=True)
    return built, flat, inner, sharded


def follower_replica(got: tuple[TrainConfig, int], ranks: RankGroup) -> Replica:
    """A rank > 0's replica, from rank 0's settings and vocabulary size."""
    cfg, vocab = got
    device = rank_device(cfg.device, ranks.local_rank)
    _, flat, inner, sharded = build_replica(cfg, vocab, device, ranks)
    if sharded is not None:
        return Replica(None, inner, device, sharded=sharded)  # its full copy is dropped
    return Replica(flat, inner, device)


def derive_seed(text: str) -> int:
    """A stable 63-bit seed from a string (e.g. the peer id)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@dataclasses.dataclass(frozen=True)
class Placed:
    """One model-sized buffer of a node: its name, bytes and where it lives ("device": the
    training device; "host": host memory, pinned beside a GPU)."""

    name: str
    nbytes: int
    where: str


class Trainer:
    """Model, optimizer and outer state of one node; :meth:`run` is the worker-thread body."""

    def __init__(self, cfg: TrainConfig, outer: AsyncConfig, fragments: int,
                 lock: TrainingLock, stats: TrainStats,
                 round_end: Callable[[], None] | None = None, keep_anchor: bool = False,
                 ranks: RankGroup | None = None,
                 before_build: Callable[[str, int], None] | None = None) -> None:
        """``round_end``: the mode's outer update, called by :meth:`step` every
        ``inner_steps`` after the step, without the lock (it may wait on the network); None:
        the GASLoC update ``AsyncGaslocState.round_end``, inside the H-th step's lock hold (no
        exchange or checkpoint can fall between a round's last step and its round end).
        ``keep_anchor``: the mode reads the anchor even where the momentum form does not.
        ``ranks``: this process is rank 0 of a multi-rank node (:mod:`.ranks`): the other
        ranks build their replicas with this one and follow its steps. ``before_build``:
        called with the device type and the vocabulary size once the data is read, before the
        model is built (the node says what it builds, and refuses what cannot fit)."""
        self.cfg = cfg
        self.ranks = ranks
        self._ranks_lost = False  # a collective failed: the other ranks are not to be waited on
        self.lock = lock
        self.stats = stats
        # the gossip transport's counters of exchange work in flight (set by the gossip mode):
        # steps that overlap none are "quiet" (TrainStats.quiet_steps, the utilization)
        self.exchange_work: ExchangeStats | None = None
        self.device = (resolve_device(cfg.device) if ranks is None
                       else rank_device(cfg.device, ranks.local_rank))
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 where float32 products remain
        self.host = torch.device("cpu")  # the outer state's home, pinned beside a GPU
        self.data = load_data(cfg, cfg.seed)  # first: the tokenizer sets the vocabulary
        if before_build is not None:
            before_build(self.device.type, self.data.tokenizer.vocab_size)
        if ranks is not None:  # the other ranks build the same replica
            ranks.share(cfg)
            ranks.share(self.data.tokenizer.vocab_size)
            if cfg.sharding == "fsdp":  # and evaluate their rows of the validation batches
                ranks.share_batches(self.data.val)
        built, self.flat, self.inner, self.sharded = build_replica(
            cfg, self.data.tokenizer.vocab_size, self.device, ranks)
        # sharded: the flat buffer (rank 0's full copy) is behind the ranks' rows after a
        # step; a reader arriving then (an exchange, a checkpoint) fills it first
        self._copy_behind = False
        # where checkpoints go (the daemon sets it). Sharded, each rank writes its rows of the
        # AdamW state there (a directory beside node.pt), also before the ranks stop, for the
        # checkpoint that follows the stop
        self.checkpoint_dir = ""
        self._final_optimizer: dict[str, Any] | None = None
        if self.sharded is not None:
            assert ranks is not None
            ranks.sharded = self.sharded
            lock.on_hold = self._catch_up
        self.model = built.module
        # Runs apart: architecture, theta_0 and the tokenizer (same ids must mean the same).
        self.fingerprint = hashlib.sha256(
            f"{built.fingerprint}/{self.data.tokenizer.name}".encode()).hexdigest()
        self.model_description = built.description
        self.validation_set = self.data.validation_set
        # the flat buffer holds theta_0 now: the state copies what it keeps to the host
        self.state = AsyncGaslocState(self.flat.buffer, self.flat.buffer, outer, host=self.host,
                                      keep_anchor=keep_anchor)
        # theta_0 in bfloat16 on the host (a quarter of a float32 copy on the device's side:
        # none): it only anchors the plausibility screens (update guard, bootstrap agreement:
        # displacements from it, whose bfloat16 rounding is common to both sides compared)
        self.theta0 = host_buffer(self.flat.numel, self.flat.buffer, self.host, torch.bfloat16)
        for s, e in spans(self.flat.numel):
            self.theta0[s:e].copy_(self.flat.buffer[s:e].to(torch.bfloat16), non_blocking=True)
        self.state.sync()
        self.optimizer = self.inner.optimizer
        self._optimizer_epoch = 0  # moves when the AdamW state is replaced (ranks follow)
        self.n_layer = built.n_layer
        if fragments > built.n_layer:
            raise ValueError(f"--fragments={fragments} exceeds the model's {built.n_layer} "
                             "layers")
        self.fragments: list[Fragment] = (
            [whole(self.flat.numel)] if fragments == 1
            else layer_fragments(self.flat.spans, layer_index, fragments, "strided"))
        self.shard: Any = None
        self.val: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.generator = torch.Generator()
        # (generator state, data position) after the last step's batch: what a checkpoint
        # stores, so a resumed node draws the batches it would have drawn
        self._mark: tuple[torch.Tensor, dict[str, Any] | None] | None = None
        self.finished = threading.Event()
        self.round_end = round_end
        self.round_end_every_step = False  # a mode's callback after every step (DiLoCo)
        # the gossip mode's measure of this node's own drift, and who learns it per round
        self.probe: DriftProbe | None = None
        self.on_drift: Callable[[dict[int, float]], None] | None = None
        self.losses = LossWatch()  # a finite loss jump rolls back like NaN
        self._nonfinite = 0  # non-finite losses rolled back (max_rollbacks of them, then stop)
        # the last round end reached with finite values: (theta, the outer optimizer's
        # buffers by name), in host memory
        self._good: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
        self._good_round = 0  # the round end the good copy was taken at
        # a rollback for a rise of the loss (LossWatch.risen) first tells the gossip mode what
        # moved the node since the good copy: (theta now, the good copy, its round)
        self.on_rollback: Callable[[torch.Tensor, torch.Tensor, int], None] | None = None
        # whether a peer's exchange moved the node since a round (the rise rule undoes pushes:
        # a rise with none since the good copy is the node's own training, kept)
        self.moved_since: Callable[[int], bool] | None = None
        self._late: tuple[torch.Tensor, int] | None = None  # CUDA: (loss, tokens) to read

    def placement(self) -> list[Placed]:
        """Every model-sized buffer this node holds and where: what ``plan`` and the memory
        benchmarks count (parameters, gradients and AdamW moments on the training device; the
        outer state, theta_0 and the rollback copy on the host, "device" if a tensor of theirs
        is found on a GPU). On a CPU node both places are the same memory; the roles stay."""
        numel, out = self.flat.numel, []
        if self.sharded is not None:  # this rank's rows on the device; the full copy on the host
            rows = self.sharded.local_bytes()
            out.append(Placed("parameters (this rank's rows)", rows, "device"))
            out.append(Placed("parameters, full copy (rank 0)", self.flat.buffer.nbytes, "host"))
            # reduce-scattered: a rank keeps its rows' gradients from backward to the step
            out.append(Placed("gradients (during a step)", rows, "device"))
        else:
            out.append(Placed("parameters", self.flat.buffer.nbytes, "device"))
            # gradients exist from a step's backward pass to its optimizer step (then freed);
            # with AdamW stepped in the backward pass, about a layer's at once
            grads = gradients_at_once(numel, max(p.numel() for p in self.model.parameters()),
                                      self.n_layer, isinstance(self.optimizer, BackwardAdamW))
            out.append(Placed("gradients (during a step)", 4 * grads, "device"))
        moments = [_local(t) for st in self.optimizer.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor) and t.numel() > 1]
        expect = 2 * (self.sharded.local_bytes() if self.sharded is not None else 4 * numel)
        out.append(Placed("adamw moments", sum(t.nbytes for t in moments) or expect,
                          "device"))
        good = self._good[1] if self._good else {}
        named = (("anchor", self.state.anchor),
                 *((f"outer {n}", t) for n, t in self.state.outer.state.items()),
                 ("theta_0 (bfloat16)", self.theta0),
                 ("rollback copy", self._good[0] if self._good else None),
                 *((f"rollback {n}", t) for n, t in good.items()))
        out += [Placed(name, t.nbytes, _where(t)) for name, t in named if t is not None]
        return out

    def warm_up(self) -> None:
        """With ``--compile``: compile forward and backward on one batch (parameters and
        AdamW state untouched), so the first real step holds the lock no longer than any."""
        if not self.cfg.compile or self.shard is None or self.ranks is not None:
            return  # several ranks: DDP compiles in the first step, on every rank
        gen = torch.Generator().manual_seed(0)
        x, y = self.shard.batch(self.cfg.batch_size, self.cfg.seq_len, gen)
        if isinstance(self.optimizer, BackwardAdamW):
            self.optimizer.active = False  # the parameters must not move
        try:
            with self.inner.autocast():
                _, loss = self.inner.forward(x.to(self.device), y.to(self.device))
            assert loss is not None
            loss.backward()
        except torch.OutOfMemoryError:
            raise  # not the compiler's fault: the node says what fits (cli_node)
        except Exception as exc:  # a compiler or toolchain error, dozens of lines long
            first = next((line for line in str(exc).splitlines() if line.strip()), "")
            raise ConfigError(f"--compile: torch.compile could not build the model on "
                              f"{self.device} ({type(exc).__name__}: {first[:200]}); run "
                              "without --compile") from exc
        finally:
            if isinstance(self.optimizer, BackwardAdamW):
                self.optimizer.active = True
        self.optimizer.zero_grad(set_to_none=True)

    def load_data(self, data_seed: int) -> None:
        """Start sampling this node's batches with ``data_seed`` (the data is loaded already)."""
        self.shard = self.data.train
        self.val = [(x.to(self.device), y.to(self.device)) for x, y in self.data.val]
        self.generator.manual_seed(data_seed)

    # ------------------------------------------------------------------ loop
    def run(self, stop: threading.Event) -> None:
        """Train until ``stop`` is set or a step/time limit is reached (then ``finished``)."""
        torch.set_num_threads(self.cfg.torch_threads)
        self.stats.running = True
        started = time.monotonic()
        try:
            if math.isnan(self.stats.first_val_loss):
                self._evaluate()
            while not stop.is_set() and not self._limit_reached(started):
                self.step()
                if self.stats.step % self.cfg.eval_interval_steps == 0:
                    self._evaluate()
        except RankLost as exc:
            self._ranks_lost = True
            self.stats.error = str(exc)
            log.error("training stopped at step %d: %s", self.stats.step, exc)
        except torch.OutOfMemoryError as exc:  # one line: what fits, which flags lower it
            self.stats.error = out_of_memory(self.cfg, exc, f"at step {self.stats.step}")
        except Exception as exc:
            self.stats.error = f"{type(exc).__name__}: {exc}"
            log.exception("training failed at step %d", self.stats.step)
        finally:
            self.stop_ranks()
            self.stats.running = False
            self.finished.set()

    def stop_ranks(self) -> bool:
        """Rank 0 of a multi-rank node: stop the other ranks (after one last comparison of the
        replicas), unless one of them is gone already. True when the replicas agreed (or
        there are no other ranks)."""
        ranks, self.ranks = self.ranks, None
        if ranks is None or self._ranks_lost:
            return ranks is None
        try:
            with self.lock.urgent(writes=False):
                if self.sharded is not None and self.checkpoint_dir:
                    try:
                        self._final_optimizer = self._save_sharded(ranks)
                    except ckpt_files.CheckpointError as exc:  # the ranks stop all the same
                        log.warning("%s", exc)
                agree = ranks.stop(self.flat.buffer, self.optimizer,
                                   (self.lock.writes, self._optimizer_epoch))
            if self.sharded is not None:
                log.info("stopped the node's %d ranks (sharded; rank 0's full copy is "
                         "current)", ranks.world)
            else:
                log.info("stopped the node's %d ranks: replicas %s", ranks.world,
                         "identical" if agree else "DIFFERENT")
            return agree
        except RankLost as exc:
            log.error("%s", exc)
            return False

    def _limit_reached(self, started: float) -> bool:
        cfg = self.cfg
        return bool((cfg.max_steps and self.stats.step >= cfg.max_steps)
                    or (cfg.max_time_s and time.monotonic() - started >= cfg.max_time_s))

    def step(self) -> float:
        """One inner AdamW step (and the round end every H steps); returns the loss (on CUDA
        the previous step's: read one step late, so the host never waits for the GPU)."""
        assert self.shard is not None, "call load_data first"
        cfg, st = self.cfg, self.stats
        x, y = self.shard.batch(cfg.batch_size * cfg.grad_accum, cfg.seq_len, self.generator)
        mark = self._data_mark()  # where the next step's batch comes from
        tokens, ranks = y.numel(), self.ranks
        # Host-to-device copies before the lock: gossip commits wait only for the step itself.
        if ranks is None:
            if self.device.type == "cuda":
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        work = self.exchange_work
        before = (work.work_started, work.work_active) if work is not None else None
        t0 = time.perf_counter()
        with self.lock.step():
            if ranks is not None:  # the other ranks get what changed, then the batch
                if self.sharded is not None and self.probe is not None \
                        and self.probe.read is None:
                    self._probe_ranks(ranks, self.probe)
                ranks.lead(st.step, x, y, self.flat.buffer, self.optimizer,
                           (self.lock.writes, self._optimizer_epoch))
                x, y = (rows_on(t, cfg.grad_accum, 0, ranks.world, self.device)
                        for t in (x, y))
            if self.probe is not None:
                self.probe.before_step()
            loss = self.inner.step(x, y, st.step)
            if ranks is not None:
                loss = ranks.mean(loss)  # the node's loss: every rank's rows
            if self.probe is not None:
                self.probe.after_step()
            st.step += 1
            self._mark = mark
            self._copy_behind = self.sharded is not None
            round_end = st.step % cfg.inner_steps == 0
            if round_end and ranks is not None:
                ranks.verify(self.flat.buffer)  # the replicas took the same steps
            if round_end and self.round_end is None:
                self._catch_up()
                self.state.round_end()
                self.lock.wrote()  # the other ranks get the new parameters before the next step
                st.rounds = self.state.rounds
            writes = self.lock.writes  # what the loss below judges: the state as of now
        if round_end and self.probe is not None and self.on_drift is not None:
            self.on_drift(self.probe.round_end())
        value = self._read_loss(loss.detach(), tokens)
        if self.losses.implausible(value):
            self._roll_back(value, jump=math.isfinite(value))
            return value
        if self.losses.risen():
            if self.moved_since is None or self.moved_since(self._good_round):
                self._roll_back(value, jump=True, rise=True)  # pushed uphill: undo, blame
                return value
            self.losses.rebase()  # the node's own training rose (its data, its schedule)
            log.debug("the loss's average rose with no exchange since round %d: kept",
                      self._good_round)
        dt = time.perf_counter() - t0
        st.step_time_s = dt if st.step_time_s == 0 else _EMA * st.step_time_s + (1 - _EMA) * dt
        st.timed_steps += 1
        st.train_s += dt
        if work is None or (work.work_active == 0 and before == (work.work_started, 0)):
            st.quiet_steps += 1  # no exchange work ran during this step
            st.quiet_s += dt
        st.tokens += tokens
        st.tokens_per_s = tokens / st.step_time_s
        st.train_loss = value
        if self.round_end is not None and (round_end or self.round_end_every_step):
            self.round_end()  # after the timing: tokens/s stays compute throughput
            writes = self.lock.writes  # the mode's own outer step belongs to the kept state
        if (round_end and self.losses.near_best()) or self._good is None:
            self._keep_good(writes)  # never a state the loss judged risen
        return st.train_loss

    def _catch_up(self) -> None:
        """Sharded: fill rank 0's full copy from the ranks' rows if a step moved them since
        (the training lock's holder calls it before reading or writing the flat buffer)."""
        if self._copy_behind and self.ranks is not None:
            self.ranks.pull(self.flat.buffer)
            self._copy_behind = False

    def private_loss(self) -> Callable[[], float] | None:
        """The loss of a private held-out batch (a quarter of a training batch drawn once
        from this node's data with the OS's randomness: no peer knows it), for the loss gate
        (:class:`gasloc_p2p.protocol.blame.LossGate`); called under the training lock. None
        on a multi-rank node (a forward pass there is every rank's)."""
        if self.ranks is not None or self.sharded is not None or self.shard is None:
            return None
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        draw = getattr(self.shard, "peek", self.shard.batch)  # a stream's: nothing consumed
        x, y = draw(max(1, self.cfg.batch_size // 4), self.cfg.seq_len, gen)
        batch = [(x.to(self.device), y.to(self.device))]  # drawn now: before training runs
        return lambda: evaluate(self.model, batch)

    def _probe_ranks(self, ranks: RankGroup, probe: DriftProbe) -> None:
        """Sharded: the drift probe samples the ranks' rows (its positions sent once)."""
        ranks.probe_at(probe.positions)
        probe.read_with(ranks.sample, self.device)

    def _read_loss(self, loss: torch.Tensor, tokens: int) -> float:
        """The loss as a float: at once on a CPU; on CUDA the previous step's (the GPU runs
        one step ahead of the host; a non-finite loss is then caught one step later)."""
        if self.device.type != "cuda":
            return float(loss)
        late, self._late = self._late, (loss, tokens)
        return float(late[0] if late is not None else loss)  # the first step: at once

    # ------------------------------------------------------------------ rollback
    def _keep_good(self, writes: int | None = None) -> None:
        """Remember theta and the outer optimizer's state of a round end reached with finite
        values (in host memory: a rollback copy on the device would cost 4 bytes per parameter).
        ``writes``: the training lock's write count when the step that judged this state
        ended; if anything wrote since (a gossip commit, an injected push), the state is not
        the one the loss judged and the previous copy stays (a push landing between a round
        end's loss check and this copy became the "good" state: the rollback then restored
        it, 1 test run in 8 under load)."""
        with self.lock.urgent(writes=False):
            if writes is not None and self.lock.writes != writes and self._good is not None:
                return
            st = self.state
            # one scalar (float64: no overflow), not a model-sized boolean tensor on the device
            if not bool(torch.isfinite(st.theta.sum(dtype=torch.float64))):
                return  # never keep a bad state as the good one
            if self._good is None:
                self._good = (host_buffer(st.theta.numel(), st.theta, self.host),
                              {name: host_buffer(buf.numel(), st.theta, self.host)
                               for name, buf in st.outer.state.items()})
            st.transfer(self._good[0], st.theta)
            for name, buf in st.outer.state.items():
                self._good[1][name].copy_(buf)
            self._good_round = st.rounds

    def _roll_back(self, loss: float, jump: bool = False, rise: bool = False) -> None:
        """A non-finite loss, or (``jump``) a finite one far above the recent ones
        (:class:`LossWatch`; ``rise``: its average stayed up, and :attr:`on_rollback` hears
        what moved the node since the good copy): back to the last good anchor with fresh
        AdamW moments. Non-finite
        losses at most ``max_rollbacks`` times (then FloatingPointError: the node stops); a
        jump never stops the node. The watch starts over after any rollback: a loss that stays
        high (harder data, not a push) is accepted after one, and the first steps of the fresh
        AdamW moments (larger than the ones before them) are not judged against the losses of
        the old ones (a second, needless rollback was seen after a NaN, 1 run in 4)."""
        st, limit = self.stats, self.losses.limit()
        self.losses.reset()
        if jump:
            if self._good is None:
                return
        elif self._good is None or self._nonfinite >= self.cfg.max_rollbacks:
            raise FloatingPointError(f"training diverged: loss {loss} at step {st.step} "
                                     f"after {self._nonfinite} rollback(s); lower --lr or "
                                     "--gamma, or resume a checkpoint")
        else:
            self._nonfinite += 1
        with self.lock.urgent():
            theta, outer = self._good
            if rise and self.on_rollback is not None:
                self.on_rollback(self.state.theta, theta, self._good_round)
            self.state.transfer(self.state.theta, theta)
            if self.state.anchor is not None:
                self.state.anchor.copy_(theta)
            self.state.outer.load_state_dict(outer)
            if not rise:  # the moments may hold NaN too (a rise's are finite: kept, so the
                self.optimizer.state.clear()  # node does not restart AdamW at every push)
                if self.ranks is not None:
                    self.ranks.optimizer_to_send = {}  # sharded: every rank clears its rows'
                self._optimizer_epoch += 1
            self._late = None
        st.rollbacks += 1
        why = (f"its average rose {self.losses.rise:.0%} above its recent best" if rise
               else f"limit {limit:.4g}")
        log.warning("loss %s at step %d (%s): rolled back to the last good anchor of round "
                    "%d (rollbacks %d; non-finite %d of at most %d)", loss, st.step, why,
                    self._good_round, st.rollbacks, self._nonfinite, self.cfg.max_rollbacks)

    def val_loss(self) -> float:
        """The validation loss of the current parameters (nats per token); blocking, and
        only while the trainer thread does not run (start-up checks)."""
        if self.sharded is not None and self.ranks is not None:
            with self.lock.step():  # a collective: none of an exchange's may interleave
                return self.ranks.evaluate(self.inner, self.data.val)
        with self.inner.autocast():
            return evaluate(self.model, self.val)

    def _evaluate(self) -> None:
        loss = self.val_loss()
        self.stats.val_loss = loss
        if math.isnan(self.stats.first_val_loss):
            self.stats.first_val_loss = loss
        # One INFO line per evaluation: what benchmarks read as the loss curve (wall time from
        # the log's timestamp, tokens this node trained on).
        log.info("eval step %d tokens %d val_loss %.4f", self.stats.step, self.stats.tokens, loss)

    # ------------------------------------------------------------------ state
    def state_for_checkpoint(self) -> dict[str, Any]:
        """Host copies of everything needed to resume (taken under the lock, tensor by
        tensor: the device holds no second copy of anything meanwhile)."""
        with self.lock.urgent():
            st = self.state
            return {"fingerprint": self.fingerprint, "step": self.stats.step,
                    "rounds": st.rounds, "tokens": self.stats.tokens,
                    "theta": st.theta.to("cpu", copy=True),
                    "anchor": _host(st.anchor), "outer": st.outer.name,
                    "outer_state": {n: t.to("cpu", copy=True)
                                    for n, t in st.outer.state_dict().items()},
                    "train_config": dataclasses.asdict(self.cfg), "tokenizer": self._tok_doc(),
                    "optimizer": self._optimizer_state(),
                    "generator": self._mark[0] if self._mark else self.generator.get_state(),
                    "data": self._mark[1] if self._mark else self._data_mark()[1],
                    "val_loss": self.stats.val_loss, "first_val_loss": self.stats.first_val_loss}

    def _optimizer_state(self) -> dict[str, Any]:
        """The AdamW state on the host; sharded, written by the ranks beside the checkpoint
        (``{"sharded": directory name}``)."""
        if self.sharded is None:
            return _to_host(self.optimizer.state_dict())
        if self.ranks is None:
            if self._final_optimizer is not None:  # after the stop: what the ranks wrote
                return self._final_optimizer
            raise RankLost("the node's ranks are stopped or gone: its sharded AdamW state "
                           "cannot be saved (the previous checkpoint is kept)")
        return self._save_sharded(self.ranks)

    def _save_sharded(self, ranks: RankGroup) -> dict[str, Any]:
        """Every rank's rows of the AdamW state into a new directory beside the checkpoint
        (none while no step made moments: they would be started by the save)."""
        if not self.optimizer.state:  # every rank's state is empty alike (a rollback, start)
            return {"state": {}, "param_groups": self.optimizer.state_dict()["param_groups"]}
        if not self.checkpoint_dir:
            raise ValueError("a sharded node saves its AdamW state beside its checkpoint: "
                             "set its checkpoint directory first")
        name = ckpt_files.new_sharded_name(self.checkpoint_dir)
        marker = {ckpt_files.SHARDED: name}
        failed = ranks.save_optimizer(self.optimizer, str(Path(self.checkpoint_dir) / name))
        if failed:
            ckpt_files.discard({"optimizer": marker}, self.checkpoint_dir)
            raise ckpt_files.CheckpointError(
                f"the ranks could not write their AdamW state to {self.checkpoint_dir} "
                f"({failed}); the previous checkpoint is kept; free space or pass another "
                "--checkpoint-dir")
        return marker

    def _data_mark(self) -> tuple[torch.Tensor, dict[str, Any] | None]:
        """The sampler's state between two batches: the generator and, for a streamed corpus,
        its position (an in-memory corpus needs only the generator)."""
        position = getattr(self.shard, "position", None)
        return self.generator.get_state(), position() if position is not None else None

    def _tok_doc(self) -> dict[str, Any]:
        """The tokenizer as checkpoint data (export writes it next to the model)."""
        tok = self.data.tokenizer
        if isinstance(tok, BPETokenizer):
            return {"json": tok.to_json(), "eos_id": tok.eos_id}
        return {"name": tok.name}

    def restore(self, ckpt: dict[str, Any]) -> None:
        """Load a checkpoint written by :meth:`state_for_checkpoint`; ValueError if foreign."""
        if ckpt.get("fingerprint") != self.fingerprint:
            raise ValueError("checkpoint belongs to another model (fingerprint differs): use "
                             "another --checkpoint-dir or the same model flags and --seed")
        name, outer = ckpt_files.outer_of(ckpt)
        why = restore_problem(self.state.outer, name, outer)
        if why:
            raise ValueError(f"checkpoint: {why}")
        with self.lock.urgent():
            st = self.state
            st.transfer(st.theta, ckpt["theta"])
            if st.anchor is not None:
                st.anchor.copy_(ckpt["anchor"] if ckpt.get("anchor") is not None
                                else ckpt["theta"])
            self._restore_outer(outer if name == st.outer.name else None)
            st.rounds = int(ckpt["rounds"])
            self._restore_optimizer(ckpt["optimizer"])
            self._optimizer_epoch += 1
            self.generator.set_state(ckpt["generator"])
            if ckpt.get("data") is not None and hasattr(self.shard, "restore"):
                self.shard.restore(ckpt["data"])  # a stream goes on where it was
            self._mark = None
            self.stats.step, self.stats.rounds = int(ckpt["step"]), st.rounds
            self.stats.tokens = int(ckpt["tokens"])
            self.stats.val_loss = float(ckpt["val_loss"])
            self.stats.first_val_loss = float(ckpt["first_val_loss"])
            self._good = None

    def _restore_optimizer(self, saved: dict[str, Any]) -> None:
        """The AdamW state of a checkpoint: a one-rank node's state dict, or the directory
        a sharded node's ranks wrote (read in rows by ranks, whole by a node of one)."""
        name = ckpt_files.sharded_name(saved)
        if name is not None:
            where = str(Path(self.checkpoint_dir) / name)
            if self.sharded is not None and self.ranks is not None:
                self.ranks.optimizer_to_send = {ckpt_files.SHARDED: where}
                return
            saved = ckpt_files.read_sharded_optimizer(
                where, optimizer_names(self.model, self.optimizer),
                self.optimizer.state_dict()["param_groups"])
        if self.sharded is not None and self.ranks is not None:
            self.ranks.optimizer_to_send = saved  # every rank its rows, from rank 0's
        else:
            self.optimizer.load_state_dict(saved)

    def _restore_outer(self, outer: State | None) -> None:
        """The outer optimizer's state from a checkpoint or a peer (under the lock; its own
        buffers by name). None or empty: a node that keeps state starts it afresh at the
        public iterate (``mixed``: no momentum jump at the next round end; ``local``: zero)."""
        st = self.state
        if outer:
            st.outer.load_state_dict(outer)
        else:
            st.reset_outer()

    def adopt(self, params: torch.Tensor, outer: State | None) -> None:
        """Start from a peer's public iterate and its outer optimizer's state (late join;
        None: this node's optimizer starts afresh there).

        AdamW starts fresh and this node's own step count (so its warmup) is kept: the peer's
        moments would not match this node's data anyway.
        """
        if params.shape != self.state.theta.shape or any(
                t.shape != params.shape for t in (outer or {}).values()):
            raise ValueError(f"peer state has {params.numel()} params, this model "
                             f"{self.state.theta.numel()}")
        if outer and set(outer) != set(self.state.outer.buffers):
            raise ValueError(f"peer state holds {sorted(outer)}, this node's "
                             f"{self.state.outer.name} outer optimizer {self.state.outer.buffers}")
        with self.lock.urgent():
            self.state.transfer(self.state.theta, params)
            if self.state.anchor is not None:
                self.state.anchor.copy_(params)
            self._restore_outer(outer)
            self._good = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's rows on this rank (a DTensor's local part), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _where(t: torch.Tensor) -> str:
    return "host" if t.device.type == "cpu" else "device"


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to("cpu", copy=True) if t is not None else None


def _to_host(obj: Any) -> Any:
    """A state dict with every tensor copied to the host, one at a time."""
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def set_activation_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """Recompute each transformer layer's activations in the backward pass (``--activation-
    checkpointing``): the built-in GPT's blocks, or a Hugging Face model's decoder layers
    (the ``ModuleList`` of ``num_hidden_layers`` modules), each wrapped here in
    ``torch.utils.checkpoint`` (non-reentrant). transformers' own switch is not used: its
    name and behaviour changed between releases."""
    if not on:
        return
    if hasattr(model, "checkpointing"):
        setattr(model, "checkpointing", True)  # noqa: B010 (any module with the switch)
        return
    try:
        layers = layer_stack(model)
    except ValueError:
        raise ValueError("--activation-checkpointing: this model has no checkpointable "
                         "layers") from None
    for layer in layers:
        layer.forward = _checkpointed(layer.forward)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
