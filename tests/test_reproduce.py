"""docs/results' simulator tables are what their published runs give: `reproduce --rebuild` in a
fresh clone (no cache) rewrites every training part's table from the runs its JSON holds (the
archived parts of retired options included), and the result must equal the committed markdown
byte for byte."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import reproduce

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def rebuild(parts: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.reproduce", "--only", ",".join(parts), "--rebuild",
         "--out", str(out), "--cache", str(out / "no-cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_every_published_training_table_rebuilds_from_its_runs(tmp_path: Path) -> None:
    parts = [p for p in reproduce.TITLES if p not in reproduce.CONSENSUS_PARTS
             and (RESULTS / f"{p}.json").exists()]
    assert len(parts) >= 15 and set(reproduce.ARCHIVED) <= set(parts), parts
    for part in parts:
        shutil.copy(RESULTS / f"{part}.json", tmp_path / f"{part}.json")
    result = rebuild(parts, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    for part in parts:
        rebuilt, published = (tmp_path / f"{part}.md").read_text(), (
            RESULTS / f"{part}.md").read_text()
        assert rebuilt == published, f"docs/results/{part}.md is not what its runs give"


def test_rebuild_without_runs_says_so(tmp_path: Path) -> None:
    result = rebuild(["noloco"], tmp_path)
    assert result.returncode != 0
    assert "no cached or published runs of part 'noloco'" in result.stderr


def test_an_archived_part_cannot_run(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "benchmarks.reproduce", "--only", "staleness",
                             "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "retired after commit db57895" in result.stderr


@pytest.mark.parametrize("part", sorted(reproduce.CONSENSUS_PARTS))
def test_consensus_parts_are_not_rebuilt_from_slim_json(tmp_path: Path, part: str) -> None:
    if not (RESULTS / f"{part}.json").exists():
        pytest.skip(f"no published {part}.json")
    shutil.copy(RESULTS / f"{part}.json", tmp_path / f"{part}.json")
    result = rebuild([part], tmp_path)
    assert result.returncode != 0 and "no cached or published runs" in result.stderr
