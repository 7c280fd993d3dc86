"""The demo's page: one function per tab (Score, Generate, Adaptation, Models), each laying out its components
and wiring them to the endpoint functions of :mod:`zoo.tools.demo.handlers` with the registry bound; :func:`build_demo`
assembles the tabs and the queue. ``app.py`` (the entry point) launches the result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gradio as gr

from zoo.tools.demo import handlers
from zoo.tools.demo.handlers import (
    MAX_CHARS,
    MAX_DYNAMIC_CHARS,
    MAX_NEW_TOKENS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    NONE_CHOICE,
)
from zoo.tools.demo.registry import ModelRegistry, dynamic_stats_of
from zoo.tools.demo.stats import DynamicStats

#: Queue settings for a two-core machine: two model events at a time (dynamic evaluation has its own slot), 16
#: waiting at most.
CONCURRENCY = 2
DYNAMIC_CONCURRENCY = 1
QUEUE_SIZE = 16
#: Said on the API page: this demo's endpoints are for gradio_client; OpenAI's clients talk to the server.
OPENAI_SERVER = ("An OpenAI-compatible API (the `openai` client, lm-evaluation-harness `local-completions`) is served "
                 "by `zoo serve start`: POST http://127.0.0.1:8080/v1/completions (see serving/README.md).")
EXAMPLE = "the company said it expects to report a loss for the third quarter\nmr. smith declined to comment"
#: What the Adaptation tab's legend names mean (the names come from the models' ``adaptation_signals``).
ADAPTATION_LEGEND = """**Legend.** aLSTM (Flennerhag et al. 2018), the adaptation vectors of each layer:
`pi_x` scales the layer's input before the input projection and `pi_h` the previous hidden state before the
recurrent projection (input-side adaptation, IO policy only); `pi_ih` and `pi_hh` scale the outputs of the input
and recurrent projections, per gate and unit; `pi_b` is the adaptive bias (when the model has one).
HyperLSTM (Ha et al. 2017): `d_ix` ... `d_oh` scale the input (`x`) and recurrent (`h`) projections of gates
i, j (the cell candidate), f and o; `beta_i` ... `beta_o` are the dynamic biases of those gates."""

#: The page's style: the heat maps (their colours are inline: :mod:`zoo.tools.demo.render`), the pair of them side by
#: side, the legends, the Models tab's card tables.
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
#: The shared two-slot pool of the model events.
CPU_POOL = {"concurrency_limit": CONCURRENCY, "concurrency_id": "cpu"}


class ZooDemo(gr.Blocks):
    """The demo's Blocks, made with what its server needs beyond the page: the ``registry`` (its models' curve
    images are the only files served) and the collector of dynamic evaluation's ``stats`` (started with the
    server, stopped when the demo closes)."""

    def __init__(self, registry: ModelRegistry, stats: DynamicStats, **kwargs: Any):
        super().__init__(**kwargs)
        self.registry = registry
        self.stats = stats

    def close(self, *args: Any, **kwargs: Any) -> None:
        """Close the server, and end the statistics' child process with it."""
        self.stats.stop()
        return super().close(*args, **kwargs)


def bind(fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``fn`` with its first arguments bound, keeping its name and docstring (Gradio's API page shows the
    docstring, and its signature is that of the remaining arguments: the endpoint's inputs)."""
    bound = functools.partial(fn, *args)
    bound.__name__, bound.__doc__ = fn.__name__, fn.__doc__  # type: ignore[attr-defined]
    return bound


def score_tab(registry: ModelRegistry, stats: DynamicStats) -> None:
    """Score a text with one model or two side by side; plainly or by dynamic evaluation."""
    names = registry.names()
    text = gr.Textbox(label="Text", lines=5, value=EXAMPLE, elem_id="score-text")
    with gr.Row():
        model = gr.Dropdown(names, value=registry.default, label="Model", allow_custom_value=True,
                            elem_id="score-model")
        compare = gr.Dropdown([NONE_CHOICE] + names, value=NONE_CHOICE, label="Compare with",
                              allow_custom_value=True, elem_id="score-compare")
    with gr.Row():
        plain_btn = gr.Button("Score", variant="primary", elem_id="score-btn")
        dynamic_btn = gr.Button(f"Score by dynamic evaluation (texts up to {MAX_DYNAMIC_CHARS:,} characters, "
                                "one at a time)", elem_id="score-dynamic-btn")
    gr.Markdown("Dynamic evaluation: the weights adapt to the text as it is read (each segment scored "
                "before the step that learns from it; ~8x slower). It has its own queue, so it never "
                "holds a plain score up.", elem_id="score-dynamic-note")
    summary = gr.Markdown(elem_id="score-summary")
    heat = gr.HTML(elem_id="score-heatmap")
    with gr.Accordion("Raw report (JSON)", open=False):
        report = gr.JSON(label="report")
    outputs = [report, summary, heat]
    # the last result is cleared first, so that an error is never shown above a result it did not give
    # (in the browser: no server round trip, no event a route guard has to know)
    clear = {"fn": None, "inputs": None, "outputs": outputs, "js": "() => [null, '', '']",
             "api_visibility": "private"}
    plain_btn.click(**clear).then(bind(handlers.score, registry, stats), [text, model, compare], outputs,
                                  api_name="score", api_description="Score a text: per-token "
                                  "log-probabilities, perplexity, bit rates. " + OPENAI_SERVER, **CPU_POOL)
    dynamic_btn.click(**clear).then(bind(handlers.score_dynamic, registry, stats), [text, model, compare],
                                    outputs, api_name="score_dynamic", concurrency_limit=DYNAMIC_CONCURRENCY,
                                    concurrency_id="dynamic", show_progress="full")


def generate_tab(registry: ModelRegistry) -> None:
    """Stream a continuation of a prompt, with the sampling settings as sliders."""
    prompt = gr.Textbox(label="Prompt", lines=2, value="the stock market", elem_id="gen-prompt")
    model = gr.Dropdown(registry.names(), value=registry.default, label="Model", allow_custom_value=True,
                        elem_id="gen-model")
    with gr.Row():
        n = gr.Slider(1, MAX_NEW_TOKENS, value=50, step=1, label="max_new_tokens")
        temperature = gr.Slider(0.0, MAX_TEMPERATURE, value=1.0, step=0.05, label="temperature (0 = greedy)")
    with gr.Row():
        top_k = gr.Slider(0, MAX_TOP_K, value=0, step=1, label="top-k (0 = off)")
        top_p = gr.Slider(0.05, 1.0, value=0.95, step=0.01, label="top-p")
        seed = gr.Number(value=0, precision=0, label="seed (-1 = random)")
    with gr.Row():
        eos = gr.Checkbox(value=False, label="stop at the end of the sentence (else each end of "
                                             "sentence is a line break and generation goes on)")
        no_unk = gr.Checkbox(value=True, label="never generate <unk> (the unknown-word token)")
    with gr.Row():
        go = gr.Button("Generate", variant="primary", elem_id="gen-btn")
        stop = gr.Button("Stop")
    note = gr.Markdown(elem_id="gen-note")
    out = gr.Textbox(label="Continuation", lines=6, elem_id="gen-out")
    # the seed used (drawn first for -1, so the note can show it) travels in a hidden box: the public endpoint
    # keeps its parameters, and a client's seed -1 still means an unseeded draw
    used = gr.Number(value=0, precision=0, label="seed", visible=False)
    first = go.click(bind(handlers.generate_note, registry), [prompt, model, seed], [note, used],
                     api_visibility="private")
    event = first.success(bind(handlers.generate, registry), [prompt, model, n, temperature, top_k, top_p, used,
                                                              eos, no_unk], out,
                          api_name="generate", api_description="Generate a continuation. " + OPENAI_SERVER,
                          time_limit=300, **CPU_POOL)
    stop.click(None, None, None, cancels=[first, event])


def adaptation_tab(registry: ModelRegistry) -> None:
    """Trace the adaptation policy over a text; only the models that adapt are offered (all when none does)."""
    names = registry.names()
    adaptive = [n for n in names if registry.has_adaptation(n)] or names
    default = registry.default
    gr.Markdown("How much does the adaptation policy change the weights at each token? For an aLSTM "
                "the adaptation vectors π (and for a HyperLSTM the scaling vectors d and biases β) are "
                "recomputed at every step; the plot shows ‖s_t − s_{t−1}‖₂ per vector, per layer, "
                "as in the weight-change figure of the HyperNetworks paper.")
    gr.Markdown(ADAPTATION_LEGEND, elem_id="adapt-legend")
    text = gr.Textbox(label="Text", lines=4, value=EXAMPLE, elem_id="adapt-text-in")
    model = gr.Dropdown(adaptive, value=default if default in adaptive else (adaptive or [None])[0],
                        label="Model", allow_custom_value=True, elem_id="adapt-model")
    go = gr.Button("Trace the adaptation", variant="primary", elem_id="adapt-btn")
    msg = gr.Markdown()
    text_html = gr.HTML(elem_id="adapt-html")
    plot = gr.Plot(label="adaptation change per token", format="png", elem_id="adapt-plot")
    with gr.Accordion("Raw trace (JSON)", open=False):
        data = gr.JSON(label="trace")
    go.click(bind(handlers.adaptation, registry), [text, model], [msg, text_html, plot, data],
             api_name="adaptation", **CPU_POOL)


def models_tab(registry: ModelRegistry, demo: gr.Blocks) -> None:
    """The catalogue as a table; one model's card, details and training curve (the default's on page load)."""
    gr.Dataframe(registry.table(), headers=["name", "architecture", "data", "parameters", "valid", "test",
                                            "metric", "source"],
                 interactive=False, label="Catalogue (valid/test: perplexity or bits per character)",
                 wrap=True, elem_id="models-table")
    model = gr.Dropdown(registry.names(), value=registry.default, label="Model", allow_custom_value=True,
                        elem_id="models-model")
    with gr.Row():  # curve and details side by side, the card below at full width (its tables)
        curve = gr.Image(label="training curve", type="filepath", interactive=False,
                         elem_id="models-curve", height=360)
        details = gr.JSON(label="details", height=360)
    card = gr.Markdown(elem_id="models-card")
    info = bind(handlers.model_info, registry)
    model.change(info, model, [card, details, curve], api_name="model_info", concurrency_limit=CONCURRENCY)
    if registry.default:
        demo.load(info, model, [card, details, curve], api_visibility="private")


def build_demo(registry: ModelRegistry, stats: DynamicStats | None = None) -> ZooDemo:
    """The page over ``registry``'s models; ``stats`` collects dynamic evaluation's statistics (by default a
    collector of the registry's models: :func:`~zoo.tools.demo.registry.dynamic_stats_of`), started by the launch."""
    stats = stats if stats is not None else dynamic_stats_of(registry)
    with ZooDemo(registry, stats, title="alstm-zoo demo") as demo:
        gr.Markdown("# alstm-zoo: adaptive-parameterization language models\n"
                    "Score text token by token, generate, compare models and watch the adaptation at work. "
                    f"Inputs are capped at {MAX_CHARS:,} characters.")
        if not registry.names():
            gr.Markdown("⚠️ **No models found.** Bundle one (`zoo/pretrained/`) or start with `--model-dir DIR`.")
        with gr.Tabs():
            with gr.Tab("Score", id="score"):
                score_tab(registry, stats)
            with gr.Tab("Generate", id="generate"):
                generate_tab(registry)
            with gr.Tab("Adaptation", id="adaptation"):
                adaptation_tab(registry)
            with gr.Tab("Models", id="models"):
                models_tab(registry, demo)
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=1)
    return demo
