"""The size ladder's commands run end to end at a smoke size (issue 25, part 3).

The GPU queue runs the GPU rungs (bf16 on ``cuda``, the 16k-BPE corpus); here the same
rows run on the CPU at a smoke size on a corpus built in the test, and the table comes out with
every arm paired against DiLoCo's Nesterov row. A missing corpus is one line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import repro_ladder
from gasloc_p2p.data import registry


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("ladder")
    bpe, byte = root / "bpe", root / "byte"
    registry.build(bpe, ["pip"], size_mb=0.2, vocab_size=512, val_every=5)
    registry.build(byte, ["pip"], size_mb=0.2, val_every=5, tokenizer_kind="byte")
    return bpe, byte


def reproduce(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.reproduce", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(("part", "which"), [("ladder-5m", 0), ("ladder-0.1m", 1)])
def test_a_rung_runs_end_to_end_at_a_smoke_size(corpora, tmp_path, part, which):
    done = reproduce("--only", part, "--seeds", "0", "--jobs", "1", "--smoke", "--device",
                     "cpu", "--data", str(corpora[which]), "--out", str(tmp_path / "out"),
                     "--cache", str(tmp_path / "cache"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = (tmp_path / "out" / f"{part}.md").read_text()
    for label, _ in repro_ladder.rows(part):
        assert label in table
    assert (tmp_path / "out" / f"{part}.json").is_file()


def test_the_gpu_rungs_fit_a_slice_of_the_gpu_queue():
    """Issue 25 sized the 25M rung at 262M tokens an arm (about 25 minutes on an H100 for both
    rungs, one arm after another): it never fitted a GPU window. Issue 38 resized it so that
    the five arms run side by side within one slice of the queue."""
    for part in repro_ladder.GPU_PARTS:
        _, cfg = repro_ladder.RUNGS[part]
        assert (cfg.device, cfg.precision, cfg.data) == ("cuda", "bf16", repro_ladder.BPE)
    tokens = {p: c.workers * c.steps * c.batch_size * c.seq_len
              for p, (_, c) in repro_ladder.RUNGS.items()}
    assert 20e6 <= tokens["ladder-25m"] <= 40e6  # 33M tokens an arm at 25M
    assert 50e6 <= tokens["ladder-5m"] <= 80e6


def test_a_missing_corpus_is_one_line(tmp_path):
    done = reproduce("--only", "ladder-0.1m", "--data", str(tmp_path / "none"), "--out",
                     str(tmp_path / "out"), "--cache", str(tmp_path / "cache"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"ladder-0.1m: no corpus at {tmp_path / 'none'}: build it with `make corpus`")
