"""Data every volunteer can reach: a URL (downloaded once, checked by sha256) or a Hugging Face
dataset (``hf:NAME[:CONFIG][@SPLIT]``, streamed), besides local files.

A run manifest names the source and, for files and URLs, the sha256 of their bytes
(:mod:`gasloc_p2p.node.manifest`): every node trains on the same data, and a node that cannot
reach it says so in one line naming ``--data`` when it starts. A hub dataset is streamed (never
downloaded whole); each node reads it in its own order, seeded by its identity, and the
validation documents (the same on every node) are left out of its training stream.
"""

from __future__ import annotations

import hashlib
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from gasloc_p2p.data.corpus import DataError

HUB_PREFIX = "hf:"
_DOWNLOAD_TIMEOUT_S = 60.0
_BLOCK = 1 << 20


def is_url(data: str) -> bool:
    return data.startswith(("http://", "https://"))


def is_hub(data: str) -> bool:
    return data.startswith(HUB_PREFIX)


def is_remote(data: str) -> bool:
    """A source that is not a local path (no file to find at configuration time)."""
    return is_url(data) or is_hub(data)


@dataclass(frozen=True)
class HubSpec:
    """``hf:NAME[:CONFIG][@SPLIT]``: a dataset on the Hugging Face hub (or a local dataset
    folder, which ``datasets`` reads the same way)."""

    name: str
    config: str | None = None
    split: str = "train"

    @classmethod
    def parse(cls, data: str) -> HubSpec:
        rest = data[len(HUB_PREFIX):]
        rest, _, split = rest.partition("@")
        name, _, config = rest.partition(":")
        if not name:
            raise DataError(f"--data {data!r}: name a dataset, hf:NAME[:CONFIG][@SPLIT]")
        return cls(name, config or None, split or "train")


HUB_PROBE_TIMEOUT_S = 5.0


def hub_problem(name: str, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the hub that serves dataset ``name`` cannot be reached from here (None: a TCP
    connection to it opens, ``name`` is a local folder or a path to one, or the hub's offline
    mode is on). One connection, bounded: ``datasets`` would retry for about 30 s, a warning
    per try."""
    if name.startswith(("/", ".", "~")) or Path(name).exists() or any(os.environ.get(v, "").strip() not in ("", "0") for v in (
            "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return None
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        return f"cannot reach the Hugging Face hub at {host}:{port} ({exc.strerror or exc})"
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("GASLOC_CACHE") or Path.home() / ".cache" / "gasloc_p2p") / "data"


def fetch_url(url: str, sha256: str = "", timeout_s: float = _DOWNLOAD_TIMEOUT_S) -> Path:
    """The file at ``url``, downloaded once into the cache (kept under a name derived from the
    URL, with its file name and suffix) and checked against ``sha256`` when given; DataError
    in one line naming ``--data`` otherwise."""
    name = Path(urllib.parse.urlparse(url).path).name or "data"
    folder = cache_dir() / hashlib.sha256(url.encode()).hexdigest()[:16]
    path = folder / name
    if path.is_file() and (not sha256 or file_sha256(path) == sha256):
        return path
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / (name + ".part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply, open(partial, "wb") as f:
            while block := reply.read(_BLOCK):
                digest.update(block)
                f.write(block)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        partial.unlink(missing_ok=True)
        why = getattr(exc, "reason", None) or exc
        raise DataError(f"--data {url}: cannot download it ({why}); check the address and "
                        "this machine's network, or pass --data PATH to a local copy") from None
    if sha256 and digest.hexdigest() != sha256:
        partial.unlink(missing_ok=True)
        raise DataError(f"--data {url}: its bytes have sha256 {digest.hexdigest()[:16]}..., "
                        f"the run's data {sha256[:16]}... (the file changed since the run "
                        "started)")
    partial.replace(path)
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def identity_seed(seed: int) -> int:
    """The shuffle seed of a node's hub stream (from its data seed, itself derived from its
    identity): each node reads the dataset in its own order."""
    return seed % (1 << 31)
