"""Dynamic evaluation (``zoo.dynamic``): each segment scored before the step that uses it (the scores of a prefix do
not depend on what follows it), the trained weights and the gradient statistics restored / untouched afterwards (the
same text scores the same twice), lr = 0 equals static scoring, the RMS rule's step is the documented formula, the
statistics come from the training split, adaptation helps on a text that repeats, the API / CLI switches with their
errors, and the benchmark's ``--quick`` run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, WORDS, tiny_lm
from zoo.data import resolve_data_dir
from zoo.dynamic import DEFAULTS, DynamicParams, GradStats, dynamic_logprobs, gradient_stats

pytestmark = pytest.mark.usefixtures("one_thread")

#: Small statistics settings for the tiny models (the defaults collect over 100k tokens).
SMALL = {"stats_tokens": 400, "stats_batch": 4, "stats_bptt": 9}


def _seq(n: int = 60, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, len(WORDS), (n,), generator=torch.Generator().manual_seed(seed))


def _stats(lm: torch.nn.Module, **kw) -> GradStats:
    return gradient_stats(lm, _seq(600, seed=9), DynamicParams(**{**SMALL, **kw}))


@pytest.fixture
def tiny_data(tmp_path, monkeypatch):
    """A PTB-style corpus over the tiny vocabulary (first-seen order = ``WORDS``), as ``$ZOO_DATA_DIR``."""
    root = tmp_path / "data" / "ptb"
    root.mkdir(parents=True)
    words = " ".join(WORDS[1:])
    gen = torch.Generator().manual_seed(1)
    lines = ["", words] + [" ".join(WORDS[i] for i in torch.randint(2, len(WORDS), (12,), generator=gen).tolist())
                           for _ in range(200)]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    for split in ("valid", "test"):
        (root / f"{split}.txt").write_text("the cat sat\n")
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


#: The RNN kernels with an inference mode (their ``train`` argument; cuDNN refuses the backward of one run without
#: it) and where that argument is, by the overload (``data, batch_sizes, hx, ...`` for packed input).
_RNN_KERNELS = {torch.lstm: 6, torch.gru: 6, torch.rnn_tanh: 6, torch.rnn_relu: 6}


class _RnnModes(torch.overrides.TorchFunctionMode):
    """Records, for each RNN kernel call, whether autograd was recording and the kernel's ``train`` flag."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _RNN_KERNELS:
            packed = isinstance(args[2], torch.Tensor)  # (input, batch_sizes, hx, ...): one argument later
            self.calls.append((torch.is_grad_enabled(), bool(args[_RNN_KERNELS[func] + packed])))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", ["lstm", "alstm", "hyperlstm", "pnorm_gru"])
def test_the_gradient_pass_never_runs_an_rnn_in_inference_mode(variant):
    """Dynamic evaluation and its statistics take gradients of a model in ``eval()``: an RNN kernel run in inference
    mode there (cuDNN's, on CUDA) has no backward. Every kernel call made while autograd records has its ``train``
    flag on (the LSTM baselines' fused kernel: dropout 0, the module's dropout off); scoring, without autograd,
    keeps inference mode; the numbers are those of the kernel in inference mode."""
    lm = tiny_lm(variant, init_range=1.0).eval()
    seq = _seq()
    with _RnnModes() as seen:
        stats = _stats(lm)
        got = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=7, lr=1e-3, **SMALL), stats=stats)
        with torch.no_grad():
            lm(seq[None])
    assert all(train for grad, train in seen.calls if grad), seen.calls
    if variant == "lstm":  # (the other architectures run their own cells: no kernel with a mode)
        assert {(True, True), (False, False)} <= set(seen.calls)
    static = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=7, lr=0.0, decay=0.0))
    with torch.no_grad():
        logits, _ = lm(seq[:-1][None])
    want = torch.log_softmax(logits[0].float(), -1).gather(1, seq[1:, None]).squeeze(1).double()
    assert torch.equal(static, want) and torch.isfinite(got).all()


@pytest.mark.parametrize("rule", ["sgd", "rms"])
def test_lr_zero_equals_static_scoring_and_weights_are_restored(rule):
    lm = tiny_lm("alstm", init_range=1.0).eval()
    seq = _seq()
    stats = _stats(lm)
    rms_before = [r.clone() for r in stats.rms]
    before = [p.detach().clone() for p in lm.parameters()]
    static = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=7, lr=0.0, decay=0.0, rule=rule))
    with torch.no_grad():
        logits, _ = lm(seq[:-1][None])
    ref = torch.log_softmax(logits[0], -1).gather(1, seq[1:, None]).squeeze(1).double()
    torch.testing.assert_close(static, ref, rtol=1e-5, atol=1e-6)
    p = DynamicParams(segment=7, lr=0.5 if rule == "sgd" else 0.05, decay=0.01, rule=rule, **SMALL)
    adapted = dynamic_logprobs(lm, seq[:-1], seq[1:], p, stats=stats)
    again = dynamic_logprobs(lm, seq[:-1], seq[1:], p, stats=stats)
    assert torch.equal(adapted, again), "scoring the same text twice gives the same numbers"
    assert all(torch.equal(a, b) for a, b in zip(before, lm.parameters(), strict=True))
    # never written at all, not even written and restored: a server shares the model between concurrent requests
    versions = [q._version for q in lm.parameters()]
    dynamic_logprobs(lm, seq[:-1], seq[1:], p, stats=stats)
    assert [q._version for q in lm.parameters()] == versions
    assert all(torch.equal(a, b) for a, b in zip(rms_before, stats.rms, strict=True)), "statistics are read-only"
    # the first segment is scored before any step: static there (up to the no-grad vs grad kernels), different after
    torch.testing.assert_close(adapted[:7], static[:7], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(adapted[7:], static[7:])


@pytest.mark.parametrize("rule", ["sgd", "rms"])
def test_each_segment_is_scored_before_the_step_that_uses_it(rule):
    """Cutting the text inside a segment changes no score before the cut: no token was scored by weights that had
    seen it, or anything after it (a step taken before scoring its own segment would see the whole segment)."""
    lm = tiny_lm("lstm", init_range=1.0).eval()
    seq = _seq(50, seed=4)
    stats = _stats(lm)
    p = DynamicParams(segment=6, lr=0.5 if rule == "sgd" else 0.05, decay=0.02, rule=rule, **SMALL)
    full = dynamic_logprobs(lm, seq[:-1], seq[1:], p, stats=stats)
    for cut in (6 * 3 + 4, 6 * 5 + 1):
        part = dynamic_logprobs(lm, seq[:cut], seq[1:cut + 1], p, stats=stats)
        torch.testing.assert_close(part, full[:cut], rtol=0, atol=0)


def test_rms_rule_is_the_documented_update():
    """Three segments by hand: theta_1 = theta_0 - lr g_0 / (R + eps); theta_2 = theta_1 - lr g_1 / (R + eps)
    + min(1, decay R / mean R) (theta_0 - theta_1); the third segment is scored with theta_2."""
    lm = tiny_lm("alstm", init_range=1.0).eval()
    seq = _seq(16, seed=5)
    stats = _stats(lm)
    p = DynamicParams(segment=5, lr=0.02, decay=0.3, eps=1e-3, **SMALL)
    got = dynamic_logprobs(lm, seq[:-1], seq[1:], p, stats=stats)
    ref = tiny_lm("alstm", init_range=1.0).eval()
    params = list(ref.parameters())
    theta0 = [q.detach().clone() for q in params]
    mean_r = torch.cat([r.flatten() for r in stats.rms]).double().mean().item()
    state, logps = ref.init_state(1), []
    for k in range(3):
        x, y = seq[5 * k:5 * k + 5][None], seq[5 * k + 1:5 * k + 6]
        logits, state = ref(x, tuple(s.detach() for s in state))
        lp = torch.log_softmax(logits[0], -1).gather(1, y[:, None]).squeeze(1)
        logps.append(lp.detach().double())
        grads = torch.autograd.grad(-lp.mean(), params, allow_unused=True)
        with torch.no_grad():
            for q, g, q0, r in zip(params, grads, theta0, stats.rms, strict=True):
                new = q - p.lr * (g if g is not None else 0) / (r + p.eps) + (p.decay * r / mean_r).clamp(max=1) * (
                    q0 - q)
                q.copy_(new)
    torch.testing.assert_close(got, torch.cat(logps), rtol=1e-5, atol=1e-6)


def test_gradient_stats_are_the_rms_of_training_gradients_and_change_nothing():
    lm = tiny_lm("lstm", init_range=1.0).eval()
    before = [q.detach().clone() for q in lm.parameters()]
    train = _seq(41, seed=7)
    st = gradient_stats(lm, train, DynamicParams(stats_tokens=40, stats_batch=2, stats_bptt=19))
    assert st.num_tokens == 40 and st.key == (40, 2, 19)
    assert all(torch.equal(a, b) for a, b in zip(before, lm.parameters(), strict=True))
    # one mini-batch (2 columns of 20 tokens, 19 predictions each): R = |gradient of its mean NLL|
    cols = train[:40].view(2, 20)
    logits, _ = lm(cols[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), cols[:, 1:].reshape(-1))
    grads = torch.autograd.grad(loss, list(lm.parameters()))
    for r, g in zip(st.rms, grads, strict=True):
        torch.testing.assert_close(r, g.abs(), rtol=1e-5, atol=1e-7)


def test_adaptation_helps_on_a_text_that_repeats():
    lm = tiny_lm("lstm", init_range=1.0).eval()
    part = _seq(40, seed=3)
    seq = torch.cat([part, part, part])
    static = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=5, lr=0.0, decay=0.0))
    dyn = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=5, lr=0.3, decay=0.0, rule="sgd"))
    assert dyn[80:].sum() > static[80:].sum() + 1.0, "the third repetition should score better once adapted"
    rms = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=5, lr=0.01, decay=0.0, **SMALL),
                           stats=_stats(lm))
    assert rms[80:].sum() > static[80:].sum() + 1.0


@pytest.mark.parametrize("bad", [dict(segment=0), dict(lr=-1.0), dict(decay=2.0), dict(lr=float("nan")),
                                 dict(rule="adam"), dict(eps=0.0), dict(eps=-1e-3), dict(stats_tokens=0),
                                 dict(stats_batch=2.5), dict(stats_tokens=100), dict(segment=True),
                                 dict(segment=10_001), dict(lr=1.5), dict(lr=1e300)])
def test_bad_parameters_are_clear_errors(bad):
    with pytest.raises(ValueError):
        DynamicParams(**bad)


def test_a_step_that_makes_the_weights_non_finite_is_a_clear_error(monkeypatch):
    """Settings that blow the adapted weights up were a "ppl nan" with exit 0 (or a float overflow traceback):
    now the first non-finite score stops it, naming the token and the step sizes. (The overflow is injected
    after the third real update: which settings overflow a given model is not portable.)"""
    import zoo.dynamic as dynamic

    real, calls = dynamic._step, []

    def overflowing(params_list, *args):
        real(params_list, *args)
        calls.append(1)
        if len(calls) == 3:
            params_list[0].mul_(float("inf"))

    monkeypatch.setattr(dynamic, "_step", overflowing)
    lm = tiny_lm("lstm").eval()
    seq = _seq(60)
    with pytest.raises(ValueError, match=r"dynamic evaluation diverged at token 15: .*too large for this model "
                                         r"\(lr 0.5\); try a smaller lr"):
        dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(lr=0.5, rule="sgd", segment=5))
    assert all(bool(torch.isfinite(q).all()) for q in lm.parameters()), "the model passed in is untouched"


def test_rms_without_or_with_wrong_statistics_is_a_clear_error():
    lm = tiny_lm("lstm").eval()
    seq = _seq(20)
    with pytest.raises(ValueError, match="gradient statistics"):
        dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(lr=0.01, **SMALL))
    other = _stats(tiny_lm("alstm"))
    with pytest.raises(ValueError, match="do not match"):
        dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(lr=0.01, **SMALL), stats=other)
    zero = GradStats(tuple(torch.zeros_like(q) for q in lm.parameters()), 0, (1, 1, 1))
    with pytest.raises(ValueError, match="all zero"):
        dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(lr=0.01, **SMALL), stats=zero)


def test_model_statistics_come_from_its_training_split_and_are_cached(tiny_checkpoint, tiny_data):
    import zoo
    from zoo.data import load_corpus

    model = zoo.load(str(tiny_checkpoint))
    p = DynamicParams(**SMALL)
    st = model.dynamic_stats(p)
    ref = gradient_stats(model.lm, load_corpus("ptb").train, p)
    assert all(torch.equal(a, b) for a, b in zip(st.rms, ref.rms, strict=True)), "from the training split"
    assert model.dynamic_stats(p) is st, "cached"
    assert model.dynamic_stats(DynamicParams(rule="sgd")) is None
    with torch.no_grad():
        next(model.lm.parameters()).add_(0.1)
    assert model.dynamic_stats(p) is not st, "new weights, new statistics"


def test_model_statistics_are_kept_on_disk_for_the_next_process(tiny_checkpoint, tiny_data, tmp_path, monkeypatch):
    """Each ``zoo ... --dynamic`` command is a new process: the statistics are read back from the cache (the same
    tensors), other weights never find them, a torn file is remade, and ``cache=False`` neither reads nor writes."""
    import zoo
    import zoo.zoo_model

    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    p = DynamicParams(**SMALL)
    first = zoo.load(str(tiny_checkpoint)).dynamic_stats(p)
    files = list((tmp_path / "cache" / "dynamic-stats").glob("*.safetensors"))
    assert len(files) == 1

    calls = []

    def counted(*args, **kw):
        calls.append(1)
        return gradient_stats(*args, **kw)

    monkeypatch.setattr(zoo.zoo_model, "gradient_stats", counted)
    again = zoo.load(str(tiny_checkpoint)).dynamic_stats(p)
    assert not calls and all(torch.equal(a, b) for a, b in zip(first.rms, again.rms, strict=True))
    assert again.num_tokens == first.num_tokens and again.key == first.key

    files[0].write_bytes(files[0].read_bytes()[:100])  # torn
    remade = zoo.load(str(tiny_checkpoint)).dynamic_stats(p)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(first.rms, remade.rms, strict=True))
    assert zoo.load(str(tiny_checkpoint)).dynamic_stats(p) is not None and len(calls) == 1, "the remade file reads"

    zoo.load(str(tiny_checkpoint)).dynamic_stats(p, cache=False)
    assert len(calls) == 2, "cache=False collects anew"

    other = zoo.load(str(tiny_checkpoint))
    with torch.no_grad():
        next(other.lm.parameters()).add_(0.1)
    other.dynamic_stats(p)
    assert len(calls) == 3 and len(list(files[0].parent.glob("*.safetensors"))) == 2, "other weights, other file"
    other.dynamic_stats(DynamicParams(**{**SMALL, "stats_tokens": 300}))
    assert len(calls) == 4, "other settings, other file"


def test_model_statistics_refuse_a_corpus_of_another_vocabulary(tiny_checkpoint, tmp_path, monkeypatch):
    import zoo

    root = tmp_path / "other" / "ptb"
    root.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        (root / f"{split}.txt").write_text("some other words entirely\n" * 50)
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "other"))
    model = zoo.load(str(tiny_checkpoint))
    with pytest.raises(ValueError, match="vocabulary does not match"):
        model.score("the cat", dynamic=DynamicParams(**SMALL))
    assert model.score("the cat", dynamic=DynamicParams(rule="sgd"))[0]["num_tokens"] > 0


def test_api_and_cli(tiny_checkpoint, tiny_data):
    import zoo

    model = zoo.load(str(tiny_checkpoint))
    text = "the cat sat on the mat\nthe cat sat on the mat"
    a = model.score(text, dynamic=True)[0]
    b = model.score(text, dynamic=DynamicParams(lr=0.0, decay=0.0))[0]
    assert a["num_tokens"] == b["num_tokens"] == model.score(text)[0]["num_tokens"]
    assert b["nll"] == pytest.approx(model.score(text)[0]["nll"], rel=1e-5)
    assert model.score(text, dynamic=True)[0]["nll"] == a["nll"]
    # past the first 20-token segment the weights adapt: a text that repeats itself is scored better than statically
    repeated = "\n".join(["the cat sat on the mat"] * 8)
    adapted = model.score(repeated, dynamic=DynamicParams(rule="sgd", lr=0.1, decay=0.0))[0]
    static = model.score(repeated)[0]["nll"]
    assert adapted["nll"] < static * (1 - 1e-3), (adapted["nll"], static)  # (a tiny random model: ~0.4% here)
    with pytest.raises(ValueError, match="eager backend in fp32"):
        zoo.load(str(tiny_checkpoint), precision="bf16").score(text, dynamic=True)
    cli = [sys.executable, "-m", "zoo.cli", "score", str(tiny_checkpoint), "--text", text, "--json", "--dynamic"]
    env = {**os.environ, "ZOO_DATA_DIR": str(tiny_data)}
    ok = subprocess.run(cli, capture_output=True, text=True, cwd=REPO, env=env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["nll"] == pytest.approx(a["nll"], rel=1e-6)
    sgd = subprocess.run([*cli, "--dynamic-rule", "sgd", "--dynamic-lr", "0.1"], capture_output=True, text=True,
                         cwd=REPO, env=env)
    assert sgd.returncode == 0, sgd.stderr
    for flag, value, field in (("--dynamic-lr", "-1", "lr"), ("--dynamic-eps", "0", "eps"),
                               ("--dynamic-stats-tokens", "0", "stats_tokens")):
        bad = subprocess.run([*cli, flag, value], capture_output=True, text=True, cwd=REPO, env=env)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(f"zoo: error: --dynamic: "
                                                                                      f"{field}"), bad.stderr


@pytest.mark.skipif(not (resolve_data_dir() / "ptb" / "train.txt").is_file(), reason="needs the PTB data")
@pytest.mark.parametrize("model", [None, "lstm-ptb-zaremba-small"])
def test_benchmark_quick(tmp_path, model):
    out = tmp_path / "dynamic_eval.json"
    extra = ["--model", model] if model else []
    run = subprocess.run([sys.executable, "benchmarks/dynamic_eval.py", "--quick", "--out", str(out), *extra],
                         capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert len(res["grid"]) == 2 and all(g["valid"]["num_tokens"] == 299 for g in res["grid"])
    assert res["chosen"] == min(res["grid"], key=lambda g: g["valid"]["ppl"])["params"]
    assert res["gradient_stats"]["split"] == "train" and res["speed"]["slowdown_median"] > 0
    assert out.with_suffix(".md").read_text().startswith(f"Model `{model or 'alstm-ptb-5m-light'}`")


def test_benchmark_refuses_an_unknown_model_and_a_quick_run_into_the_results():
    for args, says in ((["--model", "no-such-model"], "no-such-model"), (["--quick"], "--quick needs --out")):
        run = subprocess.run([sys.executable, "benchmarks/dynamic_eval.py", *args], capture_output=True, text=True,
                             cwd=REPO, timeout=120)
        assert run.returncode == 2 and says in run.stderr.strip().splitlines()[-1], run.stderr


def test_models_table_reads_every_finished_dynamic_result(tmp_path):
    from zoo.tools.release.cards import dynamic_results

    def write(name: str, model: str, quick: bool = False, finished: bool = True) -> None:
        res = {"meta": {"model": model, "quick": quick}} | ({"dynamic": {"test": {"ppl": 70.5}}} if finished else {})
        (tmp_path / name).write_text(json.dumps(res))

    write("dynamic_eval.json", "a")
    write("dynamic_eval-b.json", "b")
    write("dynamic_eval-c.json", "c", quick=True)
    write("dynamic_eval-d.json", "d", finished=False)
    assert dynamic_results(tmp_path) == {"a": 70.5, "b": 70.5}


def test_defaults_are_the_benchmarks_validation_choice():
    """``DEFAULTS`` is the point ``benchmarks/dynamic_eval.py`` chose: the lowest *validation* perplexity of its
    grid (test measured for that point only)."""
    res = json.loads((REPO / "benchmarks" / "results" / "dynamic_eval.json").read_text())
    assert not res["meta"]["quick"] and not res["meta"]["tokens_limit"]
    assert res["chosen"] == min(res["grid"], key=lambda g: g["valid"]["ppl"])["params"]
    assert DynamicParams(**res["chosen"]) == DEFAULTS


def _with_dynamic_eval(checkpoint, settings) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(dict(config, dynamic_eval=settings)))


def test_a_checkpoints_own_settings_are_what_dynamic_true_uses(tiny_checkpoint, tiny_data):
    """A model tuned on its validation split carries its settings (config.json ``dynamic_eval``): ``dynamic=True``
    and the CLI's ``--dynamic`` use them, and a mapping or a ``--dynamic-*`` option changes one of them."""
    import zoo

    own = {"rule": "sgd", "lr": 0.1, "decay": 0.01, "segment": 10}
    _with_dynamic_eval(tiny_checkpoint, own)
    model = zoo.load(str(tiny_checkpoint))
    assert model.dynamic_defaults == DynamicParams(**own)
    text = "\n".join(["the cat sat on the mat"] * 6)
    mine = model.score(text, dynamic=True)[0]["nll"]
    assert mine == model.score(text, dynamic=DynamicParams(**own))[0]["nll"]
    assert mine != pytest.approx(model.score(text, dynamic=DEFAULTS.with_changes({"rule": "sgd"}))[0]["nll"],
                                 rel=1e-6), "the built-in defaults score differently: the test can tell them apart"
    changed = model.score(text, dynamic={"lr": 0.0})[0]["nll"]
    assert changed == model.score(text, dynamic=DynamicParams(**{**own, "lr": 0.0}))[0]["nll"] != mine
    cli = [sys.executable, "-m", "zoo.cli", "score", str(tiny_checkpoint), "--text", text, "--json", "--dynamic"]
    env = {**os.environ, "ZOO_DATA_DIR": str(tiny_data)}
    for extra, want in (([], mine), (["--dynamic-lr", "0"], changed)):
        run = subprocess.run([*cli, *extra], capture_output=True, text=True, cwd=REPO, env=env)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["nll"] == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="unknown dynamic-evaluation setting.*'lrr'"):
        model.score(text, dynamic={"lrr": 0.0})
    info = subprocess.run([sys.executable, "-m", "zoo.cli", "info", str(tiny_checkpoint), "--json"],
                          capture_output=True, text=True, cwd=REPO)
    assert json.loads(info.stdout)["dynamic_eval"] == {**DynamicParams(**own).to_dict(), "source": "config.json"}


@pytest.mark.parametrize(("settings", "says"), [({"decay": 5}, "decay must be at most 1"),
                                                ({"speed": 1}, "unknown dynamic-evaluation setting"),
                                                ([1, 2], "must be a mapping")])
def test_a_malformed_dynamic_eval_entry_is_refused_at_load(tiny_checkpoint, settings, says):
    import zoo
    from zoo.errors import CheckpointError

    _with_dynamic_eval(tiny_checkpoint, settings)
    with pytest.raises(CheckpointError, match=f"config.json 'dynamic_eval': .*{says}"):
        zoo.load(str(tiny_checkpoint))


def test_bundled_models_carry_their_measured_settings():
    """Every bundled model ``benchmarks/dynamic_eval.py`` measured ships the point it chose on validation (so
    ``--dynamic`` reproduces the README's "test, dynamic eval" column), and its card says so, in the body and in
    the machine-readable model-index (apart from the static numbers); the others ship none."""
    from zoo.catalog import bundled_dir, catalog
    from zoo.tools.release.cards import DYNAMIC_METRIC_CONFIG, card_metrics, dynamic_runs

    runs = dynamic_runs(REPO / "benchmarks" / "results")
    assert "alstm-ptb-5m-long-medium" in runs
    for name in catalog()["models"]:
        config = json.loads((bundled_dir() / name / "config.json").read_text())
        card = (bundled_dir() / name / "README.md").read_text()
        if name in runs:
            assert config["dynamic_eval"] == runs[name]["chosen"], name
            assert f"test perplexity {runs[name]['dynamic']['test']['ppl']:.2f}" in card, name
            # each dynamic number beside the static one of the same protocol (batch 1), not the card's batch-10 one
            assert (f"validation {runs[name]['dynamic']['valid']['ppl']:.2f} against "
                    f"{runs[name]['static']['valid']['ppl']:.2f} (batch 1 too") in card, name
            assert f"`zoo eval {name} --dataset {config['dataset']} --split test --dynamic`" in card, name
            index = card_metrics(card)
            for split in ("valid", "test"):
                assert index[split][f"perplexity:{DYNAMIC_METRIC_CONFIG}"] == runs[name]["dynamic"][split]["ppl"]
                assert index[split]["perplexity"] != index[split][f"perplexity:{DYNAMIC_METRIC_CONFIG}"]
        else:
            assert "dynamic_eval" not in config, name
            assert not any(":" in key for split in card_metrics(card).values() for key in split), name


def test_a_sentence_level_model_refuses_dynamic_evaluation_in_score_and_eval(capsys):
    """``eval --dynamic`` refused a model trained on single sentences but ``score --dynamic`` ran (stream-mode
    statistics over its whole training split first): both refuse now, before any work, with the same line."""
    import zoo
    from tests.olah_fixture import run_main

    model = zoo.load("pnorm-gru-ptbchar-sent-p1")
    for call in (lambda: model.score("the cat", dynamic=True), lambda: model.evaluate(split="valid", dynamic=True)):
        with pytest.raises(ValueError, match="this model was trained on single sentences"):
            call()
    for cmd in (["score", "pnorm-gru-ptbchar-sent-p1", "--text", "the cat", "--dynamic"],
                ["eval", "pnorm-gru-ptbchar-sent-p1", "--split", "valid", "--dynamic"]):
        code, _, err = run_main(capsys, *cmd)
        assert code == 2 and err.count("\n") == 1 and "trained on single sentences" in err, cmd
