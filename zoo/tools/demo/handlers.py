"""The demo's endpoints as plain functions: score (plain or by dynamic evaluation), generate, trace the adaptation,
describe a model. Each takes the :class:`~zoo.tools.demo.registry.ModelRegistry` (and the dynamic-evaluation
statistics where it needs them) as its first arguments, so tests call them directly, without a Gradio server; the
UI (:mod:`zoo.tools.demo.ui`) binds those arguments once. A bad input is a ``gr.Error`` with the service core's
one-line message (the same schema and messages as the HTTP server and the CLI: :mod:`zoo.api.service`).
"""

from __future__ import annotations

import dataclasses
import html
import math
import random
from collections.abc import Iterator
from typing import Any

import gradio as gr
from matplotlib.figure import Figure

from zoo.adaptation import trace_text
from zoo.api.service import GenerateRequest, Limits, ScoreRequest, Service, parse_request
from zoo.checkpoint import CheckpointError, read_config
from zoo.errors import InvalidRequest, ZooError
from zoo.tools.demo.registry import ModelRegistry, dynamic_stats_of, user_error
from zoo.tools.demo.render import (
    DIFFERENCE_SCALE_BITS,
    SURPRISAL_SCALE_BITS,
    _fmt,
    _summary_md,
    adaptation_figure,
    heatmap_html,
)
from zoo.tools.demo.stats import DynamicStats
from zoo.zoo_model import ZooModel

#: Input caps for a small shared CPU machine.
MAX_CHARS = 20_000
#: tokens per scored text once tokenised: a character model spells a character outside its alphabet as five
#: symbols, and every token is a span of the heatmap
MAX_TOKENS = 25_000
MAX_PROMPT_CHARS = 2_000
#: Dynamic evaluation takes gradient steps (~8x the time of a plain score): its texts are capped shorter, it runs
#: one at a time in its own queue (:data:`zoo.tools.demo.ui.DYNAMIC_CONCURRENCY`), and its statistics are
#: collected at start-up.
MAX_DYNAMIC_CHARS = 2_000
MAX_NEW_TOKENS = 500
MAX_TRACE_TOKENS = 500
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 200
#: The Adaptation tab's colour scale runs from 0 to the text's own largest change: the vectors' sizes differ by model
#: and layer, so no fixed scale fits them all, and the legend says so.
ADAPTATION_SCALE_NOTE = ("change of all adaptation vectors at each token, ‖Δs‖₂; colour scale per text: 0 to this "
                         "text's largest change (colours do not compare across texts)")
#: The "Compare with" choice that compares with nothing.
NONE_CHOICE = "(none)"
LN2 = math.log(2.0)

#: What the demo accepts: the same schema and messages as the HTTP server and the CLI, narrowed to the sliders'
#: ranges; an over-long text is cut with a warning rather than refused (a pasted article is still worth scoring).
LIMITS = Limits(max_texts=1, max_chars=MAX_CHARS, max_total_chars=MAX_CHARS, max_total_tokens=MAX_TOKENS,
                max_prompt_chars=MAX_PROMPT_CHARS,
                max_new_tokens=MAX_NEW_TOKENS, max_temperature=MAX_TEMPERATURE, max_top_k=MAX_TOP_K, truncate=True,
                allow_dynamic=True)
DYNAMIC_LIMITS = dataclasses.replace(LIMITS, max_chars=MAX_DYNAMIC_CHARS, max_total_chars=MAX_DYNAMIC_CHARS)


# -- input validation: the service core's schema (zoo.api.service), with the demo's limits ------------------------
def parse(payload: dict[str, Any], limits: Limits = LIMITS) -> ScoreRequest | GenerateRequest:
    """A request through the service schema; a bad field becomes a ``gr.Error`` with its one-line message."""
    try:
        return parse_request(payload, limits)
    except InvalidRequest as e:
        raise user_error(e.message + ".") from None


def clean_text(text: Any, limits: Limits = LIMITS) -> tuple[str, str]:
    """The text to score (the demo's box may send None when empty) and the notice to show ('' if none)."""
    req = parse({"text": "" if text is None else text}, limits)
    return req.texts[0], " ".join(f"{w}." for w in req.warnings)


# -- scoring ---------------------------------------------------------------------------------------------------
def score_one(model: ZooModel, text: str, dynamic: bool = False) -> dict[str, Any]:
    """One model's report on ``text`` through the service core (with :data:`LIMITS`: the token cap)."""
    reply = Service(model, LIMITS).score([ScoreRequest((text,), return_tokens=True, dynamic=dynamic)])[0]
    if isinstance(reply, ZooError):  # e.g. dynamic evaluation without the model's training data
        raise user_error(f"{model.name}: {reply}")
    if isinstance(reply, Exception):  # a bug, not the input: the service core logged it
        raise gr.Error(f"Scoring failed with {model.name}; the server log has the details.", print_exception=False)
    res = reply["texts"][0]
    toks = res["tokens"]
    return {
        "model": model.name, "architecture": model.lm.architecture, "num_parameters": model.num_parameters,
        "perplexity": res["ppl"], "bits_per_input_char": res["bits_per_input_char"],
        "bits_per_input_char_charged": res["bits_per_input_char_charged"], "num_unseen_chars": res["num_unseen_chars"],
        "bits_per_token": res["bits_per_token"],
        "num_tokens": res["num_tokens"], "num_unk": res["num_unk"], "oov": res["oov"],
        "num_dropped": res["num_dropped"], "dropped_items": res.get("dropped_items", []),
        "tokens": [t["token"] for t in toks], "surprisal_bits": [-t["logprob"] / LN2 for t in toks],
        "is_char": model.tokenizer.is_char, "warnings": res.get("warnings", []),
    } | (_dynamic_effect(model, text, res) if dynamic else {})


def _dynamic_effect(model: ZooModel, text: str, res: dict[str, Any]) -> dict[str, Any]:
    """What dynamic evaluation did to this text: its perplexity beside the plain one (a cheap second score), and
    how many of the model's weight updates (one per ``segment`` tokens) happened before the text's last token."""
    plain = score_one(model, text)["perplexity"]
    segment = model.dynamic_defaults.segment
    return {"dynamic": True, "static_perplexity": plain, "dynamic_segment": segment,
            "dynamic_updates": max(0, (res["num_tokens"] - 1) // segment)}


def signed_percent(change: float) -> str:
    """``change`` as a signed percentage to one decimal; a change that rounds to zero is "0.0%", never "-0.0%"."""
    shown = round(change * 100, 1)
    return "0.0%" if shown == 0 else f"{shown:+.1f}%"


def _dynamic_note(results: list[dict[str, Any]]) -> str:
    """The summary's first line for a dynamic score: that it ran, and how far it moved each model's number."""
    parts = []
    for r in results:
        change = r["perplexity"] / r["static_perplexity"] - 1 if r["static_perplexity"] else 0.0
        parts.append(f"{html.escape(r['model'])}: perplexity {_fmt(r['perplexity'])} against "
                     f"{_fmt(r['static_perplexity'])} without it ({signed_percent(change)}; "
                     f"{r['dynamic_updates']} weight update(s), one per {r['dynamic_segment']} tokens)")
    return ("**Scored by dynamic evaluation** (the weights adapt to the text as it is read): " + "; ".join(parts)
            + ".\n\n")


def score(registry: ModelRegistry, stats: DynamicStats | None, text: str, model: str,
          compare: str | None = None) -> tuple[dict[str, Any], str, str]:
    """Score ``text`` with ``model`` (and ``compare``): report, summary table, highlighted text."""
    return _score(registry, stats, text, model, compare, dynamic=False)


def score_dynamic(registry: ModelRegistry, stats: DynamicStats | None, text: str, model: str,
                  compare: str | None = None) -> tuple[dict[str, Any], str, str]:
    """:func:`score` by dynamic evaluation (the weights adapt to the text as it is read; :mod:`zoo.dynamic`):
    its own queue, one at a time, texts up to :data:`MAX_DYNAMIC_CHARS`."""
    # (the docstring is the API page's description; ``stats`` says whether a model's statistics are ready, and
    # ``None`` makes a collector of the registry's models, not started, so a model not yet collected is refused)
    return _score(registry, stats, text, model, compare, dynamic=True)


def _score(registry: ModelRegistry, stats: DynamicStats | None, text: str, model: str, compare: str | None,
           dynamic: bool) -> tuple[dict[str, Any], str, str]:
    text, notice = clean_text(text, DYNAMIC_LIMITS if dynamic else LIMITS)
    if notice:
        gr.Warning(notice)
    names = [registry.check(model)]
    if compare not in (None, "", NONE_CHOICE):
        names.append(registry.check(compare))
    if dynamic:
        stats = stats if stats is not None else dynamic_stats_of(registry)
        for n in names:
            why = stats.problem(n)
            if why is not None:
                raise user_error(f"{n}: {why}")
    results = [score_one(registry.get(n), text, dynamic) for n in names]
    for r in results:  # (loading refuses NaN/inf weights; finite ones can still overflow): say so
        if not all(math.isfinite(x) for x in r["surprisal_bits"]):
            raise user_error(f"{r['model']} gives non-finite scores on this text (its logits overflow).")
    html_text, diff, diff_note = _score_html(results)
    report = {"notice": notice, "models": results, "difference_bits": diff, "difference_note": diff_note,
              "num_chars": len(text)}
    summary = (_dynamic_note(results) if dynamic else "") + _summary_md(results, diff, notice)
    return report, summary, html_text


def _score_html(results: list[dict[str, Any]]) -> tuple[str, list[float] | None, str]:
    """The heatmap of one model, or of two side by side with their difference below: (html, A - B per token or
    ``None``, why there is no difference or '')."""
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
    return "\n".join(blocks), diff, diff_note


# -- generation, the adaptation trace, the model page ------------------------------------------------------
def generate(registry: ModelRegistry, prompt: str, model: str, max_new_tokens: float = 50,
             temperature: float = 1.0, top_k: float = 0, top_p: float = 1.0, seed: float | None = 0,
             stop_at_eos: bool = False, no_unk: bool = True) -> Iterator[str]:
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


def generate_note(registry: ModelRegistry, prompt: str, model: str, seed: float | None = 0) -> tuple[str, int]:
    """What the Generate tab says before it streams: the seed it will use (drawn here for seed -1, so that the
    page can show it and the same continuation can be had again) and the prompt's words the model cannot read
    (``<unk>``) or drops (its corpus never has them). Returns ``(note, seed)``."""
    m = registry.get(registry.check(model))
    if seed is None or seed == -1:
        seed = random.randrange(2**31)
        lines = [f"Seed **{seed}** (drawn for seed -1: enter it to get this continuation again)."]
    else:
        lines = []
    enc = m.tokenizer.encode("" if prompt is None else str(prompt), add_eos=False)
    kind = "characters" if m.tokenizer.is_char else "words"
    if enc.oov_items:
        unk = ", ".join(f"`{w}`" for w in dict.fromkeys(enc.oov_items))
        lines.append(f"Prompt {kind} unknown to {m.name}, read as `<unk>`: {unk}.")
    if enc.dropped:
        gone = ", ".join(f"`{d}`" for d in dict.fromkeys(enc.dropped))
        lines.append(f"Dropped from the prompt (its corpus has no such characters): {gone}.")
    return " ".join(lines), int(seed)


def adaptation(registry: ModelRegistry, text: str, model: str) -> tuple[str, str, Figure | None, dict[str, Any]]:
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
                             caption=ADAPTATION_SCALE_NOTE, unit="", elem_class="adapt-text")
    msg = (f"**{m.name}** ({m.lm.architecture}): the plot shows, for each token, the L2 norm of the change "
           f"of each adaptation vector from the previous token (one panel per layer). Large values mean the "
           f"adaptation policy re-weights the layer strongly at that token.")
    if notice:
        msg = f"⚠️ {notice}\n\n{msg}"
    return msg, text_html, adaptation_figure(trace, m.name), data


def model_info(registry: ModelRegistry, model: str) -> tuple[str, dict[str, Any], str | None]:
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
