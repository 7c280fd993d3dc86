"""The `zoo` command line: documented names, JSON output, and exit 2 with one line on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import real_data
from zoo.catalog import bundled_dir
from zoo.cli import main

REPO = Path(__file__).resolve().parent.parent


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_architectures_prints_the_registry_and_a_newly_registered_one(capsys):
    """The list is the registry's, not a copy: an architecture registered at run time shows up, in text and JSON."""
    import dataclasses

    from zoo.registry import ARCHITECTURES, get_spec, register_architecture, unregister_architecture

    code, out, _ = run(capsys, "list", "--architectures")
    assert code == 0 and out.split() == sorted(ARCHITECTURES) and "lstm" in out.split()
    register_architecture(dataclasses.replace(get_spec("lstm"), name="aaa_test_lstm"))
    try:
        code, out, _ = run(capsys, "list", "--architectures", "--json")
        assert code == 0 and json.loads(out) == sorted(ARCHITECTURES) and json.loads(out)[0] == "aaa_test_lstm"
    finally:
        unregister_architecture("aaa_test_lstm")


def test_list_models_json_is_the_catalogue(capsys):
    from zoo.catalog import catalog

    code, out, _ = run(capsys, "list", "--json")
    data = json.loads(out)
    assert code == 0 and data == {"default": catalog()["default"], "models": catalog()["models"]}
    assert data["default"] in data["models"]


def test_score_json_fields(capsys, tiny_checkpoint):
    code, out, _ = run(capsys, "score", str(tiny_checkpoint), "--text", "the cat sat", "--text", "a dog", "--json",
                       "--tokens")
    lines = [json.loads(x) for x in out.splitlines()]
    assert code == 0 and len(lines) == 2
    for res in lines:
        for key in ("num_tokens", "nll", "avg_nll", "ppl", "bits_per_token", "bits_per_input_char", "oov", "tokens"):
            assert key in res
    assert lines[0]["num_tokens"] == 4


def test_score_tokens_names_its_unit(capsys, tiny_checkpoint):
    code, out, _ = run(capsys, "score", str(tiny_checkpoint), "--text", "the cat sat", "--tokens")
    assert code == 0 and "log-prob (nats)" in out and "nll" in out and "nats" in out.splitlines()[0]


def test_score_file_per_line_and_stdin(capsys, tiny_checkpoint, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("the cat\n\na dog ran\n")
    code, out, _ = run(capsys, "score", str(tiny_checkpoint), str(f), "--per-line", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["line"] for r in rows] == [1, 2, 3]  # one object per input line, numbered
    assert rows[1] == {"line": 2, "skipped": "blank"} and rows[0]["num_tokens"] == 3 and rows[2]["num_tokens"] == 4
    # lines end at "\n" (and "\r\n") only: a form feed or U+2028 inside a line does not shift the numbers
    f.write_text("the cat\u2028sat\r\na dog ran on the mat\x0cand the cat sat\n\nthe mat\n", newline="")
    code, out, _ = run(capsys, "score", str(tiny_checkpoint), str(f), "--per-line", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["line"] for r in rows] == [1, 2, 3, 4] and rows[2] == {"line": 3, "skipped": "blank"}
    assert rows[3]["num_tokens"] == 3
    f.write_text("the cat\n\n\nthe\x00mat\n")  # an error names the file's line, not an index among the texts
    code, _, err = run(capsys, "score", str(tiny_checkpoint), str(f), "--per-line")
    assert code == 2 and "line 4 looks like binary data" in err and err.count("\n") == 1, err
    f.write_bytes("\ufeffthe cat".encode())  # a byte-order mark (Windows editors write one) is not a character
    code, out, _ = run(capsys, "score", str(tiny_checkpoint), str(f), "--json")
    assert code == 0 and json.loads(out)["num_dropped"] == 0 and json.loads(out)["num_tokens"] == 3, out
    code, _, err = run(capsys, "score", str(tiny_checkpoint), "/dev/zero")  # endless: refused at its first MiB
    assert code == 2 and "/dev/zero looks like binary data" in err and err.count("\n") == 1, err
    code, _, err = run(capsys, "score", str(tiny_checkpoint), "/dev/urandom")  # endless, few NULs: not UTF-8
    assert code == 2 and "/dev/urandom: not valid UTF-8 (byte " in err and err.count("\n") == 1, err
    closed = subprocess.run(["sh", "-c", f'exec "{sys.executable}" -m zoo.cli score "{tiny_checkpoint}" - <&-'],
                            capture_output=True, cwd=REPO, timeout=120, text=True)
    assert closed.returncode == 2 and closed.stderr == \
        "zoo: error: no standard input to read: give --text or a file\n", closed.stderr
    proc = subprocess.run([sys.executable, "-m", "zoo.cli", "score", str(tiny_checkpoint), "-"], input=b"the mat",
                          capture_output=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and b"ppl" in proc.stdout


def test_publish_dry_run_defaults_to_the_catalogue_repo(capsys):
    from zoo.zoo_model import catalog

    name = catalog()["default"]
    code, out, err = run(capsys, "publish", name, "--dry-run")
    assert code == 0, err
    assert catalog()["models"][name]["repo_id"] in out and "would upload" in out


def test_offline_download_says_the_model_is_bundled(capsys, monkeypatch, tmp_path):
    from zoo.zoo_model import catalog

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code, _, err = run(capsys, "download", catalog()["default"])
    assert code == 2 and "is bundled with this checkout" in err and len(err.strip().splitlines()) == 1


def test_generate_seeded(capsys, tiny_checkpoint):
    args = ["generate", str(tiny_checkpoint), "--prompt", "the", "--max-new-tokens", "12", "--seed", "3", "--json"]
    _, a, _ = run(capsys, *args)
    _, b, _ = run(capsys, *args)
    assert json.loads(a)["text"] == json.loads(b)["text"]
    others = {json.loads(run(capsys, *args[:-2], str(seed), "--json")[1])["text"] for seed in (4, 5, 6)}
    assert others - {json.loads(a)["text"]}, "the seed does not change what is sampled"


def test_info(capsys, tiny_checkpoint):
    code, out, _ = run(capsys, "info", str(tiny_checkpoint), "--json")
    info = json.loads(out)
    assert code == 0 and info["source"] == "local path" and info["architecture"] == "alstm"
    code, out, _ = run(capsys, "info", "alstm-ptb-5m", "--directory")  # (for tokenizer=$(zoo info NAME --directory))
    assert code == 0 and out == f"{bundled_dir() / 'alstm-ptb-5m'}\n"


@pytest.mark.parametrize("args,message", [
    (["score", "no-such-model", "--text", "x"], "unknown model 'no-such-model': not a checkpoint directory"),
    (["score", "alstm-ptb-5m-lon", "--text", "x"],
     "unknown model 'alstm-ptb-5m-lon': did you mean 'alstm-ptb-5m-long-medium'? It is not"),
    (["score", "lstm-ptb-zarmba-small", "--text", "x"], "did you mean 'lstm-ptb-zaremba-small'?"),
    (["score", "{ckpt}", "--text", ""], "empty"),
    (["score", "{ckpt}", "{missing}"], "cannot read"),
    (["score", "{ckpt}", "{binary}"], "not valid UTF-8"),
    (["generate", "{ckpt}", "--temperature", "-1"], "--temperature must be"),
    (["generate", "{ckpt}", "--top-p", "0"], "--top-p must be"),
    (["eval", "{ckpt}", "--dataset", "ptb", "--data-dir", "{missing}"], "not found"),
    (["train", "no-such-recipe"], "no recipe"),
    (["score", "{ckpt}", "--text", "x", "--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["train", "lstm-ptb-zaremba-small", "no-such-recipe", "--run-dir", "{missing}"], "no recipe"),
    (["train", "lstm-ptb-zaremba-small", "lstm-ptb-zaremba-small", "--jobs", "0", "--run-dir", "{missing}"],
     "--jobs must be a positive"),
    (["train", "lstm-ptb-zaremba-small", "--epochs", "-1", "--run-dir", "{missing}"],
     "--epochs must be a positive integer, got -1"),
    (["train", "lstm-ptb-zaremba-small", "--max-minutes", "-5", "--run-dir", "{missing}"],
     "--max-minutes must be at least 0"),
    (["train", "lstm-ptb-zaremba-small", "--max-minutes", "nan", "--run-dir", "{missing}"],
     "--max-minutes must be at least 0, got nan"),
    (["train", "lstm-ptb-zaremba-small", "--pause-after-minutes", "-1", "--run-dir", "{missing}"],
     "--pause-after-minutes must be at least 0"),
    # argparse's own errors are one line too (it printed its usage block before the message)
    (["score", "{ckpt}", "--text", "x", "--batch-size", "abc"], "zoo score: error: argument --batch-size: invalid"),
    (["eval", "{ckpt}", "--split", "foo"], "invalid choice: 'foo'"),
    ([], "zoo: error: the following arguments are required: command (see `zoo --help`)"),
    (["train", "lstm-ptb-zaremba-small", "--device", "foo", "--run-dir", "{missing}"], "--device 'foo' is not a"),
    (["export", "{ckpt}", "--out", "{binary}"], "is a file, not a folder"),
    (["export", "{ckpt}", "--format", "torchscript", "--out", "{binary}/sub/dir"],
     "/sub/dir: "),
    (["score", "{ckpt}", ""], "empty file name: give a file, - for standard input, or --text"),
    (["score", "{ckpt}", "--text", "x", "--dynamic", "--dynamic-lr", "2"], "lr must be at most 1, got 2"),
    (["score", "{ckpt}", "--text", "a", "--per-line"], "--per-line splits an input file"),
    (["score", "{ckpt}", "--text", "a", "{missing}"], "give either --text or an input file, not both"),
    (["publish", "no-such-model", "--dry-run"], "unknown model 'no-such-model': publish takes a bundled"),
    (["download", "{ckpt}"], "is a local folder: download takes a catalogue name"),
    (["info", ""], "no model given"),
    (["info", "{ckpt}", "--revision", "v9"], "is a local folder: a revision ('v9') applies to Hub models only"),
    (["train", "lstm-ptb-zaremba-small", "lstm-ptb-zaremba-small", "--run-dir", "{missing}"],
     "a recipe is named twice: lstm-ptb-zaremba-small"),
    # schema errors in the command line's words: the flag or the file, not the request field
    (["generate", "{ckpt}", "--top-k", "-3"], "zoo: error: --top-k must be an integer >= 0, got -3"),
    (["score", "{ckpt}", "{nul}"], "nul.txt looks like binary data"),
    (["score", "{ckpt}", "--text", "ok", "--text", "a\x01\x02\x03\x04\x05b"], "--text #2 looks like binary"),
    (["score", "{ckpt}", "--text", "ab\udcedc"], "--text is not valid UTF-8 (byte 2)"),  # the byte 0xED
    (["score", "{ckpt}", "--text", "x", "--dynamic-lr", "0.1"], "--dynamic-lr applies only with --dynamic"),
    (["eval", "{ckpt}", "--dynamic", "--bptt", "5"], "--bptt does not apply with --dynamic"),
    (["eval", "{ckpt}", "--dynamic", "--backend", "onnx"], "--dynamic runs on the eager backend in fp32"),
    (["score", "{ckpt}", "--text", "x", "--dynamic", "--dynamic-stats-tokens", "1400"],
     "stats_tokens must be at least 1,420"),
    (["serve", "start", "--inference-port", "70000", "--run-dir", "{missing}"], "a port is in 1..65535, got 70000"),
    (["serve", "start", "--timeout", "nan", "--run-dir", "{missing}"], "--timeout: must be positive, got nan"),
    (["serve", "start", "--host", "no-such-host.invalid", "--run-dir", "{missing}"], "is not an address"),
    (["serve", "start", "--workers", "0", "--run-dir", "{missing}"], "--workers must be >= 1"),
    (["train", "{bad_toml}", "--run-dir", "{missing}"], "not a valid TOML recipe"),
    (["train", "{no_model}", "--run-dir", "{missing}"], "invalid recipe (KeyError: 'model')"),
    (["train", "{bad_field}", "--run-dir", "{missing}"], "invalid recipe (TypeError"),
    (["train", "{bad_field}", "{no_model}", "--run-dir", "{missing}"], "invalid recipe"),
    (["train", "{bad_seed}", "--run-dir", "{missing}"], "seed must be an integer, got 'abc'"),
    (["train", "{no_arch}", "--run-dir", "{missing}"], "[model] must be a table with an `architecture`"),
])
def test_bad_input_exits_2_with_one_line(tiny_checkpoint, tmp_path, args, message, capfd, monkeypatch):
    """In-process (``zoo.cli.main``, whose return value ``python -m zoo.cli`` exits with; argparse's own exit
    caught), with the output captured at the file descriptors: one process start per case cost a CPU minute per
    ten cases. The `python -m zoo.cli` path itself: tests/test_layers.py."""
    binary = tmp_path / "bin.dat"
    binary.write_bytes(b"\xff\xfe\x00abc")
    (tmp_path / "nul.txt").write_bytes(b"the\x00cat")
    (tmp_path / "bad.toml").write_text('name = "x"\n[train\n')
    (tmp_path / "no_model.toml").write_text('name = "x"\ndataset = "ptb"\n')
    (tmp_path / "bad_field.toml").write_text('name = "x"\ndataset = "ptb"\n[model]\n[train]\nepoks = 3\n')
    (tmp_path / "bad_seed.toml").write_text('name = "x"\ndataset = "ptb"\nseed = "abc"\n'
                                            '[model]\narchitecture = "lstm"\n')
    (tmp_path / "no_arch.toml").write_text('name = "x"\ndataset = "ptb"\n[model]\nemb_size = 8\n')
    fill = {"ckpt": str(tiny_checkpoint), "missing": str(tmp_path / "nope"), "binary": str(binary),
            "bad_toml": str(tmp_path / "bad.toml"), "no_model": str(tmp_path / "no_model.toml"),
            "bad_field": str(tmp_path / "bad_field.toml"), "bad_seed": str(tmp_path / "bad_seed.toml"),
            "no_arch": str(tmp_path / "no_arch.toml"), "nul": str(tmp_path / "nul.txt")}
    argv = [a.format(**fill) for a in args]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)
    capfd.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0], err


def test_default_model_scores_offline_from_the_bundled_copy(tmp_path):
    """A fresh clone: `zoo score default` works with no network and an empty Hub cache (the bundled copy)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))
    env.pop("ZOO_CATALOG", None)
    env.pop("ZOO_PRETRAINED_DIR", None)
    cmd = [sys.executable, "-m", "zoo.cli"]
    proc = subprocess.run([*cmd, "score", "default", "--text", "The Dow rose 3.5% on Monday.", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.splitlines()[0])
    assert res["num_tokens"] == 8 and 1 < res["ppl"] < 10_000 and res["oov"] == 0
    info = json.loads(subprocess.run([*cmd, "info", "default", "--json"], capture_output=True, text=True, env=env,
                                     timeout=120, check=True).stdout)
    assert info["source"].startswith("bundled") and info["num_parameters"] > 1_000_000


def test_zoo_eval_defaults_reproduce_the_card(tmp_path):
    """`zoo eval default` with no protocol flags scores the test split the card's way (one stream, batch 1) and
    reproduces the catalogue's test number to 0.01% (the README's command; it used to default to batch 10)."""
    cat = json.loads((REPO / "zoo" / "catalog.json").read_text())
    expected = cat["models"][cat["default"]]["metrics"]["test"]
    real_data("ptb")
    proc = subprocess.run([sys.executable, "-m", "zoo.cli", "eval", "default", "--json"], capture_output=True,
                          text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    assert res["batch_size"] == 1 and res["dataset"] == "ptb" and res["split"] == "test"
    assert res["ppl"] == pytest.approx(expected, rel=1e-4)
    bad = subprocess.run([sys.executable, "-m", "zoo.cli", "eval", "default", "--batch-size", "0"],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.strip() == "zoo: error: --batch-size must be a positive integer, got 0"


def test_export_without_the_onnx_toolchain_names_the_extra(capsys, monkeypatch, tiny_checkpoint, tmp_path):
    """A plain install has no ONNX toolchain: `zoo export --format onnx` says which extra to install, before the
    model loads (it was a ModuleNotFoundError traceback from inside the exporter)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else real(name, *a))
    code, _, err = run(capsys, "export", str(tiny_checkpoint), "--format", "onnx", "--out", str(tmp_path / "x"))
    assert code == 2 and "needs onnxscript: pip install 'alstm-zoo[export]'" in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()


def test_a_broken_catalogue_is_one_line(capsys, monkeypatch, tmp_path):
    """$ZOO_CATALOG naming a file that is not JSON, or a folder: one line naming it (a JSONDecodeError traceback
    before)."""
    (tmp_path / "essay.txt").write_text("not json")
    for path, message in ((tmp_path / "essay.txt", "is not valid JSON"), (tmp_path, "is a folder")):
        monkeypatch.setenv("ZOO_CATALOG", str(path))
        code, _, err = run(capsys, "list")
        assert code == 2 and message in err and str(path) in err and err.count("\n") == 1, err
