"""The C allocator's settings for a node process (glibc ``mallopt``/``malloc_trim``), issue 9.

A node allocates model-size tensors (gradients, AdamW's step temporaries, payloads, decoded
fragments, the state snapshot) from many threads: the trainer, the event loop, gRPC's pollers
and a 32-thread ``to_thread`` pool. glibc gives each thread that contends a lock its own arena
(up to 8 per core) and, once a freed block is larger than its mmap threshold, raises that
threshold (up to 32 MiB) so that later blocks of that size come from the arenas' heaps, where
freed memory stays resident. :func:`tune` caps the arenas; fixing the mmap threshold (so that
tensors of a megabyte or more are mapped on their own and returned when freed) is opt-in
(``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment, or ``tune(mmap_threshold=...)``): it
cost 22 % of the step time of a 12.8M-parameter GPT on one thread (page faults on every
step's fresh activations and gradients), measured side by side. :func:`trim` hands back what
the heaps keep after a burst (an exchange, a checkpoint).

Outside glibc (musl, macOS) both are no-ops that say so. Nothing here touches torch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
M_ARENA_MAX = -8

ARENA_MAX = 2
MMAP_THRESHOLD_BYTES = 1 << 20  # 1 MiB (opt-in): every model-size buffer is its own mapping


@dataclass(frozen=True)
class Applied:
    """What :func:`tune` set (zeros and ``reason`` when it could not)."""

    arena_max: int = 0
    mmap_threshold: int = 0
    reason: str = ""


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None  # not glibc
    return libc


def tune(arena_max: int = ARENA_MAX, mmap_threshold: int = 0) -> Applied:
    """Cap glibc's arenas and, when ``mmap_threshold`` > 0, fix its mmap threshold (call
    before threads start).

    An environment that already chose (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``,
    ``GLIBC_TUNABLES``) is left alone for that setting.
    """
    libc = _libc()
    if libc is None:
        return Applied(reason="not glibc: allocator left as it is")
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    arenas = threshold = 0
    if ("MALLOC_ARENA_MAX" not in os.environ and "arena_max" not in tunables
            and libc.mallopt(M_ARENA_MAX, arena_max) == 1):
        arenas = arena_max
    # a fixed threshold also stops glibc from raising it (and the trim threshold with it)
    if (mmap_threshold > 0 and "MALLOC_MMAP_THRESHOLD_" not in os.environ and "mmap_threshold" not in tunables
            and libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1):
        threshold = mmap_threshold
    return Applied(arenas, threshold, "" if arenas or threshold else "set by the environment")


def trim() -> bool:
    """Return the free memory of every arena to the system (``malloc_trim(0)``)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def arena_count() -> int:
    """Arenas in use by this process (from ``malloc_info``; 0 when it cannot be read)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "open_memstream"):
        return 0
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    libc.open_memstream.restype = ctypes.c_void_p
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return 0
    try:
        libc.malloc_info(0, ctypes.c_void_p(stream))
    finally:
        libc.fclose(ctypes.c_void_p(stream))
    text = ctypes.string_at(buf, size.value).decode()
    libc.free(buf)
    return text.count("<heap nr=")
