"""The make targets README promises do what README says, and `make` prints no warnings."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Target -> what its recipe must run (README's description of it).
EXPECTED = {
    "swarm": ["gasloc-node swarm --nodes 3"],
    "test": ["ruff check", "proto/generate.py --check", "mypy gasloc_p2p", "pytest"],
    "sim": ["gasloc-node sim "],
    "proto": ["proto/generate.py"],
    "bench-core": ["benchmarks/bench_core.py"],
    "bench-codecs": ["benchmarks/bench_codecs.py"],
    "bench-sim": ["benchmarks/bench_sim.py"],
    "bench-node": ["benchmarks/bench_node.py"],
    "bench-diloco": ["benchmarks/bench_diloco.py"],
    "bench-fuzz": ["benchmarks/bench_fuzz.py"],
    "bench-byzantine": ["benchmarks/bench_byzantine.py"],
    "bench-chaos": ["benchmarks/bench_chaos.py"],
    "reproduce": ["benchmarks/reproduce.py"],
}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no `make` on this machine")


def dry_run(target: str) -> subprocess.CompletedProcess[str]:
    # .venv/.installed is made up-to-date by -o so the dry run never plans a setup.
    return subprocess.run(["make", "-n", "-o", ".venv/.installed", target], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def readme_targets() -> set[str]:
    text = (ROOT / "README.md").read_text()
    return set(re.findall(r"`make ([a-z][a-z-]*)`", text)) | set(
        re.findall(r"^make ([a-z][a-z-]*)", text, re.M))


def test_every_readme_target_is_checked_here():
    missing = readme_targets() - set(EXPECTED) - {"setup", "bench", "clean"}
    assert not missing, f"README names make targets this test does not check: {missing}"


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_target_runs_what_readme_says(target):
    result = dry_run(target)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr
    for needle in EXPECTED[target]:
        assert needle in result.stdout, f"make {target} does not run {needle!r}:\n{result.stdout}"


def test_make_bench_runs_every_benchmark():
    result = dry_run("bench")
    assert result.returncode == 0 and "warning" not in result.stderr.lower(), result.stderr
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert scripts, "no benchmarks found"
    missing = [s for s in scripts if f"benchmarks/{s}" not in result.stdout]
    assert not missing, f"make bench skips {missing}"
