"""Atomic checkpoints: write a temporary file in the same directory, fsync, then rename.

A crash or a full disk during the write leaves the previous checkpoint intact: ``os.replace``
is atomic on POSIX within one file system. :class:`CheckpointError` carries an actionable
message; the daemon logs it and keeps training.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
FILENAME = "node.pt"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the old one (if any) is untouched."""


def checkpoint_path(directory: str | Path) -> Path:
    return Path(directory) / FILENAME


def save_atomic(payload: dict[str, Any], directory: str | Path) -> Path:
    """Write ``payload`` (torch.save) to ``directory/node.pt`` atomically; returns the path."""
    target = checkpoint_path(directory)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".node-", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoints in {target.parent}: {exc.strerror}; "
                              "fix the permissions or pass another --checkpoint-dir") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        hint = ("the disk is full: free space or pass another --checkpoint-dir"
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "check the directory")
        raise CheckpointError(f"checkpoint to {target} failed ({exc.strerror}); the previous "
                              f"checkpoint is kept; {hint}") from exc
    return target


def load(directory: str | Path) -> dict[str, Any] | None:
    """The checkpoint in ``directory``, or None if there is none."""
    path = checkpoint_path(directory)
    if not path.exists():
        return None
    try:
        payload: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path} ({exc}); move it away to start fresh") from exc
    return payload
