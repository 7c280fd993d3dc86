"""What every export format shares: the step module, the checkpoint hash, manifests and default locations.

Why one step module for everything: the exports are architecture-agnostic by construction. They are
built from :meth:`zoo.lm.LanguageModel.step` (embedding -> ``rnn.step`` -> decoder) with the state
as a flat tuple named by ``lm.state_names()``, the one interface every registered architecture
implements; the sequence entry points are a loop (ONNX ``Scan``, TorchScript ``for``) over that step.
Nothing here looks at the architecture, so a new architecture exports without touching this package.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from zoo.files import cache_home, sha256_file, write_atomic
from zoo.lm import LanguageModel

#: Bumped when the layout or the I/O contract of the exported files changes.
EXPORT_VERSION = 1
MANIFEST = "export.json"
#: Batch size of the example inputs used to capture the graphs; parity checks use other shapes.
EXAMPLE_BATCH = 2


def exports_root() -> Path:
    """Where ``zoo export`` writes by default and where backends look first: ``$ZOO_EXPORTS_DIR`` (a checkout's
    ``.venv`` sets it to ``exports/out``), else ``$XDG_DATA_HOME/alstm-zoo/exports`` (``~/.local/share/...``)."""
    env = os.environ.get("ZOO_EXPORTS_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "alstm-zoo" / "exports"


def cache_root() -> Path:
    """Cache of lazily created exports, keyed by checkpoint hash (:func:`zoo.files.cache_home`/exports)."""
    return cache_home() / "exports"


class StepModule(nn.Module):
    """``(token [B], *state) -> (logits [B, V], *new_state)``: the LM's step with a flat state signature.

    Flat positional tensors (not a tuple argument) give ONNX one named input per state tensor.
    """

    def __init__(self, lm: LanguageModel) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, token: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
        logits, new_state = self.lm.step(token, tuple(state))
        return (logits, *new_state)


def state_shapes(lm: LanguageModel) -> list[list[int]]:
    """The per-example shape of every state tensor (the state without its batch dimension)."""
    return [list(s.shape[1:]) for s in lm.init_state(1)]


def weights_sha256(model: Any) -> str:
    """SHA-256 of the checkpoint a model was loaded from (its ``model.safetensors`` bytes).

    A model built in memory has no file; then the hash is taken over its state dict (names, shapes,
    float32 bytes), so the same weights always map to the same export cache entry.
    """
    directory = getattr(model, "directory", None)
    if directory is not None and (Path(directory) / "model.safetensors").is_file():
        return sha256_file(Path(directory) / "model.safetensors")
    lm: LanguageModel = model.lm if hasattr(model, "lm") else model
    h = hashlib.sha256(json.dumps(lm.config, sort_keys=True).encode())
    for key, value in sorted(lm.state_dict().items()):
        h.update(f"{key}:{tuple(value.shape)}".encode())
        h.update(value.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def base_manifest(model: Any, fmt: str, sha256: str) -> dict[str, Any]:
    """The fields every export manifest carries (what a backend checks before trusting an export)."""
    lm: LanguageModel = model.lm
    return {
        "export_version": EXPORT_VERSION,
        "format": fmt,
        "model_name": getattr(model, "name", None),
        "checkpoint_sha256": sha256,
        "architecture": lm.architecture,
        "model_args": lm.config,
        "vocab_size": lm.vocab_size,
        "state_names": lm.state_names(),
        "state_shapes": state_shapes(lm),
        "torch_version": torch.__version__.split("+")[0],
        "files": {},
    }


def write_manifest(directory: Path, manifest: dict[str, Any]) -> Path:
    return write_atomic(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of an export folder, or ``None`` when there is none or it is unreadable."""
    try:
        return json.loads((Path(directory) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        return None


