"""The node's C-allocator settings (issue 9): arenas capped, big blocks mapped and returned."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gasloc_p2p.node.runtime import allocator

pytestmark = pytest.mark.skipif(allocator._libc() is None, reason="needs glibc")

# A fresh process: optionally tune, then 8 threads allocate at once; print the arenas in use
# and how much of 40 freed 4 MiB blocks (allocated after one of that size was freed, which
# raises glibc's dynamic mmap threshold) stays resident.
_PROBE = """
import ctypes, sys, threading
from gasloc_p2p.node.runtime import allocator
if sys.argv[1] == "tune":
    allocator.tune(mmap_threshold=allocator.MMAP_THRESHOLD_BYTES)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
bar = threading.Barrier(8)
def work():
    bar.wait()
    blocks = [libc.malloc(100) for _ in range(20000)]
    for b in blocks:
        libc.free(ctypes.c_void_p(b))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
size = 4 << 20
libc.free(ctypes.c_void_p(libc.malloc(size)))
base = rss()
blocks = [libc.malloc(size) for _ in range(40)]
for b in blocks:
    ctypes.memset(b, 1, size)
for b in blocks[:-1]:  # the last one pins the heap's top: the rest cannot be trimmed away
    libc.free(ctypes.c_void_p(b))
print(allocator.arena_count(), rss() - base)
"""


def _probe(mode: str) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.split()
    return int(out[0]), int(out[1])


def test_tune_caps_arenas_and_returns_big_blocks():
    arenas, kept = _probe("tune")
    default_arenas, default_kept = _probe("none")
    assert arenas <= allocator.ARENA_MAX < default_arenas
    assert kept < 16 << 20 < 100 << 20 < default_kept  # 39 x 4 MiB freed: gone vs. kept


def test_environment_choice_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert allocator.tune() == allocator.Applied(reason="set by the environment")

