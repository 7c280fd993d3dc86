"""Model cards generated from what a training run wrote (``eval.json``, ``log.jsonl``, ``config.json``).

Why generated: a hand-written card drifts from the weights it describes. Here every number comes
from the run's files: the ``model-index`` (the Hub's machine-readable results, built with
``huggingface_hub``'s :class:`ModelCardData` / :class:`EvalResult`) holds the metrics of the weights
that are actually shipped (the ``release/`` checkpoint, float16 when the recipe says so), and the
body gives the float32 numbers next to them so the cost of the cast is reported, not assumed.
Published numbers to compare with come from the recipe's optional ``[reference]`` table
(``valid``, ``test``, ``metric``, ``source``); nothing is typed into the card by hand.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.datasets import get_dataset
from zoo.formatting import format_number
from zoo.registry import CITATIONS, get_spec
from zoo.tools import PACKAGE_DIR
from zoo.training import STREAM_ONLY, first_selectable_epoch

LIBRARY = "alstm-zoo"
RECIPES_DIR = PACKAGE_DIR / "recipes"
TASK_TYPE = "text-generation"
TASK_NAME = "Language modeling"


def citation_keys(architecture: str, recipe: dict[str, Any] | None = None) -> list[str]:
    """The architecture's source paper(s) from the registry; a model trained the AWD-LSTM way (NT-ASGD, AR/TAR,
    weight drop) also cites Merity et al. for the training method."""
    spec = get_spec(architecture)
    keys = list(spec.citations)
    recipe = recipe or {}
    train, model = recipe.get("train", {}), recipe.get("model", {})
    awd = (train.get("optimizer") == "ntasgd" or bool(train.get("alpha")) or bool(train.get("beta"))
           or bool(model.get("arch_args", {}).get("weight_drop")))
    if awd and spec.awd_citation and spec.awd_citation not in keys:
        keys.append(spec.awd_citation)
    return keys


# -- metrics ---------------------------------------------------------------------------------------------------
def primary_metric(dataset: str) -> str:
    """``bits_per_char`` for character-level data (what its papers report), else ``perplexity``."""
    return get_dataset(dataset).metric


def release_metrics(ev: dict[str, Any]) -> dict[str, Any]:
    """The catalogue metrics ``{metric, valid, test}`` of the shipped weights, read from ``eval.json``."""
    rel = ev.get("release") or {}
    valid, test = rel.get("valid", ev["valid"]), rel.get("test", ev["test"])
    if primary_metric(ev["dataset"]) == "bits_per_char":
        return {"metric": "bits_per_char", "valid": valid["bits_per_token"], "test": test["bits_per_token"]}
    return {"metric": "perplexity", "valid": valid["ppl"], "test": test["ppl"]}


#: ``metric_config`` of the model-index entries measured under dynamic evaluation: same metric, same split, a
#: different protocol, so a reader (and :func:`card_metrics`) never takes one for the static number.
DYNAMIC_METRIC_CONFIG = "dynamic-evaluation"


def eval_results(ev: dict[str, Any], dynamic: dict[str, Any] | None = None) -> list:
    """``EvalResult`` entries (valid and test; perplexity, plus bits per character for char-level data).
    ``dynamic`` (a :func:`dynamic_runs` result): its valid and test perplexities too, under
    :data:`DYNAMIC_METRIC_CONFIG` with the settings chosen on validation as ``metric_args``, so the Hub's
    machine-readable results hold the number the card's evaluation section quotes."""
    from huggingface_hub import EvalResult

    ds = get_dataset(ev["dataset"])
    rel = ev.get("release") or {}
    title = ds.title
    if ev.get("mode") == "sentences":  # not comparable with the stream numbers of the corpus's other models
        title += (f", single lines of at most {ev['recipe']['train'].get('max_len', 100)} symbols, each from a zero "
                  "state (sentence-level protocol)")
    out = []
    for split_key, split_name in (("valid", "validation"), ("test", "test")):
        res = rel.get(split_key, ev[split_key])
        metrics = [("perplexity", "Perplexity", res["ppl"], None, None)]
        if ds.char_level:
            metrics.append(("bpc", "Bits per character", res["bits_per_token"], None, None))
        if dynamic:
            metrics.append(("perplexity", "Perplexity, dynamic evaluation", dynamic["dynamic"][split_key]["ppl"],
                            DYNAMIC_METRIC_CONFIG, dict(dynamic["chosen"])))
        for mtype, mname, value, mconfig, margs in metrics:
            out.append(EvalResult(task_type=TASK_TYPE, task_name=TASK_NAME, dataset_type=ds.hub_id,
                                  dataset_name=title, dataset_config=ds.hub_config, dataset_split=split_name,
                                  metric_type=mtype, metric_name=mname, metric_value=value, metric_config=mconfig,
                                  metric_args=margs))
    return out


def card_metrics(card_text: str) -> dict[str, dict[str, float]]:
    """Parse a card's ``model-index`` back: ``{"valid": {"perplexity": x, ...}, "test": {...}}``; a metric with a
    ``metric_config`` is keyed ``"TYPE:CONFIG"`` (``"perplexity:dynamic-evaluation"``), apart from the static one."""
    from huggingface_hub import ModelCard

    card = ModelCard(card_text)
    out: dict[str, dict[str, float]] = {}
    for r in card.data.eval_results or []:
        split = {"validation": "valid"}.get(r.dataset_split, r.dataset_split)
        key = f"{r.metric_type}:{r.metric_config}" if r.metric_config else r.metric_type
        out.setdefault(split, {})[key] = r.metric_value
    return out


def catalog_metrics_from_card(card_text: str, dataset: str) -> dict[str, Any]:
    """The catalogue's ``{metric, valid, test}`` as read from a card (to check the two agree)."""
    m = card_metrics(card_text)
    key = "bpc" if primary_metric(dataset) == "bits_per_char" else "perplexity"
    return {"metric": primary_metric(dataset), "valid": m["valid"][key], "test": m["test"][key]}


# -- formatting helpers ----------------------------------------------------------------------------------------
def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """A recipe dict as TOML (``None`` values are left out: TOML has no null), tables after scalars."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if v is not None and not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{prefix}{k}]", to_toml(v, f"{prefix}{k}.")]
    return "\n".join(lines).strip("\n")


def has_numbers(reference: dict[str, Any] | None) -> bool:
    """Whether a recipe's ``[reference]`` gives a published number; without one it only cites the setting a run
    follows (see :func:`zoo.tools.release.bundle.find_reference`)."""
    return bool(reference) and any(k in reference for k in ("valid", "test"))


# -- the card --------------------------------------------------------------------------------------------------
def card_data(name: str, ev: dict[str, Any], license: str = "mit", tags: list[str] | None = None,
              dynamic: dict[str, Any] | None = None):
    """The front matter (``ModelCardData``) of a run's card (``dynamic``: see :func:`eval_results`)."""
    from huggingface_hub import ModelCardData

    ds = get_dataset(ev["dataset"])
    base_tags = [LIBRARY, ev["architecture"], "recurrent-neural-network", "language-model", ev["dataset"],
                 "safetensors", "character-level" if ds.char_level else "word-level"]
    return ModelCardData(model_name=name, eval_results=eval_results(ev, dynamic), library_name=LIBRARY, license=license,
                         datasets=[ds.hub_id], language="en", pipeline_tag=TASK_TYPE,
                         tags=list(dict.fromkeys(base_tags + (tags or []))))


def build_card(name: str, ev: dict[str, Any], log: list[dict[str, Any]], config: dict[str, Any], *,
               repo_id: str, revision: str, license: str = "mit", figures: list[str] | None = None,
               reference: dict[str, Any] | None = None, file_sizes: dict[str, int] | None = None,
               comparisons: list[dict[str, Any]] | None = None, dynamic: dict[str, Any] | None = None) -> str:
    """The full card (front matter + body) of a bundled model. ``comparisons``: the tier reports
    (:mod:`zoo.tools.tiers`) this run takes part in; the card states their claims, met or not. ``dynamic``: the
    model's dynamic-evaluation result (:func:`dynamic_runs`), if it was measured."""
    data = card_data(name, ev, license=license, dynamic=dynamic)
    body = _body(name, ev, log, config, repo_id=repo_id, revision=revision, license=license,
                 figures=figures or [], reference=reference, file_sizes=file_sizes or {},
                 comparisons=comparisons or [], dynamic=dynamic)
    return f"---\n{data.to_yaml()}\n---\n\n{body}"


#: The card body's fixed text and the order of its sections; :func:`_body` computes what fills the ``${...}``.
CARD_TEMPLATE = Path(__file__).resolve().parent / "templates" / "model_card.md"


def pieces_line(log: list[dict[str, Any]], finished_on: str | None = None) -> str | None:
    """The card's line for a run trained in pieces and carried between machines (``zoo train
    --pause-after-minutes``, ``zoo/tools/gpu/ferry.py``): the hardware line names only the machine that finished it,
    so this one says which epochs each machine trained, and that each trip rounded the weights once."""
    trips = [r for r in log if r.get("event") == "ferried"]
    paused = sum(1 for r in log if r.get("event") == "paused")
    if not trips and not paused:
        return None
    line = f"- Trained in pieces: {paused + 1} (paused {paused} time{'s' if paused != 1 else ''} at an epoch end)"
    if trips:
        machines = sorted({r["from"] for r in trips if r.get("from")})
        line += (f"; carried between machines {len(trips)} time{'s' if len(trips) != 1 else ''}"
                 + (f" (from {', '.join(machines)})" if machines else "")
                 + ", each trip rounding the weights to float16 once and Adam's second moment to an 8-bit code "
                   "(`zoo/tools/gpu/ferry.py`)")
    spans = epoch_devices(log, finished_on)
    if len(spans) > 1:
        line += "; " + ", ".join(f"epoch{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''} on {short_device(d)}"
                                 for a, b, d in spans)
    if any("best_reset" in r for r in trips):
        line += (f"; best/ chosen again from epoch {first_selectable_epoch(log)} on "
                 "(its earlier weights did not travel)")
    return line


def held_out_line(log: list[dict[str, Any]]) -> str:
    """How often the run scored the test split. A sweep prefix continued after its choice on validation finished
    twice (``zoo train`` scores test at each finish), and the card says so rather than claim a single look."""
    ends, last_epoch = [], None
    for rec in log:
        if "valid_ppl" in rec and "epoch" in rec:
            last_epoch = rec["epoch"]
        elif rec.get("event") == "finished":
            ends.append(last_epoch)
    if len(ends) <= 1:
        return "the test split was evaluated once, on the best-validation checkpoint."
    after = ", ".join(str(e) for e in ends[:-1]) + f" and {ends[-1]}"
    return (f"the test split was evaluated at each of the run's {len(ends)} finishes (after epochs {after}: "
            "a run continued after it had finished), each time on the best-validation checkpoint; no choice "
            "read it.")


def epoch_devices(log: list[dict[str, Any]], finished_on: str | None = None) -> list[tuple[int, int, str]]:
    """Which machine trained which epochs, as ``(first, last, device)`` spans in epoch order.

    An epoch record names its device (``zoo train`` logs it); older records do not, and then the machine is the
    ``from`` of the next ``ferried`` event in the log (where the piece was packed), else ``finished_on`` (the
    run's eval.json device), else "an unrecorded machine".
    """
    spans: list[tuple[int, int, str]] = []
    for i, rec in enumerate(log):
        if "epoch" not in rec or "valid_ppl" not in rec:
            continue
        device = rec.get("device") or next(
            (r.get("from") for r in log[i + 1:] if r.get("event") == "ferried"), None) or finished_on
        device = device or "an unrecorded machine"
        if spans and spans[-1][2] == device and spans[-1][1] == rec["epoch"] - 1:
            spans[-1] = (spans[-1][0], rec["epoch"], device)
        else:
            spans.append((rec["epoch"], rec["epoch"], device))
    return spans


@dataclass(frozen=True)
class _Run:
    """What every section of a card reads about the run: named once, so each section is a short function."""
    name: str
    ev: dict[str, Any]
    log: list[dict[str, Any]]
    config: dict[str, Any]

    @property
    def ds(self) -> Any:
        return get_dataset(self.ev["dataset"])

    @property
    def train(self) -> dict[str, Any]:
        return self.ev["recipe"].get("train", {})

    @property
    def sentence_mode(self) -> bool:
        return self.train.get("mode") == "sentences"

    @property
    def symbols(self) -> str:
        return "characters" if self.ds.char_level else "tokens"

    @property
    def release(self) -> dict[str, Any]:
        return self.ev.get("release") or {"dtype": "float32", "valid": self.ev["valid"], "test": self.ev["test"]}

    @property
    def epochs(self) -> list[dict[str, Any]]:
        return [r for r in self.log if "valid_ppl" in r and "epoch" in r]


def _body(name: str, ev: dict[str, Any], log: list[dict[str, Any]], config: dict[str, Any], *, repo_id: str,
          revision: str, license: str, figures: list[str], reference: dict[str, Any] | None,
          file_sizes: dict[str, int], comparisons: list[dict[str, Any]], dynamic: dict[str, Any] | None) -> str:
    """The card's markdown: the template ``CARD_TEMPLATE`` filled section by section."""
    run = _Run(name, ev, log, config)
    title = get_spec(ev["architecture"]).title
    desc = ev["recipe"].get("description") or ""
    f: dict[str, str] = {"name": name}
    f["intro"] = (f"{'An' if title[0] in 'aeiouAEIL' else 'A'} {title} language model trained on {run.ds.title}, "
                  f"from the `{LIBRARY}` model zoo. {desc}").rstrip()
    f["results_table"] = _results_table(run, reference)
    f["comparisons"] = "".join(comparison_section(rep, ev["name"]) + "\n" for rep in comparisons)
    f["usage"] = _usage(run)
    f["command_line"] = (f"Command line: `zoo score {name} --text \"...\"`, `zoo generate {name} --prompt \"...\"`, "
                         f"`zoo eval {name} --dataset {ev['dataset']}`. From the Hub: `zoo download {name}` "
                         f"(repository `{repo_id}`, revision `{revision}`; every file is checked against the sha256 "
                         "in the zoo's catalogue).")
    f["details"] = _details(run, title, file_sizes)
    f["training"] = _training(run)
    f.update(_recipe_sections(run, reference))
    f["figures"] = "".join(f"![Training curve of {name}]({fig})\n\n" for fig in figures)
    f["training_log"] = _training_log(run)
    f["results_intro"] = (
        "Results of the shipped weights on the standard splits, every line scored as a single sentence from a zero "
        "state (the setting it was trained in; see *Evaluation* below). Lower is better." if run.sentence_mode else
        "Corpus-level results of the shipped weights on the standard splits (stateful evaluation, see *Evaluation* "
        "below). Lower is better.")
    f["evaluation"] = _evaluation(run) + (_dynamic_evaluation(run, dynamic) if dynamic else "")
    f["storage"] = _storage(run)
    f["limitations"] = _limitations(run, reference, license)
    f["bibtex"] = "\n\n".join(CITATIONS[k] for k in citation_keys(ev["architecture"], ev["recipe"]))
    return string.Template(CARD_TEMPLATE.read_text(encoding="utf-8")).substitute(f)


def _results_table(run: _Run, reference: dict[str, Any] | None) -> str:
    """The shipped weights' numbers (and float32's before a cast), beside the published reference."""
    rel, ev = run.release, run.ev
    dtype = rel.get("dtype", "float32")
    rows = [f"| perplexity ({dtype} weights, as shipped) | {rel['valid']['ppl']:.3f} | {rel['test']['ppl']:.3f} |"]
    if run.ds.char_level:
        rows.append(f"| bits per character ({dtype}, as shipped) | {rel['valid']['bits_per_token']:.4f} | "
                    f"{rel['test']['bits_per_token']:.4f} |")
    if dtype != "float32":
        rows.append(f"| perplexity (float32, before the cast) | {ev['valid']['ppl']:.3f} | {ev['test']['ppl']:.3f} |")
    if has_numbers(reference):
        unit = reference.get("metric", primary_metric(ev["dataset"]))
        digits = 3 if unit == "bits_per_char" else 2   # the papers give bpc to 3 decimals
        valid, test = (format_number(reference.get(split), digits) for split in ("valid", "test"))
        rows.append(f"| published reference ({unit}): {reference.get('source', 'see recipe')} | {valid} | {test} |")
    return "| | valid | test |\n|---|---:|---:|\n" + "\n".join(rows)


def _usage(run: _Run) -> str:
    ds, char = run.ds, run.ds.char_level
    usage = ("```python\nimport zoo\n\n"
             f'model = zoo.load("{run.name}")\n'
             f'report = model.score("{ds.example_text}")\n'
             f'print(report.texts[0]["{"bits_per_token" if char else "ppl"}"])'
             f'{"  # bits per predicted symbol: the bpc above" if char else ""}\n'
             f'print(model.generate("{ds.example_prompt}", max_new_tokens=20, seed=0))\n```')
    if run.sentence_mode:
        usage += (f"\n\nThis model scores **single sentences**, the setting it was trained in: pass one sentence "
                  f"per text (each text is scored on its own from a zero state; in training it never saw more "
                  f"than {run.train.get('max_len')} {run.symbols} in a row).")
    return usage


def _details(run: _Run, title: str, file_sizes: dict[str, int]) -> str:
    margs = run.config.get("model_args", {})
    aargs, tok = margs.get("arch_args", {}), run.config.get("tokenizer", {})
    details = [f"- Architecture: `{run.ev['architecture']}` ({title})",
               f"- Parameters: {run.ev['num_parameters']:,}",
               f"- Vocabulary: {margs.get('vocab_size', 'n/a'):,} tokens, normalisation `{tok.get('normalization')}`"
               if isinstance(margs.get("vocab_size"), int) else "- Vocabulary: see vocab.json",
               f"- Embedding size {margs.get('emb_size')}, tied input/output embeddings: "
               f"{'yes' if margs.get('tie_weights') else 'no'}, input encoding `{margs.get('input_encoding')}`",
               "- Recurrent stack: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(aargs.items()))]
    if file_sizes:
        details.append("- Files: " + ", ".join(f"`{n}` ({s / 1e6:.2f} MB)" if s >= 1e5 else f"`{n}` ({s:,} B)"
                                               for n, s in sorted(file_sizes.items())))
    return "\n".join(details)


def _training(run: _Run) -> str:
    ev, train, ds = run.ev, run.train, run.ds
    world = ev.get("world_size", 1)
    sample = (f"a fixed random sample of {train['train_sentences']:,} lines" if train.get("train_sentences")
              else "every line")
    data = (f"{ds.title}, train split as single sentences ({sample}, each truncated to its first "
            f"{train.get('max_len')} {run.symbols}, from a zero state, in padded and masked batches of "
            f"{train.get('batch_size')})" if run.sentence_mode else f"{ds.title}, train split")
    training = [f"- Data: {data}; model selection on the validation split; {held_out_line(run.log)}",
                f"- Hardware: {short_device(ev.get('device', 'n/a'))}, {world} process{'es' if world != 1 else ''}; "
                f"compute precision {train.get('precision', 'fp32')}",
                f"- Training time: {format_duration(ev['train_seconds'])} ({ev['train_seconds']:.0f} s of training "
                f"steps, evaluation excluded) over {ev['epochs_trained']} epochs (recipe: {train.get('epochs')}); "
                f"best validation at epoch {ev['best_epoch']}"]
    # total tokens / total time, not the mean of the epochs' rates (a slow epoch weighs by how long it took)
    timed = [(r["tokens_per_s"], r["seconds"]) for r in run.epochs if r.get("tokens_per_s") and r.get("seconds")]
    if timed:
        rate = sum(tps * sec for tps, sec in timed) / sum(sec for _, sec in timed)
        training.append(f"- Throughput: {rate:,.0f} training tokens/s (all epochs' tokens / their time)")
    if (pieces := pieces_line(run.log, ev.get("device"))) is not None:
        training.append(pieces)
    return "\n".join(training)


def _recipe_sections(run: _Run, reference: dict[str, Any] | None) -> dict[str, str]:
    """Where the recipe lives and the recipe itself, as the run recorded it."""
    recipe = run.ev["recipe"]
    rname = recipe.get("name", run.name)
    where = (f"`zoo train {rname}` (the recipe file `zoo/recipes/{rname}.toml`)"
             if (RECIPES_DIR / f"{rname}.toml").is_file()
             else "`zoo train recipe.toml` with this recipe saved as `recipe.toml`")
    # the [reference] shown is the one the card compares with (see bundle.find_reference): publication
    # metadata that may have been corrected since the run recorded its copy, and is not a hyper-parameter
    shown = {k: v for k, v in recipe.items() if k != "reference"} | ({"reference": reference} if reference else {})
    if run.sentence_mode:  # the run records every option; the stream protocol's are inert here and would mislead
        shown["train"] = {k: v for k, v in shown.get("train", {}).items() if k not in STREAM_ONLY}
    return {"recipe_where": where, "recipe_toml": to_toml(shown)}


def _training_log(run: _Run) -> str:
    if not run.epochs:
        return ""
    char = run.ds.char_level
    unit = "bpc" if char else "ppl"   # a character model's log in bits per character

    def shown(r: dict[str, Any], split: str) -> str:
        if not char:
            return format_number(r.get(f"{split}_ppl"))
        return format_number(r[f"{split}_loss"] / math.log(2), 3) if f"{split}_loss" in r else ""

    lines = [f"| epoch | train {unit} | valid {unit} | lr | seconds | optimizer |",
             "|---:|---:|---:|---:|---:|---|"]
    for r in run.epochs:
        lines.append(f"| {r['epoch']}{' *' if r.get('best') else ''} | {shown(r, 'train')} | "
                     f"{shown(r, 'valid')} | {r.get('lr', float('nan')):.4g} | "
                     f"{format_number(r.get('seconds'), 0)} | {r.get('optimizer', '')} |")
    return ("Training log (from `log.jsonl`):\n\n" + "\n".join(lines)
            + "\n\n`*`: a new best validation loss (checkpoint kept).\n\n")


def _evaluation(run: _Run) -> str:
    """The protocol the results were measured with, and the command that reproduces them."""
    ev, valid, test = run.ev, run.ev["valid"], run.ev["test"]
    protocol = (
        f"Single-sentence protocol, the setting this model was trained in: every non-empty line of a split is its own "
        f"sequence `<eos> t_1 ... t_n <eos>`, truncated to its first {run.train.get('max_len')} {run.symbols} (a "
        f"truncated line has no closing `<eos>`), scored from a zero state. Counted: exactly the predicted symbols, "
        f"i.e. every symbol after the leading `<eos>`, plus the closing `<eos>` of a line that was not truncated; "
        f"padding never counts. Valid: {valid.get('num_sequences', 0):,} sentences, {valid.get('num_tokens'):,} "
        f"predictions; test: {test.get('num_sequences', 0):,} sentences, {test.get('num_tokens'):,} predictions. "
        if run.sentence_mode else
        f"Standard stateful protocol: each split is one token stream cut into batch columns; the state is carried "
        f"across {valid.get('bptt')}-token chunks and every next-token prediction is counted once. Valid: batch "
        f"size {valid.get('batch_size')}, {valid.get('num_tokens'):,} predictions; test: batch size "
        f"{test.get('batch_size')}, {test.get('num_tokens'):,} predictions. ")
    return (protocol
            + ("Bits per character = bits per token (each token is one character, `_` the word boundary, plus "
               "`<eos>`). " if run.ds.char_level else "")
            + f"Reproduce with `zoo eval {run.name} --dataset {ev['dataset']} --split test --batch-size "
            f"{test.get('batch_size')}`.")


def _dynamic_evaluation(run: _Run, dynamic: dict[str, Any]) -> str:
    c, d, static = dynamic["chosen"], dynamic["dynamic"], dynamic["static"]
    return (
        f"\n\nDynamic evaluation (the weights adapt to the text as it is scored, each segment scored before the "
        f"step that uses it; `zoo/dynamic.py`): test perplexity {d['test']['ppl']:.2f} against "
        f"{static['test']['ppl']:.2f} static in the same run (batch 1), validation "
        f"{d['valid']['ppl']:.2f} against {static['valid']['ppl']:.2f} (batch 1 too: the static "
        f"validation number above is at batch {run.ev['valid'].get('batch_size')}). Its settings were chosen on "
        f"validation only and ship in `config.json` "
        f"(`dynamic_eval`: rule `{c['rule']}`, segment {c['segment']}, lr {c['lr']:g}, decay {c['decay']:g}), "
        f"so `zoo eval {run.name} --dataset {run.ev['dataset']} --split test --dynamic` uses them (source: "
        f"`benchmarks/results/{dynamic['file']}`).")


def _storage(run: _Run) -> str:
    rel, ev = run.release, run.ev
    dtype = rel.get("dtype", "float32")
    if dtype == "float32":
        return "Weights are stored in float32."
    return (f"Weights are stored in {dtype} (half the size) and computed in float32 after loading. "
            f"Measured effect of the cast: valid perplexity {ev['valid']['ppl']:.4f} -> "
            f"{rel['valid']['ppl']:.4f} ({rel.get('valid_ppl_change', 0.0):+.4%}), test perplexity "
            f"{ev['test']['ppl']:.4f} -> {rel['test']['ppl']:.4f} "
            f"({rel.get('test_ppl_change', 0.0):+.4%}).")


def _limitations(run: _Run, reference: dict[str, Any] | None, license: str) -> str:
    ds = run.ds
    lim = [f"- Trained only on {ds.title}: {ds.text_source}"
           " with that benchmark's preprocessing. Text outside it scores poorly: "
           + ("characters outside the 50-symbol alphabet are unknown." if ds.char_level else
              "words outside the closed vocabulary map to `<unk>` (see `oov` / `num_unk` in score reports), "
              "and the input is normalised to the benchmark's conventions before scoring."),
           "- A small research model: its samples are not fluent and it must not be used to make decisions "
           "about people or to generate text presented as factual.",
           "- Perplexities are only comparable between models with the same vocabulary and tokenisation.",
           f"- Data licence: {ds.licence}. Model licence: {license}."]
    if reference and not has_numbers(reference):
        lim.append(f"- The setting follows {reference['source']}; no published number is comparable with this run.")
    elif reference:
        source = reference.get("source", "see recipe")
        lim.append(f"- The published reference ({source}) comes from the paper's own setting"
                   + (": it is not matched to this run where its source says so" if "not " in source and
                      "matched" in source else "") + "; the recipe above is this run's complete configuration.")
    return "\n".join(lim)


def comparison_section(report: dict[str, Any], run_name: str) -> str:
    """What a tier report (:mod:`zoo.tools.tiers`) says about the role ``run_name`` plays in it."""
    role = next(r for r, info in report["roles"].items() if any(x["run"] == run_name for x in info["sweep"]))
    chosen = report["roles"][role]["chosen"]
    lines = [f"## Comparison: {report['title']}\n",
             f"This run is the `{role}` of the tier"
             + (" (chosen on validation among its sweep)." if chosen == run_name else
                f" (a sweep point; `{chosen}` was chosen on validation)." if chosen else ".")
             + f" Full table: `model_cards/tiers/{report['tier']}.md`.\n"]
    rows = [f"| {c['source']} | {({True: 'met', False: 'not met', None: 'pending'})[c['met']]} | {c['detail']} |"
            for c in report["claims"] if role in (c["model"], c.get("baseline"))]
    if rows:
        lines.append("| claim | result | measured |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(lines)


# -- the README models table -----------------------------------------------------------------------------------
def short_device(device: str) -> str:
    """``"CPU (2 cores, 1 threads)"`` -> ``"CPU, 1 thread"``; ``"NVIDIA H100 80GB HBM3"`` -> ``"H100 GPU"``."""
    if device.startswith("CPU"):
        threads = device.split(",")[-1].strip(" )").split()[0] if "," in device else "?"
        return f"CPU, {threads} thread{'s' if threads != '1' else ''}"
    for gpu in ("H100", "H200", "A100", "L4", "T4"):
        if gpu in device:
            return f"{gpu} GPU"
    return device


def dynamic_runs(results_dir: Path) -> dict[str, dict[str, Any]]:
    """``{model: result}`` of the files ``benchmarks/dynamic_eval.py`` writes in ``results_dir``
    (``dynamic_eval.json``, the defaults' own model, and ``dynamic_eval-NAME.json``), each result with its file's
    name under ``"file"``; a run that did not finish, or a ``--quick`` one, gives nothing."""
    out = {}
    for path in sorted(results_dir.glob("dynamic_eval*.json")):
        res = json.loads(path.read_text())
        if res.get("dynamic") and not res["meta"].get("quick"):
            out[res["meta"]["model"]] = dict(res, file=path.name)
    return out


def dynamic_results(results_dir: Path) -> dict[str, float]:
    """``{model: test perplexity under dynamic evaluation}`` (:func:`dynamic_runs`)."""
    return {m: res["dynamic"]["test"]["ppl"] for m, res in dynamic_runs(results_dir).items()}


def models_table_markdown(cat: dict[str, Any] | None = None, dynamic: dict[str, float] | None = None) -> str:
    """The README's table of pretrained models, generated from the catalogue (``zoo bundle --readme-table``).
    ``dynamic``: test perplexities under dynamic evaluation (:func:`dynamic_results`), a column of their own."""
    if cat is None:
        from zoo.zoo_model import catalog

        cat = catalog()
    dynamic = dynamic or {}
    lines = ["| name | architecture | params | data | epochs | training time | valid | test | test, dynamic eval | "
             "metric | published reference |", "|---|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for name, m in sorted(cat.get("models", {}).items()):
        met = m.get("metrics", {})
        tr = m.get("training", {})
        digits = 3 if met.get("metric") == "bits_per_char" else 2
        ref = m.get("reference") or {}
        ref_valid, ref_test = (format_number(ref.get(split), digits) for split in ("valid", "test"))
        ref_txt = f"{ref_valid} / {ref_test} ({ref.get('source', '')})" if has_numbers(ref) else ref.get("source", "")
        # a sentence-level model's numbers are over single lines from a zero state: not comparable with a stream's
        data = m.get("dataset", "") + (", single sentences" if tr.get("mode") == "sentences" else "")
        flag = " (default)" if name == cat.get("default") else ""
        secs = tr.get("train_seconds")
        # runs bundled before the precision key existed were all trained in fp32
        where = f" ({short_device(tr['device'])}, {tr.get('precision', 'fp32')})" if tr.get("device") else ""
        lines.append(f"| `{name}`{flag} | {m.get('architecture', '')} | {m.get('num_parameters', 0) / 1e6:.2f}M | "
                     f"{data} | {tr.get('epochs', '')} | "
                     f"{format_duration(secs) if secs is not None else ''}{where} | "
                     f"{format_number(met.get('valid'), digits)} | {format_number(met.get('test'), digits)} | "
                     f"{format_number(dynamic[name], digits) if name in dynamic else ''} | "
                     f"{met.get('metric', '')} | {ref_txt} |")
    return "\n".join(lines) + "\n"
