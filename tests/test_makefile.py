"""The make targets README promises do what README says, and `make` prints no warnings."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Target -> what its recipe must run (README's description of it).
EXPECTED = {
    "swarm": ["gasloc-node swarm --nodes 3"],
    "test": ["ruff check", "proto/generate.py --check", "mypy gasloc_p2p", "pytest",
             '-m "not long and not processes"'],
    "test-processes": ["pytest", '-m "processes and not long"'],
    "lint": ["ruff check", "proto/generate.py --check"],
    "sim": ["gasloc-node sim "],
    "proto": ["proto/generate.py"],
    "corpus": ["gasloc-node corpus --out runs/corpus ",
               "gasloc-node corpus --out runs/corpus-bytes --size-mb 50 --tokenizer byte"],
    "ladder-cpu": ["benchmarks.reproduce --only ladder-0.1m,ladder-0.4m"],
    "gpu-plan": ["benchmarks.gpu_queue plan"],
    "gpu-next": ["scripts/gpu_next.sh --budget-min 9.5"],
    "gpu-wheels": ["scripts/gpu_wheels.sh"],
    "bench-core": ["benchmarks.bench_core"],
    "bench-ranks": ["benchmarks.bench_ranks"],
    "bench-codecs": ["benchmarks.bench_codecs"],
    "bench-sim": ["benchmarks.bench_sim"],
    "bench-node": ["benchmarks.bench_node"],
    "bench-diloco": ["benchmarks.bench_diloco"],
    "bench-scale": ["benchmarks.bench_scale"],
    "bench-swarm100m": ["benchmarks.bench_swarm100m"],
    "bench-trainer-memory": ["benchmarks.bench_trainer_memory"],
    "bench-engine": ["benchmarks.bench_engine"],
    "gpu-check": ["scripts/gpu_check.sh"],
    "bench-downloads": ["benchmarks.bench_downloads"],
    "bench-data": ["benchmarks.bench_data"],
    "bench-streaming": ["benchmarks.bench_streaming"],
    "bench-streaming-link": ["benchmarks.bench_streaming_link"],
    "bench-fuzz": ["benchmarks.bench_fuzz"],
    "bench-byzantine": ["benchmarks.bench_byzantine"],
    "bench-direction": ["benchmarks.bench_direction"],
    "bench-chaos": ["benchmarks.bench_chaos"],
    "bench-poison": ["benchmarks.bench_poison", "--attack records"],
    "bench-tamper": ["benchmarks.bench_tamper"],
    "bench-redteam": ["benchmarks.bench_redteam --attacks fresh-keys,farm-push"],
    "bench-soak": ["benchmarks.bench_soak"],
    "bench-external": ["pip install", ".[bench-external]", "benchmarks.bench_external"],
    "bench-external-1000": [".[bench-external]", "benchmarks.bench_external", "--steps 1000",
                            "--repeat 3", "--name external-1000", "gasloc-diloco-avg",
                            "--name external-1000-avg"],
    "bench-projection": ["benchmarks.bench_projection"],
    "bench-home-links": ["benchmarks.bench_home_links"],
    "bench-home-gossip": ["benchmarks.bench_home_gossip"],
    "reproduce": ["benchmarks.reproduce"],
    "test-long": ["pytest", "-m long"],
}


def test_ci_runs_the_readme_test_command_and_the_process_tests():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[-2:] == ["make test", "make test-processes"], lines[-2:]

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
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert scripts, "no benchmarks found"
    missing = [s for s in scripts if f"benchmarks.{s}" not in result.stdout]
    assert not missing, f"make bench skips {missing}"


def step(tmp_path: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / "step.sh"), "demo", "--log",
                           str(tmp_path / "demo.log"), "--", *command],
                          capture_output=True, text=True, timeout=30)


def test_a_setup_step_prints_one_timed_line_and_keeps_pip_noise_in_its_log(tmp_path):
    noisy = "for i in $(seq 30); do echo 'WARNING: Location ... is ignored'; done"
    ok = step(tmp_path, "bash", "-c", noisy)
    assert ok.returncode == 0
    assert re.fullmatch(r"== demo: ok \(\d+\.\d s\)\n", ok.stdout), ok.stdout
    assert ok.stderr == "" and (tmp_path / "demo.log").read_text().count("WARNING") == 30
    failed = step(tmp_path, "bash", "-c", noisy + "; echo 'ERROR: no matching dist'; exit 3")
    assert failed.returncode == 3
    assert "ERROR: no matching dist" in failed.stdout  # a failure shows its log's tail
    assert re.search(r"== demo: FAILED \(exit 3, \d+\.\d s\)\n$", failed.stdout)


def test_setup_and_test_run_every_step_through_the_timed_wrapper():
    result = subprocess.run(["make", "-n", "-B", "setup", "test"], cwd=ROOT, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    pip_lines = [line for line in result.stdout.splitlines() if "pip install" in line]
    assert len(pip_lines) == 3, result.stdout  # pip itself, torch, the project
    assert all("scripts/step.sh" in line and "--log" in line for line in pip_lines)
    for tool in ("ruff check", "mypy gasloc_p2p", "pytest"):
        line = next(x for x in result.stdout.splitlines() if tool in x)
        assert "scripts/step.sh" in line, line


def test_make_reproduce_runs_every_part_of_reproduce_py():
    import ast

    tree = ast.parse((ROOT / "benchmarks" / "reproduce.py").read_text())
    parts = next(node.value for node in ast.walk(tree) if isinstance(node, ast.AnnAssign)
                 and getattr(node.target, "id", "") == "PARTS")
    assert isinstance(parts, ast.Dict)
    names = {k.value for k in parts.keys if isinstance(k, ast.Constant)}
    lines = [x for x in dry_run("reproduce").stdout.splitlines() if "benchmarks.reproduce" in x]
    assert {p for x in lines for p in x.split("--only ")[1].split()[0].split(",")} == names


def test_pytest_prints_why_a_test_was_skipped(tmp_path):
    """`make test` runs `pytest -q`: the project's pytest settings must still list each skip
    with its reason (README says tests that need Prometheus, Chromium, ... say why)."""
    (tmp_path / "test_tool.py").write_text(
        "import pytest\n\n\n@pytest.mark.skip(reason='no widget on this machine')\n"
        "def test_needs_a_widget():\n    pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c",
                             str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
                             "-p", "no:cacheprovider", str(tmp_path / "test_tool.py")],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SKIPPED [1] test_tool.py:4: no widget on this machine" in result.stdout, result.stdout
