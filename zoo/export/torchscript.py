"""TorchScript export: one module with ``forward`` (sequence) and ``step`` (one token), both with explicit state.

``torch.jit.script`` does not handle every cell (the cells use Python features TorchScript lacks), so
the step is *traced* (the trace of ``LanguageModel.step`` records no Python control flow that could
depend on the batch size), and the sequence entry point is a *scripted* loop over that traced step, so
the time length stays truly dynamic. The state travels as a ``List[Tensor]`` in ``lm.state_names()``
order. TorchScript is deprecated in favour of ``torch.export`` (PyTorch 2.x documentation);
it is shipped because TorchServe and libtorch still load it natively.

**The one exception to "nothing is unpickled".** A TorchScript archive is a zip whose code and constants are
pickled, and ``torch.jit.load`` reads them: loading one can run code. The format requires it, so the zoo loads
TorchScript here and nowhere else (``load_torchscript``; a ruff banned-API rule, TID251 in ``pyproject.toml``,
refuses ``torch.jit.load``, ``torch.load`` and ``pickle`` everywhere else), and only archives made on this machine
(:attr:`zoo.backends.BackendSpec.loads_code`). Weights are safetensors; optimiser state is tensors + JSON.

No ``from __future__ import annotations`` here: TorchScript reads the annotations of the scripted class.
"""

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from zoo.errors import MissingFileError
from zoo.export.common import EXAMPLE_BATCH, base_manifest, read_manifest, state_shapes, write_manifest
from zoo.files import sha256_file
from zoo.lm import LanguageModel

State = tuple[Tensor, ...]

TS_FILE = "model.pt"
META_NAME = "zoo_export.json"


class _ListStep(nn.Module):
    """The LM step with the state as one list argument (what the scripted loop passes around)."""

    def __init__(self, lm: LanguageModel) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, token: Tensor, state: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        logits, new_state = self.lm.step(token, tuple(state))
        return logits, list(new_state)


class ScriptedLM(nn.Module):
    """The scripted wrapper: ``init_state``, ``step`` and a ``forward`` loop over the traced step."""

    def __init__(self, traced_step: torch.jit.ScriptModule, names: list[str], shapes: list[list[int]],
                 vocab_size: int) -> None:
        super().__init__()
        self.step_fn = traced_step
        self.state_names: list[str] = names
        self.state_shapes: list[list[int]] = shapes
        self.vocab_size: int = vocab_size

    @torch.jit.export
    def init_state(self, batch_size: int) -> list[Tensor]:
        """Zero state for ``batch_size`` sequences (float32, CPU)."""
        state: list[Tensor] = []
        for shape in self.state_shapes:
            state.append(torch.zeros([batch_size] + shape))
        return state

    @torch.jit.export
    def step(self, token: Tensor, state: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """``token [B]`` -> ``(logits [B, V], new_state)``."""
        return self.step_fn(token, state)

    def forward(self, tokens: Tensor, state: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """``tokens [B, T]`` -> ``(logits [B, T, V], state after the last token)``."""
        if tokens.size(1) == 0:
            return torch.zeros([tokens.size(0), 0, self.vocab_size]), state
        outs: list[Tensor] = []
        for t in range(tokens.size(1)):
            logits, state = self.step_fn(tokens[:, t], state)
            outs.append(logits)
        return torch.stack(outs, 1), state


def build_torchscript(lm: LanguageModel) -> torch.jit.ScriptModule:
    """Trace the step, script the loop around it (float32, CPU, eval mode)."""
    lm = lm.eval()
    example_state = list(lm.init_state(EXAMPLE_BATCH))
    example_token = torch.zeros(EXAMPLE_BATCH, dtype=torch.long)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings and TorchScript's deprecation notice
        traced = torch.jit.trace(_ListStep(lm), (example_token, example_state), check_trace=False)
        return torch.jit.script(ScriptedLM(traced, lm.state_names(), state_shapes(lm), lm.vocab_size))


def save_torchscript(module: torch.jit.ScriptModule, path: Path, meta: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(module, str(tmp), _extra_files={META_NAME: json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)


def load_torchscript(path: Path) -> tuple[torch.jit.ScriptModule, dict[str, Any]]:
    """Load an exported module and its embedded metadata. Unpickles (see the module's docstring): only for an
    archive this machine exported."""
    extra = {META_NAME: ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)  # noqa: TID251 (the exception)
    return module.eval(), json.loads(extra[META_NAME] or "{}")


def export_torchscript(model: Any, out_dir: Path, sha256: str) -> dict[str, Any]:
    """Write ``out_dir/model.pt`` and ``out_dir/export.json``; returns the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = base_manifest(model, "torchscript", sha256)
    manifest["entry_points"] = {
        "forward": "forward(tokens: Tensor[B, T] int64, state: List[Tensor]) -> (logits [B, T, V], state)",
        "step": "step(token: Tensor[B] int64, state: List[Tensor]) -> (logits [B, V], state)",
        "init_state": "init_state(batch_size: int) -> List[Tensor]",
    }
    module = build_torchscript(model.lm)
    meta = {k: manifest[k] for k in ("checkpoint_sha256", "state_names", "state_shapes", "vocab_size",
                                     "architecture", "model_name", "export_version")}
    save_torchscript(module, out_dir / TS_FILE, meta)
    manifest["files"] = {"module": TS_FILE}
    manifest["file_sha256"] = {TS_FILE: sha256_file(out_dir / TS_FILE)}
    write_manifest(out_dir, manifest)
    return manifest


class TorchScriptRunner:
    """Runs the exported TorchScript module (``forward`` loop over the traced step; ``step``)."""

    backend = "torchscript"

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None or manifest.get("format") != "torchscript":
            raise MissingFileError(f"{self.directory}: no TorchScript export (missing or unreadable export.json)")
        self.manifest = manifest
        self.module, self.meta = load_torchscript(self.directory / manifest["files"]["module"])
        self.state_names: list[str] = manifest["state_names"]

    def init_state(self, batch_size: int, device: Any = None) -> State:
        return tuple(self.module.init_state(batch_size))

    @torch.no_grad()
    def forward(self, tokens: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        if state is None:
            state = self.init_state(tokens.shape[0])
        logits, new_state = self.module(tokens.long(), [s.float() for s in state])
        return logits, tuple(new_state)

    __call__ = forward

    @torch.no_grad()
    def step(self, token: Tensor, state: State) -> tuple[Tensor, State]:
        logits, new_state = self.module.step(token.long(), [s.float() for s in state])
        return logits, tuple(new_state)
