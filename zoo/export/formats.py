"""The export-format registry: every fact about an export format, written once.

An :class:`ExportFormat` names the function that writes an export folder, the runner class that runs one, the
inference backends that run from it (:class:`FormatBackend`: ``onnx`` and ``onnx-int8`` both run from the ``onnx``
folder), the quantisations it can add, the module it imports and whether loading its files can run code.
``zoo export``, :func:`zoo.export.export_model`, the parity check (:mod:`zoo.export.verify`) and the backend
registry (:mod:`zoo.backends`) all read this registry: adding a format is one module (its exporter and its runner)
plus one :func:`register_format` call here, and nothing else, as an architecture is one file plus one
:func:`zoo.registry.register_architecture` call.

Functions and classes are named by import path (``"module:name"``) so that importing the registry stays cheap (no
exporter, no runtime is imported until a format is used) and a broken optional module cannot break the others.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.errors import ConfigError


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class FormatBackend:
    """An inference backend that runs from a format's folder: ``files`` are the manifest entries it needs there;
    ``int8``: it runs the dynamically quantised files (written with ``quantize="int8"``); ``servable``: TorchServe's
    handler can run it (the worker loads it from a model archive)."""

    name: str
    description: str
    files: tuple[str, ...]
    int8: bool = False
    servable: bool = True


@dataclass(frozen=True)
class ExportFormat:
    """One export format. ``exporter``: ``"module:function"``, ``function(model, out_dir, sha256, quantize=None)``
    writes the folder and its manifest and returns the manifest; ``runner``: ``"module:Class"``,
    ``Class(directory[, int8=True])`` runs it (``init_state``, ``forward``, ``step``, as the eager model)."""

    name: str
    description: str
    exporter: str
    runner: str
    backends: tuple[FormatBackend, ...]
    #: What ``quantize=`` may add besides the float files (``zoo export --quantize``).
    quantizations: tuple[str, ...] = ()
    #: A module the runner imports (a clear error naming it when missing, not an ImportError at run time).
    requires: str | None = None
    #: The modules the exporter imports (``zoo export`` names the missing ones before it loads the model).
    exporter_requires: tuple[str, ...] = ()
    #: Loading its files can run code (TorchScript: see :mod:`zoo.export.torchscript`): then only an export made on
    #: this machine (the exports folder, the export cache) is used, never one that came with a checkpoint or a Hub
    #: snapshot. ONNX graphs are data: a shipped one is used when every file matches its manifest's sha256.
    loads_code: bool = False

    def export(self, model: Any, out_dir: Path, sha256: str, quantize: str | None = None) -> dict[str, Any]:
        """Write the export folder ``out_dir`` (with ``quantize``'s files too) and return its manifest."""
        extra = {} if quantize is None else {"quantize": quantize}
        return _resolve(self.exporter)(model, out_dir, sha256, **extra)

    def open(self, directory: Path, int8: bool = False) -> Any:
        """The runner of the export in ``directory`` (its int8 files with ``int8``)."""
        cls = _resolve(self.runner)
        return cls(directory, int8=True) if int8 else cls(directory)


EXPORT_FORMATS: dict[str, ExportFormat] = {}


def register_format(spec: ExportFormat) -> ExportFormat:
    EXPORT_FORMATS[spec.name] = spec
    return spec


def format_names() -> tuple[str, ...]:
    """The registered formats, in the order ``zoo export --format all`` writes them."""
    return tuple(EXPORT_FORMATS)


def get_format(name: str) -> ExportFormat:
    try:
        return EXPORT_FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown export format {name!r} (choose from {', '.join(EXPORT_FORMATS)})") from None


register_format(ExportFormat(
    "onnx", "the ONNX graphs (a Scan graph for sequences, a step graph) and the tokenizer",
    "zoo.export.onnx_graphs:export_onnx", "zoo.export.onnx_runtime:OnnxRunner",
    (FormatBackend("onnx", "ONNX Runtime: a Scan graph for sequences, a step graph", ("sequence", "step")),
     FormatBackend("onnx-int8", "ONNX Runtime with dynamically quantised int8 weights",
                   ("sequence_int8", "step_int8"), int8=True)),
    quantizations=("int8",), requires="onnxruntime", exporter_requires=("onnx", "onnxscript", "onnxruntime")))
register_format(ExportFormat(
    "torchscript", "the traced TorchScript module",
    "zoo.export.torchscript:export_torchscript", "zoo.export.torchscript:TorchScriptRunner",
    (FormatBackend("torchscript", "the traced TorchScript module", ("module",), servable=False),),
    loads_code=True))
