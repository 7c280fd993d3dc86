"""Exports (ONNX sequence + step graphs, TorchScript) of every architecture variant, checked against eager,
and the backend switch (``zoo.load(..., backend=...)``, ``--backend``) on real exported files."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

import zoo
from zoo.catalog import bundled_dir, catalog
from zoo.checkpoint import save_checkpoint
from zoo.cli import main
from zoo.export import export_model, weights_sha256
from zoo.export.common import EXAMPLE_BATCH, read_manifest
from zoo.export.onnx_graphs import OPSET, SEQUENCE_FILE, SEQUENCE_INT8_FILE, STEP_FILE, STEP_INT8_FILE
from zoo.export.onnx_runtime import OnnxRunner
from zoo.export.torchscript import TorchScriptRunner
from zoo.zoo_model import ZooModel

from .conftest import tiny_lm, tiny_tokenizer

#: Every architecture variant the issue names: aLSTM with each adaptation model, HyperLSTM with and
#: without layer norm (the plain one with the one-hot input of the char-level HyperNetworks models),
#: p-norm GRU (p = 1 and p = 2, whose gates use other ops), LSTM.
CASES: dict[str, tuple[str, dict]] = {
    "alstm-lstm_rhn": ("alstm", {}),
    "alstm-lstm": ("alstm-lstm", {}),
    "alstm-feedforward": ("alstm-ff", {}),
    "hyperlstm-onehot": ("hyperlstm", {"input_encoding": "onehot", "tie_weights": False}),
    "hyperlstm-ln": ("hyperlstm-ln", {}),
    "pnorm_gru": ("pnorm_gru", {}),
    "pnorm_gru-p2": ("pnorm_gru-p2", {}),
    "lstm": ("lstm", {}),
}
#: (batch, time) shapes of the parity checks: none is the export example (batch 2).
SHAPES = [(1, 1), (3, 23), (6, 5)]
_EXPORTS: dict[str, tuple[ZooModel, Path]] = {}


@pytest.fixture(scope="module")
def export_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("exports")


def exported(case: str, root: Path) -> tuple[ZooModel, Path]:
    """Export a case once per test module (both formats, no int8) and keep it for every test."""
    if case not in _EXPORTS:
        variant, kwargs = CASES[case]
        model = ZooModel(tiny_lm(variant, **kwargs), tiny_tokenizer(), {"name": case}, name=case)
        export_model(model, root / case, verify=False)
        _EXPORTS[case] = (model, root / case)
    return _EXPORTS[case]


def _ppl(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1))))


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_export_matches_eager(case, fmt, export_root):
    model, root = exported(case, export_root)
    runner = OnnxRunner(root / "onnx") if fmt == "onnx" else TorchScriptRunner(root / "torchscript")
    lm = model.lm
    gen = torch.Generator().manual_seed(1)
    for batch, length in SHAPES:
        assert batch != EXAMPLE_BATCH
        tokens = torch.randint(0, lm.vocab_size, (batch, length), generator=gen)
        targets = torch.randint(0, lm.vocab_size, (batch, length), generator=gen)
        state = tuple(torch.randn(s.shape, generator=gen) * 0.5 for s in lm.init_state(batch))
        with torch.no_grad():
            ref, ref_state = lm(tokens, state)
        logits, new_state = runner.forward(tokens, state)
        assert logits.shape == (batch, length, lm.vocab_size)
        assert float((logits - ref).abs().max()) <= 1e-4
        assert len(new_state) == len(ref_state)
        for got, want in zip(new_state, ref_state, strict=True):
            assert float((got - want).abs().max()) <= 1e-4
        ppl, ppl_ref = _ppl(logits, targets), _ppl(ref, targets)
        assert abs(ppl - ppl_ref) / ppl_ref <= 1e-5
        # stepping the single-step entry point through the text reproduces the sequence entry point
        st, stepped = state, []
        for t in range(length):
            step_logits, st = runner.step(tokens[:, t], st)
            stepped.append(step_logits)
        assert float((torch.stack(stepped, 1) - logits).abs().max()) <= 1e-5
        for got, want in zip(st, new_state, strict=True):
            assert float((got - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_onnx_graphs_have_dynamic_axes_names_and_metadata(case, export_root):
    model, root = exported(case, export_root)
    names = model.lm.state_names()
    seq = onnx.load(str(root / "onnx" / SEQUENCE_FILE))
    step = onnx.load(str(root / "onnx" / STEP_FILE))
    # the whole sequence is ONE Scan node: no unrolled time loop, no fixed length
    assert [n.op_type for n in seq.graph.node] == ["Scan"]
    assert [i.name for i in seq.graph.input] == ["tokens", *names]
    assert [o.name for o in seq.graph.output] == ["logits", *[f"{n}_out" for n in names]]
    assert [i.name for i in step.graph.input] == ["token", *names]
    assert [o.name for o in step.graph.output] == ["logits", *[f"{n}_out" for n in names]]
    tok_dims = [d.dim_param for d in seq.graph.input[0].type.tensor_type.shape.dim]
    assert tok_dims == ["batch", "time"]
    assert step.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    for graph in (seq.graph, step.graph):
        for value in [*graph.input[1:], *graph.output]:
            assert value.type.tensor_type.shape.dim[0].dim_param, f"{value.name} has a fixed batch size"
    for m in (seq, step):
        meta = {p.key: p.value for p in m.metadata_props}
        assert meta["zoo.opset"] == str(OPSET)
        assert meta["zoo.checkpoint_sha256"] == weights_sha256(model)
        assert json.loads(meta["zoo.state_names"]) == names
        assert any(o.domain in ("", "ai.onnx") and o.version == OPSET for o in m.opset_import)


def test_onnx_export_is_reproducible(export_root, tmp_path):
    model, root = exported("pnorm_gru", export_root)
    export_model(model, tmp_path, formats=("onnx",), verify=False)
    for fname in (STEP_FILE, SEQUENCE_FILE):
        assert (tmp_path / "onnx" / fname).read_bytes() == (root / "onnx" / fname).read_bytes()


# -- the backend switch on a real checkpoint directory -----------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    lm = tiny_lm("alstm").eval()
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-alstm", lm, tiny_tokenizer(),
                           {"name": "tiny-alstm", "dataset": "ptb"})


@pytest.fixture(scope="module")
def cli_export(checkpoint, tmp_path_factory) -> Path:
    """``zoo export`` of the checkpoint with every format and int8, into <root>/tiny-alstm/."""
    root = tmp_path_factory.mktemp("cli-exports")
    assert main(["export", str(checkpoint), "--format", "all", "--quantize", "int8",
                 "--out", str(root / "tiny-alstm")]) == 0
    return root


TEXTS = ["the cat sat on the mat", "a dog ran\nthe dog sat on a cat 's mat", "mr. N $ n't"]


def test_cli_export_writes_manifests_with_hash_and_parity(checkpoint, cli_export):
    sha = hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()
    onnx_man = read_manifest(cli_export / "tiny-alstm" / "onnx")
    ts_man = read_manifest(cli_export / "tiny-alstm" / "torchscript")
    assert onnx_man["checkpoint_sha256"] == ts_man["checkpoint_sha256"] == sha
    assert onnx_man["opset"] == OPSET
    assert set(onnx_man["files"].values()) == {STEP_FILE, SEQUENCE_FILE, STEP_INT8_FILE, SEQUENCE_INT8_FILE}
    for man in (onnx_man, ts_man):
        assert man["parity"]["passed"]
        assert {(r["batch"], r["time"]) for r in man["parity"]["shapes"]}.isdisjoint({(EXAMPLE_BATCH, 1)})
        for fname, digest in man["file_sha256"].items():
            path = cli_export / "tiny-alstm" / man["format"] / fname
            assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_backend_switch_gives_same_scores_and_generations(checkpoint, cli_export, monkeypatch, tmp_path):
    monkeypatch.setenv("ZOO_EXPORTS_DIR", str(cli_export))
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    models = {b: zoo.load(checkpoint, backend=b) for b in ("eager", "torchscript", "onnx", "onnx-int8")}
    for b in ("torchscript", "onnx", "onnx-int8"):  # the zoo export output was found, nothing re-exported
        assert models[b].backend == b
        assert models[b].runner.directory.parent == cli_export / "tiny-alstm"
    assert not (tmp_path / "cache").exists()
    ref = models["eager"].score(TEXTS, return_tokens=True)
    for b in ("torchscript", "onnx"):
        rep = models[b].score(TEXTS, return_tokens=True)
        for got, want in zip(rep.texts, ref.texts, strict=True):
            assert got["num_tokens"] == want["num_tokens"]
            assert abs(got["ppl"] - want["ppl"]) / want["ppl"] <= 1e-5
            assert max(abs(a["logprob"] - b_["logprob"]) for a, b_ in zip(got["tokens"], want["tokens"],
                                                                          strict=True)) <= 1e-4
        assert models[b].generate_ids("the cat", max_new_tokens=12, temperature=0, stop_at_eos=False) == \
            models["eager"].generate_ids("the cat", max_new_tokens=12, temperature=0, stop_at_eos=False)
        assert models[b].generate("the dog", max_new_tokens=12, seed=3, top_k=5) == \
            models["eager"].generate("the dog", max_new_tokens=12, seed=3, top_k=5)
    q = models["onnx-int8"].score(TEXTS).corpus["ppl"]
    assert abs(q - ref.corpus["ppl"]) / ref.corpus["ppl"] <= 0.01


def test_exports_shipped_in_a_checkpoint_folder_are_trusted_only_as_verified_onnx(checkpoint, cli_export,
                                                                                 monkeypatch, tmp_path):
    """A checkpoint folder (or Hub snapshot) may carry exports. A TorchScript file is a pickle, so one that came
    with the checkpoint is never loaded (the model is exported into the cache instead); ONNX graphs are data and
    are used when every file matches its manifest's sha256, and a tampered one is passed over."""
    import shutil

    from zoo.backends import candidate_dirs, ensure_export
    from zoo.export.common import weights_sha256

    shipped = tmp_path / "shipped" / "tiny-alstm"
    shutil.copytree(checkpoint, shipped)
    for fmt in ("onnx", "torchscript"):
        shutil.copytree(cli_export / "tiny-alstm" / fmt, shipped / fmt)
    monkeypatch.setenv("ZOO_EXPORTS_DIR", str(tmp_path / "no-exports"))
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    model = zoo.load(shipped)
    sha = weights_sha256(model)
    assert all(d != shipped / "torchscript" for d, _ in candidate_dirs(model, "torchscript", sha))
    assert ensure_export(model, "torchscript").is_relative_to(tmp_path / "cache")  # made here, not the shipped one
    assert ensure_export(model, "onnx") == shipped / "onnx"                        # verified: used as it is
    blobs = tmp_path / "blobs"   # a Hub snapshot: its files are links into the repo's blobs, outside the folder
    blobs.mkdir()
    for f in (shipped / "onnx").iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        f.unlink()
        f.symlink_to(blobs / f.name)
    assert ensure_export(model, "onnx") == shipped / "onnx"
    step = shipped / "onnx" / STEP_FILE
    step.write_bytes(step.read_bytes() + b"\0")                                    # tampered after its manifest
    assert ensure_export(model, "onnx").is_relative_to(tmp_path / "cache")
    assert zoo.load(shipped, backend="onnx").score(TEXTS[0]).corpus["num_tokens"] > 0


@pytest.mark.parametrize("name", ["../../escape", "/abs/path", "a/b", ".hidden", 5])
def test_a_config_name_that_is_not_a_plain_name_is_refused(checkpoint, tmp_path, name):
    """The name names a folder (the exports): config.json cannot point it outside."""
    import json
    import shutil

    from zoo.errors import CheckpointError

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "name": name}))
    with pytest.raises(CheckpointError, match="must be a plain name"):
        zoo.load(bad)


def test_int8_graphs_are_quantised_and_keep_tied_weights_right(cli_export):
    directory = cli_export / "tiny-alstm" / "onnx"
    step_q = onnx.load(str(directory / STEP_INT8_FILE))
    seq_q = onnx.load(str(directory / SEQUENCE_INT8_FILE))
    ops = {n.op_type for n in step_q.graph.node}
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= ops
    assert [n.op_type for n in seq_q.graph.node] == ["Scan"]
    # the tiny aLSTM ties its embedding to the decoder; quantising must not transpose the shared matrix
    tokens = torch.arange(15).reshape(3, 5)
    fp, _ = OnnxRunner(directory).forward(tokens)
    q, _ = OnnxRunner(directory, int8=True).forward(tokens)
    assert float((fp - q).abs().max()) < 0.05
    assert not np.allclose(fp.numpy(), q.numpy(), atol=0, rtol=0)  # really a different (quantised) graph


def test_lazy_export_into_cache_is_reused_and_stale_exports_ignored(checkpoint, cli_export, monkeypatch, tmp_path):
    # a stale export under the exports root (another checkpoint's hash) must not be used
    stale = tmp_path / "root" / "tiny-alstm" / "torchscript"
    stale.mkdir(parents=True)
    for f in (cli_export / "tiny-alstm" / "torchscript").iterdir():
        stale.joinpath(f.name).write_bytes(f.read_bytes())
    man = json.loads((stale / "export.json").read_text())
    man["checkpoint_sha256"] = "0" * 64
    (stale / "export.json").write_text(json.dumps(man))
    monkeypatch.setenv("ZOO_EXPORTS_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    first = zoo.load(checkpoint, backend="torchscript")
    sha = hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()
    assert first.runner.directory == tmp_path / "cache" / "exports" / sha / "torchscript"
    stamp = (first.runner.directory / "model.pt").stat().st_mtime_ns
    second = zoo.load(checkpoint, backend="torchscript")
    assert second.runner.directory == first.runner.directory
    assert (second.runner.directory / "model.pt").stat().st_mtime_ns == stamp
    assert second.score(TEXTS[0])[0]["ppl"] == pytest.approx(zoo.load(checkpoint).score(TEXTS[0])[0]["ppl"],
                                                             rel=1e-5)


@pytest.mark.parametrize(("backend", "fname"), [("torchscript", "model.pt"), ("onnx", SEQUENCE_FILE)])
def test_a_damaged_export_is_made_again_in_the_cache_and_named_elsewhere(checkpoint, cli_export, monkeypatch,
                                                                          tmp_path, capsys, backend, fname):
    """A torn file whose manifest still reads was a runtime's traceback (a zip or protobuf error, exit 1): in the
    zoo's own cache it is exported again, in a folder the user made it is a one-line error naming it (exit 2),
    and a cache that cannot be written says so and names ZOO_CACHE_DIR."""
    from zoo.errors import BackendError

    monkeypatch.setenv("ZOO_EXPORTS_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    eager = zoo.load(checkpoint).score(TEXTS[0])[0]["ppl"]
    cached = zoo.load(checkpoint, backend=backend).runner.directory
    assert cached.is_relative_to(tmp_path / "cache")
    (cached / fname).write_bytes((cached / fname).read_bytes()[:200])
    capsys.readouterr()
    again = zoo.load(checkpoint, backend=backend)
    warned = capsys.readouterr().err
    assert "the " + backend + " export does not load" in warned and "; exporting again" in warned
    assert again.runner.directory == cached and again.score(TEXTS[0])[0]["ppl"] == pytest.approx(eager, rel=1e-5)

    mine = tmp_path / "root" / "tiny-alstm" / _fmt(backend)
    shutil.copytree(cli_export / "tiny-alstm" / _fmt(backend), mine)
    (mine / fname).write_bytes((mine / fname).read_bytes()[:200])
    with pytest.raises(BackendError, match=rf"{mine}: the {backend} export does not load \(.*\); delete it or "
                                           r"run `zoo export` again") as e:
        zoo.load(checkpoint, backend=backend)
    assert "\n" not in str(e.value)
    code = main(["score", str(checkpoint), "--backend", backend, "--text", TEXTS[0]])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "does not load" in err
    shutil.rmtree(mine)

    (tmp_path / "not-a-folder").write_text("x")
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "not-a-folder"))
    with pytest.raises(BackendError, match="cannot write the export cache .*not-a-folder.*set ZOO_CACHE_DIR"):
        zoo.load(checkpoint, backend=backend)


def _fmt(backend: str) -> str:
    return "onnx" if backend.startswith("onnx") else backend


def test_cli_backend_flag(checkpoint, cli_export, monkeypatch, capsys):
    monkeypatch.setenv("ZOO_EXPORTS_DIR", str(cli_export))
    results = {}
    for backend in ("eager", "onnx", "torchscript"):
        assert main(["score", str(checkpoint), "--backend", backend, "--text", TEXTS[1], "--json"]) == 0
        results[backend] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for backend in ("onnx", "torchscript"):
        assert results[backend]["ppl"] == pytest.approx(results["eager"]["ppl"], rel=1e-5)


def test_cli_export_errors(checkpoint, capsys):
    assert main(["export", "no-such-model-anywhere"]) == 2
    assert "no-such-model-anywhere" in capsys.readouterr().err
    assert main(["export", str(checkpoint), "--format", "torchscript", "--quantize", "int8"]) == 2
    assert "--quantize" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["export", str(checkpoint), "--format", "tflite"])
    assert exc.value.code == 2


def test_unknown_backend_is_a_clear_error(checkpoint):
    with pytest.raises(ValueError, match="unknown backend"):
        zoo.load(checkpoint, backend="tensorrt")


def test_default_model_onnx_backend_matches_eager(monkeypatch, tmp_path):
    """The bundled default (shipped in the repository) through ONNX Runtime equals eager."""
    assert (bundled_dir() / str(catalog().get("default"))).is_dir(), "the catalogue default must be bundled"
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ZOO_EXPORTS_DIR", str(tmp_path / "none"))
    eager = zoo.load("default")
    onnx_model = zoo.load("default", backend="onnx")
    text = "the company said its third-quarter profit rose N % on higher sales"
    assert onnx_model.score(text)[0]["ppl"] == pytest.approx(eager.score(text)[0]["ppl"], rel=1e-5)
    assert onnx_model.generate_ids("the market", max_new_tokens=8, temperature=0) == \
        eager.generate_ids("the market", max_new_tokens=8, temperature=0)
