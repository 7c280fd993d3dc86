"""The demo's rendering (its tabs are :mod:`zoo.tools.demo.ui`, its endpoints :mod:`zoo.tools.demo.handlers`):
training curves, the surprisal heat map of a scored text, the summary table of one or two models and the adaptation
figure. Pure functions of their inputs (plus the curve images written under :func:`curves_dir`), so they are tested
without a browser."""

from __future__ import annotations

import atexit
import hashlib
import html
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from zoo.adaptation import AdaptationTrace
from zoo.formatting import format_number
from zoo.scoring import UNSEEN_CHAR_BITS
from zoo.tools.plots import label_log_axis

_CURVES: list[Path] = []


def curves_dir() -> Path:
    """This process's own folder of rendered curves, made on first use (``mkdtemp``: private to the user) and
    removed at exit. The demo serves the whole folder, so it is never a fixed shared path such as
    ``/tmp/zoo-demo-curves``, which another local user could create first as a symlink to ``/``."""
    if not _CURVES:
        _CURVES.append(Path(tempfile.mkdtemp(prefix="zoo-demo-curves-")))
        atexit.register(shutil.rmtree, _CURVES[0], True)
    return _CURVES[0]


#: The heat maps' colour stops: YlOrRd for surprisal; blue-white-red for differences.
SEQ_STOPS = [(255, 255, 255), (255, 237, 160), (254, 178, 76), (240, 59, 32), (128, 0, 38)]
DIV_STOPS = [(33, 102, 172), (146, 197, 222), (255, 255, 255), (244, 165, 130), (178, 24, 43)]


def render_curve(log_file: Path, name: str) -> str | None:
    """Plot train/valid perplexity per epoch from a trainer's ``log.jsonl``; ``None`` if it has no epochs."""
    epochs = []
    for line in log_file.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "epoch" in rec and "valid_ppl" in rec:
            epochs.append(rec)
    if not epochs:
        return None
    fig = Figure(figsize=(6, 3.6), dpi=100, layout="constrained")
    ax = fig.subplots()
    x = [r["epoch"] for r in epochs]
    for key, label in (("train_ppl", "train"), ("valid_ppl", "valid")):
        if all(key in r for r in epochs):
            ax.plot(x, [r[key] for r in epochs], marker="o", ms=3, label=label)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    values = [r[k] for r in epochs for k in ("train_ppl", "valid_ppl") if isinstance(r.get(k), int | float)]
    label_log_axis(ax, min(values), max(values))
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    ax.set_title(f"{name}: training curve ({log_file.name})", fontsize=10)
    digest = hashlib.sha1(f"{log_file.resolve()}|{name}".encode()).hexdigest()[:16]
    out = curves_dir() / f"{digest}.png"
    fig.savefig(out)
    return str(out)


def _fmt(value: Any, digits: int = 2) -> str:
    """The demo's placeholder for a missing number is a dash."""
    return format_number(value, digits, missing="–")


def _fmt3(value: Any) -> str:
    """Bits (per character, per token) to 3 decimals, as the cards give bits per character."""
    return _fmt(value, 3)


# -- rendering ----------------------------------------------------------------------------------------------
def _interp(stops: list[tuple[int, int, int]], t: float) -> tuple[int, int, int]:
    t = min(1.0, max(0.0, t)) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    f = t - i
    a, b = stops[i], stops[i + 1]
    return tuple(round(a[k] + (b[k] - a[k]) * f) for k in range(3))  # type: ignore[return-value]


def _css_gradient(stops: list[tuple[int, int, int]]) -> str:
    return "linear-gradient(to right, " + ", ".join(f"rgb{s}" for s in stops) + ")"


#: The Score tab's fixed colour scales, in bits (is_char -> the top of the scale), so that a colour means the same
#: surprisal on every run and for every model of a kind; a value beyond the top takes its darkest colour (the
#: tooltip gives it exactly). For scale: a uniform guess over PTB's 10,000 words costs 13.3 bits, over PTB-char's 50
#: symbols 5.6.
SURPRISAL_SCALE_BITS = {False: 16.0, True: 8.0}
#: The same for the difference of two models (A - B), from -top to +top.
DIFFERENCE_SCALE_BITS = {False: 8.0, True: 4.0}


def heatmap_html(tokens: list[str], values: list[float], *, is_char: bool, vmax: float, caption: str,
                 unit: str = "bits", diverging: bool = False, elem_class: str = "") -> str:
    """The text, token by token, coloured by ``values``, with a legend; tooltips give the exact numbers."""
    stops = DIV_STOPS if diverging else SEQ_STOPS
    vmax = vmax if vmax > 0 else 1.0
    parts = []
    for tok, val in zip(tokens, values, strict=True):
        t = (val / vmax + 1) / 2 if diverging else val / vmax
        r, g, b = _interp(stops, t)
        fg = "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 120 else "#111"
        shown = "⏎" if tok == "<eos>" else (" " if is_char and tok == "_" else tok)
        tip = html.escape(f"{tok}: {val:+.2f} {unit}" if diverging else f"{tok}: {val:.2f} {unit}", quote=True)
        parts.append(f'<span class="tok" title="{tip}" data-value="{val:.4f}" '
                     f'style="background-color: rgb({r},{g},{b}); color: {fg};">{html.escape(shown)}</span>')
        if tok == "<eos>":
            parts.append("<br>")
        elif not is_char:
            parts.append(" ")
    lo = f"−{vmax:.1f}" if diverging else "0"
    legend = (f'<div class="zoo-legend"><span>{html.escape(caption)}</span><span>{lo}</span>'
              f'<span class="bar" style="background: {_css_gradient(stops)};"></span>'
              f'<span>{"+" if diverging else ""}{vmax:.1f} {unit}</span></div>')
    kind = "zoo-chars" if is_char else "zoo-words"  # characters: no spaces between spans, so wrap anywhere
    return f'<div class="zoo-heat {kind} {elem_class}">{legend}<div class="zoo-text">{"".join(parts)}</div></div>'


def _summary_md(results: list[dict[str, Any]], diff: list[float] | None, notice: str) -> str:
    head = "| | " + " | ".join(f"**{html.escape(r['model'])}**" for r in results) + " |"
    rows = [head, "|---" * (len(results) + 1) + "|"]
    # per-token numbers compare only over the same tokens (a word and a character model, or two vocabularies,
    # do not tokenise alike); bits per input character compare once what a model could not see is charged
    # (zoo.scoring.input_char_bits: an <unk> word is a cheap class to predict, a dropped character costs nothing)
    alike = len({tuple(r["tokens"]) for r in results}) == 1
    ppl_label = "perplexity" if alike else "perplexity (per token: the models tokenise differently, not comparable)"
    bpc_label = (f"bits per input character{' (comparable)' if len(results) > 1 else ''}: characters a model could "
                 f"not see (in `<unk>`, or dropped) charged {UNSEEN_CHAR_BITS:g} bits each")
    fields = [("architecture", "architecture", str), (bpc_label, "bits_per_input_char_charged", _fmt3),
              ("characters it could not see (charged)", "num_unseen_chars", str),
              (ppl_label, "perplexity", _fmt),
              ("bits per token (a character model: per symbol, its card's bpc)", "bits_per_token", _fmt3),
              ("tokens", "num_tokens", str), ("`<unk>` tokens", "num_unk", str),
              ("out-of-vocabulary words", "oov", str),
              ("dropped characters (not in the corpus: not scored)", "num_dropped", str)]
    for label, key, f in fields:
        rows.append(f"| {label} | " + " | ".join(f(r[key]) for r in results) + " |")
    out = "\n".join(rows)
    if diff is not None:
        mean = sum(diff) / len(diff)
        if abs(mean) < 5e-4:  # the same model twice, or two that agree to the shown precision
            verdict = "the two models predict this text equally well on average."
        else:
            better = results[1]["model"] if mean > 0 else results[0]["model"]
            verdict = f"{html.escape(better)} predicts this text better on average."
        out += f"\n\nMean per-token surprisal difference (A − B): **{mean:+.3f} bits**; {verdict}"
    for r in results:  # the library's warnings (e.g. a text that is mostly <unk> to this model)
        for w in r["warnings"]:
            out = f"⚠️ **{html.escape(r['model'])}**: {html.escape(w)}.\n\n" + out
    if notice:
        out = f"⚠️ {notice}\n\n" + out
    return out


def adaptation_figure(trace: AdaptationTrace, title: str) -> Figure:
    """One panel per layer, one line per adaptation vector, tokens along the x axis (HyperNetworks style)."""
    layers = list(trace.changes)
    n = len(trace.tokens)
    fig = Figure(figsize=(11, 1.2 + 2.0 * len(layers)), dpi=100, layout="constrained")
    axes = fig.subplots(len(layers), 1, sharex=True, squeeze=False)[:, 0]
    for ax, layer in zip(axes, layers, strict=True):
        sigs = trace.changes[layer]
        for k, (name, vals) in enumerate(sigs.items()):
            ax.plot(range(n), vals, lw=1.2, label=name, color=_tab20(k))
        ax.set_ylabel(f"layer {layer}\n‖Δ‖₂", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=min(6, len(sigs)), loc="upper right", frameon=False)
    if n <= 80:
        shown = ["⏎" if t == "<eos>" else ("␣" if t == "_" else t) for t in trace.tokens]
        axes[-1].set_xticks(range(n), shown, rotation=90, fontsize=8)
    else:
        axes[-1].set_xlabel("token index")
    fig.suptitle(f"{title}: step-to-step change of the adaptation vectors", fontsize=11)
    return fig


def _tab20(k: int) -> tuple[float, float, float]:
    import matplotlib

    return matplotlib.colormaps["tab20"](k % 20)[:3]
