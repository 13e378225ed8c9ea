"""One arm of a GPU-queue slice: one simulated run in its own process (``benchmarks.gpu_queue``).

A slice runs its arms as concurrent processes on one GPU (small models leave most of a GPU
idle; a process each also keeps the host's launch overhead on its own core). Each arm reads
its ``SimConfig`` as JSON, runs it, and writes the run's result as JSON to ``--out``. On the
way it prints one JSON line per round end with the steps done and the seconds since the start,
and after ``--calibrate-s`` seconds of training it projects its end: an arm that would not end
within ``--deadline-s`` stops at once (exit 3) with a line saying how long it would take, so a
slice sized wrongly costs a window half a minute, not its whole budget.

Usage: python -m benchmarks.gpu_arm --config JSON --out FILE [--deadline-s S]
       [--calibrate-s S]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.run import run

TOO_LONG = 3  # exit status of an arm whose projected end is past its deadline


class TooLong(Exception):
    """The arm's projected end is past its deadline."""


class Watch:
    """The progress callback: a JSON line per call; the projection once calibrated."""

    def __init__(self, deadline_s: float, calibrate_s: float, write: Any = print) -> None:
        self.t0, self.write = time.monotonic(), write
        self.deadline_s, self.calibrate_s = deadline_s, calibrate_s
        self.first: tuple[float, int] | None = None  # (seconds, steps) at the first round end
        self.checked = False

    def __call__(self, steps: int, total: int) -> None:
        now = time.monotonic() - self.t0
        self.write(json.dumps({"steps": steps, "total": total, "seconds": round(now, 2)}))
        if self.first is None:  # set-up and the first evaluation are not the steady rate
            self.first = (now, steps)
            return
        since, done = now - self.first[0], steps - self.first[1]
        if self.checked or since < self.calibrate_s or done <= 0:
            return
        self.checked = True
        projected = now + (total - steps) * since / done
        if self.deadline_s and projected > self.deadline_s:
            raise TooLong(f"{projected:.0f} s projected (rate {done / since:.2f} steps/s), "
                          f"deadline {self.deadline_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the arm's SimConfig as JSON")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--deadline-s", type=float, default=0.0, help="0: none")
    p.add_argument("--calibrate-s", type=float, default=20.0)
    args = p.parse_args(argv)
    return run_arm(json.loads(args.config), args.out, args.deadline_s, args.calibrate_s)


def run_arm(fields: dict[str, Any], out: Path, deadline_s: float, calibrate_s: float,
            write: Any = None) -> int:
    """Run the arm whose ``SimConfig`` fields are ``fields``; its result as JSON to ``out``;
    0, or :data:`TOO_LONG` (a JSON line says why). ``write``: where the progress lines go
    (default: standard output)."""
    write = write or (lambda line: print(line, flush=True))
    cfg = SimConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    try:
        result = run(cfg, progress=Watch(deadline_s, calibrate_s, write))
    except TooLong as exc:
        write(json.dumps({"too_long": str(exc)}))
        return TOO_LONG
    result["peak_device_bytes"] = _peak_device_bytes(cfg.device)
    out.write_text(json.dumps(result))
    return 0


def _peak_device_bytes(device: str) -> int:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.max_memory_allocated())


if __name__ == "__main__":
    sys.exit(main())
