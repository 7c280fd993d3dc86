"""Corpora: vocabulary sizes and token counts equal the data README's verified figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import real_data
from zoo.data import DataError, batchify, corpus_files, get_batch, load_corpus, resolve_data_dir
from zoo.errors import UnknownDatasetError

# (dataset, vocab, train, valid, test) from ../shared/data/README.md (tokens with one <eos> per line)
COUNTS = [
    ("ptb", 10_000, 929_589, 73_760, 82_430),
    ("wikitext-2", 33_278, 2_088_628, 217_646, 245_569),
    ("ptb-char", 50, 5_017_483, 393_043, 442_424),
]


@pytest.mark.parametrize("name,vocab,train,valid,test", COUNTS)
def test_vocab_and_token_counts(name, vocab, train, valid, test):
    real_data(name)
    c = load_corpus(name)
    assert len(c.vocab) == vocab
    assert (c.train.numel(), c.valid.numel(), c.test.numel()) == (train, valid, test)
    assert c.vocab.count("<eos>") == 1


@pytest.mark.parametrize("name,share", [("ptb", 0.061), ("wikitext-2", 0.063)])
def test_unk_share_of_the_test_splits(name, share):
    """The share of ``<unk>`` among the test split's words (``<eos>`` not counted) that zoo/scoring.py's
    ``UNK_SHARE_WARNING`` and the README's "four times the corpora's own 6%" cite."""
    real_data(name)
    c = load_corpus(name)
    words = c.test[c.test != c.vocab.index("<eos>")]
    assert round(float((words == c.vocab.index("<unk>")).float().mean()), 3) == share


def test_data_dir_resolution_order(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "env"))
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_data_dir(None) == tmp_path / "env"
    monkeypatch.delenv("ZOO_DATA_DIR")
    with pytest.raises(DataError, match="no data directory: set ZOO_DATA_DIR.*data_dir="):
        resolve_data_dir(None)  # the library assumes no location of its own


def test_checkout_venv_points_the_library_at_the_checkout_data():
    """The checkout's .venv sets ZOO_DATA_DIR (a .pth written by `make venv`) to ../shared/data."""
    import os

    checkout_data = Path(__file__).resolve().parents[2] / "shared" / "data"
    assert Path(os.environ["ZOO_DATA_DIR"]).resolve() == checkout_data.resolve()


def test_missing_data_names_the_expected_files(tmp_path):
    with pytest.raises(DataError, match=r"ptb/train\.txt.*ZOO_DATA_DIR"):
        corpus_files("ptb", tmp_path)
    with pytest.raises(UnknownDatasetError, match="unknown dataset 'imagenet'; registered: ptb"):
        corpus_files("imagenet", tmp_path)


def test_batchify_is_contiguous_columns():
    import torch

    data = torch.arange(23)
    b = batchify(data, 4)
    assert b.shape == (5, 4) and b[:, 1].tolist() == [5, 6, 7, 8, 9]
    x, y = get_batch(b, 0, 3)
    assert x.shape == (4, 3) and torch.equal(y, x + 1)


def test_a_corpus_file_that_is_not_utf8_is_named_with_its_line(tmp_path, capsys):
    """A corpus byte that is not UTF-8 is a one-line DataError naming the file, line and byte (it was a decoder
    traceback, exit 1); lines break as a text-mode file's do (\\n, \\r\\n, \\r; not at form feeds)."""
    from tests.olah_fixture import run_main
    from zoo.data import read_tokens

    (tmp_path / "ok.txt").write_bytes(b"a b\r\nc\rd\x0ce\n\n")
    assert read_tokens(tmp_path / "ok.txt") == ["a", "b", "<eos>", "c", "<eos>", "d", "e", "<eos>", "<eos>"]
    ptb = tmp_path / "data" / "ptb"
    ptb.mkdir(parents=True)
    for split in ("train", "test"):
        (ptb / f"{split}.txt").write_text("the cat\n")
    (ptb / "valid.txt").write_bytes(b"the cat\nthe \xff dog\n")
    with pytest.raises(DataError, match=r"ptb/valid\.txt: not valid UTF-8 \(line 2, byte 12\)"):
        read_tokens(ptb / "valid.txt")
    code, _, err = run_main(capsys, "eval", "lstm-ptb-zaremba-small", "--split", "valid", "--data-dir",
                            str(tmp_path / "data"))
    assert code == 2 and err.count("\n") == 1 and "valid.txt: not valid UTF-8 (line 2, byte 12)" in err
    with pytest.raises(DataError, match="cannot read"):
        read_tokens(tmp_path)  # a directory
