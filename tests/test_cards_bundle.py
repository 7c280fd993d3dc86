"""Model cards and bundling: a real tiny run bundled into a temp package, cards parsed back with huggingface_hub."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import struct
import tomllib
import zlib
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, ModelCardData

import zoo
from tests.conftest import real_data
from tests.olah_fixture import REPO, bundle_into, recipe_file, run_main, tiny_run
from zoo.catalog import CATALOG_FILE
from zoo.cli import main
from zoo.datasets import DATASETS
from zoo.files import sha256_file
from zoo.tools.release import cards
from zoo.tools.release.bundle import BundleError, bundle, catalog_problems


def tiny_png(path: Path) -> Path:
    """A real 2x2 PNG (the training-curve figure stand-in)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"".join(b"\x00" + b"\xff\x00\x00" * 2 for _ in range(2))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return path


@pytest.fixture(scope="module")
def tiny_run_dir(tmp_path_factory) -> Path:
    """A finished tiny training run (made once per session, shared with the Hub tests)."""
    return tiny_run(tmp_path_factory.mktemp("tiny-run"))


@pytest.fixture(scope="module")
def bundled(tiny_run_dir, tmp_path_factory):
    """The tiny run bundled (through the command line) into a temp package, with a figure, as the default."""
    tmp = tmp_path_factory.mktemp("bundle")
    pkg = tmp / "pkg"
    fig = tiny_png(tmp / "curve.png")
    env = {"ZOO_CATALOG": str(pkg / "catalog.json"), "ZOO_MODEL_CARDS_DIR": str(pkg / "cards")}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("ZOO_PRETRAINED_DIR", raising=False)
        code = main(["bundle", str(tiny_run_dir), "--name", "tiny-card", "--default", "--figure", str(fig),
                     "--recipe", str(recipe_file(tiny_run_dir))])
    assert code == 0
    ev = json.loads((tiny_run_dir / "eval.json").read_text())
    return {"pkg": pkg, "dir": pkg / "pretrained" / "tiny-card", "ev": ev, "env": env,
            "catalog": json.loads((pkg / "catalog.json").read_text())}


def test_bundle_copies_release_writes_card_and_catalogue(bundled, tiny_run_dir):
    d, ev = bundled["dir"], bundled["ev"]
    assert sorted(p.name for p in d.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                   "tiny-card-curve.png", "tokenizer.json", "tokenizer_config.json",
                                                   "vocab.json"]
    for f in ("model.safetensors", "vocab.json"):
        assert (d / f).read_bytes() == (tiny_run_dir / "release" / f).read_bytes()
    assert (bundled["pkg"] / "cards" / "tiny-card.md").read_text() == (d / "README.md").read_text()
    for src, kept in (("eval.json", "tiny-card.eval.json"), ("log.jsonl", "tiny-card.log.jsonl")):
        assert (bundled["pkg"] / "cards" / kept).read_bytes() == (tiny_run_dir / src).read_bytes()
    assert (bundled["pkg"] / "cards" / "tiny-card-curve.png").is_file()
    cat = bundled["catalog"]
    assert cat["default"] == "tiny-card"
    entry = cat["models"]["tiny-card"]
    assert entry["repo_id"] == "alstm-zoo/tiny-card" and entry["revision"] == "v1.0"
    assert entry["num_parameters"] == ev["num_parameters"] and entry["dataset"] == "ptb"
    assert entry["metrics"] == {"metric": "perplexity", "valid": ev["release"]["valid"]["ppl"],
                                "test": ev["release"]["test"]["ppl"]}
    assert entry["training"]["epochs"] == ev["epochs_trained"]
    assert entry["training"]["train_seconds"] == ev["train_seconds"]
    assert set(entry["files"]) == {p.name for p in d.iterdir()}
    for fname, meta in entry["files"].items():
        data = (d / fname).read_bytes()
        assert meta == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def test_catalogue_schema(bundled):
    assert catalog_problems(bundled["catalog"]) == []
    real = json.loads(CATALOG_FILE.read_text())
    assert catalog_problems(real) == []  # the package's own catalogue
    broken = copy.deepcopy(bundled["catalog"])
    entry = broken["models"]["tiny-card"]
    entry["files"]["vocab.json"]["sha256"] = "xyz"
    del entry["repo_id"]
    entry["metrics"]["metric"] = "accuracy"
    assert catalog_problems(broken) == [
        "tiny-card: 'repo_id' missing or not str",
        "tiny-card: metrics need metric (perplexity|bits_per_char), valid and test numbers",
        "tiny-card: files['vocab.json'] needs a sha256 (64 hex) and a size"]


def test_card_validates_and_model_index_equals_eval_json(bundled):
    ev = bundled["ev"]
    card = ModelCard.load(bundled["dir"] / "README.md")
    data = card.data
    assert isinstance(data, ModelCardData)
    assert data.library_name == "alstm-zoo" and data.pipeline_tag == "text-generation"
    assert data.language == "en" and data.license == "mit" and data.datasets == ["ptb-text-only/ptb_text_only"]
    assert data.model_name == "tiny-card" and "lstm" in data.tags
    # the model-index round-trips through huggingface_hub's parser to exactly eval.json's numbers
    assert cards.card_metrics(str(card)) == {
        "valid": {"perplexity": ev["release"]["valid"]["ppl"]}, "test": {"perplexity": ev["release"]["test"]["ppl"]}}
    again = ModelCard(data.to_yaml().join(["---\n", "\n---\n"]) + card.text)
    assert again.data.eval_results == data.eval_results
    assert cards.catalog_metrics_from_card(str(card), "ptb") == bundled["catalog"]["models"]["tiny-card"]["metrics"]


def test_card_body_holds_recipe_training_facts_figure_reference_and_citation(bundled, tiny_run_dir):
    ev, text = bundled["ev"], (bundled["dir"] / "README.md").read_text()
    recipe_block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    expected = json.loads(json.dumps(ev["recipe"]), object_hook=lambda d: {k: v for k, v in d.items() if v is not None})
    assert tomllib.loads(recipe_block) == expected  # every hyper-parameter, exactly
    assert f"{ev['num_parameters']:,}" in text
    assert f"- Hardware: {cards.short_device(ev['device'])}, 1 process; compute precision fp32" in text
    assert f"{ev['train_seconds']:.0f} s" in text
    assert bundled["catalog"]["models"]["tiny-card"]["training"]["precision"] == "fp32"
    assert f"over {ev['epochs_trained']} epochs" in text and f"epoch {ev['best_epoch']}" in text
    rel = ev["release"]
    assert f"{rel['test_ppl_change']:+.4%}" in text and "float16" in text
    assert "![Training curve of tiny-card](tiny-card-curve.png)" in text
    assert "| published reference (perplexity): test fixture reference | 120.70 | 114.50 |" in text
    assert "Recurrent Neural Network Regularization" in text and "Merity" not in text
    log = [json.loads(x) for x in (tiny_run_dir / "log.jsonl").read_text().splitlines() if '"valid_ppl"' in x]
    for r in log:  # the training-log table has one row per epoch of log.jsonl
        assert re.search(rf"^\| {r['epoch']}( \*)? \| {r['train_ppl']:.2f} \| {r['valid_ppl']:.2f} \|", text, re.M)
    assert bundled["catalog"]["models"]["tiny-card"]["reference"]["source"] == "test fixture reference"


@pytest.mark.parametrize(("arch", "title"), [
    ("alstm", "Breaking the Activation Function Bottleneck through Adaptive Parameterization"),
    ("hyperlstm", "{HyperNetworks}"),
    ("pnorm_gru", "Faster Training of Very Deep Networks Via p-Norm Gates"),
    ("lstm", "Recurrent Neural Network Regularization"),
])
def test_citation_is_chosen_by_architecture(bundled, arch, title):
    ev = dict(bundled["ev"], architecture=arch)
    config = json.loads((bundled["dir"] / "config.json").read_text())
    text = cards.build_card("x", ev, [], config, repo_id="o/x", revision="v1.0")
    assert title in text
    others = {"alstm": "Flennerhag", "hyperlstm": "Ha, David", "pnorm_gru": "Pham, Trang", "lstm": "Zaremba"}
    assert [a for a, who in others.items() if who in text] == [arch]


def test_awd_lstm_recipe_also_cites_merity(bundled):
    ev = copy.deepcopy(bundled["ev"])
    ev["recipe"]["train"]["optimizer"] = "ntasgd"
    assert cards.citation_keys("lstm", ev["recipe"]) == ["zaremba2014", "merity2018"]


def test_char_level_card_reports_bits_per_character(bundled):
    ev = dict(bundled["ev"], dataset="ptb-char")
    config = json.loads((bundled["dir"] / "config.json").read_text())
    text = cards.build_card("c", ev, [], config, repo_id="o/c", revision="v1.0")
    rel = ev["release"]
    assert cards.card_metrics(text) == {
        "valid": {"perplexity": rel["valid"]["ppl"], "bpc": rel["valid"]["bits_per_token"]},
        "test": {"perplexity": rel["test"]["ppl"], "bpc": rel["test"]["bits_per_token"]}}
    assert cards.release_metrics(ev) == {"metric": "bits_per_char", "valid": rel["valid"]["bits_per_token"],
                                         "test": rel["test"]["bits_per_token"]}


def test_card_throughput_is_total_tokens_over_total_time(bundled):
    """Not the mean of the epochs' rates: 1000 tok/s for 100 s and 4000 tok/s for 300 s is 1,300,000 tokens in
    400 s, 3,250 tok/s (the mean of the rates would say 2,500)."""
    config = json.loads((bundled["dir"] / "config.json").read_text())
    log = [{"epoch": e, "train_loss": 5.0, "valid_loss": 5.0, "valid_ppl": math.exp(5), "train_ppl": math.exp(5),
            "lr": 1e-3, "seconds": sec, "tokens_per_s": tps, "optimizer": "adam", "best": e == 1}
           for e, (tps, sec) in enumerate(((1000.0, 100.0), (4000.0, 300.0)), start=1)]
    text = cards.build_card("t", bundled["ev"], log, config, repo_id="o/t", revision="v1.0")
    assert "- Throughput: 3,250 training tokens/s (all epochs' tokens / their time)" in text


def test_sentence_mode_card_says_its_setting(bundled):
    """A model trained on single sentences (the p-norm tier) says so in its results, usage, training and evaluation
    sections; a character model's training log is in bits per character."""
    ev = copy.deepcopy(bundled["ev"]) | {"dataset": "ptb-char"}
    ev["recipe"]["train"].update(mode="sentences", max_len=100, train_sentences=10000, batch_size=32)
    for split, n in (("valid", 3370), ("test", 3761)):
        ev[split].update(mode="sentences", num_sequences=n)
    config = json.loads((bundled["dir"] / "config.json").read_text())
    log = [{"epoch": 1, "train_loss": 2 * math.log(2), "valid_loss": 1.5 * math.log(2), "valid_ppl": 2 ** 1.5,
            "train_ppl": 4.0, "lr": 1e-3, "seconds": 60.0, "optimizer": "adam", "best": True}]
    text = cards.build_card("s", ev, log, config, repo_id="o/s", revision="v1.0")
    assert "every line scored as a single sentence from a zero state" in text
    assert "This model scores **single sentences**" in text and "more than 100 characters in a row" in text
    assert "train split as single sentences (a fixed random sample of 10,000 lines, each truncated to its first " \
           "100 characters, from a zero state, in padded and masked batches of 32)" in text
    assert "Single-sentence protocol" in text and "Valid: 3,370 sentences" in text and "test: 3,761 sentences" in text
    assert "stateful" not in text and "Standard stateful protocol" not in text
    assert "| epoch | train bpc | valid bpc |" in text and "| 1 * | 2.000 | 1.500 |" in text
    assert "\nbptt =" not in text and "variable_bptt" not in text and "eval_bptt" not in text  # inert there
    stream = cards.build_card("c", bundled["ev"], log, config, repo_id="o/c", revision="v1.0")
    assert "Standard stateful protocol" in stream and "single sentence" not in stream
    assert "| epoch | train ppl | valid ppl |" in stream


def test_bundled_dir_loads_and_scores(bundled):
    model = zoo.load(bundled["dir"])
    assert model.source == "local path" and model.config["metrics"] == bundled["catalog"]["models"]["tiny-card"][
        "metrics"]
    rep = model.score("the company said it expects to report a loss")
    assert rep.texts[0]["num_tokens"] > 5 and 1 < rep.texts[0]["ppl"] < 1e5


def test_readme_table_from_catalogue(bundled, capsys, monkeypatch):
    from zoo.tools.release.cards import short_device

    monkeypatch.setenv("ZOO_CATALOG", bundled["env"]["ZOO_CATALOG"])
    code, stdout, _ = run_main(capsys, "bundle", "--readme-table")
    assert code == 0
    entry = bundled["catalog"]["models"]["tiny-card"]
    row = [line for line in stdout.splitlines() if "`tiny-card`" in line]
    assert len(row) == 1
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    assert cells == ["`tiny-card` (default)", "lstm", f"{entry['num_parameters'] / 1e6:.2f}M", "ptb",
                     str(entry["training"]["epochs"]), cards.format_duration(entry["training"]["train_seconds"])
                     + f" ({short_device(entry['training']['device'])}, fp32)",
                     f"{entry['metrics']['valid']:.2f}", f"{entry['metrics']['test']:.2f}", "", "perplexity",
                     "120.70 / 114.50 (test fixture reference)"]  # (no dynamic-evaluation number for it)
    assert stdout == cards.models_table_markdown(bundled["catalog"])
    with_dynamic = cards.models_table_markdown(bundled["catalog"], dynamic={"tiny-card": 99.125})
    assert "| 99.12 | perplexity |" in with_dynamic
    assert entry["training"]["mode"] == "stream"
    # a sentence-level model says so beside its data (its bpc is over single lines, not comparable with a
    # stream's), and a reference without numbers shows its source only, not "n/a / n/a"
    sent = copy.deepcopy(bundled["catalog"])
    sent["models"]["tiny-card"]["training"]["mode"] = "sentences"
    sent["models"]["tiny-card"]["reference"] = {"metric": "perplexity", "source": "a figure, no numbers"}
    cells = [c.strip() for c in [r for r in cards.models_table_markdown(sent).splitlines()
                                 if "`tiny-card`" in r][0].strip("|").split("|")]
    assert cells[3] == "ptb, single sentences" and cells[-1] == "a figure, no numbers"


def test_rebundle_replaces_atomically_and_keeps_other_entries(bundled, tiny_run_dir, tmp_path):
    pkg = tmp_path / "pkg"
    bundle_into(pkg, tiny_run_dir, "first")
    entry = bundle_into(pkg, tiny_run_dir, "second", repo_id="org/second", revision="v2")
    cat = json.loads((pkg / "catalog.json").read_text())
    assert sorted(cat["models"]) == ["first", "second"] and cat["default"] is None
    assert entry["repo_id"] == "org/second" and cat["models"]["second"]["revision"] == "v2"
    (pkg / "cards" / "runs").mkdir()   # "first" had been recorded as trained here, not bundled: bundling it
    for suffix in (".eval.json", ".log.jsonl"):  # retires that record, so the README lists it once
        (pkg / "cards" / "runs" / f"first{suffix}").write_text("{}")
    (pkg / "cards" / "runs" / "other.log.jsonl").write_text("{}")
    bundle_into(pkg, tiny_run_dir, "first")
    assert [p.name for p in (pkg / "cards" / "runs").iterdir()] == ["other.log.jsonl"]
    bundle_into(pkg, tiny_run_dir, "second")  # re-bundling keeps the pinned repo and revision
    assert json.loads((pkg / "catalog.json").read_text())["models"]["second"]["repo_id"] == "org/second"
    assert sorted(p.name for p in (pkg / "pretrained").iterdir()) == ["first", "second"]  # no staging left


def test_a_rebundle_whose_catalogue_write_fails_leaves_the_old_folder_and_entry(tiny_run_dir, tmp_path,
                                                                                  monkeypatch):
    """The folder and its catalogue entry (whose hashes loading checks) change together: if the entry cannot be
    written, the swapped-in folder goes and the old one comes back, so the zoo still loads as it did."""
    import zoo.tools.release.bundle as bundle_mod

    pkg = tmp_path / "pkg"
    bundle_into(pkg, tiny_run_dir, "m")
    before = {p.name: p.read_bytes() for p in (pkg / "pretrained" / "m").iterdir()}
    catalog = (pkg / "catalog.json").read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(bundle_mod, "update_catalog", fail)
    with pytest.raises(OSError, match="disk full"):
        bundle_into(pkg, tiny_run_dir, "m", repo_id="org/changed", revision="v9")
    assert {p.name: p.read_bytes() for p in (pkg / "pretrained" / "m").iterdir()} == before
    assert (pkg / "catalog.json").read_bytes() == catalog
    assert sorted(p.name for p in (pkg / "pretrained").iterdir()) == ["m"]  # no staging or old folder left
    monkeypatch.undo()
    bundle_into(pkg, tiny_run_dir, "m", repo_id="org/changed", revision="v9")
    assert json.loads((pkg / "catalog.json").read_text())["models"]["m"]["revision"] == "v9"


def test_the_bundled_zoo_stays_under_its_cap():
    """The issue's limit on what a clone carries: the package's bundled models, counted on disk (every file,
    cards and figures too), are under 200 MB, and the catalogue's file sizes add up to the same bytes."""
    from zoo.tools.release.bundle import MAX_BUNDLE_BYTES, bundled_bytes

    pretrained = Path(zoo.__file__).parent / "pretrained"
    total = bundled_bytes(pretrained)
    assert 0 < total <= MAX_BUNDLE_BYTES == 200_000_000
    cat = json.loads(CATALOG_FILE.read_text())
    assert total == sum(r["size"] for m in cat["models"].values() for r in m["files"].values())


def test_a_bundle_over_the_cap_is_refused_and_changes_nothing(tiny_run_dir, tmp_path, monkeypatch):
    """A model that would take the zoo over its cap is refused with a one-line error naming the total and the
    way out (retire one); a rebundle of a model counts its new files instead of its old ones."""
    import zoo.tools.release.bundle as bundle_mod

    pkg = tmp_path / "pkg"
    bundle_into(pkg, tiny_run_dir, "m")
    one = bundle_mod.bundled_bytes(pkg / "pretrained")
    catalog = (pkg / "catalog.json").read_bytes()
    monkeypatch.setattr(bundle_mod, "MAX_BUNDLE_BYTES", one + one // 2)
    bundle_into(pkg, tiny_run_dir, "m", revision="v2")  # replaces m: still one model's bytes
    catalog = (pkg / "catalog.json").read_bytes()
    with pytest.raises(BundleError, match=r"the bundled zoo would be [0-9.]+ MB with m2, over its 0 MB cap: "
                                          r"retire a model first") as e:
        bundle_into(pkg, tiny_run_dir, "m2")
    assert "\n" not in str(e.value)
    assert (pkg / "catalog.json").read_bytes() == catalog
    assert sorted(p.name for p in (pkg / "pretrained").iterdir()) == ["m"]  # no m2, no staging folder left


def test_retire_keeps_the_run_as_a_record_and_refuses_the_default(tiny_run_dir, tmp_path, capsys, monkeypatch):
    """A model a longer tier supersedes leaves the zoo (folder, catalogue entry, card, figure) and its evaluation
    files become a "trained here, not bundled" record; the default model and unknown names are refused."""
    from zoo.tools.release.bundle import retire

    pkg = tmp_path / "pkg"
    bundle_into(pkg, tiny_run_dir, "old", figures=[tiny_png(tmp_path / "old-curve.png")])
    bundle_into(pkg, tiny_run_dir, "new", default=True)
    cards_dir = pkg / "cards"
    ev = (cards_dir / "old.eval.json").read_bytes()
    assert (cards_dir / "old-curve.png").is_file()
    records = retire("old", catalog_file=pkg / "catalog.json", pretrained_dir=pkg / "pretrained",
                     cards_dir=cards_dir)
    assert [p.name for p in records] == ["old.eval.json", "old.log.jsonl"]
    assert (cards_dir / "runs" / "old.eval.json").read_bytes() == ev
    assert sorted(p.name for p in cards_dir.iterdir()) == ["new.eval.json", "new.log.jsonl", "new.md", "runs"]
    assert sorted(json.loads((pkg / "catalog.json").read_text())["models"]) == ["new"]
    assert sorted(p.name for p in (pkg / "pretrained").iterdir()) == ["new"]
    with pytest.raises(BundleError, match="is the default model"):
        retire("new", catalog_file=pkg / "catalog.json", pretrained_dir=pkg / "pretrained", cards_dir=cards_dir)
    bundle_into(pkg, tiny_run_dir, "old")  # bundled again: the record goes back beside the card, one copy
    assert sorted(p.name for p in (cards_dir / "runs").iterdir()) == []
    monkeypatch.setenv("ZOO_CATALOG", str(pkg / "catalog.json"))
    monkeypatch.setenv("ZOO_MODEL_CARDS_DIR", str(cards_dir))
    code, _, err = run_main(capsys, "bundle", "--retire", "nope")
    assert code == 2 and err.count("\n") == 1 and "'nope' is not in the catalogue" in err
    code, out, _ = run_main(capsys, "bundle", "--retire", "old")
    assert code == 0 and out.startswith("retired old:") and not (pkg / "pretrained" / "old").exists()


def test_refresh_rebuilds_the_card_from_the_bundled_files_and_keeps_weights_and_default(tiny_run_dir, tmp_path,
                                                                                         capsys, monkeypatch):
    """`zoo bundle --refresh NAME`: a tier report written after bundling reaches the card without the run dir;
    the weights, vocabulary and figure stay byte-identical, the default and the Hub pin stay, the catalogue's
    card hash follows the new card."""
    from zoo.tools.release.bundle import refresh

    pkg = tmp_path / "pkg"
    custom = tmp_path / "custom.toml"  # a reference given with --recipe: kept in the catalogue entry only
    custom.write_text('[reference]\nvalid = 99.5\ntest = 98.25\nmetric = "perplexity"\nsource = "Custom et al."\n')
    bundle(tiny_run_dir, "m", default=True, figures=[tiny_png(tmp_path / "m-curve.png")], repo_id="someone/m",
           revision="v2", license="apache-2.0", recipe_path=custom, catalog_file=pkg / "catalog.json",
           pretrained_dir=pkg / "pretrained", cards_dir=pkg / "cards")
    folder, cards = pkg / "pretrained" / "m", pkg / "cards"
    before = {f.name: f.read_bytes() for f in folder.iterdir()}
    run_name = json.loads((cards / "m.eval.json").read_text())["name"]
    assert "## Comparison" not in before["README.md"].decode()
    (cards / "tiers").mkdir()
    (cards / "tiers" / "t.json").write_text(json.dumps({
        "tier": "t", "title": "A test tier",
        "roles": {"lstm": {"chosen": run_name, "sweep": [{"run": run_name}]}},
        "claims": [{"source": "a paper's claim", "model": "lstm", "baseline": None, "met": True, "detail": "3 < 4"}]}))
    entry = refresh("m", catalog_file=pkg / "catalog.json", pretrained_dir=pkg / "pretrained", cards_dir=cards)
    card = (folder / "README.md").read_text()
    assert "## Comparison: A test tier" in card and "| a paper's claim | met | 3 < 4 |" in card
    assert card == (cards / "m.md").read_text()
    after = {f.name: f.read_bytes() for f in folder.iterdir()}
    assert sorted(after) == sorted(before)
    for f in ("model.safetensors", "vocab.json", "m-curve.png", "tokenizer.json"):
        assert after[f] == before[f], f
    cat = json.loads((pkg / "catalog.json").read_text())
    assert cat["default"] == "m" and entry["repo_id"] == "someone/m" and entry["revision"] == "v2"
    assert cat["models"]["m"]["files"]["README.md"]["sha256"] == hashlib.sha256(card.encode()).hexdigest()
    assert entry["reference"] == {"valid": 99.5, "test": 98.25, "metric": "perplexity", "source": "Custom et al."}
    assert "\nlicense: apache-2.0\n" in card and "Custom et al." in card
    with pytest.raises(BundleError, match="'nope' is not in the catalogue"):
        refresh("nope", catalog_file=pkg / "catalog.json", pretrained_dir=pkg / "pretrained", cards_dir=cards)
    monkeypatch.setenv("ZOO_CATALOG", str(pkg / "catalog.json"))
    monkeypatch.setenv("ZOO_MODEL_CARDS_DIR", str(cards))
    code, out, _ = run_main(capsys, "bundle", "--refresh", "m")  # nothing it quotes changed since
    assert code == 0 and "m.md unchanged, catalogue entry rebuilt" in out and "publish" not in out, out
    report = json.loads((cards / "tiers" / "t.json").read_text())
    report["claims"][0]["detail"] = "2 < 4"
    (cards / "tiers" / "t.json").write_text(json.dumps(report))
    code, out, _ = run_main(capsys, "bundle", "--refresh", "m")
    assert code == 0 and "someone/m@v2 no longer matches" in out and "zoo publish m --tag NEW_TAG" in out, out
    card = (folder / "README.md").read_text()
    assert "| a paper's claim | met | 2 < 4 |" in card
    for args, message in ((["--refresh", "nope"], "'nope' is not in the catalogue"),
                          (["--refresh", "m", "nope"], "'nope' is not in the catalogue"),
                          (["--refresh", "m", "--license", "mit"], "--refresh takes model names only, not --license"),
                          (["--retire", "m", "--default"], "--retire takes model names only, not --default")):
        code, _, err = run_main(capsys, "bundle", *args)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    # a plain re-bundle keeps the repo and revision too: when files change under them it says so, like --refresh
    code, out, err = run_main(capsys, "bundle", str(tiny_run_dir), "--name", "m", "--figure",
                              str(folder / "m-curve.png"), "--recipe", str(custom), "--license", "apache-2.0")
    assert code == 0 and out.startswith("bundled m") and err == "", err  # the same files again: nothing to say
    code, out, err = run_main(capsys, "bundle", str(tiny_run_dir), "--name", "m")  # no figure, the recipe's reference
    assert code == 0 and err.startswith("note: the hashes of README.md, m-curve.png changed") and \
        "someone/m@v2 no longer matches" in err and "`zoo publish m --tag NEW_TAG`" in err, err
    code, _, err = run_main(capsys, "bundle", str(tiny_run_dir), "--name", "m", "--revision", "v3")
    assert code == 0 and err == "", err  # a new revision: nothing published there yet
    bundle(tiny_run_dir, "m", default=True, figures=[tiny_png(tmp_path / "m-curve.png")], repo_id="someone/m",
           revision="v2", license="apache-2.0", recipe_path=custom, catalog_file=pkg / "catalog.json",
           pretrained_dir=pkg / "pretrained", cards_dir=pkg / "cards")
    (folder / "m-curve.png").unlink()
    with pytest.raises(BundleError, match="cannot rebuild its card without .*m-curve.png"):
        refresh("m", catalog_file=pkg / "catalog.json", pretrained_dir=pkg / "pretrained", cards_dir=cards)
    (cards / "m.log.jsonl").unlink()
    with pytest.raises(BundleError, match="cannot rebuild its card without"):
        refresh("m", catalog_file=pkg / "catalog.json", pretrained_dir=pkg / "pretrained", cards_dir=cards)
    assert (folder / "README.md").read_text() == card  # a refused refresh leaves the model as it was


def test_bad_inputs_are_one_line_errors(tiny_run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ZOO_CATALOG", str(tmp_path / "c.json"))
    code, _, err = run_main(capsys, "bundle", str(tmp_path / "nope"))
    assert code == 2 and err.count("\n") == 1 and "no such run directory" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_main(capsys, "bundle", str(tmp_path / "empty"))
    assert code == 2 and err.count("\n") == 1 and "no eval.json" in err
    code, _, err = run_main(capsys, "bundle")
    assert code == 2 and "give a run directory" in err
    with pytest.raises(BundleError, match="invalid model name"):
        bundle(tiny_run_dir, "Bad Name", catalog_file=tmp_path / "c.json")
    with pytest.raises(BundleError, match="no such figure"):
        bundle(tiny_run_dir, "ok", catalog_file=tmp_path / "c.json", figures=[tmp_path / "x.png"])
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "pretrained" / "ok").exists()


# -- every model bundled in the real package -------------------------------------------------------------------
def _real_bundled() -> list[str]:
    cat = json.loads(CATALOG_FILE.read_text()) if CATALOG_FILE.is_file() else {"models": {}}
    return sorted(n for n in cat.get("models", {}) if (CATALOG_FILE.parent / "pretrained" / n).is_dir())


@pytest.mark.parametrize("name", _real_bundled())
def test_real_bundled_model_card_matches_catalogue(name):
    """Every model shipped in zoo/pretrained/: its card validates, its model-index equals its catalogue metrics."""
    entry = json.loads(CATALOG_FILE.read_text())["models"][name]
    d = CATALOG_FILE.parent / "pretrained" / name
    card = ModelCard.load(d / "README.md")
    assert card.data.library_name == "alstm-zoo" and card.data.model_name == name
    assert cards.catalog_metrics_from_card(str(card), entry["dataset"]) == entry["metrics"]
    for fname, meta in entry["files"].items():
        assert sha256_file(d / fname) == meta["sha256"] and (d / fname).stat().st_size == meta["size"]
    assert (REPO / "model_cards" / f"{name}.md").read_text() == (d / "README.md").read_text()
    # the evaluation file the bundle was made from is committed beside the card
    run_eval = REPO / "model_cards" / f"{name}.eval.json"
    assert cards.release_metrics(json.loads(run_eval.read_text())) == entry["metrics"]


@pytest.mark.parametrize("name", _real_bundled())
def test_real_bundled_model_test_number_was_reproduced_by_its_cards_command(name):
    """``benchmarks/card_reproduction.py`` ran the card's own "Reproduce with `zoo eval ...`" command in a fresh
    process and got the catalogue's *current* test number within 0.01% (re-bundling a model makes its entry stale,
    so a new number cannot ship unreproduced)."""
    from benchmarks.card_reproduction import RESULTS, TOLERANCE, card_command

    entry = json.loads(CATALOG_FILE.read_text())["models"][name]
    args = card_command((CATALOG_FILE.parent / "pretrained" / name / "README.md").read_text(), name)
    assert args[:2] == ["eval", name] and args[args.index("--dataset") + 1] == entry["dataset"]
    results = json.loads((RESULTS / "card_reproduction.json").read_text())["models"]
    assert name in results, f"run: python benchmarks/card_reproduction.py --models {name}"
    r = results[name]
    assert r["card_test"] == entry["metrics"]["test"], f"stale: python benchmarks/card_reproduction.py --models {name}"
    assert r["command"] == "zoo " + " ".join(args) and r["metric"] == entry["metrics"]["metric"]
    assert abs(r["measured_test"] / r["card_test"] - 1) <= TOLERANCE and r["within_tolerance"]


def test_card_command_is_the_one_reproduce_line():
    from benchmarks.card_reproduction import card_command

    card = "x\nReproduce with `zoo eval m --dataset ptb --split test --batch-size 1`.\n"
    assert card_command(card, "m") == ["eval", "m", "--dataset", "ptb", "--split", "test", "--batch-size", "1"]
    with pytest.raises(ValueError, match="has 0 "):
        card_command(card, "other")
    with pytest.raises(ValueError, match="has 2 "):
        card_command(card + card, "m")


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_card_usage_example_is_in_the_corpus_vocabulary(dataset):
    """The card's usage example is written in its corpus's normalisation: every token is known, none is <unk>.

    A lower-cased, punctuation-free PTB sentence would score as a string of ``<unk>`` under WikiText-2's cased
    vocabulary, and the first thing a reader runs would give a misleading perplexity.
    """
    from zoo.data import load_corpus
    from zoo.datasets import get_dataset
    from zoo.tokenizer import Tokenizer

    info = DATASETS[dataset]
    real_data(dataset)
    tok = Tokenizer(load_corpus(dataset).vocab, get_dataset(dataset).normalization)
    for text in (info.example_text, info.example_prompt):
        enc = tok.encode(text)
        assert len(enc.ids) >= 3
        assert tok.count_unk(enc) == 0, (dataset, text, enc.tokens)


def test_reference_comes_from_the_recipe_file_before_the_runs_copy(tmp_path):
    """A corrected published reference in the recipe file reaches the card without retraining; a run whose
    recipe file is gone still has the copy its eval.json recorded."""
    from zoo.tools.release.bundle import find_reference

    old = {"valid": 1.0, "test": 2.0, "metric": "perplexity", "source": "as recorded when the run started"}
    ev = {"recipe": {"name": "no-such-recipe-anywhere", "reference": old}}
    recipe = tmp_path / "r.toml"
    recipe.write_text('[reference]\nvalid = 67.5\ntest = 64.5\nmetric = "perplexity"\nsource = "corrected"\n')
    assert find_reference(ev, recipe)["source"] == "corrected"
    assert find_reference(ev) == old
    with pytest.raises(BundleError, match="no such recipe file"):
        find_reference(ev, tmp_path / "missing.toml")


def test_a_reference_without_numbers_cites_the_setting(bundled, tmp_path):
    """A ``[reference]`` with a source and no number (the p-norm paper's sentence experiment ran on another corpus):
    accepted, no results row, and the card says no published number is comparable; a non-numeric value is an
    error."""
    from zoo.tools.release.bundle import find_reference

    ev = {"recipe": {"name": "no-such-recipe-anywhere"}}
    recipe = tmp_path / "r.toml"
    recipe.write_text('[reference]\nmetric = "bits_per_char"\nsource = "Pham et al. 2016, Fig. 4"\n')
    ref = find_reference(ev, recipe)
    assert ref == {"metric": "bits_per_char", "source": "Pham et al. 2016, Fig. 4"}
    config = json.loads((bundled["dir"] / "config.json").read_text())
    text = cards.build_card("s", bundled["ev"], [], config, repo_id="o/s", revision="v1.0", reference=ref)
    assert "published reference" not in text
    assert "- The setting follows Pham et al. 2016, Fig. 4; no published number is comparable with this run." in text
    recipe.write_text('[reference]\ntest = "1.2"\nsource = "s"\n')
    with pytest.raises(BundleError, match="as numbers"):
        find_reference(ev, recipe)


def test_card_shows_the_corrected_reference_in_its_recipe_block_too(tiny_run_dir, tmp_path):
    """The card's recorded-recipe block carries the [reference] the card compares with, so the two never
    disagree; every hyper-parameter stays as the run recorded it."""
    recipe = tmp_path / "r.toml"
    recipe.write_text('[reference]\nvalid = 67.5\ntest = 64.5\nmetric = "perplexity"\nsource = "corrected"\n')
    bundle(tiny_run_dir, "tiny-ref", catalog_file=tmp_path / "pkg" / "catalog.json",
           pretrained_dir=tmp_path / "pkg" / "pretrained", cards_dir=tmp_path / "pkg" / "cards", recipe_path=recipe)
    card = (tmp_path / "pkg" / "pretrained" / "tiny-ref" / "README.md").read_text()
    block = card.split("```toml\n", 1)[1].split("```", 1)[0]
    assert 'source = "corrected"' in block and "test fixture reference" not in card
    recorded = json.loads((tiny_run_dir / "eval.json").read_text())["recipe"]
    assert tomllib.loads(block)["train"] == {k: v for k, v in recorded["train"].items() if v is not None}


def test_card_says_how_often_the_test_split_was_scored():
    """A sweep prefix continued after its choice on validation finished twice, and `zoo train` scores the test
    split at each finish: its card says so instead of claiming a single look."""
    once = [{"epoch": 1, "valid_ppl": 9.0}, {"epoch": 2, "valid_ppl": 8.0}, {"event": "finished"}]
    assert "evaluated once" in cards.held_out_line(once)
    twice = [*once, {"event": "resumed"}, {"epoch": 3, "valid_ppl": 7.0}, {"event": "finished"}]
    line = cards.held_out_line(twice)
    assert "evaluated once" not in line and "2 finishes (after epochs 2 and 3" in line
    log = [json.loads(s) for s in (REPO / "model_cards" / "lstm-ptb-5m-long-light.log.jsonl").read_text().splitlines()]
    card = (REPO / "model_cards" / "lstm-ptb-5m-long-light.md").read_text()
    assert cards.held_out_line(log) in card and "after epochs 14 and 40" in card
