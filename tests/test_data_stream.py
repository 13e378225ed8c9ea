"""Streamed JSON Lines / Parquet data, tokenizers from a directory, and the validation set.

The big-file memory check is ``benchmarks/bench_data.py`` (a few hundred MB is too slow for the
suite); here the reader is shown to be lazy structurally: it yields the first documents of a
file whose tail is not even valid JSON, which a reader that loads the file whole cannot do.
"""

from __future__ import annotations

import json

import pytest
import torch

from gasloc_p2p.data import DataError, load_tokenizer, load_training_data
from gasloc_p2p.data.stream import VAL_EVERY, DocumentStream, StreamData, stream_files
from gasloc_p2p.data.tokenizers import ByteTokenizer
from tests.hf_helpers import documents, write_jsonl, write_parquet, write_tokenizer

pytest.importorskip("datasets")
DOCS = [f"<doc {i:04d}> " + d for i, d in enumerate(documents(200, 400))]
SIZES = dict(seq_len=32, batch_size=4, eval_batches=2)


@pytest.fixture(scope="module", params=["jsonl", "parquet"])
def corpus(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    if request.param == "jsonl":
        return write_jsonl(root / "c.jsonl", DOCS)
    return write_parquet(root / "c.parquet", DOCS, row_group_size=32)


def test_stream_files_recognizes_formats(tmp_path, corpus):
    kind, files = stream_files(str(corpus)) or ("", [])
    assert kind == ("json" if corpus.suffix == ".jsonl" else "parquet") and files == [str(corpus)]
    assert stream_files(str(corpus.parent)) == (kind, [str(corpus)])  # a directory of them
    (tmp_path / "a.txt").write_text("plain text")
    assert stream_files(str(tmp_path / "a.txt")) is None  # text goes the in-memory way


def test_validation_set_is_the_same_for_every_node_and_never_trained_on(corpus):
    a = load_training_data(str(corpus), "byte", seed=0, **SIZES)
    b = load_training_data(str(corpus), "byte", seed=9, shard=(1, 2), **SIZES)
    assert a.validation_set == b.validation_set and "sha256=" in a.validation_set
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a.val, b.val, strict=True))
    stream = StreamData(DocumentStream(corpus.suffix.strip(".").replace("jsonl", "json"),
                                       [str(corpus)], "text"), ByteTokenizer(), 32, 8)
    held_out = {f"<doc {i:04d}>" for i in range(0, stream.val_last_doc + 1, VAL_EVERY)}
    assert held_out and stream.val_last_doc < len(DOCS)
    text = "".join(bytes(w.tolist()).decode("utf-8", "replace") for w, _ in
                   zip(stream.train_windows(), range(2000), strict=False))
    assert "<doc 0001>" in text and not any(tag in text for tag in held_out)


def test_batches_are_deterministic_per_seed_and_shards_are_disjoint(corpus):
    def batches(seed: int, shard=None) -> list[torch.Tensor]:
        data = load_training_data(str(corpus), "byte", shard=shard, **SIZES)
        gen = torch.Generator().manual_seed(seed)
        return [data.train.batch(4, 32, gen)[0] for _ in range(3)]

    first, again, other = batches(1), batches(1), batches(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    x, y = load_training_data(str(corpus), "byte", **SIZES).train.batch(
        4, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])

    def tags(k: int) -> set[str]:
        data = load_training_data(str(corpus), "byte", shard=(k, 2), **SIZES)
        windows = [w for w, _ in zip(data.train.windows, range(400), strict=False)]
        text = "".join(bytes(w.tolist()).decode("utf-8", "replace") for w in windows)
        return {text[i:i + 10] for i in range(len(text)) if text.startswith("<doc ", i)}

    assert tags(0) and tags(1) and not tags(0) & tags(1)


def test_tokenizer_directory_packs_documents_with_eos(tmp_path, corpus):
    tok_dir = write_tokenizer(tmp_path / "tok", DOCS)
    tok = load_tokenizer(str(tok_dir))
    assert tok.eos_id is not None and tok.vocab_size == 300
    assert load_tokenizer(str(tok_dir / "tokenizer.json")).name == tok.name
    data = load_training_data(str(corpus), str(tok_dir), **SIZES)
    assert data.tokenizer.name == tok.name and f"tokenizer={tok.name}" in data.validation_set
    x, _ = data.train.batch(4, 32, torch.Generator().manual_seed(0))
    assert int(x.max()) < 300
    with pytest.raises(DataError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_bpe_on_a_stream_trains_on_its_first_documents(corpus):
    data = load_training_data(str(corpus), "bpe", bpe_vocab_size=300, **SIZES)
    assert data.tokenizer.name.startswith("bpe300-")


def test_a_missing_field_names_the_flag(corpus):
    with pytest.raises(DataError, match="--data-field 'body'"):
        load_training_data(str(corpus), "byte", "body", **SIZES)


def test_the_reader_is_lazy(tmp_path):
    """The first rows come out of a ~24 MB file whose last line is not JSON: the file is read
    block by block as the stream advances, never parsed whole up front."""
    path = tmp_path / "big.jsonl"
    line = json.dumps({"text": "x" * 4000}) + "\n"
    with path.open("w") as f:
        f.writelines(line for _ in range(6000))
        f.write("{this is not json\n")
    stream = iter(DocumentStream("json", [str(path)], "text"))
    assert [len(next(stream)) for _ in range(3)] == [4000] * 3
    with pytest.raises(DataError, match=f"^--data {str(path)!r}: cannot read it as JSON Lines"):
        for _ in stream:
            pass


def test_a_directory_without_data_files_names_the_flag(tmp_path):
    from gasloc_p2p.data.corpus import check_data_path

    (tmp_path / "notes.md").write_text("not a corpus")
    with pytest.raises(DataError, match=f"^--data {str(tmp_path)!r}: no \\*.txt, \\*.jsonl"):
        check_data_path(str(tmp_path))
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "c.jsonl", DOCS[:2])
    check_data_path(str(tmp_path))


@pytest.mark.parametrize("name, body, problem", [
    ("bad.jsonl", '{"text": "a"}\n{bad json\n', "cannot read it as JSON Lines (JSON parse error"),
    ("empty.jsonl", "", "the file holds no rows"),
    ("bad.parquet", "not parquet", "cannot read it as Parquet (Parquet magic bytes"),
])
def test_an_unreadable_file_is_one_line_naming_the_flag_and_the_file(tmp_path, name, body,
                                                                     problem):
    path = tmp_path / name
    path.write_text(body)
    with pytest.raises(DataError) as err:
        load_training_data(str(path), "byte", **SIZES)
    message = str(err.value)
    assert message.startswith(f"--data {str(path)!r}: {problem}") and "\n" not in message


def test_a_resumed_stream_continues_where_it_was(tmp_path, corpus):
    """The position (stream, leftover tokens, cut windows, shuffle buffer) and the generator,
    saved and loaded as a checkpoint does, give the very batches the node would have drawn:
    across an epoch boundary too (the small buffer makes the stream wrap within the test)."""
    from gasloc_p2p.data.stream import StreamShard

    def shard() -> StreamShard:
        data = load_training_data(str(corpus), "byte", shard=(1, 2), **SIZES)
        assert isinstance(data.train, StreamShard)
        data.train.capacity = 8
        return data.train

    running, gen = shard(), torch.Generator().manual_seed(3)
    for _ in range(5):
        running.batch(4, 32, gen)
    torch.save({"data": running.position(), "generator": gen.get_state()}, tmp_path / "p.pt")
    ahead = [running.batch(4, 32, gen)[0] for _ in range(400)]  # > an epoch of shard 1/2
    assert running.windows.epoch >= 1
    saved = torch.load(tmp_path / "p.pt", weights_only=True)
    resumed, gen2 = shard(), torch.Generator()
    resumed.restore(saved["data"])
    gen2.set_state(saved["generator"])
    assert all(torch.equal(a, resumed.batch(4, 32, gen2)[0]) for a in ahead)
    fresh = shard()  # without the position: the stream restarts, other batches
    assert not all(torch.equal(a, fresh.batch(4, 32, gen2)[0]) for a in ahead[:5])
    with pytest.raises(DataError, match="seq-len"):
        StreamShard(fresh.windows, 16).restore(saved["data"])


def test_a_peek_at_a_stream_changes_none_of_the_batches_drawn_after_it(corpus):
    """The loss gate's private batch (node/runtime/trainer.py) is drawn with ``peek``: a node
    trains on the batches it would have drawn without it, as a resumed one must."""
    from gasloc_p2p.data.stream import StreamShard

    def shard() -> StreamShard:
        data = load_training_data(str(corpus), "byte", shard=(1, 2), **SIZES)
        assert isinstance(data.train, StreamShard)
        data.train.capacity = 8
        return data.train

    plain, peeked = shard(), shard()
    x, y = peeked.peek(2, 32, torch.Generator().manual_seed(99))
    assert x.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert all(torch.equal(plain.batch(4, 32, g1)[0], peeked.batch(4, 32, g2)[0])
               for _ in range(50))
    drawn = shard()  # drawing it with ``batch`` instead would have changed them
    drawn.batch(2, 32, torch.Generator().manual_seed(99))
    g1, g3 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    fresh = shard()
    assert not all(torch.equal(fresh.batch(4, 32, g1)[0], drawn.batch(4, 32, g3)[0])
                   for _ in range(50))
