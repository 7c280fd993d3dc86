"""The lm-evaluation-harness plugin: the real harness CLI on a bundled model reproduces the zoo's own numbers, and
the three request types follow the zoo's conventions (zoo/lm_eval_plugin.py)."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import zoo  # noqa: E402
from tests.conftest import real_data  # noqa: E402
from zoo.data import load_corpus  # noqa: E402
from zoo.errors import DataError  # noqa: E402
from zoo.tokenizer import Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: The start-up hook's sources (checkout tooling); the wheel, and the checkout's .venv, have them at the root of
#: site-packages under the same names.
HOOK_DIR = REPO / "zoo" / "tools" / "lm_eval_hook"
MODEL = "alstm-ptb-5m-light"
TASKS = ("zoo_ptb_test", "zoo_ptb_valid", "zoo_ptb_test_lines", "zoo_wikitext2_test", "zoo_wikitext2_valid",
         "zoo_wikitext2_test_lines")

pytestmark = pytest.mark.usefixtures("one_thread")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(extra)
    return env


def _run_harness(args: list[str], stock: bool = False, **env: str) -> subprocess.CompletedProcess:
    """Run the harness's CLI: through ``python -m zoo.lm_eval_plugin`` (the ``zoo-lm-eval`` script), or with
    ``stock`` the harness's own ``lm_eval`` script of this venv, which finds ``--model zoo`` through the start-up hook
    and is given the task folder as ``zoo-lm-eval --tasks-dir`` prints it."""
    if stock:
        tasks_dir = subprocess.run([sys.executable, "-m", "zoo.lm_eval_plugin", "--tasks-dir"], capture_output=True,
                                   text=True, cwd=REPO, env=_env(), timeout=120, check=True).stdout.strip()
        prefix = [str(Path(sys.executable).parent / "lm_eval"), "--include_path", tasks_dir]
    else:
        prefix = [sys.executable, "-m", "zoo.lm_eval_plugin"]
    return subprocess.run([*prefix, *args], capture_output=True, text=True, cwd=REPO, env=_env(**env), timeout=600)


def _harness(args: list[str], out: Path, stock: bool = False, device: str | None = "cpu", **env: str) -> dict:
    """:func:`_run_harness` with ``--device`` (none: the harness's default) and ``--output_path out``; its results
    file's ``results``."""
    proc = _run_harness([*args, *(["--device", device] if device else []), "--output_path", str(out)], stock, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    assert files, proc.stderr[-3000:]
    return json.loads(Path(files[-1]).read_text())["results"]


@pytest.fixture(scope="module")
def model():
    return zoo.load(MODEL)


@pytest.fixture(scope="module")
def lm():
    from zoo.lm_eval_plugin import ZooLM

    return ZooLM.create_from_arg_string(f"pretrained={MODEL}", {"batch_size": "auto", "device": "cpu"})


@pytest.fixture(scope="module")
def small_ptb(tmp_path_factory) -> Path:
    """A data dir whose PTB test split is the real one's first 120 lines (train and valid: the real files, so the
    vocabulary, in first-occurrence order over the splits, is the model's and ``model.evaluate`` accepts it)."""
    root = tmp_path_factory.mktemp("data")
    (root / "ptb").mkdir()
    real = real_data("ptb")  # the bundled model's vocabulary is the real corpus's
    for split in ("train", "valid"):
        (root / "ptb" / f"{split}.txt").symlink_to(real / f"{split}.txt")
    lines = (real / "test.txt").read_text(encoding="utf-8").splitlines(keepends=True)[:120]
    (root / "ptb" / "test.txt").write_text("".join(lines), encoding="utf-8")
    return root


def _requests(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


# -- the real CLI -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_harness_cli_reproduces_the_zoos_numbers(model, small_ptb, tmp_path):
    """`lm_eval --model zoo` (through zoo-lm-eval) on a whole-split task and a line-per-document task: the word
    perplexity is exactly the zoo's score of the same text. `zoo eval`'s batch-1 stream differs by one token: the
    harness also scores the split's first word (given <eos>), which the stream only takes as its first input."""
    res = _harness(["--model", "zoo", "--model_args", f"pretrained={MODEL}", "--tasks",
                    "zoo_ptb_test,zoo_ptb_test_lines", "--limit", "40", "--batch_size", "32",
                    "--metadata", json.dumps({"zoo_data_dir": str(small_ptb)})], tmp_path / "out")
    text = (small_ptb / "ptb" / "test.txt").read_text(encoding="utf-8")
    lines = [line for line in text.split("\n") if line.strip()]

    whole = model.score(text).corpus
    got = res["zoo_ptb_test"]["word_perplexity,none"]
    assert got == pytest.approx(whole["ppl"], rel=1e-6)  # float32 sums in another process
    assert res["zoo_ptb_test"]["bits_per_byte,none"] == pytest.approx(
        whole["nll"] / (math.log(2) * len(text.encode("utf-8"))), rel=1e-6)
    assert res["zoo_ptb_test_lines"]["word_perplexity,none"] == pytest.approx(model.score(lines[:40]).corpus["ppl"],
                                                                              rel=1e-6)

    stream = model.evaluate("ptb", "test", data_dir=small_ptb, progress=False)
    assert stream["batch_size"] == 1 and whole["num_tokens"] == stream["num_tokens"] + 1
    # the first word given <eos> costs 6.43 nats; the next few words, predicted from a state that has read one <eos>
    # more, cost 0.59 nats less (5.84 nats in all, the same on the whole split, where that is 1.7e-5 of the ppl)
    first = model.score(lines[0], return_tokens=True)[0]["tokens"][0]["logprob"]
    assert whole["nll"] - stream["nll"] == pytest.approx(-first, abs=1.0)
    assert got == pytest.approx(stream["ppl"], rel=1e-3)


@pytest.mark.slow
def test_stock_lm_eval_cli_finds_the_model(model, small_ptb, tmp_path):
    """The harness's own `lm_eval` script (not the wrapper), with `--model zoo` and `--include_path "$(zoo-lm-eval
    --tasks-dir)"` as the guide documents, with no `--device` on a machine without CUDA (the harness then passes
    `cuda:0`: the model falls back to the CPU with one note), reproduces the zoo's score of the same lines."""
    res = _harness(["--model", "zoo", "--model_args", f"pretrained={MODEL}", "--tasks", "zoo_ptb_test_lines",
                    "--limit", "10", "--batch_size", "32", "--metadata", json.dumps({"zoo_data_dir": str(small_ptb)})],
                   tmp_path / "out", stock=True, device=None, CUDA_VISIBLE_DEVICES="")
    text = (small_ptb / "ptb" / "test.txt").read_text(encoding="utf-8")
    lines = [line for line in text.split("\n") if line.strip()]
    assert res["zoo_ptb_test_lines"]["word_perplexity,none"] == pytest.approx(model.score(lines[:10]).corpus["ppl"],
                                                                              rel=1e-6)


@pytest.mark.slow
def test_no_device_flag_falls_back_to_the_cpu_and_a_named_cuda_is_refused(small_ptb, tmp_path):
    """On a machine without CUDA (``CUDA_VISIBLE_DEVICES=""``): no ``--device`` runs on the CPU with one note;
    ``--device cuda`` (named by the user) is ``zoo-lm-eval``'s one-line error, exit 2, before any scoring."""
    args = ["--model", "zoo", "--model_args", f"pretrained={MODEL}", "--tasks", "zoo_ptb_test_lines", "--limit", "2",
            "--metadata", json.dumps({"zoo_data_dir": str(small_ptb)})]
    ok = _run_harness(args, CUDA_VISIBLE_DEVICES="")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stderr.count("no CUDA device here: running on the CPU") == 1, ok.stderr[-3000:]
    for device in ("cuda", "cuda:0"):
        bad = _run_harness([*args, "--device", device], CUDA_VISIBLE_DEVICES="")
        assert bad.returncode == 2, bad.stderr[-3000:]
        assert bad.stderr.strip().splitlines()[-1].startswith(f"zoo-lm-eval: error: device '{device}': this machine "
                                                              "has no CUDA device"), bad.stderr[-3000:]
        assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_the_guides_command_runs_as_written(small_ptb, tmp_path):
    """docs/guides/lm-eval.md's first command (the whole PTB test split), as written (no ``--device``), in a shell
    as a user pastes it, on a machine without CUDA; ``ZOO_DATA_DIR`` points at a 120-line test split, so its table
    shows that split's zoo score. No warning that a metric lacks its aggregation or direction (the task files
    declare both: the harness used to guess them, 7 warnings a run)."""
    import re

    page = (REPO / "docs" / "guides" / "lm-eval.md").read_text(encoding="utf-8")
    command = re.search(r"```bash\n(lm_eval --model zoo .*?)```", page, re.S)[1]
    assert "--device" not in command and "--tasks zoo_ptb_test " in command
    env = _env(ZOO_DATA_DIR=str(small_ptb), CUDA_VISIBLE_DEVICES="",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is defined, but" not in proc.stderr  # the task files name each metric's aggregation and direction
    model = zoo.load(re.search(r"pretrained=(\S+)", command)[1])
    ppl = model.score((small_ptb / "ptb" / "test.txt").read_text(encoding="utf-8")).corpus["ppl"]
    assert re.search(rf"\|word_perplexity\|.*\|\s*{ppl:.4f}\|", proc.stdout), proc.stdout[-2000:]


def test_harness_device_falls_back_only_for_the_harness_default(monkeypatch, caplog):
    from zoo.lm_eval_plugin import HARNESS_DEFAULT_DEVICE, harness_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert harness_device(None) == "cpu" and harness_device("cpu", []) == "cpu"
    cli = ["/venv/bin/lm_eval", "--model", "zoo"]
    for argv in (cli, ["lm_eval", "--model", "zoo"], ["/venv/lib/python3.11/site-packages/lm_eval/__main__.py"]):
        with caplog.at_level("WARNING", logger="zoo.lm_eval_plugin"):
            assert harness_device(HARNESS_DEFAULT_DEVICE, argv) == "cpu", argv
    assert "running on the CPU" in caplog.text
    for argv in ([*cli, "--device", "cuda:0"], [*cli, "--device=cuda:0"],  # named on the command line
                 ["/venv/bin/pytest"], ["script.py"], ["/x/__main__.py"], []):  # from Python: named by the caller
        assert harness_device("cuda:0", argv) == "cuda:0", argv
    assert harness_device("cuda", cli) == "cuda" and harness_device("cuda:1", cli) == "cuda:1"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert harness_device(HARNESS_DEFAULT_DEVICE, cli) == HARNESS_DEFAULT_DEVICE  # with CUDA: the harness's choice


@pytest.mark.skipif(not os.environ.get("ZOO_LMEVAL_FULL"), reason="set ZOO_LMEVAL_FULL=1: about a minute per model")
def test_whole_test_split_equals_zoo_eval():
    """The issue's acceptance check, opt-in for time: zoo_ptb_test's word perplexity equals `zoo eval`'s batch-1
    test perplexity (the catalogue's number) to 1e-4 (measured: 1.7e-5, the one extra scored token)."""
    cat = zoo.zoo_model.catalog()["models"][MODEL]
    res = _harness(["--model", "zoo", "--model_args", f"pretrained={MODEL}", "--tasks", "zoo_ptb_test"],
                   Path(os.environ.get("TMPDIR", "/tmp")) / "zoo-lmeval-full")
    assert res["zoo_ptb_test"]["word_perplexity,none"] == pytest.approx(cat["metrics"]["test"], rel=1e-4)


# -- the request types, in process ------------------------------------------------------------------------------
def test_rolling_scores_like_model_score(lm, model):
    docs = ["the stock market fell sharply", "mr. smith 's company rose 3.5 %\nbut analysts were n't sure\n", ""]
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(d,) for d in docs]), disable_tqdm=True)
    assert got == pytest.approx([-r["nll"] for r in model.score(docs)], rel=1e-9)


def test_loglikelihood_and_greedy_flag(lm, model):
    ctx = "the stock market"
    greedy = lm.generate_until(_requests("generate_until", [(ctx, {"until": [], "max_gen_toks": 3})]))[0]
    words = greedy.split()
    assert greedy.startswith(" ") and len(words) == 3
    other = "market" if words[0] != "market" else "stock"
    args = [(ctx, greedy), (ctx, f" {other} {words[1]}"), ("", "the stock"), (ctx + "\n", "the"), ("", "")]
    (ll, is_greedy), (ll2, is_greedy2), (ll3, _), (ll4, _), empty = lm.loglikelihood(_requests("loglikelihood", args))
    toks = model.score(ctx + greedy, return_tokens=True)[0]["tokens"]
    assert [t["token"] for t in toks[3:6]] == words
    assert is_greedy and ll == pytest.approx(sum(t["logprob"] for t in toks[3:6]), rel=1e-6)
    assert not is_greedy2 and ll2 < ll
    assert ll3 == pytest.approx(toks[0]["logprob"] + toks[1]["logprob"], rel=1e-6)
    after_eos = model.score(ctx + "\nthe", return_tokens=True)[0]["tokens"]
    assert after_eos[3]["token"] == "<eos>" and ll4 == pytest.approx(after_eos[4]["logprob"], rel=1e-6)
    assert empty == (0.0, True)


def test_generate_until_honours_stop_strings(lm, model):
    ctx = "the company said"
    full = lm.generate_until(_requests("generate_until", [(ctx, {"until": [], "max_gen_toks": 12})]))[0]
    assert full == " " + model.generate(ctx, max_new_tokens=12, temperature=0)  # greedy: the zoo's own generation
    words = full.split()
    stop_a, stop_b = f" {words[4]}", f" {words[2]}"
    cut = min(full.find(stop_a), full.find(stop_b))
    reqs = [(ctx, {"until": [stop_a, stop_b], "max_gen_toks": 12}), (ctx, {"until": stop_a, "max_gen_toks": 12}),
            (ctx, {"until": ["\n\n"], "max_gen_toks": 1}), (ctx + " ", {"until": [], "max_gen_toks": 2})]
    both, one, short, spaced = lm.generate_until(_requests("generate_until", reqs))
    assert both == full[:cut] and one == full[:full.find(stop_a)]
    assert short == f" {words[0]}" and spaced == f"{words[0]} {words[1]}"
    sampled = [lm.generate_until(_requests("generate_until", [(ctx, {"do_sample": True, "temperature": 1.0,
                                                                     "seed": 5, "max_gen_toks": 8})]))[0]
               for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0].strip()
    # an empty stop string never stops (as in a list); max_gen_toks=0 is zero tokens, not the default; a
    # temperature below the library's minimum is greedy, not a sampler failure
    edge = [(ctx, {"until": "", "max_gen_toks": 3}), (ctx, {"until": [], "max_gen_toks": 0}),
            (ctx, {"do_sample": True, "temperature": 1e-40, "max_gen_toks": 12})]
    no_stop, nothing, tiny_t = lm.generate_until(_requests("generate_until", edge))
    assert no_stop == " ".join(["", *words[:3]]) and nothing == "" and tiny_t == full


def test_a_long_context_is_run_in_pieces_with_the_same_generation(lm, model, monkeypatch):
    import zoo.generation as generation

    ctx = " ".join(["the company said its profit rose"] * 30)
    want = lm.generate_until(_requests("generate_until", [(ctx, {"until": [], "max_gen_toks": 6})]))[0]
    monkeypatch.setattr(generation, "LOGIT_BUDGET", 16 * len(model.tokenizer))  # (zoo.generation.read_context)
    lengths, forward = [], lm.model.runner.forward
    monkeypatch.setattr(lm.model.runner, "forward", lambda t, s=None: (lengths.append(t.shape[1]), forward(t, s))[1])
    assert lm.generate_until(_requests("generate_until", [(ctx, {"until": [], "max_gen_toks": 6})]))[0] == want
    assert max(lengths) == 16 and sum(lengths) == len(model.tokenizer.encode(ctx, add_eos=False).ids)


def test_character_model():
    """A character model spells the text out: rolling scores are its own, generated characters join without
    spaces, and a stop string cuts inside a word."""
    from zoo.lm_eval_plugin import ZooLM

    char = ZooLM(pretrained="alstm-ptbchar-1.5m-long", batch_size=4)
    doc = "the stock market fell sharply\nbut analysts were n't sure"
    (got,) = char.loglikelihood_rolling(_requests("loglikelihood_rolling", [(doc,)]), disable_tqdm=True)
    assert got == pytest.approx(-char.model.score(doc)[0]["nll"], rel=1e-9)
    full = char.generate_until(_requests("generate_until", [("the stock market", {"until": [], "max_gen_toks": 20})]))
    assert full[0] == char.model.generate("the stock market", max_new_tokens=20, temperature=0)
    letter = next(c for c in full[0][1:] if c.isalpha())
    cut = char.generate_until(_requests("generate_until", [("the stock market", {"until": [letter],
                                                                                   "max_gen_toks": 20})]))
    assert cut[0] == full[0][:full[0].find(letter)]


@pytest.mark.slow
def test_backend_and_dtype_pass_through(tiny_checkpoint, tmp_path, monkeypatch):
    from zoo.lm_eval_plugin import ZooLM

    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ZOO_EXPORTS_DIR", str(tmp_path / "none"))
    docs = [("the cat sat on the mat\na dog ran",)]
    eager = ZooLM(pretrained=str(tiny_checkpoint))
    onnx = ZooLM.create_from_arg_string(f"pretrained={tiny_checkpoint},backend=onnx")
    bf16 = ZooLM.create_from_arg_string(f"pretrained={tiny_checkpoint},dtype=bfloat16")
    assert (onnx.model.backend, bf16.model.precision) == ("onnx", "bf16")
    ref = eager.loglikelihood_rolling(_requests("loglikelihood_rolling", docs), disable_tqdm=True)
    assert onnx.loglikelihood_rolling(_requests("loglikelihood_rolling", docs), disable_tqdm=True) == pytest.approx(
        ref, rel=1e-5)
    assert bf16.loglikelihood_rolling(_requests("loglikelihood_rolling", docs), disable_tqdm=True) == pytest.approx(
        ref, rel=0.02)
    with pytest.raises(ValueError, match="dtype"):
        ZooLM(pretrained=str(tiny_checkpoint), dtype="float16")


# -- task files and packaging -----------------------------------------------------------------------------------
def test_task_files_are_indexed_and_read_the_local_data():
    from lm_eval.tasks import TaskManager

    from zoo.lm_eval_plugin import TASKS_DIR, corpus_documents, corpus_token_count

    assert set(TASKS) <= set(TaskManager(include_path=str(TASKS_DIR), include_defaults=False).all_tasks)
    ptb_lines = corpus_documents("ptb", "test", "line")["test"]["text"]
    assert len(ptb_lines) == 3761 and all(line.strip() for line in ptb_lines)
    wiki = corpus_documents("wikitext-2", "test")["test"]["text"]
    assert len(wiki) == 1 and corpus_token_count(wiki[0]) == 245_569     # the README's token count
    real_data("wikitext-2")
    tok = Tokenizer(load_corpus("wikitext-2").vocab, "wikitext")
    assert len(tok.encode(wiki[0]).ids) == corpus_token_count(wiki[0])  # what the model scores is what is counted
    assert len(corpus_documents("wikitext-2", "test", "line")["test"]) < 4358  # blank lines are no documents
    with pytest.raises(FileNotFoundError, match="ZOO_DATA_DIR"):
        corpus_documents("ptb", "test", zoo_data_dir="/nonexistent")
    with pytest.MonkeyPatch.context() as mp:  # no data dir at all: the hint is the harness's --metadata
        mp.delenv("ZOO_DATA_DIR", raising=False)
        with pytest.raises(DataError, match="--metadata '{\"zoo_data_dir\""):
            corpus_documents("ptb", "test")


def test_zoo_imports_without_lm_eval():
    """lm_eval is an optional extra: the package imports without it, and the plugin says what to install."""
    code = ("import sys; sys.modules['lm_eval'] = None\nimport zoo, zoo.zoo_model\n"
            "try:\n    import zoo.lm_eval_plugin\nexcept ImportError as e:\n    print(e)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "alstm-zoo[lm-eval]" in proc.stdout


# -- the start-up hook behind the stock `lm_eval --model zoo` (zoo/tools/lm_eval_hook/) ---------------------------
def _python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter of this venv (its .pth files run at start-up) and return the JSON it
    prints last."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=_env(**env),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_HEAVY = "sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lm_eval', 'zoo'})"


def test_hook_is_installed_at_start_up_and_imports_nothing_heavy():
    """The venv's .pth has imported the hook before any user code, and all it loaded is a meta-path finder:
    neither torch nor lm_eval nor zoo is imported at start-up. The module is the one at the root of site-packages,
    as a wheel installs it, and there it is the checkout's source (`make venv` links both files)."""
    got = _python("import json, sys, sysconfig\nstarted = 'alstm_zoo_lm_eval_hook' in sys.modules\n"
                  f"heavy = {_HEAVY}\nimport alstm_zoo_lm_eval_hook as h\n"
                  "print(json.dumps({'started': started, 'heavy': heavy, 'file': h.__file__, "
                  "'site': sysconfig.get_paths()['purelib'], "
                  "'finders': sum(isinstance(f, h.Finder) for f in sys.meta_path)}))")
    site = Path(got.pop("site"))
    assert got == {"started": True, "heavy": [], "file": str(site / "alstm_zoo_lm_eval_hook.py"), "finders": 1}
    for name in ("alstm_zoo_lm_eval_hook.py", "alstm_zoo_lm_eval_hook.pth"):
        assert (site / name).resolve() == HOOK_DIR / name, f"{site / name} is not the checkout's: run `make venv`"


def test_hook_registers_zoo_and_the_harness_keeps_its_own_models():
    """In a fresh process the harness's first lookup (`get_model` on an empty registry imports lm_eval.models) finds
    `zoo` as the zoo's class; the harness's own models are still all there and resolve; lm_eval.models keeps its
    real loader; the plugin's own register() afterwards changes nothing."""
    got = _python(
        "import json, sys\nfrom lm_eval.api.registry import get_model, model_registry\n"
        "import alstm_zoo_lm_eval_hook as h\n"
        "zoo_cls = get_model('zoo')\nimport lm_eval.models as lm\nimport zoo.lm_eval_plugin as zp\nzp.register()\n"
        "print(json.dumps({'zoo': f'{zoo_cls.__module__}:{zoo_cls.__qualname__}', 'target': h.TARGET, "
        "'same': zoo_cls is zp.ZooLM and dict(model_registry.items())['zoo'] is zp.ZooLM, "
        "'builtin': sorted(set(lm.MODEL_MAPPING) - set(model_registry)), 'dummy': get_model('dummy').__name__, "
        "'loader': type(lm.__loader__).__name__, 'spec_loader': lm.__spec__.loader is lm.__loader__}))")
    assert got == {"zoo": "zoo.lm_eval_plugin:ZooLM", "target": "zoo.lm_eval_plugin:ZooLM", "same": True,
                   "builtin": [], "dummy": "DummyLM", "loader": "SourceFileLoader", "spec_loader": True}


def test_hook_opt_out():
    """ALSTM_ZOO_NO_LM_EVAL_HOOK=1: no finder, and the harness's registry holds its own models only."""
    got = _python("import json, sys\nimport alstm_zoo_lm_eval_hook as h\nimport lm_eval.models as lm\n"
                  "from lm_eval.api.registry import model_registry\n"
                  "print(json.dumps({'finders': sum(isinstance(f, h.Finder) for f in sys.meta_path), "
                  "'zoo': 'zoo' in model_registry, 'same': sorted(model_registry) == sorted(lm.MODEL_MAPPING)}))",
                  ALSTM_ZOO_NO_LM_EVAL_HOOK="1")
    assert got == {"finders": 0, "zoo": False, "same": True}


def test_hook_pth_is_silent_without_its_module(tmp_path):
    """A .pth left behind by an uninstalled package (the checkout's copy is not in the wheel's RECORD) must not
    print errors at every start-up: its line is a no-op when the module cannot be imported."""
    (tmp_path / "alstm_zoo_lm_eval_hook.pth").write_bytes((HOOK_DIR / "alstm_zoo_lm_eval_hook.pth").read_bytes())
    code = (f"import sys, site\nsys.modules['alstm_zoo_lm_eval_hook'] = None\nsite.addsitedir({str(tmp_path)!r})\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "ok", "")


def test_agreement_benchmark_is_consistent_and_current():
    """``benchmarks/results/lm_eval_agreement.json`` (the README's harness table and its agreement sentence): made for
    a bundled model's current weights (its ``zoo eval`` is the card's test number), the harness's word perplexity
    one token away from it, the line task the same at every batch size, and the markdown made from this JSON."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from lm_eval_agreement import markdown

    path = REPO / "benchmarks" / "results" / "lm_eval_agreement.json"
    res = json.loads(path.read_text())
    entry = zoo.zoo_model.catalog()["models"][res["model"]]
    assert res["card_test"] == entry["metrics"]["test"], "re-run benchmarks/lm_eval_agreement.py: the model changed"
    z, w = res["zoo_eval"], res["whole"]
    assert z["ppl"] == pytest.approx(entry["metrics"]["test"], rel=1e-6)
    assert res["harness_tokens"] == z["num_tokens"] + 1
    assert abs(res["relative_difference"]) < 1e-4
    harness_nll = math.log(w["word_perplexity"]) * res["harness_tokens"]
    assert res["nll_difference_nats"] == pytest.approx(harness_nll - z["nll"])
    assert any("word_perplexity" in line and f"{w['word_perplexity']:.4f}" in line for line in w["table"])
    assert [r["batch_size"] for r in res["lines"]] == [1, 32]
    assert res["lines"][0]["word_perplexity"] == pytest.approx(res["lines"][1]["word_perplexity"], rel=1e-6)
    assert path.with_suffix(".md").read_text() == markdown(res)
