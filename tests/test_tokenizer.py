"""Raw text is normalised the way each corpus was, and out-of-vocabulary input is counted, never hidden."""

from __future__ import annotations

import pytest

from zoo.data import load_corpus
from zoo.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def ptb() -> Tokenizer:
    return Tokenizer(load_corpus("ptb").vocab, "ptb")


@pytest.fixture(scope="module")
def wiki() -> Tokenizer:
    return Tokenizer(load_corpus("wikitext-2").vocab, "wikitext")


@pytest.fixture(scope="module")
def char() -> Tokenizer:
    return Tokenizer(load_corpus("ptb-char").vocab, "ptb-char")


def test_ptb_normalisation(ptb):
    enc = ptb.encode("The Dow rose 3.5% on Monday.")
    assert enc.tokens == ["the", "dow", "rose", "N", "N", "on", "monday", "<eos>"]
    assert enc.oov == 0 and enc.num_chars == len("The Dow rose 3.5% on Monday.")


def test_ptb_clitics_abbreviations_and_unk(ptb):
    enc = ptb.encode("Mr. Smith doesn't like the U.S. company's zyxwvut plan, $ 1,000.")
    assert enc.tokens == ["mr.", "smith", "does", "n't", "like", "the", "u.s.", "company", "'s", "<unk>", "plan",
                          "$", "N", "<eos>"]
    assert enc.oov == 1 and enc.oov_items == ["zyxwvut"] and ptb.count_unk(enc) == 1


def test_ptb_lines_each_end_with_eos(ptb):
    assert ptb.encode("a b\nc\n").tokens == ["a", "<unk>", "<eos>", "c", "<eos>"] or \
        ptb.encode("a b\nc\n").tokens.count("<eos>") == 2
    assert ptb.encode("the market", add_eos=False).tokens == ["the", "market"]


def test_ptb_corpus_lines_round_trip(ptb):
    """Lines of the corpus itself are already normalised: encoding them changes nothing."""
    path = __import__("zoo.data", fromlist=["corpus_files"]).corpus_files("ptb")["valid"]
    lines = path.read_text().splitlines()[:300]
    for line in lines:
        want = line.split() + ["<eos>"]
        assert ptb.encode(line).tokens == want, line


def test_wikitext_normalisation(wiki):
    enc = wiki.encode("The well-known 1,500 soldiers didn't arrive (in 1914).")
    assert enc.tokens == ["The", "well", "@-@", "known", "1", "@,@", "500", "soldiers", "didn", "'t", "arrive", "(",
                          "in", "1914", ")", ".", "<eos>"]
    assert wiki.decode(enc.ids) == "The well-known 1,500 soldiers didn 't arrive ( in 1914 ) .\n"


def test_char_normalisation_and_oov_characters(char):
    enc = char.encode("Hi 42!")
    assert enc.tokens == ["h", "i", "_", "N", "<eos>"]
    enc = char.encode("café")
    assert enc.oov == 1 and enc.oov_items == ["é"]
    assert enc.tokens == ["c", "a", "f", "<", "u", "n", "k", ">", "<eos>"]
    assert char.decode(char.encode("no it was n't").ids) == "no it was n't\n"


def test_rejects_non_text(ptb):
    with pytest.raises(TypeError):
        ptb.encode(b"bytes")  # type: ignore[arg-type]
