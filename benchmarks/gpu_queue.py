"""The GPU queue (issue 38): research in slices of a few minutes, in priority order, whose
records add up across the rare, short GPU windows the project gets.

A *slice* is at most about 7.5 minutes on one H100 or H200: a few *arms* (configurations) run
side by side on the one GPU as separate processes (small models leave most of a GPU idle). The
first window (2026-11-29, an H200) measured one 5M ladder arm at 6 minutes alone (launch-bound,
about 23 ms a worker step), so the first call of a window gets 9.5 minutes. A slice is
*done* when its records are in the folder ``docs/results/gpu-queue/``, one file a slice (JSON Lines: commit,
device, torch version, seed, config, figures; one line per arm), for the slice's present
configuration (a resized slice is pending again). So a window runs what is pending, in order,
and the next window picks up where it stopped (of a simulator or throughput slice, only the arms
without a record); seeds of one experiment are slices of their own
and accumulate. ``docs/results/gpu-queue.md`` is rebuilt from every record so far.

    python -m benchmarks.gpu_queue plan            # the queue: expected minutes, done/pending
    python -m benchmarks.gpu_queue next [--budget-min 9.5] [--only ID,...] [--out DIR]
    python -m benchmarks.gpu_queue merge FILE...   # records that came back from a GPU machine
    python -m benchmarks.gpu_queue tables          # rebuild docs/results/gpu-queue.md

``next`` runs pending slices in order within the budget, skipping one whose expected minutes
do not fit what is left; every arm also stops itself early when, after half a minute, its
projected end is past the slice's deadline (the record says so; the slice stays pending). On a
machine without CUDA it runs every slice at smoke size into a scratch folder (the same code
end to end, in a few minutes): the queue cannot rot between GPU windows (``make gpu-next``
there; the tests run it too). ``make gpu-plan`` and ``make gpu-next`` call this module; on a
GPU machine ``scripts/gpu_next.sh`` installs the carried wheels first (docs/results/gpu-queue.md
says how to contribute a window).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "results" / "gpu-queue"
TABLES = ROOT / "docs" / "results" / "gpu-queue.md"
SLICE_MAX_MIN = 7.5  # one slice at most, so that it fits a window's first call after set-up
DEFAULT_BUDGET_MIN = 9.5  # a window's first call: 10 minutes a command, less start and copying
START_S = 30.0  # a slice's processes start (torch, CUDA, data) before the first step


@dataclass(frozen=True)
class Arm:
    """One configuration of a slice: a label (the table's row) and its settings (a
    ``SimConfig``'s fields for simulator slices, the runner's own keys otherwise)."""

    label: str
    config: dict[str, Any]


@dataclass(frozen=True)
class Slice:
    """One queued experiment. ``group``: the table its records join (seeds of one experiment
    are slices of one group); ``kind``: its runner in :mod:`benchmarks.gpu_slices`;
    ``minutes``: expected wall minutes on one H100, ``basis`` how that was found (an estimate
    until a window measures it: the plan then shows the measurement)."""

    id: str
    group: str
    title: str
    kind: str
    minutes: float
    basis: str
    arms: tuple[Arm, ...]
    seed: int = 0
    smoke: dict[str, Any] = field(default_factory=dict)  # settings at smoke size (CPU)

    def arms_at(self, smoke: bool) -> tuple[Arm, ...]:
        """The arms that run: all, or at smoke size the first ``smoke["arms"]`` (if set)."""
        return self.arms[:self.smoke.get("arms", len(self.arms))] if smoke else self.arms

    def digest(self) -> str:
        """The slice's configuration (arms, seed, kind): records of another one are of a
        resized slice and do not count as done."""
        return self._hash(seeded=True)

    def shape(self) -> str:
        """The configuration but its seed: slices of one shape take the same time."""
        return self._hash(seeded=False)

    def _hash(self, seeded: bool) -> str:
        def drop(config: dict[str, Any]) -> dict[str, Any]:
            return config if seeded else {k: v for k, v in config.items() if k != "seed"}

        doc = {"kind": self.kind, "arms": [(a.label, drop(a.config)) for a in self.arms],
               **({"seed": self.seed} if seeded else {})}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]


def records_of(slice_id: str, where: Path = RECORDS) -> list[dict[str, Any]]:
    """Every record of one slice (all attempts and configurations)."""
    path = where / f"{slice_id}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def is_done(sl: Slice, where: Path = RECORDS, smoke: bool = False) -> bool:
    """Whether every arm of the slice's present configuration has a record (of the smoke
    size, with ``smoke``: a CPU's check of the queue, never a result)."""
    return not arms_left(sl, where, smoke)


def arms_left(sl: Slice, where: Path = RECORDS, smoke: bool = False) -> tuple[Arm, ...]:
    """The arms of the slice's present configuration without an "ok" record yet."""
    got = {r["arm"] for r in records_of(sl.id, where)
           if r.get("status") == "ok" and r.get("digest") == sl.digest()
           and bool(r.get("smoke")) == smoke}
    return tuple(a for a in sl.arms_at(smoke) if a.label not in got)


# Kinds whose arms are independent processes: an attempt that finished some of them leaves
# only the rest to run (the concurrency slice showed an arm's losses the same to the last digit
# alone and beside four others). The concurrency slice's first arm is its reference: it reruns
# whole.
RESUMABLE = ("sim", "throughput", "engine")


def measured_minutes(sl: Slice, where: Path = RECORDS) -> tuple[float, str] | None:
    """The wall minutes of this slice's latest attempt in its present configuration, or of
    another slice of the same configuration but its seed, and their basis: measured (it ran) or
    projected (its arms stopped early, each saying how long it would have taken: the longest of
    those, plus the start). A stopped attempt's own wall is no measure of the slice."""
    from benchmarks.gpu_plan import QUEUE

    same = {s.id: s.digest() for s in QUEUE if s.shape() == sl.shape()} or {sl.id: sl.digest()}
    runs = [r for sid, digest in same.items() for r in records_of(sid, where)
            if r.get("slice_wall_s") and not r.get("smoke") and r.get("digest") == digest]
    attempts: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        attempts.setdefault((r.get("when", ""), r.get("slice", "")), []).append(r)
    # an attempt that ran only the arms left by an earlier one (``arms_run``) times no slice
    whole = [(key, rows) for key, rows in attempts.items()
             if any(projected_s(r) is not None for r in rows)
             or rows[0].get("arms_run", len(sl.arms)) >= len(sl.arms)]
    if not whole:
        return None
    _, attempt = max(whole, key=lambda kv: kv[0])
    last = attempt[0]
    projected = [p for p in map(projected_s, attempt) if p is not None]
    device = last.get("device", "?")
    if projected:
        return (max(projected) + START_S) / 60, f"projected on {device} (stopped early)"
    return last["slice_wall_s"] / 60, f"measured on {device}"


def projected_s(record: dict[str, Any]) -> float | None:
    """How long a stopped arm said it would have taken (``projected_s``, or its ``why``)."""
    if record.get("status") != "too long":
        return None
    if record.get("projected_s") is not None:
        return float(record["projected_s"])
    return projection_in(str(record.get("why", "")))


def projection_in(why: str) -> float | None:
    """The seconds a stopped arm's message (``benchmarks.gpu_arm.Watch``) projected."""
    found = re.match(r"\s*(\d+(?:\.\d+)?) s projected", why)
    return float(found.group(1)) if found else None


# ------------------------------------------------------------------------------ records
def facts() -> dict[str, Any]:
    """What every record carries about where and from what it ran."""
    import torch

    cuda = torch.cuda.is_available()
    return {"commit": _commit(), "dirty": _dirty(),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "host_cores": os.cpu_count(), "python": sys.version.split()[0],
            "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def _commit() -> str:
    """GIT_COMMIT (a GPU machine gets a copy of the tree without .git), else git's HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _dirty() -> bool | None:
    """Whether the tree has changes beyond the commit (None: no git here, as on a GPU
    machine, whose caller names the commit it copied)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def append(where: Path, slice_id: str, rows: Sequence[dict[str, Any]]) -> None:
    where.mkdir(parents=True, exist_ok=True)
    with (where / f"{slice_id}.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def merge(files: Sequence[Path], where: Path = RECORDS) -> int:
    """Append the records of ``files`` (what a GPU window's ``$OUT`` brought back) to their
    slices' files, skipping lines already there; returns how many were new."""
    new = 0
    for file in files:
        for line in file.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            known = {json.dumps(r, sort_keys=True) for r in records_of(row["slice"], where)}
            if json.dumps(row, sort_keys=True) not in known:
                append(where, row["slice"], [row])
                new += 1
    return new


# ------------------------------------------------------------------------------ commands
def plan(where: Path = RECORDS) -> list[str]:
    """The queue as printed lines: order, slice, expected minutes and their basis, status."""
    from benchmarks.gpu_plan import QUEUE

    lines = [f"{'#':>2}  {'slice':<22} {'H100 min':>8}  {'basis':<44} status"]
    total = 0.0
    for k, sl in enumerate(QUEUE, 1):
        minutes, basis = measured_minutes(sl, where) or (sl.minutes, sl.basis)
        done = is_done(sl, where)
        status = "done" if done else "pending"
        attempts = [r for r in records_of(sl.id, where) if r.get("status") != "ok"]
        if not done and attempts:
            status += f" (last attempt: {attempts[-1].get('status')}: " \
                      f"{str(attempts[-1].get('why', ''))[:60]})"
        if minutes > SLICE_MAX_MIN:
            status += f" [over {SLICE_MAX_MIN:g} min: resize]"
        total += 0 if done else minutes
        lines.append(f"{k:>2}  {sl.id:<22} {minutes:>8.1f}  {basis[:44]:<44} {status}")
    lines.append(f"pending: {total:.1f} expected minutes on one H100")
    return lines


def run_next(budget_min: float, only: Sequence[str], out: Path | None,
             smoke: bool | None = None) -> int:
    """Run pending slices in order within ``budget_min`` (see the module docstring)."""
    import torch

    from benchmarks.gpu_plan import QUEUE

    if smoke is None:
        smoke = not torch.cuda.is_available()
    if smoke:
        print("gpu-next: no CUDA here: every slice at smoke size (a check of the queue, not "
              "a result)", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-queue-"))
    where = out if out is not None else (scratch / "records" if smoke else RECORDS)
    deadline = time.monotonic() + budget_min * 60
    unknown = sorted(set(only) - {s.id for s in QUEUE})
    if unknown:
        print(f"gpu-next: --only: unknown slice(s) {unknown}; `make gpu-plan` lists them",
              file=sys.stderr)
        return 2
    failed = 0
    # smoke size: the slices of processes (swarms: mostly waiting; the concurrency slice's
    # arm processes: mostly importing) run in the background, meanwhile the rest
    apart = ("swarm", "concurrency")
    background = []
    pool = ThreadPoolExecutor(4) if smoke else None
    order = sorted(QUEUE, key=lambda s: s.kind not in apart) if smoke else QUEUE
    try:
        for sl in order:
            if only and sl.id not in only:
                continue
            if not smoke and is_done(sl, where):
                continue
            left = deadline - time.monotonic()
            got = measured_minutes(sl, where)
            expect = 0.0 if smoke else (got[0] if got else sl.minutes) * 60 + _set_up_s(sl)
            if expect > left:
                print(f"gpu-next: {sl.id}: skipped ({expect / 60:.1f} min expected, "
                      f"{left / 60:.1f} left)", flush=True)
                continue
            if pool is not None and sl.kind in apart:
                background.append(pool.submit(_run_one, sl, left, smoke, scratch, where))
                continue
            failed += _run_one(sl, left, smoke, scratch, where)
        failed += sum(job.result() for job in background)
    finally:
        if pool is not None:
            pool.shutdown()
        write_tables(where, TABLES if where == RECORDS else where / "gpu-queue.md", smoke)
        # the scratch folder goes, unless the records are in it (a smoke run without --out)
        shutil.rmtree(scratch / "work" if where.is_relative_to(scratch) else scratch,
                      ignore_errors=True)
    export = os.environ.get("OUT")
    if export and not smoke:  # a GPU machine's $OUT: the records come back from there
        for path in where.glob("*.jsonl"):
            shutil.copy(path, Path(export) / path.name)
    print(f"gpu-next: records in {where}", flush=True)
    return 1 if failed and smoke else 0


def _set_up_s(sl: Slice) -> float:
    """What a slice spends before its arms start: the corpus, when a fresh machine lacks it."""
    from benchmarks import gpu_slices

    return 60.0 if sl.kind in ("sim", "concurrency") and not gpu_slices.corpus_built() else 0.0


def _run_one(sl: Slice, left: float, smoke: bool, scratch: Path, where: Path) -> bool:
    """Run one slice and append its records; whether an arm did not end "ok"."""
    from benchmarks import gpu_slices

    started = time.monotonic()
    todo = sl
    if not smoke and sl.kind in RESUMABLE:
        left_arms = arms_left(sl, where)
        if 0 < len(left_arms) < len(sl.arms):
            todo = dataclasses.replace(sl, arms=left_arms)
    print(f"gpu-next: {sl.id}: {sl.title} ({len(todo.arms_at(smoke))} arm(s)"
          + (f" of {len(sl.arms)}: the rest have records" if todo is not sl else "") + ")",
          flush=True)
    rows = gpu_slices.run_slice(todo, left, smoke, scratch)
    took = time.monotonic() - started
    base = {**facts(), "slice": sl.id, "group": sl.group, "digest": sl.digest(),
            "seed": sl.seed, "smoke": smoke, "slice_wall_s": round(took, 1),
            "arms_run": len(todo.arms_at(smoke))}
    rows = [{**base, **row} for row in rows]
    append(where, sl.id, rows)
    bad = [r for r in rows if r["status"] != "ok"]
    print(f"gpu-next: {sl.id}: {len(rows) - len(bad)} of {len(rows)} arm(s) ok in "
          f"{took / 60:.1f} min" + (f"; {bad[0]['status']}: {bad[0].get('why', '')}"
                                    if bad else ""), flush=True)
    return bool(bad)


def write_tables(where: Path, path: Path, smoke: bool = False) -> None:
    from benchmarks import gpu_tables

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(gpu_tables.page(where, smoke))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", help="print the queue")
    nxt = sub.add_parser("next", help="run pending slices within a budget")
    nxt.add_argument("--budget-min", type=float, default=DEFAULT_BUDGET_MIN,
                     help=f"wall-clock minutes for this window (default {DEFAULT_BUDGET_MIN:g})")
    nxt.add_argument("--only", default="", help="comma-separated slice ids")
    nxt.add_argument("--out", type=Path, default=None,
                     help="records folder (default: docs/results/gpu-queue on CUDA, a scratch "
                          "folder for the smoke run)")
    nxt.add_argument("--smoke", action="store_true", help="smoke size even on CUDA")
    mrg = sub.add_parser("merge", help="add records brought back from a GPU machine")
    mrg.add_argument("files", nargs="+", type=Path)
    sub.add_parser("tables", help="rebuild docs/results/gpu-queue.md from the records")
    args = p.parse_args(argv)
    if args.command == "plan":
        print("\n".join(plan()))
        return 0
    if args.command == "next":
        if args.budget_min <= 0:
            p.error(f"--budget-min={args.budget_min}: needs minutes > 0")
        only = [s for s in args.only.split(",") if s]
        return run_next(args.budget_min, only, args.out, True if args.smoke else None)
    if args.command == "merge":
        print(f"gpu-queue: {merge(args.files)} new record(s)")
    write_tables(RECORDS, TABLES)
    print(f"gpu-queue: wrote {TABLES.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
