"""``zoo bundle RUN_DIR``: package a finished training run as a pretrained model of the zoo.

A run dir made by ``zoo train`` holds ``release/`` (the checkpoint to ship), ``eval.json`` and
``log.jsonl``. Bundling copies the release files into ``zoo/pretrained/<name>/``, writes its model
card (``README.md``, also copied to ``model_cards/<name>.md``, beside the run's ``eval.json`` and
``log.jsonl`` as ``<name>.eval.json`` / ``<name>.log.jsonl``), hashes every file, and records the
model in the catalogue (``zoo/catalog.json``), which is what downloads are verified against.
Every metric comes from ``eval.json``; nothing is typed. ``zoo bundle --retire NAME`` undoes it for a model a
longer-budget tier supersedes: the run stays a record ("trained here, not bundled", ``model_cards/runs/``);
``zoo bundle --refresh NAME`` rebuilds a bundled model's card from its own files when what it quotes changed.
The target folders are parameters (and
``$ZOO_CATALOG`` / ``$ZOO_PRETRAINED_DIR`` / ``$ZOO_MODEL_CARDS_DIR``) so tests never touch the
real package. Files are staged and swapped in, so a failed bundle leaves the old copy intact.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.catalog import DEFAULT_REVISION, bundled_dir, catalog_path
from zoo.checkpoint import (
    CARD_FILE,
    CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
    hf_fields,
    tokenizer_config_text,
)
from zoo.errors import ConfigError
from zoo.files import is_leftover, sha256_file, write_atomic
from zoo.tools import PACKAGE_DIR, REPO

RELEASE_FILES = (CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE)
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,95}$")
FIGURE_SUFFIXES = {".png", ".jpg", ".jpeg", ".svg"}
DEFAULT_ORG = "alstm-zoo"
# The zoo's weights ship inside the repository (and the sdist): a clone stays a download, not a dataset.
MAX_BUNDLE_BYTES = 200_000_000


class BundleError(ConfigError):
    """The run dir or the options cannot make a bundle (a user error: one line, exit 2)."""


def file_records(directory: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {sha256, size}}`` for every file under ``directory`` (POSIX paths, sorted), but a
    temporary file an interrupted write left (:func:`zoo.files.is_leftover`)."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and not is_leftover(p):
            out[p.relative_to(directory).as_posix()] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return out


def bundled_bytes(pretrained_dir: Path, *, without: str | None = None) -> int:
    """Bytes of every bundled model's files under ``pretrained_dir`` (but ``without``'s, which a rebundle
    replaces, and a staging or leftover folder, whose name starts with a dot)."""
    return sum(p.stat().st_size for d in pretrained_dir.iterdir() if d.is_dir() and not d.name.startswith(".")
               and d.name != without for p in d.rglob("*") if p.is_file())


def default_cards_dir() -> Path:
    return Path(os.environ.get("ZOO_MODEL_CARDS_DIR") or REPO / "model_cards")


# -- the catalogue ------------------------------------------------------------------------------------------
def read_catalog(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"default": None, "models": {}}
    try:
        cat = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: not valid JSON ({e})") from None
    cat.setdefault("models", {})
    cat.setdefault("default", None)
    return cat


def update_catalog(path: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Read, change and atomically rewrite a catalogue file."""
    cat = read_catalog(path)
    change(cat)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(cat, indent=2) + "\n")
    return cat


#: What each catalogue entry holds (``catalog_problems`` checks it); ``default`` names one entry or is null.
ENTRY_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "architecture": str, "dataset": str, "description": str, "num_parameters": int, "metrics": dict,
    "repo_id": str, "revision": str, "files": dict, "dtype": str, "training": dict, "reference": (dict, type(None)),
}


def catalog_problems(cat: dict[str, Any]) -> list[str]:
    """Every way a catalogue departs from the schema (empty when it is valid)."""
    problems = []
    models = cat.get("models")
    if not isinstance(models, dict):
        return ["'models' must be an object"]
    if cat.get("default") is not None and not isinstance(cat.get("default"), str):
        problems.append("'default' must be a model name or null")
    for name, entry in models.items():
        if not NAME_RE.match(name):
            problems.append(f"{name}: invalid name")
        for key, kind in ENTRY_SCHEMA.items():
            if not isinstance(entry.get(key), kind) or isinstance(entry.get(key), bool):
                problems.append(f"{name}: {key!r} missing or not {getattr(kind, '__name__', kind)}")
        met = entry.get("metrics") or {}
        if met.get("metric") not in ("perplexity", "bits_per_char") or not all(
                isinstance(met.get(k), int | float) for k in ("valid", "test")):
            problems.append(f"{name}: metrics need metric (perplexity|bits_per_char), valid and test numbers")
        for fname, meta in (entry.get("files") or {}).items():
            if not (isinstance(meta, dict) and re.fullmatch(r"[0-9a-f]{64}", str(meta.get("sha256")))
                    and isinstance(meta.get("size"), int)):
                problems.append(f"{name}: files[{fname!r}] needs a sha256 (64 hex) and a size")
        if entry.get("files") and not {"config.json", "model.safetensors", "vocab.json"} <= set(entry["files"]):
            problems.append(f"{name}: files must include config.json, model.safetensors and vocab.json")
    return problems


# -- reading a run ------------------------------------------------------------------------------------------
def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """``eval.json``, the ``log.jsonl`` records and the release ``config.json`` of a finished run."""
    if not run_dir.is_dir():
        raise BundleError(f"{run_dir}: no such run directory")
    ev_path = run_dir / "eval.json"
    if not ev_path.is_file():
        raise BundleError(f"{run_dir}: no eval.json (not a finished run: `zoo train` writes it at the end)")
    try:
        ev = json.loads(ev_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BundleError(f"{ev_path}: not valid JSON ({e})") from None
    missing = [k for k in ("name", "dataset", "architecture", "num_parameters", "valid", "test", "epochs_trained",
                           "best_epoch", "train_seconds", "recipe") if k not in ev]
    if missing:
        raise BundleError(f"{ev_path}: missing {', '.join(missing)}")
    for f in RELEASE_FILES:
        if not (run_dir / "release" / f).is_file():
            raise BundleError(f"{run_dir / 'release' / f}: missing (the release checkpoint is incomplete)")
    log_path = run_dir / "log.jsonl"
    log = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()] if log_path.is_file() else []
    config = json.loads((run_dir / "release" / CONFIG_FILE).read_text(encoding="utf-8"))
    if config.get("architecture") != ev["architecture"]:
        raise BundleError(f"{run_dir}: release/config.json says {config.get('architecture')!r}, eval.json says "
                          f"{ev['architecture']!r}")
    return ev, log, config


def find_reference(ev: dict[str, Any], recipe_path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """The published numbers to compare with: the recipe's optional ``[reference]`` table.

    Looked up in the recipe file first (``recipe_path``, else the bundled ``zoo/recipes/<recipe name>.toml``),
    then in the copy of the recipe that eval.json recorded. The file wins because a reference is metadata
    about a paper, not part of the training: a corrected source or number must reach the card and the tier
    report without retraining, while a run whose recipe is not bundled still has its own copy. Fields:
    ``valid``, ``test`` (numbers), ``metric`` (``perplexity`` or ``bits_per_char``), ``source`` (who
    published them, where). A reference with a ``source`` and no number cites the setting a run follows where
    no published number is comparable (the p-norm paper's sentence experiment ran on another corpus).
    """
    ref = None
    path = Path(recipe_path) if recipe_path else PACKAGE_DIR / "recipes" / f"{ev['recipe'].get('name')}.toml"
    if recipe_path and not path.is_file():
        raise BundleError(f"{path}: no such recipe file")
    if path.is_file():
        ref = tomllib.loads(path.read_text(encoding="utf-8")).get("reference")
    if ref is None:
        ref = ev["recipe"].get("reference")
    if ref is None:
        return None
    if not isinstance(ref, dict) or not isinstance(ref.get("source"), str) or not all(
            isinstance(ref.get(k), int | float) for k in ("valid", "test") if k in ref):
        raise BundleError("the recipe's [reference] needs `source`, and `valid` / `test` (where given) as numbers")
    return {k: ref[k] for k in ("valid", "test", "metric", "source") if k in ref}


def tier_reports(cards_dir: Path, run_name: str) -> list[dict[str, Any]]:
    """The tier reports (``<cards>/tiers/*.json``, written by ``python -m zoo.tools.tiers``) that include the run."""
    reports = []
    for path in sorted((cards_dir / "tiers").glob("*.json")):
        rep = json.loads(path.read_text(encoding="utf-8"))
        if any(r["run"] == run_name for info in rep.get("roles", {}).values() for r in info["sweep"]):
            reports.append(rep)
    return reports


# -- bundling -----------------------------------------------------------------------------------------------
def _places(catalog_file: str | os.PathLike | None, pretrained_dir: str | os.PathLike | None,
            cards_dir: str | os.PathLike | None) -> tuple[Path, Path, Path]:
    """The catalogue file, the bundled models' folder and the cards folder (the real package's unless given)."""
    cat_file = Path(catalog_file) if catalog_file else catalog_path()
    target_root = Path(pretrained_dir) if pretrained_dir else (cat_file.parent / "pretrained" if catalog_file
                                                               else bundled_dir())
    return cat_file, target_root, Path(cards_dir) if cards_dir else default_cards_dir()


def _entry(cat: dict[str, Any], name: str, cat_file: Path) -> dict[str, Any]:
    entry = cat["models"].get(name)
    if entry is None:
        raise BundleError(f"{name!r} is not in the catalogue {cat_file} (known: {', '.join(sorted(cat['models']))})")
    return entry


def _figure_name(name: str, path: Path) -> str:
    return path.name if path.name.startswith(name) else f"{name}-{path.name}"


def bundle(run_dir: str | os.PathLike, name: str | None = None, *, default: bool = False,
           figures: Sequence[str | os.PathLike] = (), recipe_path: str | os.PathLike | None = None,
           repo_id: str | None = None, revision: str | None = None, license: str = "mit",
           pretrained_dir: str | os.PathLike | None = None, catalog_file: str | os.PathLike | None = None,
           cards_dir: str | os.PathLike | None = None, results_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Bundle a finished run; returns the catalogue entry written (plus ``directory`` and ``card``).

    Where ``benchmarks/dynamic_eval.py`` has measured the model (a result in ``results_dir``, default
    ``benchmarks/results``), the settings it chose on validation go into ``config.json`` as ``dynamic_eval``: so
    ``--dynamic`` scores the model as its card and the README's table say it was scored."""
    run = Path(run_dir)
    ev, log, config = read_run(run)
    name = name or ev["name"]
    if not NAME_RE.match(name):
        raise BundleError(f"invalid model name {name!r}: use lower-case letters, digits, '.', '-' and '_'")
    cat_file, target_root, cards = _places(catalog_file, pretrained_dir, cards_dir)
    figs = _checked_figures(figures)
    existing = read_catalog(cat_file)["models"].get(name, {})
    repo_id = repo_id or existing.get("repo_id") or f"{DEFAULT_ORG}/{name}"
    if not re.match(r"^[\w.-]+/[\w.-]+$", repo_id):
        raise BundleError(f"invalid Hub repo id {repo_id!r} (expected ORG/NAME)")
    release = _Release(name, run, ev, log, config, repo_id=repo_id,
                       revision=revision or existing.get("revision") or DEFAULT_REVISION, license=license,
                       reference=find_reference(ev, recipe_path), figures=figs, cards=cards,
                       results_dir=Path(results_dir) if results_dir else REPO / "benchmarks" / "results")
    target_root.mkdir(parents=True, exist_ok=True)
    stage = target_root / f".{name}.partial{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    try:
        card = release.stage(stage)
        files = file_records(stage)
        total = bundled_bytes(target_root, without=name) + sum(r["size"] for r in files.values())
        if total > MAX_BUNDLE_BYTES:
            raise BundleError(f"the bundled zoo would be {total / 1e6:.1f} MB with {name}, over its "
                              f"{MAX_BUNDLE_BYTES / 1e6:.0f} MB cap: retire a model first (zoo bundle --retire NAME)")
        entry = release.catalog_entry(files)
        final = _swap_in(stage, target_root / name, cat_file, name, entry, default)
    finally:
        if stage.exists():
            shutil.rmtree(stage)
    release.keep_records(card)
    return dict(entry, directory=str(final), card=str(cards / f"{name}.md"))


def _checked_figures(figures: Sequence[str | os.PathLike]) -> list[Path]:
    figs = [Path(f) for f in figures]
    for f in figs:
        if not f.is_file():
            raise BundleError(f"{f}: no such figure file")
        if f.suffix.lower() not in FIGURE_SUFFIXES:
            raise BundleError(f"{f}: a figure must be one of {', '.join(sorted(FIGURE_SUFFIXES))}")
    return figs


@dataclass
class _Release:
    """One run on its way into the bundle: what :func:`bundle` stages, records in the catalogue and keeps."""
    name: str
    run: Path
    ev: dict[str, Any]
    log: list[dict[str, Any]]
    config: dict[str, Any]
    repo_id: str
    revision: str
    license: str
    reference: dict[str, Any] | None
    figures: list[Path]
    cards: Path
    results_dir: Path

    @property
    def figure_names(self) -> list[str]:
        return [_figure_name(self.name, f) for f in self.figures]

    def stage(self, stage: Path) -> str:
        """Write the release files, the config (with the measured dynamic-evaluation settings), the tokenizer,
        the figures and the card into ``stage``; returns the card."""
        from zoo.checkpoint import CheckpointError, load_checkpoint
        from zoo.tools.release.cards import build_card, dynamic_runs, release_metrics

        for f in (VOCAB_FILE, WEIGHTS_FILE):
            shutil.copyfile(self.run / "release" / f, stage / f)
        config = dict(self.config, name=self.name, metrics=release_metrics(self.ev), **hf_fields())
        dynamic = dynamic_runs(self.results_dir).get(self.name)
        config.pop("dynamic_eval", None)  # (a refresh starts from the bundled config: the result decides anew)
        if dynamic:
            config["dynamic_eval"] = dynamic["chosen"]
        (stage / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        try:
            _, tokenizer, _ = load_checkpoint(stage)  # strict: the shipped files must load exactly
        except CheckpointError as e:
            raise BundleError(f"the release checkpoint does not load: {e}") from None
        # written here rather than copied, so that runs made before tokenizer.json existed ship one too
        (stage / TOKENIZER_FILE).write_text(json.dumps(tokenizer.to_hf_json(), ensure_ascii=False), encoding="utf-8")
        (stage / TOKENIZER_CONFIG_FILE).write_text(tokenizer_config_text(tokenizer), encoding="utf-8")
        for f, fig_name in zip(self.figures, self.figure_names, strict=True):
            shutil.copyfile(f, stage / fig_name)
        sizes = {f: (stage / f).stat().st_size for f in RELEASE_FILES}
        card = build_card(self.name, self.ev, self.log, config, repo_id=self.repo_id, revision=self.revision,
                          license=self.license, figures=self.figure_names, reference=self.reference,
                          file_sizes=sizes, comparisons=tier_reports(self.cards, self.ev["name"]), dynamic=dynamic)
        (stage / CARD_FILE).write_text(card, encoding="utf-8")
        return card

    def catalog_entry(self, files: dict[str, Any]) -> dict[str, Any]:
        from zoo.tools.release.cards import release_metrics

        ev, train = self.ev, self.ev["recipe"].get("train", {})
        return {
            "architecture": ev["architecture"], "dataset": ev["dataset"],
            "description": ev["recipe"].get("description") or f"{ev['architecture']} trained on {ev['dataset']}",
            "num_parameters": ev["num_parameters"], "metrics": release_metrics(ev), "repo_id": self.repo_id,
            "revision": self.revision, "files": files, "dtype": (ev.get("release") or {}).get("dtype", "float32"),
            "training": {"epochs": ev["epochs_trained"], "best_epoch": ev["best_epoch"],
                         "train_seconds": ev["train_seconds"], "device": ev.get("device"),
                         "world_size": ev.get("world_size", 1), "precision": train.get("precision", "fp32"),
                         # "sentences": trained and scored on single lines from a zero state, not one carried stream
                         "mode": train.get("mode", "stream")},
            "reference": self.reference,
        }

    def keep_records(self, card: str) -> None:
        """The card, and the evaluation files the card and the catalogue were made from, kept beside the card so
        that every published number can be traced (and re-checked by the tests) on a fresh clone, without the
        run dir."""
        cards, name = self.cards, self.name
        cards.mkdir(parents=True, exist_ok=True)
        (cards / f"{name}.md").write_text(card, encoding="utf-8")
        for src, suffix in (("eval.json", ".eval.json"), ("log.jsonl", ".log.jsonl")):
            if (self.run / src).is_file():
                shutil.copyfile(self.run / src, cards / f"{name}{suffix}")
            # a run recorded as "trained here, not bundled" (model_cards/runs/) is bundled now: one copy, one place
            (cards / "runs" / f"{name}{suffix}").unlink(missing_ok=True)
        for f, fig_name in zip(self.figures, self.figure_names, strict=True):
            if f.resolve() != (cards / fig_name).resolve():
                shutil.copyfile(f, cards / fig_name)


def _swap_in(stage: Path, final: Path, cat_file: Path, name: str, entry: dict[str, Any], default: bool) -> Path:
    """Put the staged folder in place and its catalogue entry (whose file hashes loading checks) with it: the
    entry is written right after the swap, and a failure to write it puts the old folder back."""
    def change(cat: dict[str, Any]) -> None:
        cat["models"][name] = entry
        if default:
            cat["default"] = name

    old = final.parent / f".{name}.old{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(stage, final)
    try:
        update_catalog(cat_file, change)
    except BaseException:
        os.replace(final, stage)
        if old.exists():
            os.replace(old, final)
        raise
    if old.exists():
        shutil.rmtree(old)
    return final


def retire(name: str, *, pretrained_dir: str | os.PathLike | None = None,
           catalog_file: str | os.PathLike | None = None, cards_dir: str | os.PathLike | None = None) -> list[Path]:
    """Take a bundled model out of the zoo and keep its run as a record: its folder, catalogue entry, card and
    figures go; its ``eval.json`` / ``log.jsonl`` copies move to ``model_cards/runs/`` (where tier reports and the
    README's "trained here, not bundled" table read them). The default model cannot be retired (bundle another
    with ``--default`` first). Returns the record files."""
    cat_file, target_root, cards = _places(catalog_file, pretrained_dir, cards_dir)
    cat = read_catalog(cat_file)
    entry = _entry(cat, name, cat_file)
    if cat["default"] == name:
        raise BundleError(f"{name!r} is the default model: bundle another with --default before retiring it")
    kept = [cards / f"{name}{suffix}" for suffix in (".eval.json", ".log.jsonl")]
    if not all(p.is_file() for p in kept):
        raise BundleError(f"{name}: its evaluation files ({', '.join(p.name for p in kept)}) are not in {cards}; "
                          "without them the record could not be kept")
    records = []
    (cards / "runs").mkdir(parents=True, exist_ok=True)
    for src in kept:  # the record first: an interruption leaves the model bundled, never lost
        dst = cards / "runs" / src.name
        shutil.copyfile(src, dst)
        records.append(dst)
    update_catalog(cat_file, lambda c: c["models"].pop(name))
    figures = [f for f in entry.get("files", {}) if Path(f).suffix.lower() in FIGURE_SUFFIXES]
    for p in [*kept, cards / f"{name}.md", *(cards / f for f in figures)]:
        p.unlink(missing_ok=True)
    if (target_root / name).is_dir():
        shutil.rmtree(target_root / name)
    return records


def _refresh_plan(name: str, cat_file: Path, target_root: Path, cards: Path) -> dict[str, Any]:
    """Everything a refresh of ``name`` reads, checked before anything is written (so that ``--refresh A B`` either
    finds what it needs for every model or changes none)."""
    entry = _entry(read_catalog(cat_file), name, cat_file)
    folder = target_root / name
    figures = [f for f in entry.get("files", {}) if Path(f).suffix.lower() in FIGURE_SUFFIXES]
    sources = ([folder / f for f in (*RELEASE_FILES, *figures)]
               + [cards / f"{name}.eval.json", cards / f"{name}.log.jsonl"])
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise BundleError(f"{name}: cannot rebuild its card without {', '.join(missing)}")
    licence = None
    for card in (folder / CARD_FILE, cards / f"{name}.md"):
        if card.is_file() and (licence := re.search(r"^license: (\S+)$", card.read_text(encoding="utf-8"), re.M)):
            break
    if not licence:
        raise BundleError(f"{name}: no card (in {folder} or {cards}) says its licence; bundle it again from its run")
    ev = json.loads((cards / f"{name}.eval.json").read_text(encoding="utf-8"))
    recipe_file = PACKAGE_DIR / "recipes" / f"{ev.get('recipe', {}).get('name')}.toml"
    return {"entry": entry, "folder": folder, "figures": figures, "licence": licence[1],
            # a reference given with --recipe at bundling time lives on in the catalogue entry only
            "reference": None if recipe_file.is_file() else entry.get("reference")}


def refresh(name: str, *, pretrained_dir: str | os.PathLike | None = None,
            catalog_file: str | os.PathLike | None = None, cards_dir: str | os.PathLike | None = None,
            results_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Rebuild a bundled model's card and catalogue entry from its own files, for when what the card quotes has
    changed since it was bundled (a tier report regenerated, a recipe's ``[reference]`` corrected, the card
    generator improved, a dynamic-evaluation result added) and the run dir is gone. The bundled folder,
    ``<name>.eval.json`` and ``<name>.log.jsonl`` are the run: the weights, vocabulary and figures are copied through
    unchanged (byte-identical); the Hub repo, revision, licence and default are kept, and the reference is the recipe
    file's (else the catalogue's). The card's hash in the catalogue changes (and config.json's, where its
    ``dynamic_eval`` does): a release already on the Hub needs publishing again, as a new tag."""
    import tempfile

    cat_file, target_root, cards = _places(catalog_file, pretrained_dir, cards_dir)
    plan = _refresh_plan(name, cat_file, target_root, cards)
    entry, folder = plan["entry"], plan["folder"]
    with tempfile.TemporaryDirectory(prefix=f"zoo-refresh-{name}-") as tmp:
        run = Path(tmp) / "run"
        (run / "release").mkdir(parents=True)
        for f in RELEASE_FILES:
            shutil.copyfile(folder / f, run / "release" / f)
        shutil.copyfile(cards / f"{name}.eval.json", run / "eval.json")
        shutil.copyfile(cards / f"{name}.log.jsonl", run / "log.jsonl")
        figures = [Path(tmp) / f for f in plan["figures"]]
        for f in figures:
            shutil.copyfile(folder / f.name, f)
        recipe_path = None
        if plan["reference"]:
            recipe_path = Path(tmp) / "reference.toml"
            recipe_path.write_text("[reference]\n" + "".join(f"{k} = {json.dumps(v)}\n"
                                                              for k, v in plan["reference"].items()))
        return bundle(run, name, figures=figures, recipe_path=recipe_path, repo_id=entry.get("repo_id"),
                      revision=entry.get("revision"), license=plan["licence"], pretrained_dir=target_root,
                      catalog_file=cat_file, cards_dir=cards, results_dir=results_dir)


# -- command line -------------------------------------------------------------------------------------------
def cmd_bundle(args: argparse.Namespace) -> int:
    from zoo.errors import UsageError
    from zoo.tools.release.cards import models_table_markdown

    if args.readme_table:
        print(models_table_markdown(), end="")
        return 0
    given = [flag for flag, value in (("a run directory", args.run_dir), ("--name", args.name),
                                      ("--default", args.default), ("--figure", args.figure),
                                      ("--recipe", args.recipe), ("--repo-id", args.repo_id),
                                      ("--revision", args.revision), ("--license", args.license)) if value]
    for mode, names in (("--retire", args.retire), ("--refresh", args.refresh)):
        if names and given:
            raise UsageError(f"{mode} takes model names only, not {', '.join(given)}")
    if args.retire and args.refresh:
        raise UsageError("--retire and --refresh exclude each other")
    if args.retire:
        for name in args.retire:
            records = retire(name)
            print(f"retired {name}: removed from the catalogue and zoo/pretrained/; its record: "
                  f"{', '.join(str(p) for p in records)}")
        return 0
    if args.refresh:
        places = _places(None, None, None)
        for name in args.refresh:  # every model's files checked before any card is rewritten
            _refresh_plan(name, *places)
        for name in args.refresh:
            pinned = json.loads(places[0].read_text())["models"][name]
            entry = refresh(name)
            card = "rebuilt" if entry["files"]["README.md"] != pinned["files"].get("README.md") else "unchanged"
            changed = stale_release(pinned, entry)
            print(f"refreshed {name}: card {entry['card']} {card}, catalogue entry rebuilt"
                  + (f"; {changed}" if changed else ""))
        return 0
    if not args.run_dir:
        raise UsageError("give a run directory (made by `zoo train`), --retire NAME, --refresh NAME, or "
                         "--readme-table")
    before = read_catalog(catalog_path())["models"]
    entry = bundle(args.run_dir, args.name, default=args.default, figures=args.figure or [],
                   recipe_path=args.recipe, repo_id=args.repo_id, revision=args.revision,
                   license=args.license or "mit")
    m = entry["metrics"]
    name = Path(entry["directory"]).name
    print(f"bundled {name} -> {entry['directory']} ({len(entry['files'])} files); "
          f"card {entry['card']}; valid {m['metric']} {m['valid']:.4f}, test {m['test']:.4f}")
    if name in before and (changed := stale_release(before[name], entry)):
        print(f"note: {changed}", file=sys.stderr)
    return 0


def stale_release(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """What to tell the user when a model's files changed under the same Hub release (a re-bundle or a refresh
    keeps the repo and revision): a release tag is never moved, so one already published at that revision no
    longer matches the catalogue's pinned hashes and must be published again under a new tag. None if no file
    changed or the revision did."""
    if old.get("revision") != new["revision"] or old.get("repo_id") != new["repo_id"]:
        return None
    files_old, files_new = old.get("files", {}), new["files"]
    changed = sorted(f for f in files_old.keys() | files_new.keys()
                     if (files_old.get(f) or {}).get("sha256") != (files_new.get(f) or {}).get("sha256"))
    if not changed:
        return None
    return (f"the hashes of {', '.join(changed)} changed, so a release already on the Hub as "
            f"{new['repo_id']}@{new['revision']} no longer matches the catalogue (a tag is never moved): publish "
            f"it as a new release, `zoo publish {Path(new['directory']).name} --tag NEW_TAG`")


def add_cli(subparsers) -> None:
    sp = subparsers.add_parser("bundle", help="package a finished training run as a pretrained model "
                               "(files, model card, catalogue entry)")
    sp.add_argument("run_dir", nargs="?", help="a run directory made by `zoo train` (release/, eval.json, log.jsonl)")
    sp.add_argument("--name", help="catalogue name (default: the recipe name)")
    sp.add_argument("--default", action="store_true", help="make it the catalogue's default model")
    sp.add_argument("--figure", nargs="+", help="training-curve figure(s) to show in the card")
    sp.add_argument("--recipe", help="recipe file holding the [reference] table (default: zoo/recipes/<name>.toml)")
    sp.add_argument("--repo-id", help=f"Hub repository (default: {DEFAULT_ORG}/<name>)")
    sp.add_argument("--revision", help=f"Hub revision (tag) the release is pinned to (default: {DEFAULT_REVISION})")
    sp.add_argument("--license", help="licence id for the card (default: mit)")
    sp.add_argument("--retire", nargs="+", metavar="NAME", help="take bundled model(s) out of the zoo, keeping "
                    "each run as a record in model_cards/runs/ (for models a longer-budget tier supersedes)")
    sp.add_argument("--refresh", nargs="+", metavar="NAME", help="rebuild bundled model(s)' card and catalogue "
                    "entry from their own bundled files (after a tier report or a recipe's [reference] changed); "
                    "the weights stay byte-identical")
    sp.add_argument("--readme-table", action="store_true", help="print the README's models table (markdown) "
                    "generated from the catalogue, and exit")
    sp.set_defaults(func=cmd_bundle)
