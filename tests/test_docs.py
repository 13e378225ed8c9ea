"""The front door stays short and true: README's commands run as written (``make -n`` for make
targets, ``join --check`` for a node), the configuration reference is what the code generates,
``join --help`` stays small, and no file points at a document the repository does not have."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gasloc_p2p.cli import build_parser
from gasloc_p2p.node.settings import reference

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def bash_blocks(path: Path) -> list[str]:
    """The command lines of the ```bash blocks of ``path``."""
    text = path.read_text()
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= 250


def as_run_here(line: str) -> str:
    """A README line as this test runs it: make targets dry-run (``make -n``), a node
    validates its configuration and exits (``join --check``), the venv is the test's."""
    if line.startswith("make "):
        return f"make -n -C {ROOT} -o .venv/.installed {line[5:]}"
    if line == ". .venv/bin/activate":
        return f"export PATH={Path(sys.executable).parent}:$PATH"
    if line.startswith("gasloc-node join") and "--help" not in line:
        return line + " --check"
    return line


@pytest.mark.skipif(shutil.which("make") is None, reason="no `make` on this machine")
def test_every_readme_command_runs_as_written(tmp_path):
    lines = bash_blocks(README)
    assert len(lines) >= 8 and any(x.startswith("gasloc-node join") for x in lines)
    script = "set -e\n" + "\n".join(as_run_here(x) for x in lines) + "\n"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, (script, out.stdout[-3000:], out.stderr[-3000:])
    assert out.stdout.count("configuration ok") == sum(
        x.startswith("gasloc-node join") and "--help" not in x for x in lines)


def test_join_check_refuses_a_bad_flag_in_one_line():
    out = subprocess.run([sys.executable, "-m", "gasloc_p2p.cli", "join", "--check", "--gamma",
                          "1.5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--gamma=1.5" in out.stderr


def test_join_help_lists_at_most_60_options_in_groups():
    join = build_parser()._subparsers._group_actions[0].choices["join"]  # type: ignore[union-attr]
    options = [a for a in join._actions if a.option_strings]
    assert 30 <= len(options) <= 60, len(options)
    groups = [g.title for g in join._action_groups if g._group_actions]
    for name in ("network", "training", "data", "algorithm", "security", "observability"):
        assert name in groups, groups


def test_the_configuration_reference_is_current():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == reference(), ("docs/configuration.md is stale: run `python -m "
                                 "gasloc_p2p.node.settings --reference > docs/configuration.md`")
    assert "`guard_factor` |  |" in page  # tuning: no flag, documented here


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [ROOT / n for n in names if Path(n).suffix in (".md", ".py", ".proto", ".toml", ".yml",
                                                          ".sh", ".txt", "")
            and (ROOT / n).is_file() and "proto_gen" not in n]


def test_no_file_mentions_a_document_the_repository_lacks():
    missing = []
    for path in tracked_text_files():
        text = path.read_text(errors="replace")
        if "ALGORITHM.md" in text and path.name != "test_docs.py":
            missing.append(f"{path.relative_to(ROOT)}: ALGORITHM.md")
        for ref in re.findall(r"(?<![\w/.])docs/[\w./-]+\.(?:md|png|json)", text):
            if not (ROOT / ref).exists():
                missing.append(f"{path.relative_to(ROOT)}: {ref}")
        if path.suffix == ".md":
            for link in re.findall(r"\]\(([^)#\s]+)", text):
                if "://" not in link and not (path.parent / link).exists():
                    missing.append(f"{path.relative_to(ROOT)}: link {link}")
    assert not missing, missing


CODE_PATH = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-]+\.(?:py|proto))(?![\w/])")
# where a document's short paths are relative to (core/sparse.py, runtime/bootstrap.py, ...)
PATH_ROOTS = ("", "gasloc_p2p/", "gasloc_p2p/node/", "benchmarks/", "tests/")


def documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_code_path_a_document_names_exists():
    """A document that names a module (gasloc_p2p/core/sparse.py, core/sparse.py, sim/gossip.py,
    benchmarks/bench_node.py, or a bare file name) names one the repository has."""
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    names = {Path(f).name for f in tracked}
    missing = []
    for doc in documents():
        for path in CODE_PATH.findall(doc.read_text()):
            if not (path in names if "/" not in path else
                    any(root + path in tracked for root in PATH_ROOTS)):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, missing


def test_the_architecture_tree_names_what_each_folder_holds():
    """docs/architecture.md's package tree: every file it lists under a folder is there, and
    every module of the pure core is listed."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = re.search(r"## Packages\n\n```\n(.*?)```", text, re.S)
    assert tree is not None
    folder, listed, missing = "", set(), []
    for line in tree.group(1).splitlines():
        if not line.startswith(" "):  # a package or top-level file, then its description
            head = line.split()[0]
            folder = head if head.endswith("/") else head.rsplit("/", 1)[0] + "/"
            entries = [head]
        elif line.startswith("  ") and line[2] != " ":  # its files and rooms
            entries = [folder + e for e in line[2:].split("  ")[0].split(", ")]
        else:
            continue
        for entry in entries:
            listed.add(entry)
            if not any(ROOT.glob(entry.rstrip("/"))):
                missing.append(entry)
    assert not missing, f"architecture.md lists what does not exist: {missing}"
    core = {f"gasloc_p2p/core/{p.name}" for p in (ROOT / "gasloc_p2p" / "core").glob("*.py")
            if p.name != "__init__.py"}
    assert core <= listed, f"architecture.md omits {sorted(core - listed)}"

