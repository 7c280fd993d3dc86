"""One agreement matrix: every door x every architecture x the inputs that differ at the edges gives the zoo's numbers.

The reference is the Python API (``ZooModel.score``: each token's log-probability, ``<eos>`` included, the first token
conditioned on one ``<eos>``). Every door must give the same per-token log-probabilities (``TOKEN_TOL``, absolute)
where it reports them, the same document totals where it reports only those (lm-eval's rolling requests), and the
same corpus perplexity (``CORPUS_TOL``, relative) over each input's documents; or a documented reason, tested in
:data:`REASONS`. What would have caught the HF door's line-task bug: the line documents are an input here.

A door is one row of :data:`DOORS` (what it takes, and a function from a :class:`Subject` and documents to results):
a new door is a new row. The unit tier runs the in-process doors on a tiny model of every architecture variant
(``tests/conftest.py`` ``TINY_ARCHS``), in seconds; the system tier adds the doors that start a process (the CLI)
or export (ONNX Runtime), and runs the in-process doors on a bundled model of each architecture. The doors through
real servers and the harness's CLI are checked on bundled models where those are started already:
``tests/test_openai_api.py`` (``/v1/completions`` echo and ``local-completions``), ``tests/test_serving.py`` (the
native HTTP API), ``tests/test_lm_eval.py`` and ``tests/test_hf.py`` (``lm_eval --model zoo`` / ``hf``).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

import zoo  # noqa: E402
from tests.conftest import REPO, TINY_ARCHS, tiny_lm, tiny_tokenizer  # noqa: E402
from zoo.catalog import bundled_dir  # noqa: E402
from zoo.checkpoint import save_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

#: Per-token log-probabilities (nats, absolute) and corpus perplexity (relative): the issue's tolerances.
TOKEN_TOL, CORPUS_TOL = 1e-5, 1e-6
#: The inputs: name -> documents. Texts in the tiny vocabulary's PTB normalisation (upper case, digits, punctuation
#: and non-ASCII letters are what the normaliser changes: ``<unk>``, ``N``, dropped characters).
INPUTS: dict[str, list[str]] = {
    "whole text": ["the cat sat on the mat\na dog ran on the mat\nmr. smith 's cat sat\n"],
    "no final line end": ["the cat sat on the mat"],
    "final line end": ["the cat sat on the mat\n"],
    "non-ASCII and digits": ["The café's 3.5% naïve cat, in 1987, sat on $ 12 mats\n"],
    "line documents": [],  # the line tasks' own documents (zoo_tasks.corpus_documents), filled in by line_documents
    "token ids": ["the cat sat on the mat\na dog ran"],  # (as its ids, <eos> included, to the doors that take ids)
}
#: The bundled models of the system tier: one per architecture.
BUNDLED = {"alstm": "alstm-ptb-5m-light", "lstm": "lstm-ptb-5m-long-light", "hyperlstm": "hyperlstm-ptb-5m-long-medium",
           "pnorm_gru": "pnorm-gru-ptb-5m-p1"}

#: A door's result for one document: its tokens' log-probabilities, or (a float) the document's total only.
Result = list[float] | float


class Subject:
    """One model as every door needs it: the zoo model, its checkpoint folder, transformers' model and tokenizer."""

    def __init__(self, folder: Path):
        self.folder = folder

    @cached_property
    def model(self) -> zoo.ZooModel:
        return zoo.load(self.folder)

    @cached_property
    def hf(self) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import zoo.hf  # noqa: F401 (registers the zoo with transformers)

        return AutoModelForCausalLM.from_pretrained(self.folder), AutoTokenizer.from_pretrained(self.folder)

    def ids(self, text: str) -> list[int]:
        return self.model.tokenizer.encode(text).ids


# -- the doors ---------------------------------------------------------------------------------------------------
def _python_api(s: Subject, docs: list[str], ids: bool) -> list[Result]:
    return [[t["logprob"] for t in r["tokens"]] for r in s.model.score(docs, return_tokens=True).texts]


def _service(s: Subject, docs: list[str], ids: bool) -> list[Result]:
    from zoo.api.service import Service, parse_score

    (reply,) = Service(s.model).score([parse_score({"texts": docs, "return_tokens": True})])
    return [[t["logprob"] for t in r["tokens"]] for r in reply["texts"]]


def _completions(s: Subject, docs: list[str], ids: bool) -> list[Result]:
    """``/v1/completions`` in process (the schema and run the server uses): echo, no new tokens. A token-id
    prompt is literal and its first id context only, so ``<eos>`` goes first, as the zoo's text start."""
    from zoo.api.completions import CompletionRun, parse_completion
    from zoo.api.service import Limits

    out: list[Result] = []
    for doc in docs:
        prompt = [s.model.tokenizer.eos_id, *s.ids(doc)] if ids else doc
        req = parse_completion({"model": "m", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0},
                               s.model.tokenizer, Limits(), served="m")
        run = CompletionRun(s.model, req)
        while not run.done:
            run.advance()
        lps = run.reply()["choices"][0]["logprobs"]["token_logprobs"]
        out.append(lps[1:] if ids else lps)
    return out


def ended(text: str) -> str:
    """A text with its last line ended: how transformers' door scores a text (``tok("<eos>" + text + "\\n")``,
    the transformers guide; without the line end the tokenizer reads an open prompt: :data:`REASONS`)."""
    return text if text.endswith("\n") else text + "\n"


@torch.no_grad()
def _transformers(s: Subject, docs: list[str], ids: bool) -> list[Result]:
    model, tok = s.hf
    out: list[Result] = []
    for doc in docs:
        seq = [tok.eos_token_id, *s.ids(doc)] if ids else tok("<eos>" + ended(doc)).input_ids
        x = torch.tensor([seq])
        logp = torch.log_softmax(model(x).logits.float(), -1)[0, :-1].gather(1, x[0, 1:, None]).squeeze(1)
        out.append(logp.double().tolist())
    return out


def _requests(docs: list[str]) -> list[Any]:
    from lm_eval.api.instance import Instance

    return [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(d,), idx=i) for i, d in enumerate(docs)]


def _lm_eval_zoo(s: Subject, docs: list[str], ids: bool) -> list[Result]:
    from zoo.lm_eval_plugin import ZooLM

    return ZooLM(pretrained=str(s.folder), batch_size=2).loglikelihood_rolling(_requests(docs), disable_tqdm=True)


def _lm_eval_hf(s: Subject, docs: list[str], ids: bool) -> list[Result]:
    """lm-eval's own ``hf`` model around transformers' door, as ``lm_eval --model hf`` builds it (rolling windows,
    the tokenizer's BOS in front), on the documents as a task gives them."""
    from lm_eval.models.huggingface import HFLM

    model, tok = s.hf
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
    return lm.loglikelihood_rolling(_requests(docs), disable_tqdm=True)


def _cli(s: Subject, docs: list[str], ids: bool) -> list[Result]:
    """``zoo score --json --tokens --text ...``: one process for every input's documents (a process start is
    seconds), kept on the subject."""
    if not hasattr(s, "cli_results"):
        texts = sorted({d for name, ds in INPUTS.items() if name != "token ids" for d in ds})
        args = [a for d in texts for a in ("--text", d)]
        proc = subprocess.run([sys.executable, "-m", "zoo.cli", "score", str(s.folder), *args, "--json", "--tokens"],
                              capture_output=True, text=True, cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        assert len(rows) == len(texts), proc.stdout[-2000:]
        s.cli_results = {t: [tok["logprob"] for tok in r["tokens"]] for t, r in zip(texts, rows, strict=True)}
    return [s.cli_results[d] for d in docs]


def _onnx(s: Subject, docs: list[str], ids: bool) -> list[Result]:
    onnx = zoo.load(s.folder, backend="onnx")
    return [[t["logprob"] for t in r["tokens"]] for r in onnx.score(docs, return_tokens=True).texts]


@dataclass(frozen=True)
class Door:
    """A way into the zoo: ``run(subject, documents, ids)`` gives one :data:`Result` per document. ``takes_ids``:
    it also takes a prompt of token ids; ``tier``: ``unit`` (in process, quick) or ``system`` (a process, an
    export); ``tol``: its per-token tolerance where another runtime computes (ONNX Runtime's kernels)."""

    name: str
    run: Callable[[Subject, list[str], bool], list[Result]]
    takes_ids: bool = False
    tier: str = "unit"
    tol: float = TOKEN_TOL
    note: str = ""


DOORS = [
    Door("python api", _python_api, note="the reference"),
    Door("service core (native HTTP)", _service),
    Door("/v1/completions (in process)", _completions, takes_ids=True),
    Door("transformers AutoModelForCausalLM", _transformers, takes_ids=True),
    Door("lm-eval --model zoo (in process)", _lm_eval_zoo, note="document totals"),
    Door("lm-eval --model hf (in process)", _lm_eval_hf, note="document totals"),
    Door("zoo score CLI", _cli, tier="system"),
    Door("ONNX Runtime backend", _onnx, tier="system"),
]


@dataclass
class Reason:
    """Where a door does not read an input as the Python API does: ``check(subject, docs, reference, got)``
    asserts the difference is exactly what ``why`` says. ``differs``: the door's own result differs (the check
    replaces the comparison); else it agrees as used, and the check tests the raw use the reason warns about."""

    why: str
    check: Callable[[Subject, list[str], list[Result], list[Result]], None] = field(repr=False)
    differs: bool = False


def _open_prompt_check(s: Subject, docs: list[str], ref: list[Result], got: list[Result]) -> None:
    """The raw use (no line end added) gives the zoo's tokens but the last ``<eos>``: that token's log-probability
    is the whole difference."""
    _, tok = s.hf
    for doc, r in zip(docs, ref, strict=True):
        seq = tok("<eos>" + doc).input_ids
        assert seq[1:] == s.ids(doc)[:-1] and s.ids(doc)[-1] == tok.eos_token_id
        assert _transformers_raw(s, seq) == pytest.approx(r[:-1], abs=TOKEN_TOL)


def _open_document_check(s: Subject, docs: list[str], ref: list[Result], got: list[Result]) -> None:
    """The harness's total misses exactly the last ``<eos>`` of each document (and is higher by its cost)."""
    for r, g in zip(ref, got, strict=True):
        assert g == pytest.approx(sum(r[:-1]), abs=TOKEN_TOL * len(r)) and g > sum(r)


@torch.no_grad()
def _transformers_raw(s: Subject, seq: list[int]) -> list[float]:
    model, _ = s.hf
    x = torch.tensor([seq])
    return torch.log_softmax(model(x).logits.float(), -1)[0, :-1].gather(1, x[0, 1:, None]).squeeze(1).tolist()


#: (door, input) -> why it differs when used raw, and the test of exactly that difference.
REASONS = {
    ("transformers AutoModelForCausalLM", "no final line end"): Reason(
        "transformers' tokenizer ends a text with <eos> only at a line break (an open text is a prompt to continue): "
        "score a text as tok('<eos>' + text + '\\n'), as the transformers guide says", _open_prompt_check),
    ("lm-eval --model hf (in process)", "no final line end"): Reason(
        "as transformers' door, a document without a final line break is scored without its last <eos>: the zoo's "
        "task documents end with theirs (zoo_tasks.corpus_documents; the line documents input checks it), so the "
        "harness scores every <eos> the task counts", _open_document_check, differs=True),
}


# -- the matrix --------------------------------------------------------------------------------------------------
def check_door(door: Door, s: Subject) -> None:
    """Every input through ``door`` against the Python API: per-token (or per-document totals) and the corpus
    perplexity; a :data:`REASONS` entry's own check where there is one."""
    for name, docs in INPUTS.items():
        ids = name == "token ids"
        if ids and not door.takes_ids:
            continue
        ref = _python_api(s, docs, False)
        got = door.run(s, docs, ids)
        assert len(got) == len(docs), (door.name, name)
        reason = REASONS.get((door.name, name))
        if reason is not None:
            reason.check(s, docs, ref, got)
            if reason.differs:
                continue
        for r, g in zip(ref, got, strict=True):
            if isinstance(g, float):
                assert g == pytest.approx(sum(r), abs=TOKEN_TOL * len(r)), (door.name, name)
            else:
                assert len(g) == len(r) and g == pytest.approx(r, abs=door.tol), (door.name, name)
        total = sum(sum(r) for r in ref)
        count = sum(len(r) for r in ref)
        want = s.model.score(docs).corpus["ppl"]
        assert math.exp(-total / count) == pytest.approx(want, rel=CORPUS_TOL), name
        got_total = sum(g if isinstance(g, float) else sum(g) for g in got)
        assert math.exp(-got_total / count) == pytest.approx(want, rel=CORPUS_TOL * 10 if door.tol > TOKEN_TOL
                                                             else CORPUS_TOL), (door.name, name)


def spread_checkpoint(root: Path, variant: str) -> Path:
    """A tiny model whose weights are drawn wide (N(0, 0.5)), so log-probabilities differ from token to token."""
    lm = tiny_lm(variant, seed=5).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    return save_checkpoint(root / variant, lm, tiny_tokenizer(), {"name": f"tiny-{variant}", "dataset": "ptb"})


@pytest.fixture(scope="module", autouse=True)
def line_documents(tmp_path_factory) -> list[str]:
    """The ``line documents`` input: what the line tasks (``zoo_ptb_test_lines``) score, from the committed corpus."""
    from tests.conftest import synthetic_corpus
    from zoo.lm_eval_plugin import corpus_documents

    data = synthetic_corpus(tmp_path_factory.mktemp("data"), {"train": 2, "valid": 2, "test": 6})
    INPUTS["line documents"] = list(corpus_documents("ptb", "test", "line", zoo_data_dir=str(data))["test"]["text"])
    assert len(INPUTS["line documents"]) == 6
    return INPUTS["line documents"]


@pytest.fixture(scope="module")
def tiny_subjects(tmp_path_factory) -> dict[str, Subject]:
    root = tmp_path_factory.mktemp("agreement")
    return {v: Subject(spread_checkpoint(root, v)) for v in sorted(TINY_ARCHS)}


@pytest.mark.parametrize("door", [d for d in DOORS if d.tier == "unit"], ids=lambda d: d.name)
def test_every_door_agrees_on_every_tiny_architecture(door, tiny_subjects):
    for variant, subject in tiny_subjects.items():
        try:
            check_door(door, subject)
        except AssertionError as e:
            raise AssertionError(f"{door.name} on {variant}: {e}") from None


@pytest.mark.parametrize("door", [d for d in DOORS if d.tier == "system"], ids=lambda d: d.name)
def test_process_and_export_doors_agree_on_every_tiny_architecture(door, tiny_subjects, tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))  # (the ONNX export's cache)
    monkeypatch.setenv("ZOO_EXPORTS_DIR", str(tmp_path / "none"))
    one_each = {arch: variant for variant, (arch, _) in sorted(TINY_ARCHS.items(), reverse=True)}  # (a process each)
    for variant in sorted(one_each.values()):
        subject = tiny_subjects[variant]
        try:
            check_door(door, subject)
        except AssertionError as e:
            raise AssertionError(f"{door.name} on {variant}: {e}") from None


@pytest.mark.parametrize("arch", sorted(BUNDLED))
def test_every_in_process_door_agrees_on_a_bundled_model_of_each_architecture(arch):
    subject = Subject(bundled_dir() / BUNDLED[arch])
    for door in (d for d in DOORS if d.tier == "unit"):
        check_door(door, subject)


def test_the_matrix_has_every_door_and_input():
    """A door without a row here is a door nobody compared: the matrix's rows and columns, named."""
    assert {d.name for d in DOORS} >= {"python api", "service core (native HTTP)", "/v1/completions (in process)",
                                       "transformers AutoModelForCausalLM", "lm-eval --model zoo (in process)",
                                       "lm-eval --model hf (in process)", "zoo score CLI", "ONNX Runtime backend"}
    assert all(door in {d.name for d in DOORS} and name in INPUTS for door, name in REASONS)
    models = zoo.catalog.catalog()["models"]
    assert set(BUNDLED) == {e["architecture"] for e in models.values()}  # a bundled model of each architecture
    assert all(models[name]["architecture"] == arch for arch, name in BUNDLED.items())
    assert {arch for arch, _ in TINY_ARCHS.values()} >= set(BUNDLED)  # and a tiny one
