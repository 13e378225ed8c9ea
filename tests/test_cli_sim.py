"""The `gasloc-node sim` command as a user runs it: a real process, real files."""

from __future__ import annotations

import json
import subprocess
import sys

CLI = [sys.executable, "-m", "gasloc_p2p.cli"]


def test_help_lists_commands_and_flags():
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=True).stdout
    assert "sim" in out
    out = subprocess.run([*CLI, "sim", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--algorithms", "--mode", "--graph", "--codec", "--slow-link-factor", "--seeds"):
        assert flag in out


def test_wrong_flag_and_value_give_one_line_errors():
    for args, needle in [(["sim", "--workerz", "3"], "unrecognized arguments"),
                         (["sim", "--workers", "three"], "--workers: expected int, got 'three'"),
                         (["sim", "--codec", "int3"], "unknown codec 'int3'")]:
        res = subprocess.run([*CLI, *args], capture_output=True, text=True)
        assert res.returncode == 2
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], res.stderr


def test_sim_run_writes_json_and_png(tmp_path):
    args = ["sim", "--algorithms", "gasloc,diloco", "--workers", "3", "--steps", "10", "--H", "5",
            "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32",
            "--batch-size", "4", "--eval-every", "5", "--eval-batches", "1", "--no-progress",
            "--out", str(tmp_path), "--name", "t"]
    res = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    results = json.loads((tmp_path / "t.json").read_text())
    assert [r["config"]["algorithm"] for r in results] == ["gasloc", "diloco"]
    for r in results:
        assert r["history"][-1]["tokens"] == 3 * 10 * 4 * 32
        assert r["history"][-1]["val_loss"] < r["history"][0]["val_loss"]
    png = (tmp_path / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
