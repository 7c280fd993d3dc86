"""The alstm-zoo Gradio demo: score with per-token surprisal, stream generation, browse the models,
and watch the adaptation policy at work.

A thin UI layer: scoring, sampling and the adaptation trace all come from the library
(:mod:`zoo.pretrained`, :mod:`zoo.adaptation`); this file only validates input, formats results and
wires the components. It runs offline on the bundled models plus any checkpoint directories given
with ``--model-dir`` (repeatable) or ``ZOO_DEMO_MODELS`` (paths separated by ``os.pathsep``).

    python app.py [--port 7860] [--host 127.0.0.1] [--model-dir DIR ...]

Named API endpoints (gradio_client): ``/score``, ``/generate``, ``/adaptation``, ``/model_info``.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import logging
import math
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MPLBACKEND", "Agg")


def _check_port_env() -> None:
    """gradio reads $GRADIO_SERVER_PORT as it is imported, and a non-number there was a traceback from inside
    ``import gradio``: checked first, one line, exit 2 (only when run as the demo, not when imported)."""
    value = os.environ.get("GRADIO_SERVER_PORT", "").strip()
    if value and not (value.isdigit() and 0 < int(value) < 65536):
        print(f"app.py: error: GRADIO_SERVER_PORT must be a port number in 1..65535, got {value!r}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    _check_port_env()

import gradio as gr  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import zoo  # noqa: E402
from zoo.adaptation import trace_text  # noqa: E402
from zoo.catalog import bundled_dir, catalog  # noqa: E402
from zoo.checkpoint import CheckpointError, read_config  # noqa: E402
from zoo.device import resolve_device  # noqa: E402
from zoo.errors import InvalidRequest, ZooError  # noqa: E402
from zoo.pretrained import ZooModel  # noqa: E402
from zoo.registry import ARCHITECTURES  # noqa: E402
from zoo.service import GenerateRequest, Limits, ScoreRequest, Service, parse_request  # noqa: E402
from zoo.tools.demo_guard import GuardRoutes  # noqa: E402
from zoo.tools.demo_render import (  # noqa: E402
    DIFFERENCE_SCALE_BITS,
    SURPRISAL_SCALE_BITS,
    _fmt,
    _summary_md,
    adaptation_figure,
    curves_dir,
    heatmap_html,
    render_curve,
)
from zoo.tools.demo_stats import DynamicStats  # noqa: E402
from zoo.tools.ports import port_free  # noqa: E402

log = logging.getLogger("zoo.demo")
REPO = Path(__file__).resolve().parent

#: Input caps for a small shared CPU machine.
MAX_CHARS = 20_000
#: tokens per scored text once tokenised: a character model spells a character outside its alphabet as five
#: symbols, and every token is a span of the heatmap
MAX_TOKENS = 25_000
MAX_PROMPT_CHARS = 2_000
#: Dynamic evaluation takes gradient steps (~8x the time of a plain score): its texts are capped shorter, it runs
#: one at a time in its own queue (:data:`DYNAMIC_CONCURRENCY`), and its statistics are collected at start-up.
MAX_DYNAMIC_CHARS = 2_000
DYNAMIC_CONCURRENCY = 1
MAX_NEW_TOKENS = 500
MAX_TRACE_TOKENS = 500
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 200
#: What the Adaptation tab's legend names mean (the names come from the models' ``adaptation_signals``).
ADAPTATION_LEGEND = """**Legend.** aLSTM (Flennerhag et al. 2018), the adaptation vectors of each layer:
`pi_x` scales the layer's input before the input projection and `pi_h` the previous hidden state before the
recurrent projection (input-side adaptation, IO policy only); `pi_ih` and `pi_hh` scale the outputs of the input
and recurrent projections, per gate and unit; `pi_b` is the adaptive bias (when the model has one).
HyperLSTM (Ha et al. 2017): `d_ix` ... `d_oh` scale the input (`x`) and recurrent (`h`) projections of gates
i, j (the cell candidate), f and o; `beta_i` ... `beta_o` are the dynamic biases of those gates."""
#: Where curves drawn from training logs are written (served: see ``launch``).
CACHE_SIZE = 4
#: Queue settings for a two-core machine: two model events at a time (dynamic evaluation has its own slot), 16
#: waiting at most.
CONCURRENCY = 2
#: Said on the API page: this demo's endpoints are for gradio_client; OpenAI's clients talk to the server.
OPENAI_SERVER = ("An OpenAI-compatible API (the `openai` client, lm-evaluation-harness `local-completions`) is served "
                 "by `zoo serve start`: POST http://127.0.0.1:8080/v1/completions (see serving/README.md).")
QUEUE_SIZE = 16
NONE_CHOICE = "(none)"
LN2 = math.log(2.0)

# YlOrRd for surprisal; blue-white-red for differences.
CSS = """
.zoo-heat {line-height: 1.9; font-family: ui-monospace, monospace; font-size: 14px; word-wrap: break-word;}
.zoo-heat .tok {padding: 1px 2px; border-radius: 3px; white-space: pre-wrap;}
.zoo-heat.zoo-chars .zoo-text {word-break: break-all; overflow-wrap: anywhere;}
.zoo-heat .zoo-text {max-width: 100%; overflow-wrap: anywhere;}
.zoo-pair {display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 20px;}
.zoo-pair > div {min-width: 0;}
.zoo-legend {display: flex; align-items: center; gap: 8px; font-size: 12px; margin: 6px 0 12px 0;}
.zoo-legend .bar {width: 220px; height: 12px; border: 1px solid #999; border-radius: 2px;}
#models-card table {display: block; overflow-x: auto;}
#models-card th {white-space: nowrap; word-break: normal;}
"""


# -- input validation: the service core's schema (zoo.service), with the demo's limits ------------------------
#: What the demo accepts: the same schema and messages as the HTTP server and the CLI, narrowed to the sliders'
#: ranges; an over-long text is cut with a warning rather than refused (a pasted article is still worth scoring).
LIMITS = Limits(max_texts=1, max_chars=MAX_CHARS, max_total_chars=MAX_CHARS, max_total_tokens=MAX_TOKENS,
                max_prompt_chars=MAX_PROMPT_CHARS,
                max_new_tokens=MAX_NEW_TOKENS, max_temperature=MAX_TEMPERATURE, max_top_k=MAX_TOP_K, truncate=True,
                allow_dynamic=True)
DYNAMIC_LIMITS = dataclasses.replace(LIMITS, max_chars=MAX_DYNAMIC_CHARS, max_total_chars=MAX_DYNAMIC_CHARS)


def parse(payload: dict[str, Any], limits: Limits = LIMITS) -> ScoreRequest | GenerateRequest:
    """A request through the service schema; a bad field becomes a ``gr.Error`` with its one-line message."""
    try:
        return parse_request(payload, limits)
    except InvalidRequest as e:
        raise gr.Error(e.message + ".") from None


def clean_text(text: Any, limits: Limits = LIMITS) -> tuple[str, str]:
    """The text to score (the demo's box may send None when empty) and the notice to show ('' if none)."""
    req = parse({"text": "" if text is None else text}, limits)
    return req.texts[0], " ".join(f"{w}." for w in req.warnings)


# -- the models ---------------------------------------------------------------------------------------
class ModelRegistry:
    """The catalogue's bundled models plus extra checkpoint directories, loaded lazily into an LRU cache."""

    def __init__(self, extra_dirs: Sequence[str | os.PathLike] = (), device: str = "cpu"):
        self.device = device  # (every model is loaded onto it: `python app.py --device cuda`)
        self.entries: dict[str, dict[str, Any]] = {}
        cat = catalog()
        for name, meta in sorted(cat.get("models", {}).items()):
            directory = bundled_dir() / name
            if (directory / "config.json").is_file():  # offline: only what is bundled
                self.entries[name] = {"source": "bundled", "dir": directory, "meta": dict(meta)}
        for directory in self._expand(extra_dirs):
            try:
                config = read_config(directory)
            except CheckpointError as e:
                raise ValueError(str(e)) from None
            name = str(config.get("name") or directory.name)
            if name in self.entries:
                name = f"{name} ({directory})"
            self.entries[name] = {"source": "local path", "dir": directory, "meta": self._meta_from_config(config)}
        default = cat.get("default")
        self.default = default if default in self.entries else next(iter(self.entries), None)
        self._cache: OrderedDict[str, ZooModel] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _expand(paths: Sequence[str | os.PathLike]) -> list[Path]:
        """A path is a checkpoint directory or a folder of checkpoint directories."""
        out: list[Path] = []
        for raw in paths:
            path = Path(raw).expanduser()
            if (path / "config.json").is_file():
                out.append(path)
            elif path.is_dir():
                subs = [p for p in sorted(path.iterdir()) if (p / "config.json").is_file()]
                if not subs:
                    raise ValueError(f"{path}: no checkpoint directory (config.json) in it")
                out.extend(subs)
            else:
                raise ValueError(f"{path}: not a directory")
        return out

    @staticmethod
    def _meta_from_config(config: dict[str, Any]) -> dict[str, Any]:
        metrics = config.get("metrics") if isinstance(config.get("metrics"), dict) else {}
        return {"architecture": config.get("architecture"), "dataset": config.get("dataset"),
                "num_parameters": config.get("num_parameters"), "metrics": metrics}

    def names(self) -> list[str]:
        return list(self.entries)

    def check(self, name: Any) -> str:
        if not isinstance(name, str) or name not in self.entries:
            known = ", ".join(self.entries) or "none (bundle a model or pass --model-dir)"
            raise gr.Error(f"Unknown model {name!r}. Available: {known}.")
        return name

    def get(self, name: Any) -> ZooModel:
        name = self.check(name)
        with self._lock:
            if name in self._cache:
                self._cache.move_to_end(name)
                return self._cache[name]
            model = self.load(name)
            self._cache[name] = model
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return model

    def load(self, name: str) -> ZooModel:
        """A fresh copy of the model ``name`` (not cached: :meth:`get` caches)."""
        entry = self.entries[name]
        try:
            model = zoo.load(name if entry["source"] == "bundled" else entry["dir"], device=self.device)
        except Exception as e:  # a broken checkpoint must not take the app down
            log.exception("loading %s failed", name)
            raise gr.Error(f"Could not load model {name!r}: {e}") from None
        model.name = name
        return model

    def has_adaptation(self, name: str) -> bool:
        arch = self.entries[name]["meta"].get("architecture")
        return arch in ARCHITECTURES and ARCHITECTURES[arch].adapts

    def table(self) -> list[list[Any]]:
        rows = []
        for name, entry in self.entries.items():
            meta, met = entry["meta"], entry["meta"].get("metrics") or {}
            params = meta.get("num_parameters")
            rows.append([name + (" (default)" if name == self.default else ""), meta.get("architecture") or "",
                         meta.get("dataset") or "", f"{params:,}" if isinstance(params, int) else "",
                         _fmt(met.get("valid")), _fmt(met.get("test")), met.get("metric") or "", entry["source"]])
        return rows

    def card(self, name: str) -> str:
        entry = self.entries[name]
        for path in (entry["dir"] / "README.md", REPO / "model_cards" / f"{name}.md"):
            if path.is_file():
                text = path.read_text(encoding="utf-8", errors="replace")
                if text.startswith("---"):  # drop the YAML front matter, the table shows its content
                    end = text.find("\n---", 3)
                    text = text[end + 4:] if end > 0 else text
                # a card's images are relative to its folder, which the demo does not serve (weights live
                # there): the curve is shown beside the card instead, so the links go, with a pointer
                text = re.sub(r"!\[([^\]]*)\]\([^)\s]+\)", r"*(\1: shown under 'training curve')*", text)
                return text.strip()
        return f"*No model card bundled for `{name}`.*"

    def curve(self, name: str) -> str | None:
        """A training-curve image: the catalogue's ``training_curve``, an image beside the checkpoint, or one
        drawn from the training run's ``log.jsonl`` (beside the checkpoint or in ``runs/<name>/``)."""
        entry = self.entries[name]
        hint = entry["meta"].get("training_curve") or entry["meta"].get("curve")
        candidates = [entry["dir"] / hint, REPO / hint] if isinstance(hint, str) else []
        candidates += [entry["dir"] / f for f in ("training_curve.png", "curve.png", "training_curve.jpg")]
        candidates += [REPO / "model_cards" / f"{name}{s}" for s in ("-curve.png", "_curve.png", ".png")]
        candidates += [p for ext in ("png", "jpg", "jpeg", "svg") for p in sorted(entry["dir"].glob(f"*.{ext}"))]
        found = next((p for p in candidates if p.is_file()), None)
        if found is not None:
            return str(found)
        for log_file in (entry["dir"] / "log.jsonl", REPO / "runs" / name / "log.jsonl"):
            if log_file.is_file():
                return render_curve(log_file, name)
        return None


def _score_one(model: ZooModel, text: str, dynamic: bool = False) -> dict[str, Any]:
    reply = Service(model, LIMITS).score([ScoreRequest((text,), return_tokens=True, dynamic=dynamic)])[0]
    if isinstance(reply, ZooError):  # e.g. dynamic evaluation without the model's training data
        raise gr.Error(f"{model.name}: {reply}")
    if isinstance(reply, Exception):  # a bug, not the input: the service core logged it
        raise gr.Error(f"Scoring failed with {model.name}; the server log has the details.")
    res = reply["texts"][0]
    toks = res["tokens"]
    return {
        "model": model.name, "architecture": model.lm.architecture, "num_parameters": model.num_parameters,
        "perplexity": res["ppl"], "bits_per_input_char": res["bits_per_input_char"],
        "bits_per_token": res["bits_per_token"],
        "num_tokens": res["num_tokens"], "num_unk": res["num_unk"], "oov": res["oov"],
        "num_dropped": res["num_dropped"], "dropped_items": res.get("dropped_items", []),
        "tokens": [t["token"] for t in toks], "surprisal_bits": [-t["logprob"] / LN2 for t in toks],
        "is_char": model.tokenizer.is_char, "warnings": res.get("warnings", []),
    } | (_dynamic_effect(model, text, res) if dynamic else {})


def _dynamic_effect(model: ZooModel, text: str, res: dict[str, Any]) -> dict[str, Any]:
    """What dynamic evaluation did to this text: its perplexity beside the plain one (a cheap second score), and
    how many of the model's weight updates (one per ``segment`` tokens) happened before the text's last token."""
    plain = _score_one(model, text)["perplexity"]
    segment = model.dynamic_defaults.segment
    return {"dynamic": True, "static_perplexity": plain, "dynamic_segment": segment,
            "dynamic_updates": max(0, (res["num_tokens"] - 1) // segment)}


def _dynamic_note(results: list[dict[str, Any]]) -> str:
    """The summary's first line for a dynamic score: that it ran, and how far it moved each model's number."""
    parts = []
    for r in results:
        change = r["perplexity"] / r["static_perplexity"] - 1 if r["static_perplexity"] else 0.0
        parts.append(f"{html.escape(r['model'])}: perplexity {_fmt(r['perplexity'])} against "
                     f"{_fmt(r['static_perplexity'])} without it ({change:+.1%}; {r['dynamic_updates']} weight "
                     f"update(s), one per {r['dynamic_segment']} tokens)")
    return ("**Scored by dynamic evaluation** (the weights adapt to the text as it is read): " + "; ".join(parts)
            + ".\n\n")


def dynamic_stats_of(registry: ModelRegistry) -> DynamicStats:
    """The collector of dynamic evaluation's statistics (:mod:`zoo.tools.demo_stats`): at start-up the
    ``--model-dir`` models (the operator named them) and the default model, the rest of the catalogue on first use."""
    entries = registry.entries
    every = [(n, "bundled" if e["source"] == "bundled" else str(e["dir"])) for n, e in entries.items()]
    first = [(n, src) for n, src in every if entries[n]["source"] != "bundled" or n == registry.default]
    return DynamicStats(sorted(first, key=lambda m: m[0] == registry.default), every)


# -- event handlers ---------------------------------------------------------------------------------------
def make_handlers(registry: ModelRegistry, stats: DynamicStats | None = None) -> dict[str, Any]:
    """The four endpoint functions, closed over one registry (tests build their own)."""

    dyn_stats = stats or dynamic_stats_of(registry)

    def score(text: str, model: str, compare: str | None = None) -> tuple[dict[str, Any], str, str]:
        """Score ``text`` with ``model`` (and ``compare``): report, summary table, highlighted text."""
        return _score(text, model, compare, dynamic=False)

    def score_dynamic(text: str, model: str, compare: str | None = None) -> tuple[dict[str, Any], str, str]:
        """:func:`score` by dynamic evaluation (the weights adapt to the text as it is read; :mod:`zoo.dynamic`):
        its own queue, one at a time, texts up to :data:`MAX_DYNAMIC_CHARS`."""
        return _score(text, model, compare, dynamic=True)

    def _score(text: str, model: str, compare: str | None, dynamic: bool) -> tuple[dict[str, Any], str, str]:
        text, notice = clean_text(text, DYNAMIC_LIMITS if dynamic else LIMITS)
        if notice:
            gr.Warning(notice)
        names = [registry.check(model)]
        if compare not in (None, "", NONE_CHOICE):
            names.append(registry.check(compare))
        for n in names if dynamic else []:
            why = dyn_stats.problem(n)
            if why is not None:
                raise gr.Error(f"{n}: {why}")
        results = [_score_one(registry.get(n), text, dynamic) for n in names]
        for r in results:  # (loading refuses NaN/inf weights; finite ones can still overflow): say so
            if not all(math.isfinite(x) for x in r["surprisal_bits"]):
                raise gr.Error(f"{r['model']} gives non-finite scores on this text (its logits overflow).")
        vmax = max(SURPRISAL_SCALE_BITS[r["is_char"]] for r in results)  # fixed: the same colours on every run
        blocks, diff, diff_note = [], None, ""
        for tag, r in zip("AB", results, strict=False):
            cap = f"{tag}: {r['model']} — surprisal −log₂ p(token | context)" if len(results) > 1 \
                else f"{r['model']} — surprisal −log₂ p(token | context)"
            blocks.append(heatmap_html(r["tokens"], r["surprisal_bits"], is_char=r["is_char"], vmax=vmax,
                                       caption=cap, elem_class=f"model-{tag.lower()}"))
        if len(results) == 2:  # A and B side by side, their difference below
            blocks = ['<div class="zoo-pair">' + "".join(f"<div>{blk}</div>" for blk in blocks) + "</div>"]
            a, b = results
            if a["tokens"] == b["tokens"]:
                diff = [x - y for x, y in zip(a["surprisal_bits"], b["surprisal_bits"], strict=True)]
                dmax = DIFFERENCE_SCALE_BITS[a["is_char"]]
                blocks.append(heatmap_html(a["tokens"], diff, is_char=a["is_char"], vmax=dmax, diverging=True,
                                           caption="A − B (red: A more surprised, blue: B more surprised)",
                                           elem_class="model-diff"))
            else:
                diff_note = "The two models tokenise this text differently, so there is no per-token difference."
                blocks.append(f"<p><em>{diff_note}</em></p>")
        report = {"notice": notice, "models": results, "difference_bits": diff, "difference_note": diff_note,
                  "num_chars": len(text)}
        summary = (_dynamic_note(results) if dynamic else "") + _summary_md(results, diff, notice)
        return report, summary, "\n".join(blocks)

    def generate(prompt: str, model: str, max_new_tokens: float = 50, temperature: float = 1.0,
                 top_k: float = 0, top_p: float = 1.0, seed: float | None = 0, stop_at_eos: bool = False,
                 no_unk: bool = True) -> Iterator[str]:
        """Stream the continuation of ``prompt``, one token at a time (each yield is the text so far)."""
        req = parse({"task": "generate", "prompt": "" if prompt is None else prompt,
                     "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                     "seed": None if seed is None or seed == -1 else seed, "stop_at_eos": stop_at_eos,
                     "allow_unk": not no_unk})
        for w in req.warnings:
            gr.Warning(f"{w}.")
        service = Service(registry.get(registry.check(model)), LIMITS)
        out = ""
        yield out
        for piece in service.stream(req):
            out += piece
            yield out

    def adaptation(text: str, model: str) -> tuple[str, str, Figure | None, dict[str, Any]]:
        """Trace how much the adaptation vectors change at each token: message, text, plot, data."""
        text, notice = clean_text(text)
        m = registry.get(model)
        trace = trace_text(m.lm, m.tokenizer, text, max_tokens=MAX_TRACE_TOKENS)
        if trace.truncated:
            notice = (notice + " " if notice else "") + \
                f"Only the first {MAX_TRACE_TOKENS:,} of {trace.total_tokens:,} tokens were traced."
        if notice:
            gr.Warning(notice)
        data = dict(trace.to_dict(), model=m.name, architecture=m.lm.architecture, notice=notice)
        if not trace.has_signals:
            msg = (f"**{m.name}** ({m.lm.architecture}) has no input-dependent weights (it exposes no adaptation "
                   f"signals), so there is nothing to plot. Pick an aLSTM (recurrent adaptation model) or a HyperLSTM.")
            return msg, "", None, data
        totals = trace.layer_total
        mix = [math.sqrt(sum(v[t] ** 2 for v in totals.values())) for t in range(len(trace.tokens))]
        text_html = heatmap_html(trace.tokens, mix, is_char=m.tokenizer.is_char, vmax=max(mix) or 1.0,
                                 caption="change of all adaptation vectors at each token, ‖Δs‖₂", unit="",
                                 elem_class="adapt-text")
        msg = (f"**{m.name}** ({m.lm.architecture}): the plot shows, for each token, the L2 norm of the change "
               f"of each adaptation vector from the previous token (one panel per layer). Large values mean the "
               f"adaptation policy re-weights the layer strongly at that token.")
        if notice:
            msg = f"⚠️ {notice}\n\n{msg}"
        return msg, text_html, adaptation_figure(trace, m.name), data

    def model_info(model: str) -> tuple[str, dict[str, Any], str | None]:
        """Card, details (parameters, data, metrics, configuration) and training curve of one model."""
        name = registry.check(model)
        entry = registry.entries[name]
        details = dict(entry["meta"], name=name, source=entry["source"], directory=str(entry["dir"]))
        try:
            details["config"] = read_config(entry["dir"]).get("model_args")
        except CheckpointError as e:
            details["config_error"] = str(e)
        curve = registry.curve(name)
        details["training_curve"] = curve
        return registry.card(name), details, curve

    return {"score": score, "score_dynamic": score_dynamic, "generate": generate, "adaptation": adaptation,
            "model_info": model_info}


# -- the UI -------------------------------------------------------------------------------------------------
EXAMPLE = "the company said it expects to report a loss for the third quarter\nmr. smith declined to comment"


def build_demo(model_dirs: Sequence[str | os.PathLike] = (), device: str = "cpu") -> gr.Blocks:
    """The Blocks app over the bundled models plus ``model_dirs``, run on ``device``."""
    registry = ModelRegistry(model_dirs, device)
    stats = dynamic_stats_of(registry)
    h = make_handlers(registry, stats)
    names = registry.names()
    adaptive = [n for n in names if registry.has_adaptation(n)] or names
    default = registry.default
    cpu = {"concurrency_limit": CONCURRENCY, "concurrency_id": "cpu"}

    with gr.Blocks(title="alstm-zoo demo") as demo:
        gr.Markdown("# alstm-zoo: adaptive-parameterization language models\n"
                    "Score text token by token, generate, compare models and watch the adaptation at work. "
                    f"Inputs are capped at {MAX_CHARS:,} characters.")
        if not names:
            gr.Markdown("⚠️ **No models found.** Bundle one (`zoo/pretrained/`) or start with `--model-dir DIR`.")
        with gr.Tabs():
            with gr.Tab("Score", id="score"):
                s_text = gr.Textbox(label="Text", lines=5, value=EXAMPLE, elem_id="score-text")
                with gr.Row():
                    s_model = gr.Dropdown(names, value=default, label="Model", allow_custom_value=True,
                                          elem_id="score-model")
                    s_cmp = gr.Dropdown([NONE_CHOICE] + names, value=NONE_CHOICE, label="Compare with",
                                        allow_custom_value=True, elem_id="score-compare")
                with gr.Row():
                    s_btn = gr.Button("Score", variant="primary", elem_id="score-btn")
                    s_dyn = gr.Button(f"Score by dynamic evaluation (texts up to {MAX_DYNAMIC_CHARS:,} characters, "
                                      "one at a time)", elem_id="score-dynamic-btn")
                gr.Markdown("Dynamic evaluation: the weights adapt to the text as it is read (each segment scored "
                            "before the step that learns from it; ~8x slower). It has its own queue, so it never "
                            "holds a plain score up.", elem_id="score-dynamic-note")
                s_sum = gr.Markdown(elem_id="score-summary")
                s_html = gr.HTML(elem_id="score-heatmap")
                with gr.Accordion("Raw report (JSON)", open=False):
                    s_json = gr.JSON(label="report")
                # the last result is cleared first, so that an error is never shown above a result it did not give
                # (in the browser: no server round trip, no event a route guard has to know)
                clear = {"fn": None, "inputs": None, "outputs": [s_json, s_sum, s_html],
                         "js": "() => [null, '', '']", "api_visibility": "private"}
                s_btn.click(**clear).then(h["score"], [s_text, s_model, s_cmp], [s_json, s_sum, s_html],
                                          api_name="score", api_description="Score a text: per-token "
                                          "log-probabilities, perplexity, bit rates. " + OPENAI_SERVER, **cpu)
                s_dyn.click(**clear).then(h["score_dynamic"], [s_text, s_model, s_cmp], [s_json, s_sum, s_html],
                                          api_name="score_dynamic", concurrency_limit=DYNAMIC_CONCURRENCY,
                                          concurrency_id="dynamic", show_progress="full")

            with gr.Tab("Generate", id="generate"):
                g_prompt = gr.Textbox(label="Prompt", lines=2, value="the stock market", elem_id="gen-prompt")
                g_model = gr.Dropdown(names, value=default, label="Model", allow_custom_value=True, elem_id="gen-model")
                with gr.Row():
                    g_n = gr.Slider(1, MAX_NEW_TOKENS, value=50, step=1, label="max_new_tokens")
                    g_temp = gr.Slider(0.0, MAX_TEMPERATURE, value=1.0, step=0.05, label="temperature (0 = greedy)")
                with gr.Row():
                    g_k = gr.Slider(0, MAX_TOP_K, value=0, step=1, label="top-k (0 = off)")
                    g_p = gr.Slider(0.05, 1.0, value=0.95, step=0.01, label="top-p")
                    g_seed = gr.Number(value=0, precision=0, label="seed (-1 = random)")
                with gr.Row():
                    g_eos = gr.Checkbox(value=False, label="stop at the end of the sentence (else each end of "
                                                           "sentence is a line break and generation goes on)")
                    g_unk = gr.Checkbox(value=True, label="never generate <unk> (the unknown-word token)")
                with gr.Row():
                    g_btn = gr.Button("Generate", variant="primary", elem_id="gen-btn")
                    g_stop = gr.Button("Stop")
                g_out = gr.Textbox(label="Continuation", lines=6, elem_id="gen-out")
                ev = g_btn.click(h["generate"], [g_prompt, g_model, g_n, g_temp, g_k, g_p, g_seed, g_eos, g_unk], g_out,
                                 api_name="generate", api_description="Generate a continuation. " + OPENAI_SERVER,
                                 time_limit=300, **cpu)
                g_stop.click(None, None, None, cancels=[ev])

            with gr.Tab("Adaptation", id="adaptation"):
                gr.Markdown("How much does the adaptation policy change the weights at each token? For an aLSTM "
                            "the adaptation vectors π (and for a HyperLSTM the scaling vectors d and biases β) are "
                            "recomputed at every step; the plot shows ‖s_t − s_{t−1}‖₂ per vector, per layer, "
                            "as in the weight-change figure of the HyperNetworks paper.")
                gr.Markdown(ADAPTATION_LEGEND, elem_id="adapt-legend")
                a_text = gr.Textbox(label="Text", lines=4, value=EXAMPLE, elem_id="adapt-text-in")
                a_model = gr.Dropdown(adaptive, value=default if default in adaptive else (adaptive or [None])[0],
                                      label="Model", allow_custom_value=True, elem_id="adapt-model")
                a_btn = gr.Button("Trace the adaptation", variant="primary", elem_id="adapt-btn")
                a_msg = gr.Markdown()
                a_html = gr.HTML(elem_id="adapt-html")
                a_plot = gr.Plot(label="adaptation change per token", format="png", elem_id="adapt-plot")
                with gr.Accordion("Raw trace (JSON)", open=False):
                    a_json = gr.JSON(label="trace")
                a_btn.click(h["adaptation"], [a_text, a_model], [a_msg, a_html, a_plot, a_json],
                            api_name="adaptation", **cpu)

            with gr.Tab("Models", id="models"):
                gr.Dataframe(registry.table(), headers=["name", "architecture", "data", "parameters", "valid",
                                                        "test", "metric", "source"],
                             interactive=False, label="Catalogue (valid/test: perplexity or bits per character)",
                             wrap=True, elem_id="models-table")
                m_model = gr.Dropdown(names, value=default, label="Model", allow_custom_value=True,
                                      elem_id="models-model")
                with gr.Row():  # curve and details side by side, the card below at full width (its tables)
                    m_curve = gr.Image(label="training curve", type="filepath", interactive=False,
                                       elem_id="models-curve", height=360)
                    m_details = gr.JSON(label="details", height=360)
                m_card = gr.Markdown(elem_id="models-card")
                m_model.change(h["model_info"], m_model, [m_card, m_details, m_curve], api_name="model_info",
                               concurrency_limit=CONCURRENCY)
                if default:
                    demo.load(h["model_info"], m_model, [m_card, m_details, m_curve], api_visibility="private")
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=1)
    demo.zoo_registry = registry  # type: ignore[attr-defined]
    demo.zoo_dynamic = stats  # type: ignore[attr-defined]
    close = demo.close

    def close_and_stop(*args: Any, **kwargs: Any) -> Any:  # the statistics' child process ends with the demo
        stats.stop()
        return close(*args, **kwargs)

    demo.close = close_and_stop  # type: ignore[method-assign]
    return demo


def launch(demo: gr.Blocks, host: str = "127.0.0.1", port: int = 7860, block: bool = True):
    """Start the server (loopback by default); returns ``(app, local_url, share_url)`` when not blocking.

    Only curve images may be served as files: each model's curve file and the folder of rendered curves,
    never a model folder (weights) or anything else.
    """
    registry: ModelRegistry = demo.zoo_registry  # type: ignore[attr-defined]
    demo.zoo_dynamic.start()  # type: ignore[attr-defined]
    allowed = [str(curves_dir())]
    allowed += [c for c in (registry.curve(n) for n in registry.names()) if c and not c.startswith(allowed[0])]
    from starlette.middleware import Middleware

    known = {fn.api_name for fn in demo.fns.values() if fn.api_name and getattr(fn, "api_visibility", "public")
             == "public"}
    return demo.launch(server_name=host, server_port=port, prevent_thread_lock=not block, quiet=True,
                       css=CSS, show_error=True, footer_links=["api", "gradio"], max_threads=8,
                       allowed_paths=allowed,
                       app_kwargs={"middleware": [Middleware(GuardRoutes, demo=demo, known=known)]})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env_port = os.environ.get("GRADIO_SERVER_PORT", "").strip()
    p = argparse.ArgumentParser(description="alstm-zoo Gradio demo (offline, on the bundled models)")
    if env_port and not env_port.isdigit():
        p.error(f"GRADIO_SERVER_PORT must be a port number, got {env_port!r}")
    p.add_argument("--port", type=int, default=int(env_port) if env_port else 7860,
                   help="port (default: $GRADIO_SERVER_PORT or 7860)")
    p.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                   help="address to bind (default 127.0.0.1)")
    p.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                   help="extra checkpoint directory, or a folder of them (repeatable; also $ZOO_DEMO_MODELS)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto (cuda when there is one)")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    return args


def model_dirs_from(args: argparse.Namespace) -> list[str]:
    env = [d for d in os.environ.get("ZOO_DEMO_MODELS", "").split(os.pathsep) if d.strip()]
    return env + list(args.model_dir)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # two events may run at once on a two-core machine: one core each
    print("app.py: loading the models ...", flush=True)
    try:
        device = str(resolve_device(args.device, "--device"))  # a device this machine lacks: one line, exit 2
        demo = build_demo(model_dirs_from(args), device)
    except ValueError as e:
        print(f"app.py: error: {e}", file=sys.stderr)
        return 2
    if not port_free(args.host, args.port):  # Gradio's own message would advise a variable we already read
        print(f"app.py: error: port {args.port} on {args.host} is in use; pick another with --port N or "
              "GRADIO_SERVER_PORT=N (make demo PORT=N)", file=sys.stderr)
        return 2
    # Gradio stays quiet (its share=True hint does not apply to a loopback demo): this line says where it is
    print(f"app.py: serving the demo on http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
    launch(demo, args.host, args.port, block=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
