"""An ONNX export folder is enough to deploy: ``exports/onnx_example.py`` scores and generates with only
onnxruntime, tokenizers and numpy, in a fresh virtual environment where torch (and the zoo) cannot be imported,
and agrees with the zoo: perplexity to 1e-5 relative, greedy generation token for token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import zoo
from zoo.export import export_model
from zoo.generation import Sampler, SamplingParams

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "exports" / "onnx_example.py"
ONLY = ("numpy", "numpy.libs", "onnxruntime", "tokenizers")
TEXT = "the company said its profit rose N N in the third quarter\nshares fell sharply on monday"

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def no_torch_python(tmp_path_factory) -> Path:
    """A fresh venv that sees exactly numpy, onnxruntime and tokenizers (links into a folder of their own, on its
    path through a .pth file), nothing else of this environment."""
    root = tmp_path_factory.mktemp("no-torch")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    py = root / "venv" / "bin" / "python"
    pkgs = root / "packages"
    pkgs.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for name in ONLY:
        if (here / name).exists():
            os.symlink(here / name, pkgs / name)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "only_runtime.pth").write_text(f"{pkgs}\n")
    probe = subprocess.run([str(py), "-c", "import onnxruntime, tokenizers, numpy\n"
                            "for m in ('torch', 'zoo'):\n"
                            "    try:\n        __import__(m)\n    except ImportError:\n        continue\n"
                            "    raise SystemExit(m + ' is importable')"],
                           capture_output=True, text=True, cwd=root, env={"PATH": os.environ["PATH"]}, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    return py


def _run(py: Path, *args: str) -> dict:
    res = subprocess.run([str(py), str(EXAMPLE), *args], capture_output=True, text=True, timeout=300,
                         env={"PATH": os.environ["PATH"]}, cwd=Path(py).parents[2])
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_score_and_generate_with_onnxruntime_tokenizers_numpy_only(no_torch_python, tmp_path):
    model = zoo.load("default")
    export_model(model, tmp_path / "exp", formats=("onnx",), verify=False)
    folder = tmp_path / "exp" / "onnx"
    manifest = json.loads((folder / "export.json").read_text())
    assert (folder / manifest["tokenizer_file"]).is_file() and manifest["eos_id"] == model.tokenizer.eos_id
    got = _run(no_torch_python, str(folder), "--text", TEXT)
    ref = model.score(TEXT)[0]
    assert got["num_tokens"] == ref["num_tokens"]
    assert got["ppl"] == pytest.approx(ref["ppl"], rel=1e-5)
    assert _run(no_torch_python, str(folder), "--text", TEXT + "\n")["num_tokens"] == ref["num_tokens"]
    gen = _run(no_torch_python, str(folder), "--generate", "the company said", "--tokens", "40")
    # the zoo's rule for <unk> (never generated, as in the demo), applied by the example's copy of it
    assert gen["ids"] == model.generate_ids("the company said", max_new_tokens=40, temperature=0.0, allow_unk=False)
    assert model.tokenizer.unk_id not in gen["ids"]
    # the same text as the zoo's: <eos> a line break (words compared line by line)
    zoo_text = model.generate("the company said", max_new_tokens=40, temperature=0.0, allow_unk=False)
    assert [line.split() for line in gen["text"].split("\n")] == [line.split() for line in zoo_text.split("\n")]
    free = _run(no_torch_python, str(folder), "--generate", "the company said", "--tokens", "40", "--allow-unk")
    assert free["ids"] == model.generate_ids("the company said", max_new_tokens=40, temperature=0.0, allow_unk=True)


@pytest.mark.slow
def test_a_character_model_never_finishes_spelling_unk(no_torch_python, tmp_path):
    """A character model spells <unk> over five symbols: the example withholds the last one, as the zoo does."""
    model = zoo.load("lstm-ptbchar-1.5m-long")
    export_model(model, tmp_path / "exp", formats=("onnx",), verify=False)
    folder = tmp_path / "exp" / "onnx"
    prompt = "t h e _ < u n k"  # the prompt ends four symbols into <unk>: the next may not be ">"
    context = [model.tokenizer.eos_id] + [model.tokenizer.index[c] for c in prompt.split()]
    with torch.no_grad():
        logits, _ = model.lm(torch.tensor([context]), model.lm.init_state(1))
    for allow_unk, flags in ((False, []), (True, ["--allow-unk"])):  # the zoo's own Sampler on the same context
        sampler = Sampler(model.tokenizer, SamplingParams(temperature=0.0, allow_unk=allow_unk), list(context))
        first = _run(no_torch_python, str(folder), "--generate", prompt, "--tokens", "1", *flags)["ids"][0]
        assert first == sampler.choose(logits[0, -1].float())
    gt = model.tokenizer.index[">"]
    assert int(logits[0, -1].argmax()) == gt  # the model would close the <unk> ...
    assert first == gt and _run(no_torch_python, str(folder), "--generate", prompt, "--tokens", "1")["ids"][0] != gt


def test_the_examples_unk_rule_is_the_zoos_line_for_line():
    """The example cannot import the zoo, so it carries a copy of ``zoo.generation.unk_ban``: the same code."""
    import ast

    def body(path: Path) -> list[str]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "unk_ban")
        if ast.get_docstring(fn):
            fn.body = fn.body[1:]
        return [ast.unparse(fn.args), ast.unparse(fn.returns), *map(ast.unparse, fn.body)]

    assert body(EXAMPLE) == body(REPO / "zoo" / "generation.py")
