"""The demo's models: the catalogue's bundled models plus extra checkpoint directories, each with its card and
training curve, loaded lazily through the library's :class:`zoo.model_cache.ModelCache`.

Why a registry of its own: the demo names models as a visitor sees them (a ``--model-dir`` checkpoint whose name
clashes with a bundled one gets its folder in the name), shows models it has not loaded (the Models tab's table),
and turns every failure into a one-line ``gr.Error`` that the page shows, never a traceback. One registry is made
by ``app.py`` and handed to the handlers (:mod:`zoo.tools.demo.handlers`) and the UI (:mod:`zoo.tools.demo.ui`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gradio as gr

import zoo
from zoo.catalog import bundled_dir, catalog
from zoo.checkpoint import CheckpointError, read_config
from zoo.errors import ZooError
from zoo.model_cache import ModelCache
from zoo.registry import ARCHITECTURES
from zoo.tools import REPO
from zoo.tools.demo.render import _fmt, render_curve
from zoo.tools.demo.stats import DynamicStats
from zoo.zoo_model import ZooModel

log = logging.getLogger("zoo.demo")


def user_error(message: str) -> gr.Error:
    """A mistake the user can fix (an empty box, an unknown model, statistics not ready yet): the page shows
    ``message``, and the terminal gets it as one log line, not Gradio's traceback of the raise (a traceback is
    for bugs: those are logged with theirs where they are caught)."""
    log.warning("app.py: user error: %s", message)
    return gr.Error(message, print_exception=False)

#: Loaded models kept in memory (least recently used is dropped): two compute slots, each comparing two models.
CACHE_SIZE = 4


class ModelRegistry:
    """The catalogue's bundled models plus extra checkpoint directories, loaded lazily into an LRU cache."""

    def __init__(self, extra_dirs: Sequence[str | os.PathLike] = (), device: str = "cpu"):
        self.device = device  # (every model is loaded onto it: `python app.py --device cuda`)
        self.entries: dict[str, dict[str, Any]] = {}
        cat = catalog()
        for name, meta in sorted(cat.get("models", {}).items()):
            directory = bundled_dir() / name
            if (directory / "config.json").is_file():  # offline: only what is bundled
                self.entries[name] = {"source": "bundled", "dir": directory, "meta": dict(meta)}
        for directory in self._expand(extra_dirs):
            try:
                config = read_config(directory)
            except CheckpointError as e:
                raise ValueError(str(e)) from None
            name = str(config.get("name") or directory.name)
            if name in self.entries:
                name = f"{name} ({directory})"
            self.entries[name] = {"source": "local path", "dir": directory, "meta": self._meta_from_config(config)}
        default = cat.get("default")
        self.default = default if default in self.entries else next(iter(self.entries), None)
        self.cache = ModelCache(CACHE_SIZE)

    @staticmethod
    def _expand(paths: Sequence[str | os.PathLike]) -> list[Path]:
        """A path is a checkpoint directory or a folder of checkpoint directories."""
        out: list[Path] = []
        for raw in paths:
            path = Path(raw).expanduser()
            if (path / "config.json").is_file():
                out.append(path)
            elif path.is_dir():
                subs = [p for p in sorted(path.iterdir()) if (p / "config.json").is_file()]
                if not subs:
                    raise ValueError(f"{path}: no checkpoint directory (config.json) in it")
                out.extend(subs)
            else:
                raise ValueError(f"{path}: not a directory")
        return out

    @staticmethod
    def _meta_from_config(config: dict[str, Any]) -> dict[str, Any]:
        metrics = config.get("metrics") if isinstance(config.get("metrics"), dict) else {}
        return {"architecture": config.get("architecture"), "dataset": config.get("dataset"),
                "num_parameters": config.get("num_parameters"), "metrics": metrics}

    def names(self) -> list[str]:
        return list(self.entries)

    def check(self, name: Any) -> str:
        if not isinstance(name, str) or name not in self.entries:
            known = ", ".join(self.entries) or "none (bundle a model or pass --model-dir)"
            raise user_error(f"Unknown model {name!r}. Available: {known}.")
        return name

    def get(self, name: Any) -> ZooModel:
        """The model ``name``, from the cache (loaded on first use; shared by every tab and request)."""
        name = self.check(name)
        entry = self.entries[name]
        source = name if entry["source"] == "bundled" else str(entry["dir"])
        return self.cache.get(source, self.device, lambda: self.load(name))

    def load(self, name: str) -> ZooModel:
        """A fresh copy of the model ``name`` (not cached: :meth:`get` caches)."""
        entry = self.entries[name]
        try:
            model = zoo.load(name if entry["source"] == "bundled" else entry["dir"], device=self.device)
        except Exception as e:  # a broken checkpoint must not take the app down
            if isinstance(e, ZooError):  # a checkpoint the user gave that is not one: their mistake, one line
                raise user_error(f"Could not load model {name!r}: {e}") from None
            log.exception("loading %s failed", name)  # a bug: its traceback once, in the log
            raise gr.Error(f"Could not load model {name!r}: {e}", print_exception=False) from None
        model.name = name
        return model

    def has_adaptation(self, name: str) -> bool:
        arch = self.entries[name]["meta"].get("architecture")
        return arch in ARCHITECTURES and ARCHITECTURES[arch].adapts

    def table(self) -> list[list[Any]]:
        rows = []
        for name, entry in self.entries.items():
            meta, met = entry["meta"], entry["meta"].get("metrics") or {}
            params = meta.get("num_parameters")
            digits = 3 if met.get("metric") == "bits_per_char" else 2  # bits per character as the cards give them
            rows.append([name + (" (default)" if name == self.default else ""), meta.get("architecture") or "",
                         meta.get("dataset") or "", f"{params:,}" if isinstance(params, int) else "",
                         _fmt(met.get("valid"), digits), _fmt(met.get("test"), digits), met.get("metric") or "",
                         entry["source"]])
        return rows

    def card(self, name: str) -> str:
        entry = self.entries[name]
        for path in (entry["dir"] / "README.md", REPO / "model_cards" / f"{name}.md"):
            if path.is_file():
                text = path.read_text(encoding="utf-8", errors="replace")
                if text.startswith("---"):  # drop the YAML front matter, the table shows its content
                    end = text.find("\n---", 3)
                    text = text[end + 4:] if end > 0 else text
                # a card's images are relative to its folder, which the demo does not serve (weights live
                # there): the curve is shown beside the card instead, so the links go, with a pointer
                text = re.sub(r"!\[([^\]]*)\]\([^)\s]+\)", r"*(\1: shown under 'training curve')*", text)
                return text.strip()
        return f"*No model card bundled for `{name}`.*"

    def curve(self, name: str) -> str | None:
        """A training-curve image: the catalogue's ``training_curve``, an image beside the checkpoint, or one
        drawn from the training run's ``log.jsonl`` (beside the checkpoint or in ``runs/<name>/``)."""
        entry = self.entries[name]
        hint = entry["meta"].get("training_curve") or entry["meta"].get("curve")
        candidates = [entry["dir"] / hint, REPO / hint] if isinstance(hint, str) else []
        candidates += [entry["dir"] / f for f in ("training_curve.png", "curve.png", "training_curve.jpg")]
        candidates += [REPO / "model_cards" / f"{name}{s}" for s in ("-curve.png", "_curve.png", ".png")]
        candidates += [p for ext in ("png", "jpg", "jpeg", "svg") for p in sorted(entry["dir"].glob(f"*.{ext}"))]
        found = next((p for p in candidates if p.is_file()), None)
        if found is not None:
            return str(found)
        for log_file in (entry["dir"] / "log.jsonl", REPO / "runs" / name / "log.jsonl"):
            if log_file.is_file():
                return render_curve(log_file, name)
        return None


def dynamic_stats_of(registry: ModelRegistry) -> DynamicStats:
    """The collector of dynamic evaluation's statistics (:mod:`zoo.tools.demo.stats`): at start-up the
    ``--model-dir`` models (the operator named them) and the default model, the rest of the catalogue on first use."""
    entries = registry.entries
    every = [(n, "bundled" if e["source"] == "bundled" else str(e["dir"])) for n, e in entries.items()]
    first = [(n, src) for n, src in every if entries[n]["source"] != "bundled" or n == registry.default]
    return DynamicStats(sorted(first, key=lambda m: m[0] == registry.default), every)
