"""Tier comparisons: sweep points chosen on validation only, claims computed from the runs' own files."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import real_data
from zoo.tools import readme, tiers

TIERS = {
    "t": {
        "dataset": "ptb", "title": "test tier", "param_tolerance": 0.05,
        "roles": {"alstm": ["a"], "lstm": ["l-light", "l-heavy"], "gru_p1": ["g1"], "gru": ["g2"]},
        "claims": [
            {"kind": "test_improvement", "model": "alstm", "baseline": "lstm", "min_rel": 0.08, "source": "s1"},
            {"kind": "epochs_to_baseline_best", "model": "alstm", "baseline": "lstm", "max_ratio": 0.5,
             "source": "s2"},
            {"kind": "epochs_to_baseline_train", "model": "gru", "baseline": "gru_p1", "source": "s3"},
        ],
    }
}


def fake_run(root, name, valid_ppls, train_losses, valid, test, params=5_000_000, finished=True):
    """A run dir with the files `zoo train` writes (log.jsonl records, eval.json), with chosen numbers."""
    d = root / name
    d.mkdir()
    recs = [{"epoch": i + 1, "valid_ppl": v, "valid_loss": math.log(v), "train_loss": t, "seconds": 60.0}
            for i, (v, t) in enumerate(zip(valid_ppls, train_losses, strict=True))]
    (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if finished:
        ev = {"dataset": "ptb", "architecture": "x", "num_parameters": params, "train_seconds": 60.0 * len(recs),
              "epochs_trained": len(recs), "valid": {"ppl": valid}, "test": {"ppl": test}}
        (d / "eval.json").write_text(json.dumps(ev))
    return d


@pytest.fixture
def runs(tmp_path):
    fake_run(tmp_path, "a", [150, 120, 100, 90], [5.0, 4.6, 4.4, 4.3], valid=90, test=86)
    # the heavy LSTM has the better validation but the worse test ppl: validation must decide
    fake_run(tmp_path, "l-light", [160, 140, 125, 118], [5.0, 4.7, 4.5, 4.4], valid=118, test=90)
    fake_run(tmp_path, "l-heavy", [170, 130, 115, 110], [5.1, 4.8, 4.6, 4.5], valid=110, test=100,
             params=5_200_000)
    fake_run(tmp_path, "g1", [150, 140, 130, 125], [5.0, 4.8, 4.6, 4.5], valid=125, test=120)
    fake_run(tmp_path, "g2", [150, 135, 126, 120], [4.9, 4.5, 4.4, 4.3], valid=120, test=115, finished=False)
    return tmp_path


def test_claims_from_runs(runs):
    rep = tiers.compare("t", runs, TIERS)
    assert rep["roles"]["lstm"]["chosen"] == "l-heavy"  # best validation, although its test is worse
    test_claim, conv, gru = rep["claims"]
    assert test_claim["measured_rel"] == pytest.approx(1 - 86 / 100) and test_claim["met"] is True
    # LSTM best valid 110 at epoch 4; the aLSTM is at or below 110 first at epoch 3: 0.75x > 0.5x
    assert (conv["baseline_best_epoch"], conv["model_epoch_reached"]) == (4, 3)
    assert conv["measured_ratio"] == pytest.approx(0.75) and conv["met"] is False
    assert gru["met"] is None and "not finished" in gru["detail"]  # g2 has no eval.json yet
    (g2,) = rep["roles"]["gru"]["sweep"]
    assert g2["status"] == "unfinished" and g2["last_valid"] == 120 and "(120.00 at its last epoch)" in \
        tiers.markdown(rep)
    assert rep["param_budget"]["spread"] == pytest.approx(0.04) and rep["param_budget"]["met"] is True
    assert "(the largest 4.0% above the smallest; within the tier's 5%)" in tiers.markdown(rep)


def test_parameter_budget_is_checked_between_the_smallest_and_the_largest(runs):
    """"Within 5% of each other" is every pair within 5%: 5.0M and 5.3M are 6% apart, although each is within 3%
    of their midpoint (the check this replaced)."""
    (runs / "l-heavy" / "eval.json").write_text(json.dumps(
        json.loads((runs / "l-heavy" / "eval.json").read_text()) | {"num_parameters": 5_300_000}))
    rep = tiers.compare("t", runs, TIERS)
    assert rep["param_budget"]["spread"] == pytest.approx(0.06) and rep["param_budget"]["met"] is False
    assert "(the largest 6.0% above the smallest; OUTSIDE the tier's 5%)" in tiers.markdown(rep)


def test_a_report_is_the_same_bytes_when_nothing_changed(runs, tmp_path):
    """Regenerating a tier report with no new run writes the same files: a report carries no timestamp, so
    neither it nor the cards quoting it change (and no Hub README sha moves) for nothing."""
    out, figs = tmp_path / "out", tmp_path / "figs"
    tiers.write(tiers.compare("t", runs, TIERS), out, figs)
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    tiers.write(tiers.compare("t", runs, TIERS), out, figs)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert "generated" not in json.loads(first["t.json"])


def test_train_loss_claim_and_markdown(runs):
    (runs / "g2" / "eval.json").write_text(json.dumps({
        "dataset": "ptb", "architecture": "pnorm_gru", "num_parameters": 5_000_000, "train_seconds": 240.0,
        "epochs_trained": 4, "valid": {"ppl": 120}, "test": {"ppl": 115}}))
    rep = tiers.compare("t", runs, TIERS)
    gru = rep["claims"][2]
    assert (gru["baseline_final_train_loss"], gru["model_epoch_reached"], gru["met"]) == (4.5, 2, True)
    md = tiers.markdown(rep)
    assert "| lstm | **l-heavy** | finished | 5.20M | 4 | 110.00 | 100.00 |  |" in md
    assert "| s2 | **not met** | a vs l-heavy |" in md and "| s3 | met | g2 vs g1 |" in md


def test_test_target_claim_has_no_baseline(runs):
    """An issue's absolute target (``test_target``): the chosen run's test metric against a ceiling."""
    targets = {"t": TIERS["t"] | {"claims": [
        {"kind": "test_target", "model": "alstm", "max": 86.0, "source": "target 86"},
        {"kind": "test_target", "model": "lstm", "max": 99.0, "source": "target 99"},
        {"kind": "test_target", "model": "gru", "max": 200.0, "source": "target g"}]}}
    rep = tiers.compare("t", runs, targets)
    at_most, above, pending = rep["claims"]
    assert (at_most["met"], at_most["measured"], at_most["model_run"]) == (True, 86, "a")
    assert "baseline_run" not in at_most and at_most["detail"] == "test perplexity: 86.00 (target: at most 86.00)"
    assert above["met"] is False and above["model_run"] == "l-heavy"  # the run chosen on validation (test 100)
    assert pending["met"] is None  # g2 unfinished
    md = tiers.markdown(rep)
    assert "| target 86 | met |" in md and "| target 99 | **not met** |" in md
    from zoo.tools.release.cards import comparison_section

    section = comparison_section(rep, "a")
    assert "| target 86 | met |" in section and "target 99" not in section


def test_write_files_and_readme_picks_them_up(runs, tmp_path):
    out = tmp_path / "repo" / "model_cards"
    paths = tiers.write(tiers.compare("t", runs, TIERS), out / "tiers", out)
    assert [p.name for p in paths] == ["t.json", "t.md", "t-tier-curve.png"]
    assert json.loads(paths[0].read_text())["roles"]["alstm"]["chosen"] == "a"
    (tmp_path / "repo" / "zoo").mkdir()
    section = readme.tiers_section(tmp_path / "repo")  # the docs site's tiers page (docs/results/tiers.md)
    assert "**test tier**" in section and "model_cards/tiers/t.json" in section and "t-tier-curve.png" in section
    (out / "tiers" / "a-long.md").write_text("**long tier**\n")  # the README follows tiers.toml's order
    (out / "tiers" / "zz-unlisted.md").write_text("**unlisted**\n")
    (tmp_path / "repo" / "zoo" / "tools").mkdir()
    (tmp_path / "repo" / "zoo" / "tools" / "tiers.toml").write_text('[t]\ntitle = "x"\n["a-long"]\ntitle = "y"\n')
    assert [p.stem for p in readme.tier_reports(tmp_path / "repo")] == ["t", "a-long", "zz-unlisted"]


def test_unknown_tier_is_a_clear_error(capsys):
    assert tiers.main(["no-such-tier"]) == 2
    assert "unknown tier 'no-such-tier'" in capsys.readouterr().err


def test_bundled_tiers_are_fair_before_any_compute_is_spent():
    """Every recipe a tier names exists, trains on the tier's corpus for the tier's epochs and optimiser, and the
    tier's models sit within its parameter tolerance (counted on the meta device: nothing allocated). A recipe
    edit that breaks a comparison fails here, not after days of training."""
    import torch

    from zoo.data import load_corpus
    from zoo.lm import LanguageModel
    from zoo.training import Recipe, recipe_path

    vocab: dict[str, int] = {}
    for tier_name, tier in tiers.load_tiers().items():
        ds = tier["dataset"]
        real_data(ds)
        vocab.setdefault(ds, len(load_corpus(ds).vocab))
        counts, optim = {}, {}
        for role, recipes in tier["roles"].items():
            for name in recipes:
                rec = Recipe.load(recipe_path(name))
                assert (rec.dataset, rec.train.epochs) == (ds, tier["epochs"]), (tier_name, name)
                optim.setdefault(role, set()).add((rec.train.optimizer, rec.train.lr, tuple(rec.train.cut_steps),
                                                   rec.train.batch_size, rec.train.mode))
                with torch.device("meta"):
                    model = LanguageModel(vocab_size=vocab[ds], **rec.model)
                counts[name] = sum(p.numel() for p in model.parameters())
        assert max(counts.values()) / min(counts.values()) - 1 <= tier["param_tolerance"], (tier_name, counts)
        # one optimiser, schedule, batch and mode per tier (the 8-epoch ptb-5m tier's p-norm GRUs keep their own lr,
        # compared only among themselves); and a claim compares models trained exactly the same way, lr included
        assert len({o[:1] + o[2:] for run in optim.values() for o in run}) == 1, (tier_name, optim)
        for claim in tier.get("claims", []):
            roles = [claim["model"]] + ([claim["baseline"]] if "baseline" in claim else [])
            assert len(set().union(*(optim[r] for r in roles))) == 1, (tier_name, claim["source"])
        for name, others in tier.get("seeds", {}).items():  # another seed: the same recipe but for its seed
            assert any(name in names for names in tier["roles"].values()), (tier_name, name)
            base = Recipe.load(recipe_path(name)).to_dict()
            for other in others:
                rec = Recipe.load(recipe_path(other)).to_dict()
                assert rec["seed"] != base["seed"] and rec["name"] == other, (tier_name, other)
                assert {k: v for k, v in rec.items() if k not in ("name", "seed", "description")} == \
                    {k: v for k, v in base.items() if k not in ("name", "seed", "description")}, (tier_name, other)


def test_card_section_and_bundle_lookup(runs, tmp_path):
    from zoo.tools.release.bundle import tier_reports
    from zoo.tools.release.cards import comparison_section

    cards = tmp_path / "cards"
    tiers.write(tiers.compare("t", runs, TIERS), cards / "tiers", cards)
    assert tier_reports(cards, "nobody") == []
    (rep,) = tier_reports(cards, "l-light")
    text = comparison_section(rep, "l-light")
    assert "`lstm` of the tier (a sweep point; `l-heavy` was chosen on validation)" in text
    assert "| s1 | met |" in text and "| s2 | not met |" in text and "s3" not in text
    assert "(chosen on validation among its sweep)" in comparison_section(rep, "a")


def test_a_bundled_run_counts_without_its_run_dir(runs, tmp_path):
    """On a fresh clone runs/ is empty: the log and eval.json kept beside the card stand in for the run."""
    cards = tmp_path / "cards"
    cards.mkdir()
    for src, dst in (("log.jsonl", "a.log.jsonl"), ("eval.json", "a.eval.json")):
        (cards / dst).write_bytes((runs / "a" / src).read_bytes())
    import shutil

    shutil.rmtree(runs / "a")
    rep = tiers.compare("t", runs, TIERS, cards_dir=cards)
    (a,) = rep["roles"]["alstm"]["sweep"]
    assert a["status"] == "finished" and a["log"].endswith("a.log.jsonl") and rep["claims"][0]["met"] is True
    assert tiers.compare("t", runs, TIERS, cards_dir=tmp_path / "none")["roles"]["alstm"]["sweep"][0]["status"] \
        == "missing"


def test_curve_labels_name_the_run(tmp_path):
    from zoo.tools.plots import run_label

    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "log.jsonl").write_text("")
    (tmp_path / "m.log.jsonl").write_text("")
    assert [run_label(tmp_path / "r1"), run_label(tmp_path / "r1" / "log.jsonl"), run_label(tmp_path / "m.log.jsonl")] \
        == ["r1", "r1", "m"]


def test_a_run_stopped_before_the_tier_budget_is_shown_but_never_chosen(runs):
    """A wall-clock budget can end a run early (its eval.json exists): it is not comparable at equal epochs."""
    ev = json.loads((runs / "l-heavy" / "eval.json").read_text())
    ev.update(epochs_trained=3, device="NVIDIA H100 80GB HBM3")
    (runs / "l-heavy" / "eval.json").write_text(json.dumps(ev))
    with open(runs / "l-heavy" / "log.jsonl", "a") as f:  # what `zoo train --max-minutes` logs when it stops
        f.write(json.dumps({"event": "budget_stop", "epoch": 3}) + "\n")
    rep = tiers.compare("t", runs, {"t": dict(TIERS["t"], epochs=4)})
    heavy = next(r for r in rep["roles"]["lstm"]["sweep"] if r["run"] == "l-heavy")
    assert heavy["status"] == "stopped early" and heavy["device"] == "H100 GPU"
    from unittest import mock

    fake = lambda logs, out, *a, **k: (k["labels"], out)[1]  # noqa: E731
    with mock.patch("zoo.tools.plots.plot_curves", side_effect=fake) as plot:
        tiers.write(rep, runs / "out", runs / "out")
    assert "l-heavy (H100 GPU)" in plot.call_args.kwargs["labels"]  # the figure says where each run trained
    assert rep["roles"]["lstm"]["chosen"] == "l-light"  # the better validation, but stopped early
    assert "| lstm | l-heavy | stopped early | 5.20M | 3 | 110.00 | 100.00 | H100 GPU |" in tiers.markdown(rep)
    assert tiers.compare("t", runs, TIERS)["roles"]["lstm"]["chosen"] == "l-heavy"  # no budget: comparable
    with open(runs / "g2" / "log.jsonl", "a") as f:  # stopped by its time budget before its evaluation
        f.write(json.dumps({"event": "budget_stop", "epoch": 4}) + "\n")
    (g2,) = tiers.compare("t", runs, TIERS)["roles"]["gru"]["sweep"]
    assert g2["status"] == "stopped early" and g2["last_valid"] == 120


def test_an_unbundled_sweep_point_counts_from_its_record(runs, tmp_path):
    """Sweep points that are not bundled keep their two files in model_cards/runs/ for fresh clones."""
    import shutil

    cards = tmp_path / "cards"
    (cards / "runs").mkdir(parents=True)
    for src in ("log.jsonl", "eval.json"):
        (cards / "runs" / f"g1.{src}").write_bytes((runs / "g1" / src).read_bytes())
    shutil.rmtree(runs / "g1")
    (g1,) = tiers.compare("t", runs, TIERS, cards_dir=cards)["roles"]["gru_p1"]["sweep"]
    assert g1["status"] == "finished" and g1["log"].endswith("runs/g1.log.jsonl")


@pytest.mark.parametrize("device, short", [("CPU (2 cores, 1 threads)", "CPU, 1 thread"),
                                           ("CPU (16 cores, 4 threads)", "CPU, 4 threads"),
                                           ("NVIDIA H100 80GB HBM3", "H100 GPU"), ("", "")])
def test_short_device(device, short):
    from zoo.tools.release.cards import short_device

    assert short_device(device) == short


def test_published_numbers_and_the_counting_note(runs):
    """Each chosen run is set against its recipe's [reference]; a tier note says what is counted, with the
    number of scored test symbols read from the runs' eval.json files."""
    for name, ref in (("a", {"valid": 60.0, "test": 50.0, "metric": "perplexity", "source": "paper A"}),
                      ("l-heavy", None), ("g1", {"metric": "perplexity", "source": "paper G, another corpus"})):
        ev = json.loads((runs / name / "eval.json").read_text())
        ev["recipe"] = {"name": name, **({"reference": ref} if ref else {})}
        ev["test"]["num_tokens"] = 82429
        (runs / name / "eval.json").write_text(json.dumps(ev))
    rep = tiers.compare("t", runs, {"t": dict(TIERS["t"], note="Counted: every token.")})
    md = tiers.markdown(rep)
    assert "| alstm | a | 86.00 | 50.00 | +36.00 (+72.0%) | paper A |" in md
    assert "| lstm | l-heavy | 100.00 | not published |  |  |" in md
    assert "| gru_p1 | g1 | 120.00 | no comparable number |  | paper G, another corpus |" in md
    # two of the chosen runs say how many test tokens they scored, the others do not say: one count
    assert "Counted: every token. Test symbols scored: 82,429 (from each run's eval.json)." in md


def test_a_char_tier_plots_bits_per_character(runs, tmp_path):
    """Character-level tiers draw validation bpc (valid_loss / ln 2), not perplexity."""
    from zoo.tools import plots

    rep = tiers.compare("t", runs, {"t": dict(TIERS["t"], dataset="ptb-char")})
    assert rep["metric"] == "bits_per_char"
    log = runs / "a" / "log.jsonl"
    first = json.loads(log.read_text().splitlines()[0])
    assert plots.value(first, "valid_bpc") == pytest.approx(math.log(150) / math.log(2))
    out = plots.plot_curves([runs / "a"], tmp_path / "c.png", "t", metric="valid_bpc")
    assert out.stat().st_size > 1000
    from unittest import mock

    with mock.patch("zoo.tools.plots.plot_curves", side_effect=lambda logs, out, *a, **k: out) as plot:
        tiers.write(rep, tmp_path / "out", tmp_path / "out")
    assert plot.call_args.kwargs["metric"] == "valid_bpc" and plot.call_args.kwargs["layout"] == "time"


def test_the_pnorm_tier_draws_the_papers_figure_4_layout(runs, tmp_path):
    """The p-norm tier asks (tiers.toml `curve`) for the paper's Fig. 4 panels: training loss and validation bpc by
    epoch; the figure is drawn from the runs' logs, and an unknown layout is refused."""
    from zoo.tools import plots

    assert tiers.load_tiers()["pnorm-ptbchar-sentences"]["curve"] == "train_valid"
    rep = tiers.compare("t", runs, {"t": dict(TIERS["t"], dataset="ptb-char", curve="train_valid")})
    assert rep["curve"] == "train_valid"
    paths = tiers.write(rep, tmp_path / "out", tmp_path / "fig")
    assert paths[-1].name == "t-tier-curve.png" and paths[-1].stat().st_size > 1000
    with pytest.raises(ValueError, match="unknown curve layout 'fig4'"):
        plots.plot_curves([runs / "a"], tmp_path / "x.png", layout="fig4")


def test_plots_command_line_draws_both_layouts(runs, tmp_path):
    """`python -m zoo.tools.plots RUN --out F [--layout ...]` (the command the module's docstring gives) works."""
    import subprocess
    import sys

    for layout in ("time", "train_valid"):
        out = tmp_path / f"{layout}.png"
        proc = subprocess.run([sys.executable, "-m", "zoo.tools.plots", str(runs / "a"), "--out", str(out),
                               "--layout", layout], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert out.stat().st_size > 1000


def test_finished_unbundled_runs_are_recorded_and_the_report_names_the_records(runs, tmp_path):
    """The tier tool copies each finished run that is not bundled into model_cards/runs/ and the report then
    names those copies (files every clone has); a run still training is read live and not recorded."""
    cards = tmp_path / "cards"
    cards.mkdir()
    (cards / "a.log.jsonl").write_bytes((runs / "a" / "log.jsonl").read_bytes())  # "a" is bundled
    (cards / "a.eval.json").write_bytes((runs / "a" / "eval.json").read_bytes())
    written = tiers.record_runs("t", runs, TIERS, cards_dir=cards)
    assert sorted(p.name for p in written) == ["g1.eval.json", "g1.log.jsonl", "l-heavy.eval.json",
                                               "l-heavy.log.jsonl", "l-light.eval.json", "l-light.log.jsonl"]
    assert tiers.record_runs("t", runs, TIERS, cards_dir=cards) == []  # unchanged: nothing rewritten
    rep = tiers.compare("t", runs, TIERS, cards_dir=cards)
    logs = {r["run"]: r["log"] for info in rep["roles"].values() for r in info["sweep"]}
    assert logs["a"].endswith("cards/a.log.jsonl") and logs["g1"].endswith("cards/runs/g1.log.jsonl")
    assert logs["g2"].endswith("g2/log.jsonl")  # unfinished: live, not recorded
    with open(runs / "g1" / "log.jsonl", "a") as f:  # g1 continued after it was recorded: the live log counts
        f.write(json.dumps({"epoch": 5, "valid_ppl": 124.0, "valid_loss": math.log(124.0), "train_loss": 4.4,
                            "seconds": 60.0}) + "\n")
    (g1,) = tiers.compare("t", runs, TIERS, cards_dir=cards)["roles"]["gru_p1"]["sweep"]
    assert g1["log"].endswith("g1/log.jsonl") and g1["epochs_logged"] == 5
    assert [p.name for p in tiers.record_runs("t", runs, TIERS, cards_dir=cards)] == ["g1.log.jsonl"]


@pytest.mark.parametrize("tier", sorted(p.stem for p in (tiers.REPO / "model_cards" / "tiers").glob("*.json")))
def test_every_committed_tier_report_regenerates_from_committed_files(tier, tmp_path):
    """A fresh clone has no runs/: each tier report in the repository must come out the same from the files the
    repository keeps (bundled cards' copies and model_cards/runs/ records), and name only files it keeps."""
    kept = json.loads((tiers.REPO / "model_cards" / "tiers" / f"{tier}.json").read_text())
    again = tiers.compare(tier, tmp_path / "no-runs")
    assert again == kept
    logs = [r["log"] for info in kept["roles"].values() for r in info["sweep"] if "log" in r]
    assert logs and all((tiers.REPO / p).is_file() for p in logs)


def test_a_sweep_prefix_is_set_against_the_chosen_run_at_equal_epochs(runs):
    """A sweep point trained short on purpose (the full schedule's first epochs) is never chosen; if it is ahead of
    the chosen run at its last epoch, the role is undecided and its claims pending until it is trained in full."""
    tier = {"t": dict(TIERS["t"], epochs=4)}

    def make_prefix(valids):
        fake_run_dir = runs / "l-light"
        recs = [{"epoch": i + 1, "valid_ppl": v, "valid_loss": math.log(v), "train_loss": 4.5, "seconds": 60.0}
                for i, v in enumerate(valids)]
        (fake_run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        ev = json.loads((fake_run_dir / "eval.json").read_text())
        ev.update(epochs_trained=len(valids), valid={"ppl": valids[-1]})
        (fake_run_dir / "eval.json").write_text(json.dumps(ev))

    make_prefix([160, 125])  # l-heavy had 130 at epoch 2: the prefix is ahead
    rep = tiers.compare("t", runs, tier)
    light = next(r for r in rep["roles"]["lstm"]["sweep"] if r["run"] == "l-light")
    assert light["status"] == "sweep prefix" and rep["roles"]["lstm"]["chosen"] == "l-heavy"
    assert light["prefix"] == {"epoch": 2, "valid": 125.0, "chosen_run": "l-heavy", "chosen_valid": 130.0,
                               "beats_chosen": True}
    lstm_claims = [c for c in rep["claims"] if c.get("baseline") == "lstm"]
    assert lstm_claims and all(c["met"] is None and "zoo train l-light --epochs 4 --resume" in c["detail"]
                               for c in lstm_claims)
    assert "sweep prefix" not in rep["claims"][2]["detail"]  # a claim on other roles is computed as usual
    make_prefix([160, 135])  # behind at epoch 2: the full-budget run stands
    rep = tiers.compare("t", runs, tier)
    assert all(c["met"] is not None for c in rep["claims"] if c.get("baseline") == "lstm")
    assert "| lstm | l-light | sweep prefix (epoch 2: 135.00 vs 130.00 for l-heavy) |" in tiers.markdown(rep)


def test_a_small_gap_waits_for_the_other_seeds_and_is_decided_on_the_means(runs):
    """Under ``seeds_below`` one seed does not decide a test_improvement claim: it is pending until every listed
    seed of both chosen runs has finished, then computed from the mean test metric (each seed and the spread
    shown); a gap at least that large is decided on one seed as before."""
    claim = {"kind": "test_improvement", "model": "alstm", "baseline": "lstm", "min_rel": 0.05, "seeds_below": 0.03,
             "source": "s1"}
    tier = {"t": TIERS["t"] | {"claims": [claim]}}
    (runs / "a" / "eval.json").write_text(json.dumps(json.loads((runs / "a" / "eval.json").read_text())
                                                     | {"test": {"ppl": 98.0}}))  # 2% below l-heavy's 100
    (c,) = tiers.compare("t", runs, tier)["claims"]
    assert c["met"] is None and "list more seeds of a and l-heavy" in c["detail"]
    tier["t"]["seeds"] = {"a": ["a-s2"], "l-heavy": ["l-heavy-s2"]}
    fake_run(runs, "a-s2", [150, 120, 100, 91], [5.0, 4.6, 4.4, 4.3], valid=91, test=94)
    fake_run(runs, "l-heavy-s2", [170, 130, 115, 111], [5.1, 4.8, 4.6, 4.5], valid=111, test=104, finished=False)
    rep = tiers.compare("t", runs, tier)
    (c,) = rep["claims"]
    assert c["met"] is None and c["detail"].endswith("train the other seeds (l-heavy-s2)")
    assert "| lstm | l-heavy-s2 | other seed of l-heavy: unfinished |" in tiers.markdown(rep)
    (runs / "l-heavy-s2" / "eval.json").write_text(json.dumps({
        "dataset": "ptb", "architecture": "x", "num_parameters": 5_200_000, "train_seconds": 240.0,
        "epochs_trained": 4, "valid": {"ppl": 111}, "test": {"ppl": 104}}))
    rep = tiers.compare("t", runs, tier)
    (c,) = rep["claims"]
    assert c["one_seed_rel"] == pytest.approx(0.02)
    assert c["measured_rel"] == pytest.approx(1 - 96 / 102) and c["met"] is True  # means 96 vs 102: 5.9% lower
    assert "96.00 (seeds: 98.00, 94.00; spread 4.00) vs 102.00 (seeds: 100.00, 104.00; spread 4.00)" in c["detail"]
    assert rep["roles"]["alstm"]["seeds"]["mean_test"] == 96.0
    assert "| alstm | a-s2 | other seed of a: finished |  |  | 91.00 | 94.00 |  |" in tiers.markdown(rep)
    written = tiers.record_runs("t", runs, tier, cards_dir=runs / "cards")
    assert {"a-s2.eval.json", "l-heavy-s2.eval.json"} <= {p.name for p in written}
    claim["seeds_below"] = 0.01  # a 2% gap is then decided on one seed
    (c,) = tiers.compare("t", runs, tier)["claims"]
    assert c["met"] is False and "one_seed_rel" not in c and c["measured_rel"] == pytest.approx(0.02)
    assert c["detail"].endswith("; one seed decides: the gap is not under 1%")


def test_a_role_waits_for_a_sweep_point_still_training_or_missing(runs):
    """A point that has not finished could still be the better one on validation: the role's claims are pending
    (a report that says met now and not met later would have guessed)."""
    (runs / "l-light" / "eval.json").unlink()  # still training
    rep = tiers.compare("t", runs, TIERS)
    lstm_claims = [c for c in rep["claims"] if c.get("baseline") == "lstm"]
    assert lstm_claims and all(c["met"] is None and "l-light not trained to its end yet" in c["detail"]
                               for c in lstm_claims)
    tier = {"t": dict(TIERS["t"], roles=dict(TIERS["t"]["roles"], alstm=["a", "a-never-trained"]))}
    rep = tiers.compare("t", runs, tier)
    assert all(c["met"] is None and "a-never-trained" in c["detail"] for c in rep["claims"][:2])
