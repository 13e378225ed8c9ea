"""The training lock: the trainer's steps against urgent work (gossip commits, snapshots)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
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

    @contextmanager
    def urgent(self) -> Iterator[None]:
        """For gossip commits, snapshots and checkpoints: served before the next train step."""
        with self._cond:
            self._urgent_waiting += 1
            while self._held:
                self._cond.wait()
            self._urgent_waiting -= 1
            self._held = True
        try:
            yield
        finally:
            self._release()

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
            self._release()

    def _release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()
