"""``gasloc-node corpus``: a corpus built offline from installed packages (issue 25, part 2).

Built here at a smoke size from ``pip``'s own files (installed wherever the tests run): the
manifest and hash are the same on a rebuild, held-out files never reach the training tokens,
the token files are memory-mapped back into the simulator's data, and bad input is one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest

from gasloc_p2p.data import registry
from gasloc_p2p.data.corpus import DataError
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.run import run

SMALL = {"packages": ["pip"], "size_mb": 0.4, "vocab_size": 512, "val_every": 5}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    return out, registry.build(out, **SMALL)


def test_the_corpus_says_what_went_in_and_rebuilds_the_same(built, tmp_path):
    out, meta = built
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["packages"][0]["name"] == "pip"
    assert manifest["packages"][0]["version"] == metadata.version("pip")
    assert manifest["bytes"] >= 0.4e6 and manifest["validation_files"] > 0
    assert meta["corpus_sha256"] == manifest["sha256"] and meta["vocab_size"] == 512
    again = registry.build(tmp_path, **SMALL)
    assert again == meta
    assert (tmp_path / "train.bin").read_bytes() == (out / "train.bin").read_bytes()


def test_held_out_files_never_reach_training(built):
    out, meta = built
    data, tokenizer = registry.load(str(out))
    assert data.train.numel() == meta["train_tokens"] and data.val.numel() == meta["val_tokens"]
    chosen, _ = registry.sources(["pip"], int(0.4e6))
    held = [s for s in chosen if registry.is_validation(s.name, 5)]
    kept = [s for s in chosen if not registry.is_validation(s.name, 5)]
    assert held and kept
    train_text = tokenizer.decode(data.train.tolist())
    val_text = tokenizer.decode(data.val.tolist())
    first_held = held[0].path.read_text(encoding="utf-8", errors="replace")[:200]
    first_kept = kept[0].path.read_text(encoding="utf-8", errors="replace")[:200]
    assert first_held in val_text and first_held not in train_text
    assert first_kept in train_text


def test_the_simulator_trains_on_it(built):
    out, _ = built
    cfg = SimConfig(workers=2, steps=10, H=5, n_layer=1, n_embd=32, n_head=2, seq_len=32,
                    batch_size=4, eval_every=5, eval_batches=2, warmup_steps=2,
                    data=str(out))
    result = run(cfg)
    losses = [e["val_loss"] for e in result["history"]]
    assert losses[-1] < losses[0]


def test_a_damaged_corpus_and_bad_input_are_one_line(built, tmp_path):
    out, _ = built
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("meta.json", "manifest.json", "tokenizer.json", "val.bin"):
        (broken / name).write_bytes((out / name).read_bytes())
    (broken / "train.bin").write_bytes((out / "train.bin").read_bytes()[:100])
    with pytest.raises(DataError, match="train.bin does not hold"):
        registry.load(str(broken))
    with pytest.raises(DataError, match="'no-such-package' is not installed"):
        registry.sources(["no-such-package"], 10)
    with pytest.raises(DataError, match="fewer than --size-mb"):
        registry.sources(["pip"], int(1e12))
    cli = subprocess.run([sys.executable, "-m", "gasloc_p2p.cli", "corpus", "--out",
                          str(tmp_path / "x"), "--packages", "no-such-package"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2
    assert cli.stderr.strip() == ("gasloc-node corpus: --packages: 'no-such-package' is not "
                                  "installed here")
