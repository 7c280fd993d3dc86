"""``tokenizer.json`` (Hugging Face ``tokenizers``) gives exactly the zoo's ids on every line of every split of
each corpus a bundled model was trained on, ``<eos>`` per line included: other tools can read the vocabulary."""

from __future__ import annotations

import json

import pytest

from tests.conftest import real_data
from zoo.catalog import bundled_dir, catalog
from zoo.checkpoint import TOKENIZER_FILE, load_tokenizer, read_config
from zoo.data import SPLITS, corpus_files, load_corpus

tokenizers = pytest.importorskip("tokenizers")


def _one_model_per_dataset() -> list[str]:
    seen: dict[str, str] = {}
    for name, entry in sorted(catalog().get("models", {}).items()):
        if (bundled_dir() / name / TOKENIZER_FILE).is_file():
            seen.setdefault(entry["dataset"], name)
    return sorted(seen.values())


@pytest.mark.parametrize("name", _one_model_per_dataset())
def test_tokenizer_json_gives_the_zoo_ids_on_the_corpus_splits(name):
    folder = bundled_dir() / name
    config = read_config(folder)
    zoo_tok = load_tokenizer(folder, config)
    hf = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    assert hf.get_vocab_size() == len(zoo_tok)
    dataset = config["dataset"]
    real_data(dataset)
    corpus = load_corpus(dataset)
    for split, path in corpus_files(dataset).items():
        lines = path.read_text(encoding="utf-8").splitlines()
        ids = [i for enc in hf.encode_batch(lines) for i in enc.ids]
        assert ids == corpus.split(split).tolist(), (dataset, split)
    assert sorted(corpus_files(dataset)) == sorted(SPLITS)
    if not zoo_tok.is_char:  # a word model's corpus line is also valid raw text: the zoo tokenizer agrees
        line = path.read_text(encoding="utf-8").splitlines()[3]
        assert hf.encode(line).ids == zoo_tok.encode(line).ids
    else:  # a character outside the alphabet: the zoo spells it < u n k >, and so does the file (it made
        # tokenizers fail: WordLevel's unk_token is not in a character vocabulary)
        for raw, spelled in (("café au lait", "c a f é _ a u _ l a i t"), ("a😀b \\ x", "a _ 😀 _ b _ \\ _ x")):
            assert hf.encode(spelled).ids == zoo_tok.encode(raw).ids, raw
        assert hf.decode(hf.encode("c a f é").ids) == "caf<unk>"


def test_every_bundled_model_ships_one_matching_its_vocab():
    checked = []
    for name in catalog().get("models", {}):
        folder = bundled_dir() / name
        if not (folder / "config.json").is_file():
            continue
        checked.append(name)
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        model = json.loads((folder / TOKENIZER_FILE).read_text(encoding="utf-8"))["model"]
        assert model["type"] == "WordLevel" and model["vocab"] == {t: i for i, t in enumerate(vocab)}, name
    assert checked and checked == list(catalog()["models"]), "every catalogue model is bundled here and checked"
