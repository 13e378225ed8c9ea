"""``gasloc-node join --nproc-per-node K``: start the K ranks of one node and watch them.

The same command runs in K child processes with the environment ``torchrun`` would give them
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on a free local
port); rank 0 is the node, the others train beside it (:mod:`gasloc_p2p.node.runtime.ranks`).
``torchrun --nproc-per-node K -m gasloc_p2p.cli join ...`` does the same without this
launcher.

The launcher owns its children: Ctrl-C reaches every rank from the terminal (rank 0 stops the
node cleanly, the others wait for its word); SIGTERM is passed to rank 0. When a rank dies,
the launcher names it on one line, stops the others (SIGTERM, then SIGKILL after
:data:`STOP_GRACE_S`) and exits 1; a restart of the same command resumes from the node's
checkpoint. Otherwise its exit code is rank 0's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

STOP_GRACE_S = 30.0  # rank 0's clean stop (a checkpoint) before the launcher kills it
# the other ranks, once rank 0 is gone: they have nothing to save and exit by themselves when
# their next collective fails (at once); one still waiting to meet rank 0 is killed
FOLLOWER_GRACE_S = 5.0
POLL_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(base: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    return dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                GASLOC_NPROC_PER_NODE=str(world))


def _die_with_parent(sig: int) -> Callable[[], None]:
    """A rank gets ``sig`` when the launcher dies, however it dies (Linux; elsewhere
    nothing): no rank outlives it. Rank 0 gets SIGTERM (a clean stop), the others SIGKILL
    (they ignore SIGTERM: rank 0 stops them)."""

    def arm() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG

    return arm


def describe(code: int) -> str:
    """``signal SIGKILL`` or ``exit code 3``: how a child process ended (its exit code)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def launch(argv: Sequence[str], world: int) -> int:
    """Run ``gasloc-node <argv>`` as ``world`` ranks; returns the node's exit code."""
    port = free_port()
    cmd = [sys.executable, "-m", "gasloc_p2p.cli", *argv]
    procs = [subprocess.Popen(cmd, env=rank_env(dict(os.environ), r, world, port),
                              preexec_fn=_die_with_parent(signal.SIGTERM if r == 0
                                                          else signal.SIGKILL))
             for r in range(world)]
    stopping = [False]

    def on_term(signum: int, _frame: object) -> None:
        stopping[0] = True
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, h) for s, h in ((signal.SIGTERM, on_term),
                                               (signal.SIGINT, signal.SIG_IGN))}
    try:
        return _watch(procs, world)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _reap(procs)


def _watch(procs: list[subprocess.Popen[bytes]], world: int) -> int:
    while True:
        codes = [p.poll() for p in procs]
        dead = [r for r, c in enumerate(codes) if c is not None and (c != 0 or r == 0)]
        if not dead:
            if all(c == 0 for c in codes):
                return 0
            time.sleep(POLL_S)
            continue
        # a rank that died takes rank 0 down with it (a collective fails): where both are
        # gone by the time we look, the rank that failed is the news, not rank 0's exit
        first = next((r for r in dead if r != 0 and codes[r] != 0), dead[0])
        code = codes[first]
        assert code is not None
        if first == 0:  # the node ended: the others stop with it (or have already)
            _stop_all(procs)
            return code
        # one write of the whole line: rank 0 logs to the same stderr meanwhile, and print's
        # text and newline as two writes were once split by its line (seen in a CI run)
        line = (f"gasloc-node join: rank {first} of {world} died ({describe(code)}); the node "
                "stops; run the same command again to resume from its checkpoint\n")
        sys.stderr.write(line)
        sys.stderr.flush()
        _stop_all(procs)
        return 1


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Rank 0 gets SIGTERM first (it stops the node cleanly); the others once it is gone."""
    deadline = time.monotonic() + STOP_GRACE_S
    if procs[0].poll() is None:
        procs[0].send_signal(signal.SIGTERM)
        try:
            procs[0].wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs[0].kill()
    deadline = time.monotonic() + FOLLOWER_GRACE_S
    for p in procs[1:]:
        if p.poll() is None:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
