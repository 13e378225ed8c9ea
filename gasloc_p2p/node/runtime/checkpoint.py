"""Atomic checkpoints: write a temporary file in the same directory, fsync, then rename.

A crash or a full disk during the write leaves the previous checkpoint intact: ``os.replace``
is atomic on POSIX within one file system. :class:`CheckpointError` carries an actionable
message; the daemon logs it and keeps training.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
FILENAME = "node.pt"
MAX_ABS_VALUE = 1e6  # as the exchange engine's limit on decoded values


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


_TENSORS = ("theta", "anchor", "memory")
_FIELDS = ("fingerprint", "step", "rounds", "tokens", "momentum", "optimizer", "generator",
           *_TENSORS)


def validate(payload: dict[str, Any], fingerprint: str, numel: int, path: str | Path) -> None:
    """CheckpointError (one line) unless ``payload`` is this model's, complete and finite.

    A checkpoint holding NaN or huge values would load and crash at the first step: under a
    restart policy, a crash loop. Optimizer moments are checked too (a NaN there is as fatal).
    """
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} is unusable: {why}; move it away to start "
                               "fresh (or resume another one)")

    missing = [k for k in _FIELDS if k not in payload]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    if payload["fingerprint"] != fingerprint:
        raise bad("it belongs to another model (fingerprint differs): use the same model "
                  "flags and --seed, or another --checkpoint-dir")
    for name in _TENSORS:
        t = payload[name]
        if t is None and name in ("memory", "anchor"):  # outer buffers a node may not keep
            continue
        if not isinstance(t, torch.Tensor) or t.shape != (numel,):
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise bad(f"{name} has shape {shape}, the model needs [{numel}]")
        _check_values(t, name, bad)
    for key, t in _optimizer_tensors(payload["optimizer"]):
        _check_values(t, f"optimizer {key}", bad)


def _check_values(t: torch.Tensor, name: str, bad: Any) -> None:
    if t.numel() and t.is_floating_point():
        hi, lo = float(t.amax()), float(t.amin())
        if not (math.isfinite(hi) and math.isfinite(lo)):
            raise bad(f"{name} holds NaN or Inf")
        if max(hi, -lo) > MAX_ABS_VALUE:
            raise bad(f"{name} holds values up to {max(hi, -lo):.3g} (limit {MAX_ABS_VALUE:g})")


def _optimizer_tensors(state_dict: Any) -> list[tuple[str, torch.Tensor]]:
    state = state_dict.get("state", {}) if isinstance(state_dict, dict) else {}
    return [(f"{k}.{name}", t) for k, per in state.items() if isinstance(per, dict)
            for name, t in per.items() if isinstance(t, torch.Tensor) and t.dim() > 0]


def load(directory: str | Path) -> dict[str, Any] | None:
    """The checkpoint in ``directory``, or None if there is none. Memory-mapped: a tensor's
    bytes are read when used (an export of a 1B model never holds the file twice)."""
    path = checkpoint_path(directory)
    if not path.exists():
        return None
    try:
        payload: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True,
                                               mmap=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path} ({exc}); move it away to start fresh") from exc
    return payload
