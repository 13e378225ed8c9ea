"""Child processes for ``gasloc-node swarm`` and its tests: logs in files, clean stops.

Each child runs in its own process group (so a terminal's Ctrl+C reaches only the parent,
which then stops the children in order) and gets SIGTERM if the parent dies (Linux
``PR_SET_PDEATHSIG``, set by a tiny exec wrapper, not by ``preexec_fn``, which is unsafe in a
process with threads). :meth:`Child.stop` sends SIGTERM, waits, then SIGKILLs whatever is left
in the child's process group (its DHT process and ``p2pd`` for a node).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

# Exec wrapper: ask for SIGTERM when the parent dies, then become the real program. The parent
# pid is checked after prctl, in case the parent died before it.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class ChildError(RuntimeError):
    """A child exited or did not print what was expected; the message has its log's tail."""


class Child:
    """One child process; stdout and stderr go to ``<log_dir>/<name>.out`` and ``.err``."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.out = log_dir / f"{name}.out"
        self.err = log_dir / f"{name}.err"
        wrapped = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *self.argv]
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(wrapped, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=dict(env) if env is not None else None,
                                         process_group=0)
        self.pid = self.proc.pid  # also its process group id
        self._terminated = False
        log.debug("started %s (pid %d): %s", name, self.pid, " ".join(self.argv))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 2000, stdout: bool = False) -> str:
        path = self.out if stdout else self.err
        try:
            return path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_for(self, pattern: str, timeout_s: float, stdout: bool = True,
                 cancel: threading.Event | None = None) -> re.Match[str]:
        """The first match of ``pattern`` in the child's output; ChildError on exit/timeout."""
        path = self.out if stdout else self.err
        deadline = time.monotonic() + timeout_s
        while True:
            found = re.search(pattern, path.read_text(errors="replace"), re.M)
            if found:
                return found
            if not self.alive:
                raise ChildError(f"{self.name} exited with code {self.proc.returncode} before "
                                 f"printing {pattern!r}; its log ({self.err}) ends with:\n"
                                 f"{self.tail()}")
            if time.monotonic() > deadline:
                raise ChildError(f"{self.name} printed no {pattern!r} within {timeout_s:g} s; "
                                 f"its log ({self.err}) ends with:\n{self.tail()}")
            if cancel is not None and cancel.is_set():
                raise ChildError(f"stopped while waiting for {self.name}")
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)  # a no-op once the child has been reaped

    def terminate(self) -> None:
        """SIGTERM once (a node takes a second SIGTERM as "force": never send two)."""
        if not self._terminated:
            self._terminated = True
            self.signal(signal.SIGTERM)

    def stop(self, grace_s: float) -> int:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL the group; returns the exit code.

        The group is SIGKILLed even after a clean exit: nothing of the child may outlive it.
        """
        self.terminate()
        try:
            code = self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %g s: killing it", self.name, grace_s)
            code = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if code is None:
            code = self.proc.wait(timeout=10)
        return code

    def group_alive(self) -> list[int]:
        """Live (non-zombie) pids of this child's process group."""
        return group_members(self.pid)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid`` (Linux /proc)."""
    return _members(2, pgid)


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is ``sid`` (Linux /proc)."""
    return _members(3, sid)


def _members(field: int, ident: int) -> list[int]:
    """Live pids whose /proc stat field ``field`` (after the command name) equals ``ident``."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[field]) == ident and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive
