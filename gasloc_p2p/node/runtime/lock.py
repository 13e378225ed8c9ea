"""The training lock: the trainer's steps against urgent work (gossip commits, snapshots)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class TrainingLock:
    """Mutual exclusion between the trainer and urgent work (corrections, snapshots).

    A plain lock is unfair: the trainer releases it and re-acquires it at once, starving the
    commit threads. Here a waiting urgent holder blocks the trainer's next acquisition.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._urgent_waiting = 0
        # urgent holds that may have written the parameters: a multi-rank node sends its
        # parameters to its other ranks before a step when this moved (node/runtime/ranks.py)
        self.writes = 0
        self.steps = 0  # the trainer's holds (each may have moved the parameters)
        # called by each urgent holder once it holds the lock, before it reads or writes (a
        # sharded node fills its full copy of the parameters there: node/runtime/sharded.py)
        self.on_hold: Callable[[], None] | None = None

    @contextmanager
    def urgent(self, writes: bool = True) -> Iterator[None]:
        """For gossip commits, snapshots and checkpoints: served before the next train step.
        ``writes`` False: the holder only reads the parameters (a snapshot, a prepare)."""
        with self._cond:
            self._urgent_waiting += 1
            while self._held:
                self._cond.wait()
            self._urgent_waiting -= 1
            self._held = True
        try:
            if self.on_hold is not None:
                self.on_hold()
            yield
        finally:
            if writes:
                self.writes += 1
            self._release()

    def wrote(self) -> None:
        """The step's holder wrote the parameters beyond the step (a round end)."""
        self.writes += 1

    @contextmanager
    def step(self) -> Iterator[None]:
        """For one optimizer step or round end of the trainer."""
        with self._cond:
            while self._held or self._urgent_waiting:
                self._cond.wait()
            self._held = True
        try:
            yield
        finally:
            self.steps += 1
            self._release()

    def _release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()
