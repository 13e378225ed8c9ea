"""Streamed data: peak resident memory while a node reads a Parquet (or JSON Lines) file far
larger than what it keeps.

Generates a file of ``--mb`` megabytes of text (random words, so it barely compresses), then in
a fresh child process builds the node's data exactly as ``gasloc-node join --data FILE`` does
(validation set, then the training window stream with its shuffle buffer) and reads one whole
epoch. Prints, for each file size side by side, the child's resident memory after imports, its
peak, and the growth (absolute and as a fraction of the file size). Run:
``.venv/bin/python -m benchmarks.bench_data --mb 100,300`` (about 3-6 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_CHILD = r"""
import faulthandler, json, resource, sys, time
faulthandler.dump_traceback_later(900, exit=True)  # a hang prints every thread's stack
import torch
from gasloc_p2p.data import load_training_data
from gasloc_p2p.data.stream import DocumentStream, StreamData
from gasloc_p2p.data.tokenizers import ByteTokenizer
import datasets  # imported before the baseline: its import is not the data's memory

def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

base = rss_mb()
t0 = time.perf_counter()
data = load_training_data(sys.argv[1], "byte", seq_len=256, batch_size=16, eval_batches=8)
gen = torch.Generator().manual_seed(0)
for _ in range(4):
    data.train.batch(16, 256, gen)
kind = "parquet" if sys.argv[1].endswith(".parquet") else "json"
stream = StreamData(DocumentStream(kind, [sys.argv[1]], "text"), ByteTokenizer(), 256, 128)
windows, trace = 0, []
for w in stream.train_windows():
    windows += 1
    if windows % 50000 == 0:
        trace.append(round(rss_mb()))
    if windows >= int(sys.argv[2]):
        break
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"base_mb": base, "peak_mb": peak, "windows": windows, "trace": trace,
                  "seconds": time.perf_counter() - t0}), flush=True)
# pyarrow's thread-pool teardown at interpreter exit can hang (seen here under load); the
# result is out, so leave without running the exit handlers.
import os
os._exit(0)
"""


def write_parquet(path: Path, megabytes: int, rows_per_group: int = 2000) -> int:
    """Random-word documents (~4 KB each) until the file holds ``megabytes``; returns chars."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    words = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), n))
                      for n in rng.integers(2, 10, 5000)])
    chars = 0
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        while path.stat().st_size < megabytes * 1_000_000 if path.exists() else True:
            docs = [" ".join(words[rng.integers(0, len(words), 700)])
                    for _ in range(rows_per_group)]
            chars += sum(len(d) for d in docs)
            writer.write_table(pa.table({"text": docs}))
            if chars > megabytes * 4_000_000:  # safety stop if compression is unexpectedly good
                break
    return chars


def write_jsonl(path: Path, megabytes: int) -> int:
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(5000)]
    chars = 0
    with path.open("w") as f:
        while chars < megabytes * 1_000_000:
            doc = " ".join(words[i] for i in rng.integers(0, len(words), 700))
            f.write(json.dumps({"text": doc}) + "\n")
            chars += len(doc)
    return chars


def measure(path: Path, chars: int) -> dict[str, float]:
    windows = chars // 257  # one epoch of 256-token byte windows
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(windows)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"the reader failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="300",
                        help="file sizes to generate, MB, comma-separated (side by side)")
    parser.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mb in (int(m) for m in args.mb.split(",")):
            path = Path(tmp) / f"big{mb}.{args.format}"
            t0 = time.perf_counter()
            chars = (write_parquet if args.format == "parquet" else write_jsonl)(path, mb)
            size_mb = path.stat().st_size / 1e6
            print(f"generated {path.name}: {size_mb:.0f} MB on disk, {chars / 1e6:.0f} M chars "
                  f"of text, in {time.perf_counter() - t0:.0f} s", flush=True)
            rows.append((size_mb, chars, measure(path, chars)))
            path.unlink()
    print(f"{'file MB':>8} {'M tokens':>9} {'s':>5} {'RSS base':>9} {'peak':>6} {'growth':>7} "
          f"{'/file':>6}  RSS every 50k windows (MB)")
    for size_mb, _chars, r in rows:
        growth = r["peak_mb"] - r["base_mb"]
        print(f"{size_mb:8.0f} {r['windows'] * 257 / 1e6:9.0f} {r['seconds']:5.0f} "
              f"{r['base_mb']:9.0f} {r['peak_mb']:6.0f} {growth:7.0f} {growth / size_mb:6.2f}  "
              f"{r['trace']}")
    print("(growth = peak - RSS after imports, MB; bounded when it does not grow with the file; "
          f"this process peaked at {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}"
          " MB while generating)")


if __name__ == "__main__":
    main()
