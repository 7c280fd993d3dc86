"""Bits per input character compare across tokenisations only once what a model could not see is charged
(issue 54, point 2; the definition: ``zoo.scoring.input_char_bits``).

A text full of words the PTB word model does not know: it turns them into ``<unk>``, a cheap class, and its plain
rate looks better than the character model's, which spells every word. Charged at
:data:`zoo.scoring.UNSEEN_CHAR_BITS` a character, the character model must not lose.
"""

from __future__ import annotations

import math

import pytest

import zoo
from zoo.scoring import UNSEEN_CHAR_BITS, input_char_bits

pytestmark = pytest.mark.usefixtures("one_thread")

#: Words of today that 1989's Wall Street Journal never printed (each is <unk> to the PTB word model).
OOV_TEXT = ("influencers posted selfies and memes about cryptocurrency startups on instagram and tiktok while "
            "podcasters livestreamed smartphones emojis and hashtags")
WORD, CHAR = "alstm-ptb-5m-long-medium", "hyperlstm-ln-ptbchar-1.5m-long"


@pytest.fixture(scope="module")
def scores():
    return {name: zoo.load(name, source="bundled").score(OOV_TEXT)[0] for name in (WORD, CHAR)}


def test_the_character_model_does_not_lose_on_words_the_word_model_does_not_know(scores):
    word, char = scores[WORD], scores[CHAR]
    assert word["num_unk"] >= 8 and char["num_unk"] == 0
    # the plain rate rewards not knowing: the word model predicted the class <unk>, not the words
    assert word["bits_per_input_char"] < char["bits_per_input_char"]
    assert char["bits_per_input_char_charged"] < word["bits_per_input_char_charged"]


def test_every_unseen_character_is_charged_at_the_stated_price(scores):
    for res in scores.values():
        n = len(OOV_TEXT)
        expected = (res["nll"] / math.log(2) + UNSEEN_CHAR_BITS * res["num_unseen_chars"]) / n
        assert res["bits_per_input_char_charged"] == pytest.approx(expected, rel=1e-12)
    word = scores[WORD]  # every letter of every <unk> word, nothing else (no punctuation in this text)
    assert all(OOV_TEXT.split().count(w) == 1 for w in word["oov_items"])
    assert word["num_unseen_chars"] == sum(len(w) for w in word["oov_items"])
    assert scores[CHAR]["num_unseen_chars"] == 0


def test_dropped_characters_are_charged_too():
    model = zoo.load(WORD, source="bundled")
    plain, punctuated = model.score(["the market fell", "the market fell !!"]).texts
    assert punctuated["num_dropped"] == 2 and punctuated["num_unseen_chars"] == 2
    assert punctuated["nll"] == pytest.approx(plain["nll"], rel=1e-6)  # the "!" were never scored (batched: fp32)
    assert punctuated["bits_per_input_char_charged"] > punctuated["bits_per_input_char"]


def test_the_corpus_aggregate_charges_the_sum():
    model = zoo.load(CHAR, source="bundled")
    report = model.score(["naïve café", "plain text"])
    c = report.corpus
    assert c["num_unseen_chars"] == sum(r["num_unseen_chars"] for r in report.texts) > 0
    assert c["bits_per_input_char_charged"] == pytest.approx(
        input_char_bits(c["nll"], len("naïve café") + len("plain text"), c["num_unseen_chars"])
        ["bits_per_input_char_charged"], rel=1e-12)
    assert input_char_bits(1.0, 0, 0) == {"bits_per_input_char": None, "bits_per_input_char_charged": None}


def test_the_demo_and_the_cli_show_the_charged_rate(scores):
    from zoo.tools.demo.render import _summary_md

    rows = []
    for name, res in scores.items():
        rows.append({"model": name, "architecture": "x", "perplexity": res["ppl"], "bits_per_token": 1.0,
                     "bits_per_input_char": res["bits_per_input_char"],
                     "bits_per_input_char_charged": res["bits_per_input_char_charged"],
                     "num_unseen_chars": res["num_unseen_chars"], "num_tokens": res["num_tokens"],
                     "num_unk": res["num_unk"], "oov": res["oov"], "num_dropped": res["num_dropped"],
                     "warnings": [], "tokens": [name]})
    table = _summary_md(rows, None, "")
    line = next(row for row in table.splitlines() if row.startswith("| bits per input character (comparable)"))
    assert "charged 8 bits each" in line
    assert f"{scores[CHAR]['bits_per_input_char_charged']:.3f}" in line  # 3 decimals
    assert f"{scores[WORD]['bits_per_input_char_charged']:.3f}" in line
    assert "tokenise differently, not comparable" in table
