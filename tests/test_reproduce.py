"""docs/results' simulator tables are what their published runs give: `reproduce.py --rebuild`
in a fresh clone (no cache) rewrites every training part's table from the runs its JSON holds,
and the result must equal the committed markdown byte for byte."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
NOT_REBUILDABLE = {"consensus", "acid-consensus"}  # they publish every 25th round only


def training_parts() -> list[str]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import reproduce
    finally:
        sys.path.pop(0)
    return [p for p in reproduce.PARTS if p not in NOT_REBUILDABLE]


def test_every_published_training_table_rebuilds_from_its_runs(tmp_path: Path) -> None:
    parts = [p for p in training_parts() if (RESULTS / f"{p}.json").exists()]
    assert len(parts) >= 10, parts
    for part in parts:
        shutil.copy(RESULTS / f"{part}.json", tmp_path / f"{part}.json")
    result = subprocess.run(
        [sys.executable, "benchmarks/reproduce.py", "--only", ",".join(parts), "--rebuild",
         "--out", str(tmp_path), "--cache", str(tmp_path / "no-cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    for part in parts:
        rebuilt, published = (tmp_path / f"{part}.md").read_text(), (
            RESULTS / f"{part}.md").read_text()
        assert rebuilt == published, f"docs/results/{part}.md is not what its runs give"


def test_rebuild_without_runs_says_so(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/reproduce.py", "--only", "noloco", "--rebuild",
         "--out", str(tmp_path), "--cache", str(tmp_path / "no-cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "no cached or published runs of part 'noloco'" in result.stderr


@pytest.mark.parametrize("part", sorted(NOT_REBUILDABLE))
def test_consensus_parts_are_not_rebuilt_from_slim_json(tmp_path: Path, part: str) -> None:
    if not (RESULTS / f"{part}.json").exists():
        pytest.skip(f"no published {part}.json")
    shutil.copy(RESULTS / f"{part}.json", tmp_path / f"{part}.json")
    result = subprocess.run(
        [sys.executable, "benchmarks/reproduce.py", "--only", part, "--rebuild",
         "--out", str(tmp_path), "--cache", str(tmp_path / "no-cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "no cached or published runs" in result.stderr
