"""Adding an export format is one module and one registration: a toy format defined in this test module (the
eager model's own checkpoint files in an export folder, run by the model they load) goes through
:func:`zoo.export.export_model` with its parity check, ``zoo export --format``, and a backend of its own
(``zoo.load(..., backend=...)``, found or exported into the cache), with no other file of the zoo edited: the
format registry (:mod:`zoo.export.formats`) is the only place the rest of the code learns about formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zoo
from zoo.backends import BACKENDS, backend_names, get_backend
from zoo.checkpoint import load_checkpoint, save_checkpoint
from zoo.cli import main
from zoo.export import export_model
from zoo.export.common import base_manifest, read_manifest, write_manifest
from zoo.export.formats import EXPORT_FORMATS, ExportFormat, FormatBackend, format_names, register_format

from .conftest import tiny_lm, tiny_tokenizer

TEXT = "the cat sat on the mat"


def export_toy(model: Any, out_dir: Path, sha256: str, quantize: str | None = None) -> dict[str, Any]:
    """The toy format's exporter: the checkpoint's files beside the manifest every export writes."""
    save_checkpoint(out_dir, model.lm, model.tokenizer)
    manifest = base_manifest(model, "toy", sha256)
    manifest["files"] = {"weights": "model.safetensors", "config": "config.json"}
    write_manifest(out_dir, manifest)
    return manifest


class ToyRunner:
    """The toy format's runner: the model its folder holds, behind the runner protocol."""

    def __init__(self, directory: Path) -> None:
        self.lm = load_checkpoint(directory)[0].eval()

    def init_state(self, batch_size: int, device: Any = None) -> tuple[torch.Tensor, ...]:
        return self.lm.init_state(batch_size)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
        return self.lm(tokens, state)

    __call__ = forward

    @torch.no_grad()
    def step(self, token: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        return self.lm.step(token, state)


@pytest.fixture
def toy_format(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_EXPORTS_DIR", str(tmp_path / "exports"))
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    spec = register_format(ExportFormat("toy", "the checkpoint's own files", f"{__name__}:export_toy",
                                        f"{__name__}:ToyRunner", (FormatBackend("toy", "the toy runner", ("weights",),
                                                                                servable=False),)))
    yield spec
    EXPORT_FORMATS.pop("toy")
    BACKENDS.pop("toy", None)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return save_checkpoint(tmp_path / "tiny-alstm", tiny_lm("alstm"), tiny_tokenizer())


def test_a_registered_format_exports_with_its_parity_check(toy_format, checkpoint, tmp_path):
    model = zoo.load(checkpoint)
    manifest = export_model(model, tmp_path / "out", formats=("toy",))["toy"]
    assert manifest["parity"]["passed"] and manifest["parity"]["max_abs_logit_diff"] <= 1e-5
    assert read_manifest(tmp_path / "out" / "toy")["format"] == "toy"
    assert "toy" in format_names() and get_backend("toy").format == "toy"
    assert "toy" in backend_names() and "toy" not in backend_names(servable_only=True)


def test_its_backend_scores_as_eager(toy_format, checkpoint, capsys):
    """The backend finds no export, exports into the cache (saying so), and scores the text as eager does."""
    eager = zoo.load(checkpoint).score(TEXT)[0]["ppl"]
    toy = zoo.load(checkpoint, backend="toy")
    assert " to toy (first use; cached in " in capsys.readouterr().err
    assert toy.backend == "toy" and isinstance(toy.runner, ToyRunner)
    assert toy.score(TEXT)[0]["ppl"] == pytest.approx(eager, rel=1e-6)


def test_zoo_export_offers_it(toy_format, checkpoint, tmp_path, capsys):
    assert main(["export", str(checkpoint), "--format", "toy", "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "toy" / "model.safetensors").is_file()
    assert main(["export", str(checkpoint), "--format", "toy", "--quantize", "int8"]) == 2
    assert "--quantize int8 applies to the onnx export" in capsys.readouterr().err
