"""The node's training loop: AdamW inner steps and GASLoC round ends, in a worker thread.

One explicit loop (nanoGPT style): sample a batch from this node's shard, forward, backward and
AdamW step, all under the :class:`TrainingLock` (a gossip correction must not land between the
forward and the backward: it would change tensors autograd saved). Every ``H`` steps the outer
update: GASLoC's ``AsyncGaslocState.round_end`` inside that step's lock hold, or the
``round_end`` callback a mode injects (DiLoCo: after the step, without the lock, which it takes
itself around its network wait). The event loop never runs any of this.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.flat import FlatParams, Fragment, layer_fragments, whole
from gasloc_p2p.data import ByteTokenizer, Shard, TokenData, load_corpus
from gasloc_p2p.model import build_model, layer_index, model_fingerprint
from gasloc_p2p.node.config import TrainConfig
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.stats import TrainStats
from gasloc_p2p.train import AdamWConfig, InnerLoop, LRSchedule, evaluate

log = logging.getLogger(__name__)
_EMA = 0.9  # smoothing of step time and throughput


def inner_settings(cfg: TrainConfig) -> tuple[LRSchedule, AdamWConfig]:
    """This node's inner schedule and optimizer (the cosine spans ``--lr-horizon-steps``)."""
    schedule = LRSchedule(lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                          min_lr_ratio=cfg.min_lr_ratio, horizon_steps=cfg.lr_horizon_steps)
    return schedule, AdamWConfig(weight_decay=cfg.weight_decay, decay_vectors=cfg.decay_vectors)


def load_data(cfg: TrainConfig, seed: int) -> tuple[Shard, list[tuple[torch.Tensor, torch.Tensor]]]:
    """This node's training shard and the fixed validation batches (same on every node)."""
    data = TokenData.build(load_corpus(cfg.data or None), ByteTokenizer())
    spec = cfg.shard_spec()
    shard = data.shards(spec[1], iid=True, seed=seed)[spec[0]] if spec else \
        data.shards(1, iid=True, seed=seed)[0]
    return shard, data.val_batches(cfg.batch_size, cfg.seq_len, cfg.eval_batches)


def derive_seed(text: str) -> int:
    """A stable 63-bit seed from a string (e.g. the peer id)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class Trainer:
    """Model, optimizer and outer state of one node; :meth:`run` is the worker-thread body."""

    def __init__(self, cfg: TrainConfig, outer: AsyncConfig, fragments: int,
                 lock: TrainingLock, stats: TrainStats,
                 round_end: Callable[[], None] | None = None) -> None:
        """``round_end``: the mode's outer update, called by :meth:`step` every
        ``inner_steps`` after the step, without the lock (it may wait on the network); None:
        the GASLoC update ``AsyncGaslocState.round_end``, inside the H-th step's lock hold (no
        exchange or checkpoint can fall between a round's last step and its round end)."""
        self.cfg = cfg
        self.lock = lock
        self.stats = stats
        gpt = cfg.gpt()
        self.model = build_model(gpt, cfg.seed)
        self.fingerprint = model_fingerprint(self.model, gpt, cfg.seed)
        self.flat = FlatParams(self.model)
        self.theta0 = self.flat.buffer.detach().clone()
        self.state = AsyncGaslocState(self.flat.buffer, self.theta0, outer)
        self.inner = InnerLoop(self.model, *inner_settings(cfg))
        self.optimizer = self.inner.optimizer
        self.fragments: list[Fragment] = (
            [whole(self.flat.numel)] if fragments == 1
            else layer_fragments(self.flat.spans, layer_index, fragments, "strided"))
        self.shard: Shard | None = None
        self.val: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.generator = torch.Generator()
        self.finished = threading.Event()
        self.round_end = round_end
        self._good: tuple[torch.Tensor, torch.Tensor] | None = None  # (anchor, memory)

    def load_data(self, data_seed: int) -> None:
        self.shard, self.val = load_data(self.cfg, self.cfg.seed)
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
        except Exception as exc:
            self.stats.error = f"{type(exc).__name__}: {exc}"
            log.exception("training failed at step %d", self.stats.step)
        finally:
            self.stats.running = False
            self.finished.set()

    def _limit_reached(self, started: float) -> bool:
        cfg = self.cfg
        return bool((cfg.max_steps and self.stats.step >= cfg.max_steps)
                    or (cfg.max_time_s and time.monotonic() - started >= cfg.max_time_s))

    def step(self) -> float:
        """One inner AdamW step (and the round end every H steps); returns the loss."""
        assert self.shard is not None, "call load_data first"
        cfg, st = self.cfg, self.stats
        x, y = self.shard.batch(cfg.batch_size, cfg.seq_len, self.generator)
        t0 = time.perf_counter()
        with self.lock.step():
            loss = self.inner.step(x, y, st.step)
            st.step += 1
            round_end = st.step % cfg.inner_steps == 0
            if round_end and self.round_end is None:
                self.state.round_end()
                st.rounds = self.state.rounds
        if not math.isfinite(float(loss.detach())):
            self._roll_back(float(loss.detach()))
            return float(loss.detach())
        dt = time.perf_counter() - t0
        st.step_time_s = dt if st.step_time_s == 0 else _EMA * st.step_time_s + (1 - _EMA) * dt
        st.tokens += y.numel()
        st.tokens_per_s = y.numel() / st.step_time_s
        st.train_loss = float(loss.detach())
        if round_end and self.round_end is not None:
            self.round_end()  # after the timing: tokens/s stays compute throughput
        if round_end or self._good is None:
            self._keep_good()
        return st.train_loss

    # ------------------------------------------------------------------ rollback
    def _keep_good(self) -> None:
        """Remember the anchor and outer memory of a round end reached with a finite loss."""
        with self.lock.urgent():
            st = self.state
            if not math.isfinite(float(st.anchor.sum())):
                return  # never keep a bad anchor as the good one
            if self._good is None:
                self._good = (st.anchor.clone(), st.memory.clone())
            else:
                self._good[0].copy_(st.anchor)
                self._good[1].copy_(st.memory)

    def _roll_back(self, loss: float) -> None:
        """A non-finite loss: back to the last good anchor with fresh AdamW moments, at most
        ``max_rollbacks`` times (then FloatingPointError: the node stops)."""
        st = self.stats
        if self._good is None or st.rollbacks >= self.cfg.max_rollbacks:
            raise FloatingPointError(f"training diverged: loss {loss} at step {st.step} "
                                     f"after {st.rollbacks} rollback(s); lower --lr or --gamma, "
                                     "or resume a checkpoint")
        with self.lock.urgent():
            anchor, memory = self._good
            self.state.theta.copy_(anchor)
            self.state.anchor.copy_(anchor)
            self.state.memory.copy_(memory)
            self.optimizer.state.clear()  # the moments may hold NaN too
        st.rollbacks += 1
        log.warning("loss %s at step %d: rolled back to the last good anchor (rollback %d of "
                    "at most %d)", loss, st.step, st.rollbacks, self.cfg.max_rollbacks)

    def _evaluate(self) -> None:
        loss = evaluate(self.model, self.val)
        self.stats.val_loss = loss
        if math.isnan(self.stats.first_val_loss):
            self.stats.first_val_loss = loss
        log.debug("step %d val_loss %.4f", self.stats.step, loss)

    # ------------------------------------------------------------------ state
    def state_for_checkpoint(self) -> dict[str, Any]:
        """Copies of everything needed to resume (taken under the lock)."""
        with self.lock.urgent():
            st = self.state
            return {"fingerprint": self.fingerprint, "step": self.stats.step,
                    "rounds": st.rounds, "tokens": self.stats.tokens,
                    "theta": st.theta.clone(), "anchor": st.anchor.clone(),
                    "memory": st.memory.clone(), "momentum": st.cfg.momentum,
                    "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                    "generator": self.generator.get_state(),
                    "val_loss": self.stats.val_loss, "first_val_loss": self.stats.first_val_loss}

    def restore(self, ckpt: dict[str, Any]) -> None:
        """Load a checkpoint written by :meth:`state_for_checkpoint`; ValueError if foreign."""
        if ckpt.get("fingerprint") != self.fingerprint:
            raise ValueError("checkpoint belongs to another model (fingerprint differs): use "
                             "another --checkpoint-dir or the same model flags and --seed")
        if ckpt.get("momentum") != self.state.cfg.momentum:
            raise ValueError(f"checkpoint used --momentum {ckpt.get('momentum')}")
        with self.lock.urgent():
            st = self.state
            st.theta.copy_(ckpt["theta"])
            st.anchor.copy_(ckpt["anchor"])
            st.memory.copy_(ckpt["memory"])
            st.rounds = int(ckpt["rounds"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.generator.set_state(ckpt["generator"])
            self.stats.step, self.stats.rounds = int(ckpt["step"]), st.rounds
            self.stats.tokens = int(ckpt["tokens"])
            self.stats.val_loss = float(ckpt["val_loss"])
            self.stats.first_val_loss = float(ckpt["first_val_loss"])
            self._good = None

    def adopt(self, params: torch.Tensor, memory: torch.Tensor) -> None:
        """Start from a peer's public iterate and outer memory (late join).

        AdamW starts fresh and this node's own step count (so its warmup) is kept: the peer's
        moments would not match this node's data anyway.
        """
        if params.shape != self.state.theta.shape or memory.shape != params.shape:
            raise ValueError(f"peer state has {params.numel()} params, this model "
                             f"{self.state.theta.numel()}")
        with self.lock.urgent():
            self.state.theta.copy_(params)
            self.state.anchor.copy_(params)
            self.state.memory.copy_(memory)
            self._good = None
