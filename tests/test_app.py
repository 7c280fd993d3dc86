"""The Gradio demo, driven through its public API with gradio_client against a real server on loopback.

The app is launched once for the module over tiny checkpoints (an aLSTM, an LSTM and a HyperLSTM built
with the real checkpoint code, and an LSTM whose scores wait for the test: the queue test's) plus whatever models
are bundled, so it runs before any real model exists and exercises the real default once it is bundled. Every
number the app returns is checked against the library computing the same thing in-process. Dynamic evaluation's
statistics are collected only for the tests about them (a minute of CPU per bundled model otherwise, beside every
other test).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import psutil  # noqa: E402

import app  # noqa: E402
import zoo  # noqa: E402
from tests.conftest import REPO, TINY_ARCHS, WORDS, tiny_lm, tiny_tokenizer  # noqa: E402
from zoo import scoring  # noqa: E402
from zoo.adaptation import adaptation_trace, trace_text  # noqa: E402
from zoo.checkpoint import save_checkpoint  # noqa: E402
from zoo.models.lstm import LSTMStack  # noqa: E402
from zoo.registry import ArchitectureSpec, register_architecture, unregister_architecture  # noqa: E402
from zoo.tools.demo import handlers as demo_handlers  # noqa: E402
from zoo.tools.demo import ui as demo_ui  # noqa: E402
from zoo.tools.demo.registry import ModelRegistry, dynamic_stats_of  # noqa: E402
from zoo.tools.demo.render import DIFFERENCE_SCALE_BITS, SURPRISAL_SCALE_BITS  # noqa: E402
from zoo.tools.demo.stats import DynamicStats  # noqa: E402
from zoo.tools.ports import free_port  # noqa: E402
from zoo.zoo_model import ZooModel  # noqa: E402

gradio_client = pytest.importorskip("gradio_client")
from gradio_client.exceptions import AppError  # noqa: E402

# gradio's queue triggers pandas deprecation warnings that are not this project's
pytestmark = pytest.mark.filterwarnings("ignore:.*no_silent_downcasting", "ignore:The copy keyword is deprecated")

TEXT = "the cat sat on the mat\na dog ran to the zebra"
TINY = {"tiny-alstm": "alstm", "tiny-lstm": "lstm", "tiny-hyperlstm": "hyperlstm-ln"}


def build_tiny_models(root: Path) -> Path:
    """A folder of tiny checkpoints; the HyperLSTM's hyper weights are randomised so its d and beta move."""
    tok = tiny_tokenizer()
    for name, variant in TINY.items():
        lm = tiny_lm(variant).eval()
        if variant.startswith("hyper"):
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for cell in lm.rnn.layers:
                    cell.hyper_zw_weight.copy_(torch.randn(cell.hyper_zw_weight.shape, generator=gen))
                    cell.hyper_beta.copy_(torch.randn(cell.hyper_beta.shape, generator=gen) * 0.3)
        save_checkpoint(root / name, lm, tok, {"name": name, "dataset": "ptb"})
    (root / "tiny-alstm" / "README.md").write_text("---\nlicense: mit\n---\n# tiny-alstm\nAn untrained test model.\n")
    # a trainer-style log (as zoo.training writes it) from which the Models tab draws the training curve
    log = [{"epoch": e, "train_ppl": 900.0 / e, "valid_ppl": 950.0 / e, "lr": 1.0} for e in (1, 2, 3)]
    (root / "tiny-alstm" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return root


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    return build_tiny_models(tmp_path_factory.mktemp("demo-models"))


class Gate:
    """Holds every sequence pass of the gated model from :meth:`close` until :meth:`open`: what a test sends it
    runs until the test says so, however fast the machine (the queue test's two model slots stay taken)."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.waiting = threading.Semaphore(0)  # one release per pass held

    def close(self) -> None:
        self.opened.clear()

    def open(self) -> None:
        self.opened.set()

    def hold(self) -> None:
        if not self.opened.is_set():
            self.waiting.release()
            assert self.opened.wait(300), "the test never opened the gate"


GATE = Gate()


class GatedLSTMStack(LSTMStack):
    """The LSTM, its sequence pass held at :data:`GATE` (scoring waits; generation's single steps do not)."""

    def forward(self, x: torch.Tensor, state=None):
        GATE.hold()
        return super().forward(x, state)


@pytest.fixture(scope="module")
def gated_root(tmp_path_factory):
    """A folder with ``gated-lstm``, of the architecture ``gated_lstm`` (registered for this module's tests)."""
    register_architecture(ArchitectureSpec("gated_lstm", GatedLSTMStack, "LSTM held by the test", ("zaremba2014",)))
    root = tmp_path_factory.mktemp("gated")
    torch.manual_seed(0)
    lm = zoo.LanguageModel(len(WORDS), "gated_lstm", {"hidden_size": 16, "num_layers": 1}, emb_size=8)
    save_checkpoint(root / "gated-lstm", lm.eval(), tiny_tokenizer(), {"name": "gated-lstm", "dataset": "ptb"})
    yield root
    GATE.open()
    unregister_architecture("gated_lstm")


@pytest.fixture(scope="module")
def launched(model_root, gated_root):
    """``(demo, client, local_url)``: the app launched once for the module. Its statistics collector starts
    nothing (the tests about dynamic evaluation ask for a model's: :meth:`DynamicStats.problem`)."""
    registry = ModelRegistry([model_root, gated_root])
    stats = DynamicStats([], [("tiny-alstm", str(model_root / "tiny-alstm"))])
    demo = demo_ui.build_demo(registry, stats)
    _, url, _ = app.launch(demo, port=free_port(), block=False)
    client = gradio_client.Client(url, verbose=False)
    try:
        yield demo, client, url
    finally:
        client.close()
        demo.close()


@pytest.fixture(scope="module")
def served(launched, model_root):
    """(client, local_url, registry) of the app launched once for the module (the registry is the tests' own)."""
    _, client, url = launched
    return client, url, app.ModelRegistry([model_root])


def local(model_root: Path, name: str) -> ZooModel:
    return ZooModel.from_pretrained(model_root / name, name=name)


# -- the adaptation trace (library) ---------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(TINY_ARCHS))
def test_trace_aligns_with_scoring_and_is_empty_without_signals(variant):
    lm, tok = tiny_lm(variant).eval(), tiny_tokenizer()
    trace = trace_text(lm, tok, TEXT)
    expects_signals = bool(lm.rnn.adaptation_signals(lm.init_state(1)))
    assert trace.has_signals == expects_signals
    enc = tok.encode(TEXT)
    assert trace.tokens == enc.tokens and trace.total_tokens == len(enc.ids)
    if not expects_signals:
        assert trace.changes == {} and trace.to_dict()["layer_total"] == {}
        return
    # the step path gives the same log-probabilities as the scorer's sequence path
    ref = ZooModel(lm, tok, {}).score(TEXT, return_tokens=True)[0]["tokens"]
    assert trace.logprobs == pytest.approx([t["logprob"] for t in ref], abs=1e-5)
    for sigs in trace.changes.values():
        for vals in sigs.values():
            assert len(vals) == len(enc.ids) and all(v >= 0 and math.isfinite(v) for v in vals)


def test_trace_values_are_norms_of_signal_differences():
    lm, tok = tiny_lm("alstm").eval(), tiny_tokenizer()
    ids = tok.encode("the cat sat").ids
    trace = adaptation_trace(lm, ids, tok.eos_id)
    state = lm.init_state(1)
    seen = []
    with torch.no_grad():
        for t in [tok.eos_id] + ids:
            _, state = lm.step(torch.tensor([t]), state)
            seen.append(lm.rnn.adaptation_signals(state)["layer1.pi_hh"][0])
    expected = [float((seen[i + 1] - seen[i]).norm()) for i in range(len(ids))]
    assert trace.changes[1]["pi_hh"] == pytest.approx(expected, rel=1e-5)
    assert max(expected) > 0
    short = adaptation_trace(lm, ids, tok.eos_id, max_tokens=2)
    assert short.truncated and len(short.tokens) == 2 and short.total_tokens == len(ids)
    assert short.changes[1]["pi_hh"] == pytest.approx(expected[:2], rel=1e-5)


# -- the app through gradio_client ------------------------------------------------------------------------
def test_named_endpoints(served):
    client, _, _ = served
    named = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    for name in ("/score", "/generate", "/adaptation", "/model_info"):
        assert name in named, sorted(named)
    # the API page says where the OpenAI-compatible server is (its clients do not speak Gradio's API)
    for name in ("/score", "/generate"):
        assert "/v1/completions" in named[name]["description"] and "zoo serve start" in named[name]["description"]


def test_score_matches_library(served, model_root):
    client, _, _ = served
    report, summary, heat = client.predict(TEXT, "tiny-alstm", app.NONE_CHOICE, api_name="/score")
    ref = local(model_root, "tiny-alstm").score(TEXT, return_tokens=True)[0]
    (res,) = report["models"]
    assert res["perplexity"] == pytest.approx(ref["ppl"], rel=1e-9)
    assert res["bits_per_input_char"] == pytest.approx(ref["bits_per_input_char"], rel=1e-9)
    assert res["num_tokens"] == ref["num_tokens"] and res["num_unk"] == ref["num_unk"] == 2  # "to", "zebra"
    assert res["surprisal_bits"] == pytest.approx([-t["logprob"] / math.log(2) for t in ref["tokens"]])
    assert heat.count('class="tok"') == ref["num_tokens"]
    assert "perplexity" in summary and f"{ref['ppl']:.2f}" in summary
    # the colour scale is fixed and stated: the same on every run and every text
    _, _, other = client.predict("the", "tiny-alstm", app.NONE_CHOICE, api_name="/score")
    for h in (heat, other):
        assert f"{SURPRISAL_SCALE_BITS[False]:.1f} bits</span>" in h


def test_compare_two_models_per_token_difference(served, model_root):
    client, _, _ = served
    report, summary, heat = client.predict(TEXT, "tiny-alstm", "tiny-lstm", api_name="/score")
    a, b = report["models"]
    assert (a["model"], b["model"]) == ("tiny-alstm", "tiny-lstm")
    ref_b = local(model_root, "tiny-lstm").score(TEXT)[0]
    assert b["perplexity"] == pytest.approx(ref_b["ppl"], rel=1e-9)
    diff = report["difference_bits"]
    assert diff == pytest.approx([x - y for x, y in zip(a["surprisal_bits"], b["surprisal_bits"], strict=True)])
    assert "model-diff" in heat and heat.count('class="tok"') == 3 * a["num_tokens"]
    assert f"+{DIFFERENCE_SCALE_BITS[False]:.1f} bits</span>" in heat
    assert "tiny-lstm" in summary and "A − B" in summary


def test_generate_streams_token_by_token(served, model_root):
    client, _, _ = served
    model = local(model_root, "tiny-lstm")
    params = dict(max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0, allow_unk=False)  # the demo's defaults
    seed = 4
    expected = model.generate("the cat", seed=seed, **params)
    job = client.submit("the cat", "tiny-lstm", 12, 1.0, 0, 1.0, seed, False, True, api_name="/generate")
    job.result(timeout=60)
    outputs = job.outputs()
    assert outputs[-1] == expected
    assert len(outputs) >= 5
    for prev, nxt in zip(outputs, outputs[1:], strict=False):
        assert nxt.startswith(prev) and len(nxt) > len(prev)


def test_adaptation_endpoint(served, model_root):
    client, _, _ = served
    msg, heat, plot, data = client.predict(TEXT, "tiny-alstm", api_name="/adaptation")
    ref = trace_text(local(model_root, "tiny-alstm").lm, tiny_tokenizer(), TEXT)
    assert data["changes"]["layer0"]["pi_ih"] == pytest.approx(ref.changes[0]["pi_ih"], rel=1e-6)
    assert set(data["changes"]) == {"layer0", "layer1"} and plot is not None
    assert heat.count('class="tok"') == len(ref.tokens) and "L2 norm" in msg

    _, _, plot, data = client.predict(TEXT, "tiny-hyperlstm", api_name="/adaptation")
    d_ih = data["changes"]["layer0"]["d_ih"]
    assert plot is not None and len(d_ih) == len(ref.tokens) and max(d_ih) > 0
    assert {"beta_f", "d_oh"} <= set(data["changes"]["layer1"])

    msg, heat, plot, data = client.predict(TEXT, "tiny-lstm", api_name="/adaptation")
    assert "no input-dependent weights" in msg and plot is None and data["changes"] == {}


def test_adaptation_trace_is_capped_with_a_message(served):
    client, _, _ = served
    text = "the cat sat on the mat\n" * 100  # 700 tokens
    msg, heat, _, data = client.predict(text, "tiny-alstm", api_name="/adaptation")
    assert data["truncated"] and data["total_tokens"] == 700 and len(data["tokens"]) == demo_handlers.MAX_TRACE_TOKENS
    assert f"first {demo_handlers.MAX_TRACE_TOKENS} of 700 tokens" in data["notice"] and "700 tokens" in msg
    assert heat.count('class="tok"') == demo_handlers.MAX_TRACE_TOKENS


def test_model_info(served, model_root):
    client, _, registry = served
    card, details, curve = client.predict("tiny-alstm", api_name="/model_info")
    assert "An untrained test model" in card and "license: mit" not in card
    assert details["architecture"] == "alstm" and details["num_parameters"] > 0
    assert details["config"]["arch_args"]["adapt_size"] == 4
    assert Path(curve).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and details["training_curve"].endswith(".png")
    _, details, curve = client.predict("tiny-lstm", api_name="/model_info")
    assert curve is None and details["architecture"] == "lstm" and details["training_curve"] is None
    assert [r[0] for r in registry.table()][-3:] == [n + (" (default)" if n == registry.default else "")
                                                    for n in sorted(TINY)]


def test_default_model_scores(served):
    """The catalogue default once bundled (else the first tiny model): the app serves it end to end."""
    client, _, registry = served
    report, _, _ = client.predict("The Dow rose 3.5% on Monday.", registry.default, app.NONE_CHOICE,
                                  api_name="/score")
    (res,) = report["models"]
    entry = registry.entries[registry.default]
    ref_model = zoo.load(registry.default) if entry["source"] == "bundled" else zoo.load(entry["dir"])
    ref = ref_model.score("The Dow rose 3.5% on Monday.")[0]
    assert res["model"] == registry.default and res["num_tokens"] == ref["num_tokens"] > 1
    assert res["perplexity"] == pytest.approx(ref["ppl"], rel=1e-9) and math.isfinite(res["perplexity"])


@pytest.mark.parametrize(("endpoint", "args", "message"), [
    ("/score", ("", "tiny-alstm", app.NONE_CHOICE), "empty"),
    ("/score", ("   \n ", "tiny-alstm", app.NONE_CHOICE), "empty"),
    ("/score", ("abc\x00\x01\x02def", "tiny-alstm", app.NONE_CHOICE), "binary"),
    ("/score", ("\x01\x02\x03\x04" * 10 + "the cat", "tiny-alstm", app.NONE_CHOICE), "binary"),
    ("/score", (TEXT, "no-such-model", app.NONE_CHOICE), "Unknown model"),
    ("/score", (TEXT, "tiny-alstm", "also-missing"), "Unknown model"),
    ("/adaptation", ("", "tiny-alstm"), "empty"),
    ("/adaptation", (TEXT, "nope"), "Unknown model"),
    # sliders: Gradio checks their bounds itself ("Value 0 is less than minimum value 1.")
    ("/generate", ("the", "tiny-lstm", 0, 1.0, 0, 1.0, 0), "less than minimum value 1"),
    ("/generate", ("the", "tiny-lstm", 100000, 1.0, 0, 1.0, 0), "greater than maximum value 500"),
    ("/generate", ("the", "tiny-lstm", 5, -1.0, 0, 1.0, 0), "less than minimum value 0"),
    ("/generate", ("the", "tiny-lstm", 5, 1.0, -3, 1.0, 0), "less than minimum value 0"),
    ("/generate", ("the", "tiny-lstm", 5, 1.0, 0, 0.0, 0), "less than minimum value 0.05"),
    ("/generate", ("the", "tiny-lstm", 5, 1.0, 0, 1.0, -5), "seed must be an integer between 0"),
    ("/generate", ("\x00\x01binary", "tiny-lstm", 5, 1.0, 0, 1.0, 0), "binary"),
    ("/generate", ("the", "missing", 5, 1.0, 0, 1.0, 0), "Unknown model"),
    ("/model_info", ("missing",), "Unknown model"),
])
def test_bad_input_gives_readable_error(served, endpoint, args, message):
    client, _, _ = served
    with pytest.raises(AppError, match=message):
        client.predict(*args, api_name=endpoint)
    report, _, _ = client.predict("the cat", "tiny-alstm", app.NONE_CHOICE, api_name="/score")  # still alive
    assert report["models"][0]["num_tokens"] == 3


def test_long_input_is_capped_with_a_message(served):
    client, _, _ = served
    text = ("the cat sat on the mat " * 1200)[: demo_handlers.MAX_CHARS + 5000]
    report, summary, _ = client.predict(text, "tiny-lstm", app.NONE_CHOICE, api_name="/score")
    assert report["num_chars"] == demo_handlers.MAX_CHARS
    assert "20,000" in report["notice"] and "20,000" in summary


def test_catalogue_models_bundled_copies_only(monkeypatch, tmp_path, model_root):
    """Catalogue entries are shown (with their metrics) when a bundled copy exists, and load with zoo.load."""
    shutil.copytree(model_root / "tiny-alstm", tmp_path / "pretrained" / "cat-alstm")
    entry = {"architecture": "alstm", "dataset": "ptb", "num_parameters": 3895, "description": "test entry",
             "metrics": {"metric": "perplexity", "valid": 14.5, "test": 14.25}}
    cat = {"default": "cat-alstm", "models": {"cat-alstm": entry, "not-bundled": dict(entry)}}
    (tmp_path / "catalog.json").write_text(json.dumps(cat))
    monkeypatch.setenv("ZOO_CATALOG", str(tmp_path / "catalog.json"))
    monkeypatch.delenv("ZOO_PRETRAINED_DIR", raising=False)
    registry = app.ModelRegistry([model_root / "tiny-lstm"])
    assert registry.names() == ["cat-alstm", "tiny-lstm"] and registry.default == "cat-alstm"
    row = registry.table()[0]
    assert row[:7] == ["cat-alstm (default)", "alstm", "ptb", "3,895", "14.50", "14.25", "perplexity"]
    assert row[7] == "bundled"
    model = registry.get("cat-alstm")
    assert model.source == "bundled" and model.score("the cat")[0]["num_tokens"] == 3
    assert registry.get("cat-alstm") is model  # cached
    assert "An untrained test model" in registry.card("cat-alstm")


def _wait_for(jobs: list, want: dict, timeout: float = 60) -> None:
    """Poll the jobs' statuses (as their server reported them) until the counts in ``want`` are seen at once."""
    from gradio_client.utils import Status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [job.status().code for job in jobs]
        if all(codes.count(getattr(Status, k)) == n for k, n in want.items()):
            return
        if all(code == Status.FINISHED for code in codes):
            break
        time.sleep(0.005)
    raise AssertionError(f"never saw {want}: last {codes}")


def test_model_events_run_two_at_a_time_and_the_queue_refuses_the_seventeenth(served):
    """Through gradio_client against the real demo: of three long scores sent at once, two run and the third
    waits its turn (the two-slot pool of a 2-core machine); generations share that pool (they queue behind the
    scores); with 17 requests waiting, the 17th is refused at once with "Queue is full" and the other 16 are
    answered. The long scores are the gated model's: they run until every later request has its answer from the
    queue, and the test then lets them end (it raced a slow model before, retuned three times)."""
    from gradio_client.utils import QueueError, Status

    client, _, _ = served
    long_text = "the cat sat on the mat a dog ran to the zebra\n" * 200
    GATE.close()
    try:
        long = [client.submit(long_text, "gated-lstm", app.NONE_CHOICE, api_name="/score") for _ in range(3)]
        for _ in range(2):  # two scores are in the model, held
            assert GATE.waiting.acquire(timeout=60), "the long scores never reached the model"
        _wait_for(long, {"PROCESSING": 2, "IN_QUEUE": 1})
        # the queue now holds the third score: 15 more fit, the 16th sent is the 17th waiting
        short = [client.submit("the cat", "gated-lstm", app.NONE_CHOICE, api_name="/score") for _ in range(8)]
        short += [client.submit("the", "gated-lstm", 2, 1.0, 0, 1.0, 0, False, True, api_name="/generate")
                  for _ in range(8)]
        deadline = time.monotonic() + 60
        while any(j.status().code in (Status.STARTING, Status.JOINING_QUEUE) for j in short):
            assert time.monotonic() < deadline, [j.status().code for j in short]
            time.sleep(0.005)
        assert not any(job.done() for job in long)
    finally:
        GATE.open()
    outcomes = []
    for job in short:
        try:
            outcomes.append(job.result(timeout=120))
        except QueueError:
            outcomes.append("refused")
    assert all(job.result(timeout=120)[0]["models"][0]["num_tokens"] > 1000 for job in long)
    assert outcomes.count("refused") == 1, outcomes
    scores, texts = outcomes[:8], outcomes[8:]
    assert all(o[0]["models"][0]["num_tokens"] == 3 for o in scores if o != "refused"), scores
    assert all(len(o.split()) == 2 for o in texts if o != "refused"), texts  # two new tokens each


def test_validators_directly(model_root):
    """The handlers' own checks (behind the sliders' bounds) are the service schema's, with the demo's limits,
    and name the parameter."""
    registry = app.ModelRegistry([model_root])

    def gen(*args, **kwargs):
        return demo_handlers.generate(registry, *args, **kwargs)

    for kwargs, msg in [({"max_new_tokens": 501}, "max_new_tokens must be an integer between 0 and 500 here"),
                        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
                        ({"temperature": float("inf")}, "temperature must be a finite number"),
                        ({"temperature": 2.5}, "temperature must be at most 2"),
                        ({"temperature": 1e-40}, r"temperature must be 0 \(greedy\)"),
                        ({"top_k": 201}, "top_k must be an integer between 0 and 200"),
                        ({"top_p": 0.0}, r"top_p must be in \(0"),
                        ({"seed": "x"}, "seed must be an integer")]:
        with pytest.raises(gr.Error, match=msg):
            next(gen("the", "tiny-lstm", **kwargs))
    with pytest.raises(gr.Error, match="surrogate"):
        next(gen("the \ud800", "tiny-lstm"))
    assert list(gen("the", "tiny-lstm", max_new_tokens=3, temperature=0.0))[0] == ""
    cap = demo_handlers.MAX_CHARS
    assert demo_handlers.clean_text("x" * (cap + 30)) == (
        "x" * cap, f"text has {cap + 30:,} characters; only the first {cap:,} were used.")
    assert demo_handlers.LIMITS.max_new_tokens == demo_handlers.MAX_NEW_TOKENS and demo_handlers.LIMITS.truncate
    assert demo_handlers.LIMITS.max_total_tokens == demo_handlers.MAX_TOKENS


def test_token_cap_reaches_the_demo_as_a_readable_error(model_root, monkeypatch):
    """Over the token cap once tokenised (a character model's unknown characters are five symbols each; the
    tiny word model gets a small cap to show the path): a one-line gr.Error, not a heatmap of that size."""
    import dataclasses

    monkeypatch.setattr(demo_handlers, "LIMITS", dataclasses.replace(demo_handlers.LIMITS, max_total_tokens=50))
    registry = app.ModelRegistry([model_root])

    def score(*args):
        return demo_handlers.score(registry, None, *args)

    # (81 is counted without the tokenizer here: "or more" where a word could be several symbols)
    with pytest.raises(gr.Error, match="tiny-lstm: texts tokenise to 81 tokens (or more )?for this model; the limit "
                                       "is 50"):
        score("the cat " * 40, "tiny-lstm")
    assert score("the cat " * 10, "tiny-lstm")[0]["models"][0]["num_tokens"] == 21


def test_cli_port_env_and_model_dirs(monkeypatch, model_root, capsys):
    monkeypatch.setenv("GRADIO_SERVER_PORT", "7991")
    assert app.parse_args([]).port == 7991
    assert app.parse_args(["--port", "8123"]).port == 8123
    monkeypatch.setenv("ZOO_DEMO_MODELS", os.pathsep.join([str(model_root / "tiny-lstm"), ""]))
    args = app.parse_args(["--model-dir", str(model_root / "tiny-alstm")])
    dirs = app.model_dirs_from(args)
    assert dirs == [str(model_root / "tiny-lstm"), str(model_root / "tiny-alstm")]
    assert {"tiny-lstm", "tiny-alstm"} <= set(app.ModelRegistry(dirs).names())
    assert app.main(["--model-dir", str(model_root / "does-not-exist")]) == 2
    assert "not a directory" in capsys.readouterr().err
    monkeypatch.setenv("GRADIO_SERVER_PORT", "http")
    with pytest.raises(SystemExit) as exc:
        app.parse_args([])
    assert exc.value.code == 2 and "GRADIO_SERVER_PORT" in capsys.readouterr().err


def test_python_app_py_honours_gradio_server_port(model_root):
    """`python app.py` as `make demo` runs it: serves on 127.0.0.1 at $GRADIO_SERVER_PORT, offline."""
    port = free_port()
    env = dict(os.environ, GRADIO_SERVER_PORT=str(port), ZOO_DEMO_MODELS=str(model_root),
               GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(REPO / "app.py")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline, body = time.monotonic() + 90, ""
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/gradio_api/info", timeout=5) as r:
                    body = r.read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert '"/score"' in body and '"/generate"' in body, proc.poll()
        children = psutil.Process(proc.pid).children(recursive=True)  # the statistics' collector
    finally:
        proc.terminate()  # as a supervisor stops it
        try:
            out = proc.communicate(timeout=15)[0].decode()
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate(timeout=5)[0].decode()
    # what `make demo` shows: our own progress and address, not Gradio's share=True hint
    assert f"app.py: serving the demo on http://127.0.0.1:{port}" in out and "share=True" not in out, out
    # and its child process ends with it (it went on alone, a minute of CPU per model)
    alive = psutil.wait_procs(children, timeout=15)[1]
    for child in alive:  # (stopped here if not)
        child.kill()
    assert children and not alive, alive


def test_adaptation_tab_offers_adaptive_models_only(launched):
    demo = launched[0]
    registry = demo.registry
    (drop,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "adapt-model"]
    offered = {value for _, value in drop.choices}
    assert "tiny-alstm" in offered and "tiny-lstm" not in offered
    assert all(registry.has_adaptation(n) for n in offered)


def test_make_demo_says_what_each_step_does():
    """Each long step of `make demo` is announced just before it runs: the four install steps numbered in order,
    the C++ build with how long it takes, and the demo's start before app.py."""
    import re

    out = subprocess.run(["make", "-n", "-B", "demo"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    lines = out.splitlines()
    announced = [i for i, line in enumerate(lines) if line.startswith('echo "zoo: ')]
    assert re.findall(r'^echo "zoo: \[(\d)/4\]', out, re.M) == ["1", "2", "3", "4"], out
    assert all(i + 1 < len(lines) and not lines[i + 1].startswith("echo") for i in announced), out
    steps = {lines[i]: lines[i + 1] for i in announced}
    assert any("compiling the C++" in s and "minutes" in s and "build-ext" in cmd for s, cmd in steps.items()), out
    assert any("starting the demo" in s and "app.py" in cmd for s, cmd in steps.items()), out


def test_make_demo_honours_gradio_server_port():
    """`GRADIO_SERVER_PORT=N make demo` starts on N (the Makefile's PORT defaults to it); PORT still wins."""
    env = dict(os.environ, GRADIO_SERVER_PORT="7999")
    env.pop("PORT", None)
    out = subprocess.run(["make", "-n", "demo"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert "app.py --port 7999" in out.stdout, out.stdout + out.stderr
    out = subprocess.run(["make", "-n", "demo", "PORT=8123"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert "app.py --port 8123" in out.stdout


def test_a_model_with_non_finite_weights_is_a_readable_error(tmp_path):
    """Loading refuses NaN/inf weights by tensor name (zoo.checkpoint); the demo shows that line, and stays up."""
    lm = tiny_lm("lstm").eval()
    with torch.no_grad():
        lm.decoder.bias.fill_(float("nan"))
    save_checkpoint(tmp_path / "tiny-nan", lm, tiny_tokenizer(), {"name": "tiny-nan", "dataset": "ptb"})
    registry = app.ModelRegistry([tmp_path])

    def score(*args):
        return demo_handlers.score(registry, None, *args)

    with pytest.raises(gr.Error, match="Could not load model 'tiny-nan': .*tensor 'decoder.bias' has "
                                           "non-finite values"):
        score("the cat sat", "tiny-nan")


def test_rendered_curves_live_in_a_private_folder_of_this_process(model_root):
    """The demo serves the curves folder as files: a fixed shared path (/tmp/zoo-demo-curves) could have been
    planted by another user as a symlink to /, so it is this process's own mkdtemp folder (mode 0700)."""
    from zoo.tools.demo.render import curves_dir, render_curve

    folder = curves_dir()
    assert folder == curves_dir() and folder.name.startswith("zoo-demo-curves-") and not folder.is_symlink()
    assert folder.stat().st_mode & 0o077 == 0
    out = render_curve(model_root / "tiny-alstm" / "log.jsonl", "tiny-alstm")
    assert out is not None and Path(out).parent == folder


def test_only_curve_images_are_served_as_files(served, model_root):
    """The file route serves curve images, never weights, configs or anything else in a model folder."""
    _, url, registry = served
    base = url.rstrip("/")

    def get(path: Path) -> int:
        try:
            with urllib.request.urlopen(f"{base}/gradio_api/file={path}", timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    curve = registry.curve("tiny-alstm")
    assert curve and get(Path(curve)) == 200
    for name in ("tiny-alstm", "tiny-lstm"):
        for f in ("model.safetensors", "config.json", "vocab.json"):
            assert get(model_root / name / f) in (403, 404), f
    assert get(REPO / "zoo" / "catalog.json") in (403, 404)
    assert get(REPO / "model_cards" / "alstm-ptb-5m-light.eval.json") in (403, 404)


def test_busy_port_is_one_line_and_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "app.py", "--port", str(port)], cwd=REPO, capture_output=True,
                              text=True, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"port {port}" in proc.stderr and "--port N" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_unknown_api_endpoint_is_404_and_the_app_stays_up(served):
    client, url, _ = served
    for route in ("call", "run"):
        req = urllib.request.Request(f"{url.rstrip('/')}/gradio_api/{route}/no_such_endpoint", data=b'{"data": []}',
                                     method="POST", headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 404
        assert "/score" in json.loads(info.value.read())["detail"]
    report, _, _ = client.predict("the cat", "tiny-alstm", app.NONE_CHOICE, api_name="/score")
    assert report["models"][0]["num_tokens"] == 3


def test_dynamic_option_without_training_data_is_a_readable_error(served, launched):
    """The Score tab's dynamic-evaluation button goes through the service core; a model whose training split is not
    in the data dir (these tiny models' vocabulary is not PTB's) gets a one-line error naming the model, and the
    app stays up (the core's positive path: tests/test_service.py)."""
    client, _, _ = served
    stats = launched[0].stats
    stats.problem("tiny-alstm")  # the first ask starts its collection
    assert stats.wait("tiny-alstm", 240)  # refused at once (not PTB's vocabulary)
    with pytest.raises(Exception, match="tiny-alstm: dynamic evaluation with rule 'rms' needs the model's training"):
        client.predict(TEXT, "tiny-alstm", app.NONE_CHOICE, api_name="/score_dynamic")
    report, _, _ = client.predict(TEXT, "tiny-alstm", app.NONE_CHOICE, api_name="/score")
    assert report["models"][0]["num_tokens"] > 0


@pytest.mark.parametrize("value", ["x", "70000"])
def test_a_bad_port_in_the_environment_is_one_line(value):
    """gradio reads $GRADIO_SERVER_PORT while it is imported: the demo checks it first (it was a traceback from
    inside `import gradio` for 'x', and a message naming --port for 70000)."""
    proc = subprocess.run([sys.executable, "app.py"], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={**os.environ, "GRADIO_SERVER_PORT": value})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"GRADIO_SERVER_PORT must be a port number in 1..65535, got '{value}'" in proc.stderr


def _http(url: str, method: str = "GET", body: bytes | dict | None = None,
          content_type: str = "application/json") -> tuple[int, bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read(2000)
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_gradio_routes_a_client_can_misuse_answer_4xx_and_uploads_are_refused(served):
    """Each of these was Gradio's 500 (or a 200 stream that broke, or a stored upload): now a 4xx with a JSON
    detail, and the app still answers."""
    client, url, _ = served
    base = url.rstrip("/") + "/gradio_api"
    cases = [("POST", "/queue/join", {"fn_index": 999, "data": [], "session_hash": "abc"}, 404),
             ("POST", "/queue/join", {"fn_index": 0, "data": ["only one"], "session_hash": "abc"}, 422),
             ("POST", "/api/score", {"data": []}, 422),
             ("POST", "/api/no_such_fn", {"data": []}, 404),
             ("POST", "/call/score", {"data": ["the cat"]}, 422),
             ("POST", "/component_server", {"component_id": 99999, "fn_name": "x", "data": None,
                                            "session_hash": "a"}, 404),
             ("GET", "/call/score/no-such-event", None, 404),
             ("GET", "/queue/data?session_hash=no-such-session", None, 404),
             # deeply nested JSON (Python's parser raised RecursionError: a 500), on every route the guard reads
             ("POST", "/queue/join", b"[" * 100_000, 400),
             ("POST", "/api/score", b'{"data": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", 400),
             ("POST", "/component_server", b"{\"a\":" * 50_000, 400)]
    for method, path, body, status in cases:
        code, reply = _http(base + path, method, body)
        assert code == status, (path, body, code, reply[:200])
        assert json.loads(reply)["detail"], path
    upload = b'--x\r\nContent-Disposition: form-data; name="files"; filename="a.txt"\r\n\r\nhello\r\n--x--\r\n'
    code, reply = _http(base + "/upload", "POST", upload, "multipart/form-data; boundary=x")
    assert code == 403 and "upload" in json.loads(reply)["detail"]
    report, _, _ = client.predict("the cat", "tiny-alstm", app.NONE_CHOICE, api_name="/score")
    assert report["models"][0]["num_tokens"] == 3


def _gated_dynamic(gate: Gate, evaluate):
    """``evaluate`` (:func:`zoo.dynamic.dynamic_logprobs`) held at ``gate`` while it is closed, busy: it evaluates
    again and again (a copy of the model adapts each time, from the same weights: the same numbers) until the
    test opens the gate, then returns its last evaluation. The dynamic call so runs, taking its CPU, for as long as
    the test needs it to."""

    def held(*args, **kwargs):
        if gate.opened.is_set():
            return evaluate(*args, **kwargs)
        gate.waiting.release()  # under way
        out = evaluate(*args, **kwargs)
        while not gate.opened.is_set():
            out = evaluate(*args, **kwargs)
        return out

    return held


def capped_text(text: str) -> str:
    return demo_handlers.clean_text(text, demo_handlers.DYNAMIC_LIMITS)[0]


def test_a_plain_score_is_not_held_up_by_dynamic_evaluation(tmp_path, monkeypatch):
    """Dynamic evaluation runs in its own queue of one, with its statistics collected at start-up and its text
    capped: a plain score sent while a long dynamic one runs is answered within about 2x its time alone.

    Running for certain, whatever the machine's speed: the dynamic call's evaluation is gated by the test
    (:func:`_gated_dynamic`): it computes its text's dynamic evaluation again and again, the same numbers each
    time, until the test has timed the plain scores beside it and opens the gate (it raced a 0.3 s sleep and the
    model's speed before, with a "too short" guard)."""
    gate = Gate()
    monkeypatch.setattr(scoring, "dynamic_logprobs", _gated_dynamic(gate, scoring.dynamic_logprobs))
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "tiny-sgd", tiny_lm("alstm").eval(), tok,
                    {"name": "tiny-sgd", "dataset": "ptb", "dynamic_eval": {"rule": "sgd"}})
    # the statistics of this model only (the default model's would keep a core busy for a minute beside what is
    # timed here)
    stats = DynamicStats([("tiny-sgd", str(tmp_path / "tiny-sgd"))])
    demo = demo_ui.build_demo(ModelRegistry([tmp_path]), stats)
    _, url, _ = app.launch(demo, port=free_port(), block=False)
    try:
        # (the statistics' child process starts torch and reads the corpus: seconds alone, over a minute beside
        # another xdist worker; what is timed below starts only once they are in)
        assert stats.wait("tiny-sgd", 240) and stats.state["tiny-sgd"] is None
        client = gradio_client.Client(url, verbose=False)
        long_text = ("the cat sat on the mat a dog ran to the zebra " * 80)[:demo_handlers.MAX_DYNAMIC_CHARS + 1000]

        def plain() -> float:
            t0 = time.perf_counter()
            client.predict(TEXT, "tiny-sgd", app.NONE_CHOICE, api_name="/score")
            return time.perf_counter() - t0

        alone = sorted(plain() for _ in range(5))[2]
        gate.close()
        t0 = time.perf_counter()
        job = client.submit(long_text, "tiny-sgd", app.NONE_CHOICE, api_name="/score_dynamic")
        try:
            assert gate.waiting.acquire(timeout=60), "the dynamic call never started its evaluation"
            beside = sorted(plain() for _ in range(5))[2]
        finally:
            gate.open()
        report, summary, _ = job.result(timeout=120)
        dynamic_s = time.perf_counter() - t0
        # the result says that dynamic evaluation ran, and how far it moved the number from the plain score
        res = report["models"][0]
        plain_ppl = demo_handlers.score_one(zoo.load(str(tmp_path / "tiny-sgd")), capped_text(long_text))["perplexity"]
        assert res["dynamic"] and res["static_perplexity"] == pytest.approx(plain_ppl, rel=1e-9)
        assert res["perplexity"] != res["static_perplexity"]  # many 20-token segments: the weights moved
        assert res["dynamic_updates"] == (res["num_tokens"] - 1) // 20 > 0
        assert summary.startswith("**Scored by dynamic evaluation**") and "without it" in summary
        capped = demo_handlers.clean_text(long_text, demo_handlers.DYNAMIC_LIMITS)[0]
        assert len(capped) <= demo_handlers.MAX_DYNAMIC_CHARS < len(long_text)
        assert report["models"][0]["num_tokens"] == len(tok.encode(capped).ids)  # the capped text was scored
        print(f"plain score {alone * 1000:.0f} ms alone, {beside * 1000:.0f} ms beside a dynamic one "
              f"({dynamic_s:.1f} s)")
        assert dynamic_s > 3 * beside, "the dynamic call was too short to show anything"
        assert beside <= 2 * alone + 0.05, f"plain {alone * 1000:.0f} ms alone, {beside * 1000:.0f} ms beside"
        client.close()
    finally:
        demo.close()


def test_dynamic_statistics_of_other_models_are_collected_on_first_use_and_stop_with_the_demo(tmp_path):
    """Start-up collects only the --model-dir models and the default (a minute of CPU each); another model is
    queued the first time a visitor asks, told so at once, and settled soon after; closing the demo ends the
    collection's child process."""
    tok = tiny_tokenizer()
    save_checkpoint(tmp_path / "tiny-later", tiny_lm("alstm").eval(), tok, {"name": "tiny-later", "dataset": "ptb",
                                                                           "dynamic_eval": {"rule": "sgd"}})
    stats = DynamicStats([], [("tiny-later", str(tmp_path / "tiny-later"))]).start()
    try:
        assert stats.proc is None  # nothing at start-up
        assert "being collected" in stats.problem("tiny-later")
        assert stats.wait("tiny-later", 240) and stats.problem("tiny-later") is None
        registry = app.ModelRegistry([tmp_path])
        first = {n for n, _ in dynamic_stats_of(registry).queue}
        assert first == {"tiny-later", registry.default} - {None}
    finally:
        stats.stop()
    stats = dynamic_stats_of(registry := ModelRegistry([tmp_path]))
    demo = demo_ui.build_demo(registry, stats)
    stats.start()
    proc = stats.proc
    assert proc is not None and proc.poll() is None
    demo.close()
    assert proc.poll() is not None
