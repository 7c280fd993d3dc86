"""Checkpoints written before the library redesign (``tests/fixtures/old-checkpoint`` and one tiny checkpoint per
architecture in ``tests/fixtures/old-checkpoints/``, made by the code at commit 7964690: no ``tokenizer.json``,
config written by the old ``save_checkpoint``) load strictly and score to the numbers that code computed (recorded
beside them; ``tests/fixtures/make_old_checkpoints.py`` says how they were made). The bundled models are checked
against their cards elsewhere (``test_cards_bundle.py``); the training checkpoints of runs in progress resume
(``test_train.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import zoo
from tests.conftest import CROSS_CPU_REL  # the scores were recorded on another CPU

FIXTURES = Path(__file__).resolve().parent / "fixtures"
OLD_SCORES = json.loads((FIXTURES / "old-checkpoints" / "scores.json").read_text())


def test_old_checkpoint_loads_and_scores_the_same_numbers():
    recorded = json.loads((FIXTURES / "old-checkpoint-scores.json").read_text())
    model = zoo.load(FIXTURES / "old-checkpoint")
    assert not (FIXTURES / "old-checkpoint" / "tokenizer.json").exists()  # written before tokenizer.json existed
    rep = model.score(recorded["texts"])
    assert [t["nll"] for t in rep.texts] == pytest.approx(recorded["nll"], rel=CROSS_CPU_REL, abs=0)
    assert [t["ppl"] for t in rep.texts] == pytest.approx(recorded["ppl"], rel=CROSS_CPU_REL, abs=0)


def test_old_checkpoint_saved_again_gains_a_tokenizer_json(tmp_path):
    model = zoo.load(FIXTURES / "old-checkpoint")
    out = model.save_pretrained(tmp_path / "again")
    assert json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]["<eos>"] == model.tokenizer.eos_id
    assert zoo.load(out).score("the cat sat")[0]["nll"] == model.score("the cat sat")[0]["nll"]


@pytest.mark.parametrize("name", sorted(OLD_SCORES["models"]))
def test_each_architectures_old_checkpoint_loads_and_scores_the_same_numbers(name):
    recorded = OLD_SCORES["models"][name]
    model = zoo.load(FIXTURES / "old-checkpoints" / name)
    rep = model.score(recorded["texts"])
    assert [t["num_tokens"] for t in rep.texts] == recorded["num_tokens"]
    assert [t["nll"] for t in rep.texts] == pytest.approx(recorded["nll"], rel=CROSS_CPU_REL, abs=0)


def test_the_old_checkpoints_cover_every_architecture_and_their_non_default_options():
    configs = [json.loads((FIXTURES / "old-checkpoints" / n / "config.json").read_text()) for n in OLD_SCORES["models"]]
    assert {c["architecture"] for c in configs} == {"alstm", "lstm", "hyperlstm", "pnorm_gru"}
    args = [c["model_args"] for c in configs]
    assert any(a["input_encoding"] == "onehot" for a in args)  # a character model's one-hot input
    assert any(a["arch_args"].get("use_layer_norm") for a in args)  # the HyperLSTM's layer-norm parameters
    assert any(c["tokenizer"]["normalization"] == "ptb-char" for c in configs)
    assert any(c["torch_dtype"] == "float16" for c in configs)  # how the bundled models of the time were stored


def test_every_bundled_model_scores_as_before_the_redesign():
    """Each bundled model's per-text NLL on two texts, recorded by the code at commit 7964690 (before the library
    redesign), is reproduced by the current code (to ``CROSS_CPU_REL``). Models a longer tier superseded have left
    the bundle (``zoo bundle --retire``); the trained models still bundled from then are checked (every
    architecture's format is checked on the tiny fixtures above whatever the bundle holds)."""
    from zoo.catalog import bundled_dir

    before = json.loads((FIXTURES / "bundled-scores-before.json").read_text())
    checked = set()
    for name, nll in before["models"].items():
        if not (bundled_dir() / name / "config.json").is_file():
            continue
        model = zoo.load(name)
        scores = [t["nll"] for t in model.score(before["texts"]).texts]
        assert scores == pytest.approx(nll, rel=CROSS_CPU_REL, abs=0), name
        checked.add(model.config["architecture"])
    assert "alstm" in checked, checked  # alstm-ptb-5m stays bundled: the backends benchmark's headline model
