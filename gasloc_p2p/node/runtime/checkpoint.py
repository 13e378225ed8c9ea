"""Atomic checkpoints: write a temporary file in the same directory, fsync, then rename.

A crash or a full disk during the write leaves the previous checkpoint intact: ``os.replace``
is atomic on POSIX within one file system. :class:`CheckpointError` carries an actionable
message; the daemon logs it and keeps training.

A node sharded over its ranks (FSDP2) keeps its AdamW state out of ``node.pt``: every rank
writes its rows of it with ``torch.distributed.checkpoint`` (DCP) into a directory beside it,
``optim-<number>`` (numbered in the order they are made), complete (DCP writes its
``.metadata`` last) before ``node.pt`` names it (``{"sharded": name}`` in the ``optimizer``
field). Once the new ``node.pt`` is in place the directories made before the one it names are
removed (a later one may be on its way: the state saved as the ranks stop). DCP reshards at
load: the node resumes with any number of ranks, and a one-rank node reads the whole state
(:func:`read_sharded_optimizer`).

The outer state is stored as ``outer`` (the outer optimizer's registry name) and
``outer_state`` (its buffers by name, :mod:`gasloc_p2p.core.outer`); a checkpoint of the
format before it (``momentum``: the form, ``memory``: its one buffer or None) is read as the
same (:func:`outer_of`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from gasloc_p2p.core.outer import OUTER_OPTIMIZERS

log = logging.getLogger(__name__)
FILENAME = "node.pt"
MAX_ABS_VALUE = 1e6  # as the exchange engine's limit on decoded values
SHARDED = "sharded"  # the optimizer field of a sharded node's checkpoint: {SHARDED: dir name}
_SHARDED_NAME = re.compile(r"optim-([0-9]{10})")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the old one (if any) is untouched."""


def checkpoint_path(directory: str | Path) -> Path:
    return Path(directory) / FILENAME


def save_atomic(payload: dict[str, Any], directory: str | Path, sharded: bool = True) -> Path:
    """Write ``payload`` (torch.save) to ``directory/node.pt`` atomically; returns the path.
    Then the sharded AdamW directories made before the one it names are removed (on a
    failure, the one it names: nothing else names it); a node that is not ``sharded`` (it
    makes none: one resumed from a sharded node's checkpoint) removes them all."""
    target = checkpoint_path(directory)
    keep = _number(sharded_name(payload.get("optimizer")))
    if not sharded and keep is None:
        keep = 1 << 62
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
        discard(payload, directory)
        hint = ("the disk is full: free space or pass another --checkpoint-dir"
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "check the directory")
        raise CheckpointError(f"checkpoint to {target} failed ({exc.strerror}); the previous "
                              f"checkpoint is kept; {hint}") from exc
    for old in target.parent.glob("optim-*"):
        number = _number(old.name)
        if keep is not None and number is not None and number < keep:
            shutil.rmtree(old, ignore_errors=True)
    return target


def _number(name: str | None) -> int | None:
    match = _SHARDED_NAME.fullmatch(name) if name is not None else None
    return int(match.group(1)) if match else None


def sharded_name(optimizer: Any) -> str | None:
    """The directory name of a sharded node's AdamW state (``{"sharded": name}``), else
    None (a one-rank node's ``optimizer.state_dict()``)."""
    if isinstance(optimizer, dict) and set(optimizer) == {SHARDED}:
        return str(optimizer[SHARDED])
    return None


def new_sharded_name(directory: str | Path) -> str:
    """A directory name for the next sharded AdamW state in ``directory``: numbered after
    every one there (the trainer makes them one at a time, under its lock)."""
    found = [_number(d.name) for d in Path(directory).glob("optim-*")]
    return f"optim-{max((n for n in found if n is not None), default=0) + 1:010d}"


def discard(payload: dict[str, Any], directory: str | Path) -> None:
    """Remove the sharded AdamW directory of a checkpoint that was not written."""
    name = sharded_name(payload.get("optimizer"))
    if name is not None and _number(name) is not None:
        shutil.rmtree(Path(directory) / name, ignore_errors=True)


def _sharded_entries(path: Path) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """parameter name -> {AdamW key -> (shape, dtype)} of the tensors DCP saved in ``path``
    (its metadata alone: nothing is read but that file)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"cannot read the sharded AdamW state {path} ({exc}); move the "
                              "checkpoint away to start fresh") from exc
    out: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    for key, m in meta.items():
        if key.startswith("state.") and isinstance(m, TensorStorageMetadata):
            name, _, what = key[len("state."):].rpartition(".")
            out.setdefault(name, {})[what] = (tuple(m.size), m.properties.dtype)
    return out


_READ_BYTES = 256 << 20  # a validation reads the AdamW state in batches of about this size


def _read_sharded(path: Path, entries: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]
                  ) -> dict[str, dict[str, torch.Tensor]]:
    """Some parameters' whole AdamW tensors (``entries``: name -> key -> (shape, dtype)),
    read from every rank's file in ``path`` in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    out = {n: {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in e.items()}
           for n, e in entries.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"state": out}, checkpoint_id=str(path), no_dist=True)
    return out


def _batches(entries: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]
             ) -> list[dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]]:
    """``entries`` in batches of about ``_READ_BYTES`` (one parameter at least): one DCP
    read each (a read per parameter cost 17 ms of planning: 3.6 s at 100M parameters)."""
    out: list[dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]] = [{}]
    size = 0
    for name, e in entries.items():
        nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in e.values())
        if out[-1] and size + nbytes > _READ_BYTES:
            out.append({})
            size = 0
        out[-1][name] = e
        size += nbytes
    return out


def read_sharded_optimizer(path: str | Path, names: list[str],
                           param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """A sharded node's AdamW state (DCP, written by any number of ranks) as one unsharded
    AdamW's ``state_dict()`` over the parameters ``names`` (in the optimizer's order), with the
    reader's own ``param_groups``: how a node of one rank (or of DDP replicas) resumes it."""
    entries = _sharded_entries(Path(path))
    unknown = sorted(set(entries) - set(names))
    if unknown:
        raise CheckpointError(f"the sharded AdamW state {path} holds parameters this model "
                              f"lacks ({unknown[0]}, ...); move the checkpoint away")
    whole = _read_sharded(Path(path), entries)
    state = {i: whole[n] for i, n in enumerate(names) if n in whole}
    return {"state": state, "param_groups": param_groups}


_TENSORS = ("theta", "anchor")
_FIELDS = ("fingerprint", "step", "rounds", "tokens", "optimizer", "generator", *_TENSORS)


def outer_of(payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The checkpoint's outer optimizer: (name, its buffers by name). The format before named
    outer optimizers stored ``momentum`` (the form) and ``memory`` (its one buffer; None at
    gamma 0: plain averaging); it reads as that form's class with the buffer under its name."""
    if "outer" in payload:
        state = payload.get("outer_state")
        return str(payload["outer"]), dict(state) if isinstance(state, dict) else {}
    memory, form = payload.get("memory"), str(payload.get("momentum"))
    if memory is None:
        return "average", {}
    cls = OUTER_OPTIMIZERS.get(form)
    return form, {cls.buffers[0] if cls is not None and len(cls.buffers) == 1 else "memory":
                  memory}


def validate(payload: dict[str, Any], fingerprint: str, numel: int, path: str | Path) -> None:
    """CheckpointError (one line) unless ``payload`` is this model's, complete and finite.

    A checkpoint holding NaN or huge values would load and crash at the first step: under a
    restart policy, a crash loop. Optimizer moments are checked too (a NaN there is as fatal).
    """
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} is unusable: {why}; move it away to start "
                               "fresh (or resume another one)")

    missing = [k for k in _FIELDS if k not in payload]
    if "outer" not in payload and not {"momentum", "memory"} <= set(payload):
        missing.append("outer")
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    if payload["fingerprint"] != fingerprint:
        raise bad("it belongs to another model (fingerprint differs): use the same model "
                  "flags and --seed, or another --checkpoint-dir (a Hugging Face config's "
                  "theta_0 is drawn otherwise since 2026-11-27: older checkpoints of one differ)")
    tensors = {name: payload[name] for name in _TENSORS}
    tensors.update({f"outer {k}": t for k, t in outer_of(payload)[1].items()})
    for name, t in tensors.items():
        if t is None and name == "anchor":  # a node may not keep it
            continue
        if not isinstance(t, torch.Tensor) or t.shape != (numel,):
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise bad(f"{name} has shape {shape}, the model needs [{numel}]")
        _check_values(t, name, bad)
    for key, t in _optimizer_tensors(payload["optimizer"]):
        _check_values(t, f"optimizer {key}", bad)
    shards = sharded_name(payload["optimizer"])
    if shards is not None:
        _validate_sharded(Path(path).parent, shards, numel, bad)


def _validate_sharded(directory: Path, name: str, numel: int, bad: Any) -> None:
    """The sharded AdamW state ``node.pt`` names: a plain name, complete (DCP's metadata),
    one pair of moments the size of the model, finite; read in batches of about 256 MiB."""
    where = directory / name
    if not _SHARDED_NAME.fullmatch(name) or not (where / ".metadata").is_file():
        raise bad(f"its sharded AdamW state {where} is missing or incomplete")
    try:
        entries = _sharded_entries(where)
    except CheckpointError as exc:
        raise bad(str(exc).split(" (", 1)[0]) from exc
    moments = sum(math.prod(e["exp_avg"][0]) for e in entries.values() if "exp_avg" in e)
    if entries and moments != numel:
        raise bad(f"its sharded AdamW state holds {moments} moments, the model {numel}")
    for batch in _batches(entries):
        for pname, tensors in _read_sharded(where, batch).items():
            for key, t in tensors.items():
                if t.dim() > 0:  # (as for a one-rank checkpoint: the moments, not the counts)
                    _check_values(t, f"optimizer {pname}.{key}", bad)


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
