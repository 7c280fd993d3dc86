"""Regenerate the generated parts of the README, the docs site and the other READMEs from the catalogue and the
benchmark results.

Every number in the docs must come from a file the evaluation and benchmark code wrote, so the sections between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` (``# NAME:start`` / ``# NAME:end`` in ``mkdocs.yml``) and the
model-card pages are produced here, never edited by hand:

* ``README.md``: ``best-models``, the best bundled model of each dataset (from ``zoo/catalog.json``);
* ``docs/results/models.md``: ``models-table``, every bundled model (the catalogue, itself written by ``zoo bundle``
  from each run's eval.json);
* ``docs/results/tiers.md``: ``tiers``, the comparisons ``python -m zoo.tools.tiers`` wrote to
  ``model_cards/tiers/*.md``, the runs kept as records and the training-curve figures under ``model_cards/``;
* ``docs/results/benchmarks.md``: ``benchmarks``, the markdown tables each benchmark wrote next to its JSON in
  ``benchmarks/results/``;
* ``docs/guides/lm-eval.md``: ``lm-eval-agreement``, ``benchmarks/results/lm_eval_agreement.md``;
* ``docs/results/cards/NAME.md``: one page per card in ``model_cards/`` (the card itself is included when the site
  is built, see ``zoo/tools/mkdocs_hooks.py``), and their entries in ``mkdocs.yml``'s navigation (``cards``);
* ``exports/README.md``: ``quantization`` and ``backends-table``, from ``benchmarks/results/quantization.md``
  and ``backends.md``;
* ``serving/README.md``: ``serving-benchmark``, from ``benchmarks/results/serving.md``.

The benchmark scripts write those ``.md`` files and then call :func:`main` themselves.

    python -m zoo.tools.readme          # rewrite them
    python -m zoo.tools.readme --check  # exit 1 if one is out of date (used by the tests)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from zoo.tools import REPO

RESULTS = Path("benchmarks") / "results"
BENCHMARKS = [
    ("cells.md", "Cell speed (training and scoring tokens/s relative to the fused `nn.LSTM`)"),
    ("precision.md", "Training precision: fp32 vs bf16, the two-core layout, bf16 inference"),
    ("precision_quality.md", "Training precision: equal quality of bf16 (2 epochs, same seed)"),
    ("precision_quality_char.md", "Training precision: equal quality of bf16 for the character-level cells"),
    ("fused_loss.md", "Training step: the bf16 decoder + loss with whole-batch backward GEMMs, and fused Adam"),
    ("eval_speed.md", "Evaluation: the decoder fused with the log-softmax, against decoding all the logits"),
    ("backends.md", "Inference backends (eager vs TorchScript vs ONNX Runtime)"),
    ("quantization.md", "int8 ONNX quantisation"),
    ("serving.md", "TorchServe under load"),
    ("request_cost.md", "Request cost: the largest requests the token budgets allow"),
    ("corpus.md", "Scoring a corpus: `zoo score-corpus` with 1 and 2 workers, the model in-process, KenLM"),
    ("serving_fairness.md", "Serving fairness: honest clients beside a hostile one, through the front door"),
    ("serving_ceiling.md", "Served throughput against the in-process ceiling: 16 and 64 clients, a sentence each"),
    ("front_door.md", "The front door's cost: HAProxy in front of TorchServe against TorchServe alone"),
    ("dynamic_eval.md", "Dynamic evaluation: tuned on PTB validation, measured once on test"),
    # one section per other model measured (``benchmarks/dynamic_eval.py --model NAME``); {} is NAME
    ("dynamic_eval-*.md", "Dynamic evaluation of `{}`: the defaults and two neighbours on validation, once on test"),
    ("cuda_step.md", "CUDA graphs: the captured training step against the eager one (a lent GPU)"),
    ("concurrent_runs.md", "Several training runs on one GPU: tokens/s in all for 1, 2, 3 processes"),
    ("concurrent_runs_mps.md", "Several training runs on one GPU under CUDA MPS: tokens/s in all"),
    ("campaign_pack.md", "The GPU campaign's committed pack: size per piece, repository growth, resume gap"),
    ("gpu_inference.md", "Inference on a GPU: equal numbers, and speed against the CPU (a lent GPU)"),
    ("card_reproduction.md", "Every card's test number, reproduced by the command the card gives"),
]


def tier_reports(repo: Path = REPO) -> list[Path]:
    """The tier tables ``python -m zoo.tools.tiers`` wrote, in the order of zoo/tools/tiers.toml (each long-budget
    tier before the short one it supersedes); a report whose tier is no longer listed comes last."""
    from zoo.tools.tiers import load_tiers

    toml = repo / "zoo" / "tools" / "tiers.toml"
    order = {name: i for i, name in enumerate(load_tiers(toml) if toml.is_file() else {})}
    return sorted((repo / "model_cards" / "tiers").glob("*.md"), key=lambda p: (order.get(p.stem, len(order)), p.stem))


def models_section(repo: Path = REPO) -> str:
    from zoo.tools.release.cards import dynamic_results, models_table_markdown

    return models_table_markdown(dynamic=dynamic_results(repo / RESULTS)).strip()


def best_models_section(repo: Path = REPO) -> str:
    """The README's short table: per dataset (and training mode), the bundled model with the lowest test number,
    beside the published number its card compares with."""
    from zoo.tools.release.cards import has_numbers
    from zoo.zoo_model import catalog

    best: dict[str, tuple[str, dict]] = {}
    for name, m in sorted(catalog().get("models", {}).items()):
        data = m.get("dataset", "") + (", single sentences" if m.get("training", {}).get("mode") == "sentences" else "")
        if data not in best or m["metrics"]["test"] < best[data][1]["metrics"]["test"]:
            best[data] = (name, m)
    rows = ["| data | best model | architecture | params | test | paper (its model) | card |",
            "|---|---|---|---:|---:|---|---|"]
    for data, (name, m) in sorted(best.items()):
        met, ref = m["metrics"], m.get("reference") or {}
        digits, unit = (3, "bpc") if met["metric"] == "bits_per_char" else (2, "ppl")
        paper = f"{ref['test']:.{digits}f} ({ref.get('source', '').split(':')[0]})" if has_numbers(ref) else "none"
        rows.append(f"| {data} | `{name}` | {m['architecture']} | {m['num_parameters'] / 1e6:.2f}M | "
                    f"{met['test']:.{digits}f} {unit} | {paper} | [card](model_cards/{name}.md) |")
    return "\n".join(rows)


def tiers_section(repo: Path = REPO) -> str:
    """Every tier report, the runs kept as records, and every training curve (images relative to the page)."""
    parts = []
    for tier in tier_reports(repo):
        parts.append(f"{tier.read_text(encoding='utf-8').strip()}\n\n_Source: `model_cards/tiers/{tier.stem}.json`._")
    records = unbundled_runs_table(repo)
    if records:
        parts.append(records)
    curves = sorted((repo / "model_cards").glob("*curve*.png"))
    for png in curves:
        parts.append(f"![{png.stem}](../../model_cards/{png.name})")
    return "\n\n".join(parts)


def unbundled_runs_table(repo: Path = REPO) -> str:
    """Runs trained here but not bundled (sweep points that lost on validation, runs that diverged or were
    stopped by a budget), from the two files each keeps in ``model_cards/runs/``: no number is typed."""
    import json

    from zoo.tools.release.bundle import find_reference
    from zoo.tools.release.cards import release_metrics, short_device
    from zoo.tools.tiers import read_log, stopped_by_budget

    folder = repo / "model_cards" / "runs"
    rows = []
    for log in sorted(folder.glob("*.log.jsonl")):
        name = log.name.removesuffix(".log.jsonl")
        recs = read_log(log)
        epochs = [r for r in recs if "valid_ppl" in r]
        ev_path = folder / f"{name}.eval.json"
        if ev_path.is_file():
            ev = json.loads(ev_path.read_text())
            ref = find_reference(ev) or {}  # the recipe file's (corrected) reference, as the tier tables and cards
            met = release_metrics(ev)  # the weights as they would ship (float16), as the tier tables report
            bpc = met["metric"] == "bits_per_char"
            device = short_device(ev.get("device", ""))
            rows.append(f"| {name} | {ev['num_parameters'] / 1e6:.2f}M | {ev['epochs_trained']} | "
                        f"{device} | {'bpc' if bpc else 'ppl'} | {met['valid']:.{3 if bpc else 2}f} | "
                        f"{met['test']:.{3 if bpc else 2}f} | "
                        + (f"{ref['valid']} / {ref['test']}" if "valid" in ref else "") + " |")
        else:
            last = f"({epochs[-1]['valid_ppl']:.2f} at epoch {epochs[-1]['epoch']})" if epochs else ""
            stop = " (stopped by its time budget, not evaluated)" if stopped_by_budget(recs) else \
                " (in progress: trained in pieces, paused)" if recs and recs[-1].get("event") in ("paused", "ferried") \
                else ""
            rows.append(f"| {name}{stop} |  | {len(epochs)} |  | ppl | {last} |  |  |")
    if not rows:
        return ""
    return "\n".join(["**Trained here, not bundled** (records in `model_cards/runs/`: each run's own log and "
                      "eval.json; perplexity, or bits per character for character-level runs, of the weights cast "
                      "to float16 as they would ship: the same numbers the tier tables show)", "",
                      "| run | params | epochs | trained on | metric | valid | test | published valid / test |",
                      "|---|---:|---:|---|---|---:|---:|---|", *rows])


def benchmarks_section(repo: Path = REPO) -> str:
    parts = []
    for pattern, title in BENCHMARKS:
        prefix = pattern.split("*")[0]
        for path in sorted((repo / RESULTS).glob(pattern)):
            heading = title.format(path.stem.removeprefix(prefix)) if "*" in pattern else title
            parts.append(f"### {heading}\n\n{path.read_text().strip()}\n\n"
                         f"_Source: `{RESULTS.as_posix()}/{path.name}`._")
    return "\n\n".join(parts) if parts else "_No benchmark results yet: run `make bench`._"


def result_section(name: str, repo: Path = REPO) -> str:
    """The markdown ``benchmarks/<name>.py`` wrote to ``benchmarks/results/<name>.md``, or a placeholder."""
    path = repo / RESULTS / f"{name}.md"
    if path.is_file():
        return path.read_text(encoding="utf-8").strip()
    return f"_Not measured yet: run `python benchmarks/{name}.py`._"


def _result(name: str) -> Callable[[Path], str]:
    return lambda repo: result_section(name, repo)


def card_names(repo: Path = REPO) -> list[str]:
    """Every model card in ``model_cards/`` (bundled models and retired ones kept as records)."""
    return sorted(p.stem for p in (repo / "model_cards").glob("*.md"))


def card_page(name: str) -> str:
    """The docs page of one card: the card itself is included when the site is built, so it is written once."""
    return (f"<!-- generated by `python -m zoo.tools.readme` from model_cards/{name}.md: do not edit -->\n"
            f"<!-- include: model_cards/{name}.md -->\n")


def cards_nav(repo: Path = REPO) -> str:
    """``mkdocs.yml``'s navigation entries of the card pages (every page must be in the navigation)."""
    return "\n".join(f"          - {name}: results/cards/{name}.md" for name in card_names(repo))


#: Each generated file (relative to the repository) -> its sections -> how to make a section's body.
READMES: dict[str, dict[str, Callable[[Path], str]]] = {
    "README.md": {"best-models": best_models_section},
    "docs/results/models.md": {"models-table": models_section},
    "docs/results/tiers.md": {"tiers": tiers_section},
    "docs/results/benchmarks.md": {"benchmarks": benchmarks_section},
    "docs/guides/lm-eval.md": {"lm-eval-agreement": _result("lm_eval_agreement")},
    "mkdocs.yml": {"cards": cards_nav},
    "exports/README.md": {"quantization": _result("quantization"), "backends-table": _result("backends")},
    "serving/README.md": {"serving-benchmark": _result("serving")},
}
CARDS_DIR = Path("docs") / "results" / "cards"


def whole_files(repo: Path = REPO) -> dict[str, str]:
    """Files generated whole: one docs page per model card."""
    return {(CARDS_DIR / f"{name}.md").as_posix(): card_page(name) for name in card_names(repo)}


def write_result(out: str | Path, data: dict | list, table: str) -> Path:
    """What every benchmark does with its result: ``out`` (JSON), the markdown ``table`` beside it (``.md``),
    then the READMEs regenerated from them, so no README number is ever typed by hand."""
    import json

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(table.rstrip("\n") + "\n", encoding="utf-8")
    print(f"wrote {out} and {out.with_suffix('.md').name}")
    main([])
    return out


def render(text: str, sections: dict[str, str], comment: tuple[str, str] = ("<!-- ", " -->")) -> str:
    """``text`` with the body between each section's ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` replaced
    (``comment``: the file format's comment around ``NAME:start``, ``("# ", "")`` for YAML)."""
    for name, body in sections.items():
        start, end = f"{comment[0]}{name}:start{comment[1]}", f"{comment[0]}{name}:end{comment[1]}"
        pattern = re.compile(rf"({re.escape(start)}\n).*?([ \t]*{re.escape(end)})", re.S)
        if not pattern.search(text):
            raise ValueError(f"section {name!r}: no {start} ... {end} markers")
        text = pattern.sub(lambda m, b=body: m.group(1) + b.strip("\n").rstrip() + "\n" + m.group(2), text)
    return text


def render_file(rel: str, repo: Path = REPO) -> tuple[str, str]:
    """``(current, regenerated)`` text of the generated file ``rel`` (a key of :data:`READMES`) under ``repo``."""
    old = (repo / rel).read_text(encoding="utf-8")
    comment = ("# ", "") if rel.endswith((".yml", ".yaml")) else ("<!-- ", " -->")
    try:
        new = render(old, {name: make(repo) for name, make in READMES[rel].items()}, comment)
    except ValueError as e:
        raise ValueError(f"{rel}: {e}") from None
    return old, new


def main(argv: list[str] | None = None, repo: Path = REPO) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if a README is out of date")
    args = ap.parse_args(argv)
    stale = []
    for rel in READMES:
        old, new = render_file(rel, repo)
        if new == old:
            continue
        stale.append(rel)
        if not args.check:
            (repo / rel).write_text(new, encoding="utf-8")
    if READMES.get("mkdocs.yml"):  # the card pages go with the card navigation
        stale += _sync_whole_files(repo, write=not args.check)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}: run `python -m zoo.tools.readme`", file=sys.stderr)
        return 1
    return 0


def _sync_whole_files(repo: Path, write: bool) -> list[str]:
    """Write (or, ``write=False``, only list) the whole generated pages that differ, and remove stale ones."""
    want = whole_files(repo)
    have = {p.relative_to(repo).as_posix() for p in (repo / CARDS_DIR).glob("*.md")}
    stale = sorted(rel for rel, text in want.items()
                   if not (repo / rel).is_file() or (repo / rel).read_text(encoding="utf-8") != text)
    stale += sorted(have - set(want))
    if write:
        (repo / CARDS_DIR).mkdir(parents=True, exist_ok=True)
        for rel in stale:
            if rel in want:
                (repo / rel).write_text(want[rel], encoding="utf-8")
            else:
                (repo / rel).unlink()
    return stale


if __name__ == "__main__":
    sys.exit(main())
