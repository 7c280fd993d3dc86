"""Checkpoints written before the library redesign (``tests/fixtures/old-checkpoint``, made by the code at commit
7964690: no ``tokenizer.json``, config written by the old ``save_checkpoint``) load strictly and score to the
numbers that code computed (recorded beside it). The bundled models are checked against their cards elsewhere
(``test_cards_bundle.py``); the training checkpoints of runs in progress resume (``test_train.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import zoo

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_old_checkpoint_loads_and_scores_the_same_numbers():
    recorded = json.loads((FIXTURES / "old-checkpoint-scores.json").read_text())
    model = zoo.load(FIXTURES / "old-checkpoint")
    assert not (FIXTURES / "old-checkpoint" / "tokenizer.json").exists()  # written before tokenizer.json existed
    rep = model.score(recorded["texts"])
    assert [t["nll"] for t in rep.texts] == recorded["nll"]
    assert [t["ppl"] for t in rep.texts] == recorded["ppl"]


def test_old_checkpoint_saved_again_gains_a_tokenizer_json(tmp_path):
    model = zoo.load(FIXTURES / "old-checkpoint")
    out = model.save_pretrained(tmp_path / "again")
    assert json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]["<eos>"] == model.tokenizer.eos_id
    assert zoo.load(out).score("the cat sat")[0]["nll"] == model.score("the cat sat")[0]["nll"]


def test_every_bundled_model_scores_as_before_the_redesign():
    """Each bundled model's per-text NLL on two texts, recorded by the code at commit 7964690 (before the library
    redesign), is reproduced exactly by the current code. Models a longer tier superseded have left the bundle
    (``zoo bundle --retire``); every architecture keeps at least one recorded model checked."""
    from zoo.catalog import bundled_dir

    before = json.loads((FIXTURES / "bundled-scores-before.json").read_text())
    checked = set()
    for name, nll in before["models"].items():
        if not (bundled_dir() / name / "config.json").is_file():
            continue
        model = zoo.load(name)
        assert [t["nll"] for t in model.score(before["texts"]).texts] == nll, name
        checked.add(model.config["architecture"])
    assert checked >= {"alstm", "lstm", "hyperlstm", "pnorm_gru"}, checked
