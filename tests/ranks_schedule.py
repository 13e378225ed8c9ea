"""One node's trainer on a fixed schedule, as one process or as rank 0 of K (gloo, real ranks).

``python -m tests.ranks_schedule OUT CORPUS GRAD_ACCUM DEVICE [SHARDING [compile]]`` runs the schedule in one process, or,
with the launcher's environment (``RANK``/``WORLD_SIZE``/...), as one rank of a multi-rank
node (SHARDING ``ddp``: replicas; ``fsdp``: each rank holds rows of the model): rank 0 drives
the trainer, the others follow it (:func:`ranks.follow`). The schedule
writes the parameters between steps the way an exchange does (a correction under the
training lock), takes GASLoC round ends, restores a checkpoint taken earlier (parameters and
AdamW state replaced), and makes the loss non-finite once (a rollback clears the AdamW state), with the gossip
guard's drift probe on.
Rank 0 (or the single process) saves its parameters, whether the replicas agreed at the stop,
and its counters to OUT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.core.drift import DriftProbe
from gasloc_p2p.node.config import TrainConfig
from gasloc_p2p.node.runtime import checkpoint as ckpt
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.ranks import RankGroup, distributed_env, follow
from gasloc_p2p.node.runtime.trainer import Trainer, follower_replica
from gasloc_p2p.node.stats import TrainStats
from tests.daemon_helpers import tiny_config

TICKS = 30  # steps taken (a restore goes back in the step count; the ticks go on)
CORRECT_AT, SAVE_AT, RESTORE_AT, NAN_AT = (5, 21), 9, 13, 18


def main(out: str, corpus: str, grad_accum: int, device: str, sharding: str = "ddp",
         compile_: str = "") -> int:
    found = distributed_env()
    group = RankGroup(*found) if found is not None else None
    try:
        return _run(out, corpus, grad_accum, device, sharding, group, compile_ == "compile")
    finally:
        if group is not None:  # before the interpreter's teardown (gloo's threads)
            group.close()


def _run(out: str, corpus: str, grad_accum: int, device: str, sharding: str,
         group: RankGroup | None, compile_: bool = False) -> int:
    if group is not None and not group.leader:
        held = []

        def build(got, ranks):
            replica = follower_replica(got, ranks)
            held.append(replica)
            return replica

        code = follow(group, build)
        if held and held[0].sharded is not None:  # what this rank held: its rows only
            torch.save({"rows_bytes": held[0].sharded.local_bytes(),
                        "full_copy": held[0].flat is not None}, f"{out}.rank{group.rank}")
        return code
    cfg = schedule_config(corpus, grad_accum, device, sharding, compile_)
    lock = TrainingLock()
    trainer = Trainer(cfg, OUTER, 1, lock, TrainStats(), ranks=group)
    # the checkpoint taken at SAVE_AT, written as the daemon does (sharded: the ranks write
    # their rows of the AdamW state beside it)
    trainer.checkpoint_dir = f"{out}.ckpt"
    trainer.load_data(7)
    # the gossip guard's drift probe: sharded, it samples the ranks' rows around every step
    drifts: list[dict[int, float]] = []
    trainer.probe = DriftProbe(trainer.state.theta, trainer.fragments)
    trainer.on_drift = drifts.append
    gen = torch.Generator().manual_seed(3)
    saved, val, failed = None, float("nan"), ""
    for tick in range(TICKS):
        theta = trainer.state.theta
        if tick in CORRECT_AT:  # what a gossip commit does: a write under the lock
            with lock.urgent():
                theta.add_(torch.randn(theta.numel(), generator=gen).to(theta.device) * 1e-3)
        if tick == SAVE_AT:  # an evaluation first: sharded, the ranks' collective forward
            val = trainer.val_loss()
            if sharding == "fsdp":  # ranks that cannot write: that checkpoint fails, they go on
                failed = _blocked_save(trainer, Path(f"{out}.blocked"))
            saved = trainer.state_for_checkpoint()
            ckpt.save_atomic(saved, trainer.checkpoint_dir)
        if tick == RESTORE_AT:
            assert saved is not None
            trainer.restore(saved)
        if tick == NAN_AT:
            with lock.urgent():
                theta[0] = float("nan")
        trainer.step()
    with lock.urgent():  # a commit after the last step: the stop must carry it
        trainer.state.theta.add_(1e-3)
    agree = trainer.stop_ranks()
    torch.save({"theta": trainer.flat.buffer.cpu(), "theta0": trainer.theta0.float(),
                "agree": agree, "drifts": drifts, "val": val,
                "rollbacks": trainer.stats.rollbacks, "step": trainer.stats.step,
                "rounds": trainer.stats.rounds, "checkpoint": trainer.checkpoint_dir,
                "failed_save": failed, "graphs": _compiled_graphs()}, out)
    return 0


OUTER = AsyncConfig(eta=0.7, gamma=0.5, w=0.5)


def _compiled_graphs() -> int:
    """How many graphs torch.compile built in this process (0: nothing was compiled)."""
    import torch._dynamo.utils as dynamo_utils

    return int(dynamo_utils.counters["stats"]["unique_graphs"])


def _blocked_save(trainer: Trainer, blocked: Path) -> str:
    """A sharded checkpoint into a directory no rank can write (a file stands where it should
    be): the one-line error rank 0 gets (every rank saw the failure and goes on)."""
    blocked.write_text("a file where the checkpoint directory should be")
    kept, trainer.checkpoint_dir = trainer.checkpoint_dir, str(blocked)
    try:
        trainer.state_for_checkpoint()
    except ckpt.CheckpointError as exc:
        return str(exc)
    finally:
        trainer.checkpoint_dir = kept
    return "no error"


def schedule_config(corpus: str | Path, grad_accum: int, device: str,
                    sharding: str, compile_: bool = False) -> TrainConfig:
    """The schedule's training settings (a test builds the same trainer to resume from the
    schedule's checkpoint)."""
    return tiny_config(Path(corpus), inner_steps=8, grad_accum=grad_accum, batch_size=4,
                       n_embd=32, n_head=2, warmup_steps=4, max_rollbacks=2,
                       seq_len=33,  # the position table: 33 rows, sharded 17 + 16
                       device=device, sharding=sharding, compile=compile_).train


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
    sys.stdout.flush()
    sys.stderr.flush()
    # as gasloc-node does: no interpreter teardown (DDP's reducer outlives the process group
    # there, and its threads' destruction aborted 1 exit in a few)
    os._exit(code)
