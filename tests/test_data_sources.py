"""Data every volunteer can reach: an http(s) URL (downloaded once, checked by sha256) and a
Hugging Face dataset (hf:NAME, streamed in an order of the node's own). No download from the
internet: a local HTTP server, and a local dataset folder read through the hub path."""

from __future__ import annotations

import functools
import http.server
import json
import threading
from pathlib import Path

import pytest

from gasloc_p2p.data.corpus import DataError
from gasloc_p2p.data.loader import load_training_data
from gasloc_p2p.data.sources import HubSpec, fetch_url, file_sha256

pytest.importorskip("datasets")


def _jsonl(path: Path, docs: int = 400) -> Path:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "the", "cat", "sleeps"]
    with open(path, "w") as f:
        for i in range(docs):
            text = " ".join(words[(i + j) % len(words)] for j in range(40)) + f" doc {i}."
            f.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("GASLOC_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "www"
    root.mkdir()
    _jsonl(root / "corpus.jsonl")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[method-assign]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", root
    httpd.shutdown()


def test_a_url_is_downloaded_once_and_checked_by_its_sha256(server):
    base, root = server
    sha = file_sha256(root / "corpus.jsonl")
    path = fetch_url(f"{base}/corpus.jsonl", sha)
    assert path.suffix == ".jsonl" and file_sha256(path) == sha
    (root / "corpus.jsonl").write_text('{"text": "changed"}\n')
    assert fetch_url(f"{base}/corpus.jsonl", sha) == path  # the cached copy, still right
    path.unlink()
    with pytest.raises(DataError, match=r"^--data http.*: its bytes have sha256 .* the run's"):
        fetch_url(f"{base}/corpus.jsonl", sha)
    with pytest.raises(DataError, match=r"^--data http.*/missing.jsonl: cannot download it"):
        fetch_url(f"{base}/missing.jsonl")


def test_a_url_trains_like_the_local_file(server):
    base, root = server
    kw = {"seq_len": 32, "batch_size": 4, "eval_batches": 2}
    local = load_training_data(str(root / "corpus.jsonl"), **kw)
    remote = load_training_data(f"{base}/corpus.jsonl", **kw,
                                data_sha256=file_sha256(root / "corpus.jsonl"))
    assert local.validation_set.split("sha256=")[1] == remote.validation_set.split("sha256=")[1]


def test_a_hub_dataset_is_streamed_in_each_nodes_own_order(tmp_path):
    """hf:PATH reads a dataset folder through datasets' hub loader (as hf:NAME does from the
    hub): the validation set is the same for every node, each node's training order is its
    own, and no validation document is trained on."""
    folder = tmp_path / "ds"
    folder.mkdir()
    _jsonl(folder / "train.jsonl")
    assert HubSpec.parse("hf:org/name:cfg@validation") == HubSpec("org/name", "cfg", "validation")
    kw = {"seq_len": 32, "batch_size": 4, "eval_batches": 2}
    a = load_training_data(f"hf:{folder}", seed=1, **kw)
    b = load_training_data(f"hf:{folder}", seed=2, **kw)
    assert a.validation_set == b.validation_set and a.validation_set.startswith("hub:")
    import torch

    def first(d, n=30):
        g = torch.Generator().manual_seed(0)
        return [d.train.batch(4, 32, g)[0] for _ in range(n)]
    assert not all(torch.equal(x, y) for x, y in zip(first(a), first(b), strict=True))
    stream = a.train.windows.data  # type: ignore[attr-defined]
    trained = list(stream.docs.training(0))  # every document, in this node's order
    assert len(trained) == 400 and trained != list(stream.docs)
    val = [t for i, t in enumerate(trained) if stream._is_val(i, t)]
    assert len(val) == len(stream.val_texts) > 0  # each left out of training, by content
    with pytest.raises(DataError, match="cannot open it"):
        load_training_data("hf:/no/such/dataset", **kw)
