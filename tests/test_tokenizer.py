"""Raw text is normalised the way each corpus was, and out-of-vocabulary input is counted, never hidden."""

from __future__ import annotations

import unicodedata

import pytest

from tests.conftest import real_data
from zoo.data import load_corpus
from zoo.tokenizer import Tokenizer


@pytest.fixture(scope="module", autouse=True)
def _real_corpora() -> None:
    """Every test here checks the tokenizer against the real corpora's vocabularies and text: without them, skip
    saying which is missing (rather than an error per fixture)."""
    for dataset in ("ptb", "wikitext-2", "ptb-char"):
        real_data(dataset)


@pytest.fixture(scope="module")
def ptb() -> Tokenizer:
    return Tokenizer(load_corpus("ptb").vocab, "ptb")


@pytest.fixture(scope="module")
def wiki() -> Tokenizer:
    return Tokenizer(load_corpus("wikitext-2").vocab, "wikitext")


@pytest.fixture(scope="module")
def char() -> Tokenizer:
    return Tokenizer(load_corpus("ptb-char").vocab, "ptb-char")


def test_every_corpus_is_in_nfc_form():
    """The tokenizer puts input in NFC form because the corpora are in it: were a split not, scoring it through
    the tokenizer would no longer give the corpus's own ids."""
    from zoo.data import corpus_files

    for dataset in ("ptb", "ptb-char", "wikitext-2"):
        for split, path in corpus_files(dataset).items():
            assert unicodedata.is_normalized("NFC", path.read_text(encoding="utf-8")), (dataset, split)


def test_decomposed_accents_find_the_vocabulary(wiki, char):
    composed, decomposed = "Beyoncé and José García", unicodedata.normalize("NFD", "Beyoncé and José García")
    assert composed != decomposed
    enc = wiki.encode(decomposed)
    assert enc.ids == wiki.encode(composed).ids and enc.oov == 0
    assert enc.tokens[:3] == ["Beyoncé", "and", "José"]
    # a character model's alphabet has no é: one <unk> spelling per accented letter, not one per code point
    assert char.encode(decomposed).ids == char.encode(composed).ids


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
    assert ptb.encode("a b\nc\n").tokens == ["a", "b", "<eos>", "c", "<eos>"]
    assert ptb.encode("a zzyzxq\nc").tokens == ["a", "<unk>", "<eos>", "c", "<eos>"]  # the last line too
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


AWKWARD = [
    "omg 🚀 #stonks @elonmusk",
    "def f(x):\n    return x ** 2  # squares; see https://example.com/a?b=c&d=e",
    "Mr. Smith, Co. and U.S. Inc. met Dr. Jones on Nov. 5th.",
    "東京は日本の首都です。",
    "مرحبا بالعالم",
    "שלום עולם",
    "e\u0301te\u0301 — cafe\u0301 naïve Ångström",
    "tab\there\x07bell\x1bescape\u200bzero-width\ufeffbom",
    "a" * 300 + " supercalifragilisticexpialidocious" * 3,
    "İstanbul ΣΊΣΥΦΟΣ straße ﬁne",
    "<unk> N n't 's $ & % 3.5% 1,000,000 1990s 2nd",
    "...!!!???---***///\\\\",
    "   \n\n  leading and trailing  \n",
]


def _accounted(tok: Tokenizer, text: str) -> None:
    """Every non-space character of ``text`` (in NFC form, as the tokenizer reads it) is in exactly one place:
    the source of a scored token (a vocabulary symbol or <unk>), or the dropped list. Compared as multisets of
    characters, case-folded one character at a time as the normalisations lower-case."""
    from collections import Counter

    enc = tok.encode(text)
    fold = (lambda c: c.lower() if len(c.lower()) == 1 else c) if tok.normalization != "wikitext" else (lambda c: c)
    want = Counter(fold(c) for c in unicodedata.normalize("NFC", text) if not c.isspace())
    got = Counter(fold(c) for src in enc.sources + enc.dropped for c in src)
    assert got == want, (tok.normalization, text, got - want, want - got)
    assert len(enc.sources) == len(enc.ids) == len(enc.tokens)
    unk_sources = [s for s, t in zip(enc.sources, enc.tokens, strict=True) if t == "<unk>" and s]
    if not tok.is_char:  # each <unk> names the input it replaced (a literal "<unk>" in the input included)
        assert len(unk_sources) == enc.tokens.count("<unk>")


@pytest.mark.parametrize("normalization", ["ptb", "wikitext", "ptb-char"])
def test_no_input_character_is_lost(normalization, ptb, wiki, char):
    tok = {"ptb": ptb, "wikitext": wiki, "ptb-char": char}[normalization]
    for text in AWKWARD:
        _accounted(tok, text)


def test_every_bundled_models_tokenizer_accounts_for_every_character():
    from zoo.zoo_model import ZooModel, bundled_dir, catalog

    dirs = [bundled_dir() / n for n in catalog()["models"] if (bundled_dir() / n / "config.json").is_file()]
    assert dirs
    for directory in dirs:
        tok = ZooModel.from_pretrained(directory).tokenizer
        for text in AWKWARD:
            _accounted(tok, text)


def test_char_models_keep_what_their_corpus_keeps(char):
    assert "".join(char.encode("Mr. Smith of Co. and the U.S. left.").tokens) == \
        "mr._smith_of_co._and_the_u.s._left<eos>"
    enc = char.encode("omg 🚀 #stonks @elonmusk")
    assert "".join(enc.tokens) == "omg_<unk>_#_stonks_elonmusk<eos>"
    assert enc.oov_items == ["🚀"] and enc.dropped == ["@"]


def test_ptb_corpus_splits_encode_to_themselves(ptb):
    """Every line of the PTB validation and test splits is already normalised: encoding changes nothing."""
    from zoo.data import corpus_files

    for split in ("valid", "test"):
        for line in corpus_files("ptb")[split].read_text().splitlines():
            enc = ptb.encode(line)
            assert enc.tokens == line.split() + ["<eos>"] and not enc.dropped, line


def test_wikitext_corpus_splits_encode_to_themselves(wiki):
    """The WikiText-2 validation and test splits encode to their own tokens, words the splitting rules would cut
    included (``1,000th`` is one corpus token, not ``1 @,@ 000th``), so scoring the split's raw text counts exactly
    the corpus's tokens (what an lm-evaluation-harness rolling task over the file relies on)."""
    from zoo.data import corpus_files

    for split in ("valid", "test"):
        for line in corpus_files("wikitext-2")[split].read_text(encoding="utf-8").splitlines():
            enc = wiki.encode(line)
            assert enc.tokens == line.split() + ["<eos>"] and not enc.dropped, line
    assert wiki.encode("his 1,000th game").tokens[:2] == ["his", "1,000th"]


def test_char_corpus_splits_read_as_text_encode_to_themselves(char):
    """Every line of every PTB-char split, written back as text (``_`` -> space), encodes to the corpus's own
    symbols: digits inside PTB words (``500-stock``, ``1980s``) are kept as the corpus keeps them, numbers become
    ``N``, so scoring the test split as text gives the corpus stream's bits per character."""
    from zoo.data import corpus_files

    for split, path in corpus_files("ptb-char").items():
        for line in path.read_text(encoding="utf-8").splitlines():
            text = "".join(line.split()).replace("_", " ")
            enc = char.encode(text)
            assert enc.tokens == line.split() + ["<eos>"] and not enc.dropped, (split, line)
    assert "".join(char.encode("the 500-stock index rose 3.5% in the 1980s.").tokens) == \
        "the_500-stock_index_rose_N_N_in_the_1980s<eos>"


def test_ptb_kept_words_are_the_vocabulary_words_the_rules_would_cut(monkeypatch):
    import zoo.tokenizer as T

    vocab = load_corpus("ptb-char").vocab
    words = [w for w in load_corpus("ptb").vocab if w not in ("<unk>", "<eos>", "N")]
    assert all(list(w) == Tokenizer(vocab, "ptb-char").line_tokens(w) for w in words)
    monkeypatch.setattr(T, "PTB_KEPT_WORDS", frozenset())
    cut = {w for w in words if Tokenizer(vocab, "ptb-char").line_tokens(w) != list(w)}
    monkeypatch.undo()
    assert cut == T.PTB_KEPT_WORDS


def test_initials_with_periods_find_the_bare_word(ptb):
    """``I.B.M.`` is read as ``ibm`` where the vocabulary has only that form; ``U.S.``, which it has, stays."""
    assert "ibm" in ptb.index and "i.b.m." not in ptb.index
    assert ptb.encode("I.B.M. and IBM rose. U.S. stocks").tokens == ["ibm", "and", "ibm", "rose", "u.s.", "stocks",
                                                                      "<eos>"]
    assert ptb.encode("X.Y.Z. said").tokens == ["<unk>", "said", "<eos>"]


def test_a_vocabulary_without_unk_drops_what_it_cannot_spell():
    """A checkpoint's vocabulary that has no <unk> (or, for characters, not its five letters) cannot score an
    unknown symbol: it is listed as dropped, not a KeyError / TypeError in the middle of scoring."""
    char = Tokenizer(["<eos>", "a", "_"], "ptb-char").encode("ab a")
    assert char.tokens == ["a", "_", "a", "<eos>"] and char.dropped == ["b"] and char.oov == 0
    word = Tokenizer(["<eos>", "the"], "ptb").encode("the cat")
    assert word.tokens == ["the", "<eos>"] and word.dropped == ["cat"] and word.oov == 0


@pytest.mark.parametrize("normalization", ["ptb", "ptb-char", "wikitext"])
def test_min_tokens_is_a_lower_bound_of_the_encoding(normalization):
    """Tokenizer.min_tokens (what a server refuses a request far over its token budget by, without tokenising it)
    never exceeds the encoding's length, over random texts of words, numbers, punctuation, clitics, newlines,
    control, combining and non-ASCII characters; it is the exact count for words of one symbol each."""
    import random

    from zoo.zoo_model import ModelNotFoundError, ZooModel, resolve_local

    name = {"ptb": "alstm-ptb-5m", "ptb-char": "alstm-ptbchar-1.5m-long", "wikitext": "alstm-wt2-11m-long-light"}
    try:
        tok = ZooModel.from_pretrained(resolve_local(name[normalization])[0]).tokenizer
    except ModelNotFoundError:
        pytest.skip(f"the bundled {name[normalization]} is missing")
    assert tok.normalization == normalization
    pieces = [*"abcdefgh XYZ019 .,'-$%&\n\t\r", "é", "e\u0301", "\u200b", "\x00", "ß", "日本", "🙂", " n't", "'s",
              "<unk>", "N", "mr.", "i.b.m.", "@-@", "\u2028", "...", "1,000th"]
    rng = random.Random(52)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))
        for eos in (True, False):
            assert tok.min_tokens(text, eos) <= len(tok.encode(text, eos).ids), (text, eos)
    assert tok.min_tokens("a\n" * 999) == len(tok.encode("a\n" * 999).ids) == 1998
