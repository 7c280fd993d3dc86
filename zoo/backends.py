"""Inference backends: the same ``init_state / forward / step`` runner protocol on TorchScript and ONNX Runtime.

``zoo.load(name, backend="onnx")`` (and ``--backend`` on the CLI) swaps the eager
:class:`~zoo.lm.LanguageModel` for one of these runners; scoring and generation call only the runner,
so results agree with eager to float tolerance. Where the exported files come from, in order:

1. ``exports/out/<name>/<format>/`` (``zoo export``; ``$ZOO_EXPORTS_DIR`` overrides the root),
2. ``<checkpoint dir>/<format>/`` (a Hub snapshot that carries its exports),
3. the export cache ``~/.cache/alstm-zoo/exports/<checkpoint sha256>/<format>/`` (``$ZOO_CACHE_DIR``),
4. otherwise the model is exported into that cache on first use.

An export is used only if its manifest names the same checkpoint hash and model arguments, so a
stale export is never silently paired with other weights.

Backends are a registry (:data:`BACKENDS`, one :class:`BackendSpec` each: its export format, the files of the
export it needs, how to export and how to build its runner, what it must import, whether TorchServe can run
it). The CLI's choices, the server, the benchmarks and the tests read it. Every backend but ``eager`` comes from
an export format's entry (:mod:`zoo.export.formats`, where a new format and its backends are registered):
``onnx`` and ``onnx-int8`` (the dynamically quantised graphs, :mod:`zoo.export.onnx_runtime`) and ``torchscript``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from zoo.errors import BackendError
from zoo.export.common import cache_root, exports_root, read_manifest, weights_sha256
from zoo.export.formats import EXPORT_FORMATS, ExportFormat, FormatBackend
from zoo.files import sha256_file


# -- the registry --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendSpec:
    """One inference backend. ``format`` is the export folder it runs from (``None``: the eager model itself);
    ``files`` the manifest entries it needs there; ``export(model, folder, sha256)`` writes such a folder;
    ``runner(folder)`` builds the runner; ``requires`` names a module it imports (a clear error if missing)."""

    name: str
    format: str | None
    description: str
    runner: Callable[[Path], Any] | None = None
    export: Callable[[Any, Path, str], None] | None = None
    files: tuple[str, ...] = ()
    requires: str | None = None
    #: TorchServe's handler can run it (the worker loads it from a model archive).
    servable: bool = True
    #: Loading its files can run code: see :attr:`zoo.export.formats.ExportFormat.loads_code`.
    loads_code: bool = False


BACKENDS: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> BackendSpec:
    BACKENDS[spec.name] = spec
    return spec


def _add_format_backends() -> None:
    """The backends of every export format registered since (:func:`zoo.export.formats.register_format`)."""
    for fmt in EXPORT_FORMATS.values():
        for b in fmt.backends:
            if b.name not in BACKENDS:
                register_backend(_from_format(fmt, b))


def backend_names(servable_only: bool = False) -> list[str]:
    _add_format_backends()
    return [n for n, s in BACKENDS.items() if s.servable or not servable_only]


def get_backend(name: str) -> BackendSpec:
    _add_format_backends()
    try:
        return BACKENDS[name]
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}") from None


def _from_format(fmt: ExportFormat, b: FormatBackend) -> BackendSpec:
    """The backend ``b`` of the export format ``fmt`` (its runner over the format's folder, its export)."""
    quantize = "int8" if b.int8 else None
    return BackendSpec(b.name, fmt.name, b.description, lambda d: fmt.open(d, int8=b.int8),
                       lambda model, d, sha256: fmt.export(model, d, sha256, quantize=quantize), b.files,
                       fmt.requires, servable=b.servable, loads_code=fmt.loads_code)


def _require(spec: BackendSpec) -> None:
    """The module ``spec`` needs, imported now: a missing one is a one-line BackendError naming the extra."""
    if spec.requires is None:
        return
    try:
        importlib.import_module(spec.requires)
    except ImportError:
        raise BackendError(f"the {spec.format} backends need {spec.requires}: pip install 'alstm-zoo[export]'") \
            from None


register_backend(BackendSpec("eager", None, "PyTorch, the model itself (fp32, or bf16 autocast)"))
_add_format_backends()


# -- finding or creating exports --------------------------------------------------------------------------------
def _format_of(backend: str) -> str:
    fmt = get_backend(backend).format
    if fmt is None:
        raise BackendError(f"backend {backend!r} runs the model itself: it has no export")
    return fmt


def _usable(directory: Path, backend: str, sha256: str, model_args: dict[str, Any],
            verify_files: bool = False) -> bool:
    """Whether ``directory`` holds an export of these weights for ``backend``: its manifest names the format, the
    checkpoint's sha256 and model arguments and every file the backend needs, each a plain file inside the folder;
    ``verify_files``: each file's sha256 is the manifest's too (an export that came from elsewhere)."""
    manifest = read_manifest(directory)
    if not isinstance(manifest, dict) or manifest.get("format") != _format_of(backend):
        return False
    if manifest.get("checkpoint_sha256") != sha256 or manifest.get("model_args") != model_args:
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(k in files for k in get_backend(backend).files):
        return False
    for f in files.values():  # a name inside the folder (a Hub snapshot's files are links into its blobs)
        if not isinstance(f, str) or PurePosixPath(f).is_absolute() or ".." in PurePosixPath(f).parts \
                or "\\" in f or not (directory / f).is_file():
            return False
    if verify_files:
        sums = manifest.get("file_sha256")
        return isinstance(sums, dict) and all(
            f in sums and sha256_file(directory / f) == sums[f] for f in files.values())
    return True


def candidate_dirs(model: Any, backend: str, sha256: str) -> list[tuple[Path, bool]]:
    """Where an export of this checkpoint may already be, in the order they are tried, each with whether its
    files must match their manifest's sha256 (an export that came with the checkpoint, e.g. in a Hub snapshot;
    never for a backend whose files can run code: see :attr:`BackendSpec.loads_code`)."""
    fmt = _format_of(backend)
    dirs = []
    if getattr(model, "name", None):
        dirs.append((exports_root() / model.name / fmt, False))
    if getattr(model, "directory", None) is not None and not get_backend(backend).loads_code:
        dirs.append((Path(model.directory) / fmt, True))
    dirs.append((cache_root() / sha256 / fmt, False))
    return dirs


def ensure_export(model: Any, backend: str) -> Path:
    """The folder of a usable export for ``backend``; exports into the cache when there is none."""
    spec = get_backend(backend)
    if spec.export is None:
        raise BackendError(f"backend {backend!r} runs the model itself: it has no export")
    _require(spec)
    sha256 = weights_sha256(model)
    for directory, verify in candidate_dirs(model, backend, sha256):
        if _usable(directory, backend, sha256, model.lm.config, verify_files=verify):
            return directory
    target = cache_root() / sha256 / _format_of(backend)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    except OSError as e:
        raise BackendError(f"cannot write the export cache {cache_root()} ({e.strerror or e}): set ZOO_CACHE_DIR to "
                           "a writable folder") from None
    print(f"zoo: exporting {getattr(model, 'name', 'model')} to {_format_of(backend)} (first use; cached in "
          f"{target})", file=sys.stderr, flush=True)
    try:
        spec.export(model, tmp, sha256)
        if _usable(target, backend, sha256, model.lm.config):  # another process finished first: keep its files
            return target
        if target.exists():  # an older or partial export of the same checkpoint: replace it
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def make_runner(model: Any, backend: str, directory: str | os.PathLike | None = None) -> Any:
    """A runner for ``backend`` over the model's export (found or created, unless ``directory`` is given)."""
    spec = get_backend(backend)
    if spec.runner is None:
        return model.lm
    if directory is not None:
        return _open_runner(spec, Path(directory))
    directory = ensure_export(model, backend)
    try:
        return _open_runner(spec, directory)
    except BackendError as e:
        if not directory.is_relative_to(cache_root()):  # (a folder the user made: theirs to delete)
            raise
        # the zoo's own cache (a torn or damaged file whose manifest still reads): made again, once
        print(f"zoo: warning: {e}; exporting again", file=sys.stderr, flush=True)
        shutil.rmtree(directory, ignore_errors=True)
        return _open_runner(spec, ensure_export(model, backend))


def _open_runner(spec: BackendSpec, directory: Path) -> Any:
    """``spec.runner(directory)``, a file that does not load (truncated, damaged) as a one-line BackendError: the
    runtimes raise their own types (a protobuf parse error, a zip reader error) with multi-line texts."""
    _require(spec)  # (a missing runtime is its own error, not a damaged file)
    try:
        return spec.runner(directory)
    except BackendError:
        raise
    except Exception as e:  # noqa: BLE001 (onnxruntime and torch.jit raise many types; all mean "does not load")
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise BackendError(f"{directory}: the {spec.name} export does not load ({first}); delete it or run "
                           "`zoo export` again") from None


def attach_backend(model: Any, backend: str, directory: str | os.PathLike | None = None) -> Any:
    """Switch a :class:`~zoo.zoo_model.ZooModel` to ``backend`` in place (and return it)."""
    model.runner = make_runner(model, backend, directory)
    model.backend = backend
    model.precision = "fp32"   # exports run as exported (see ZooModel.set_precision)
    return model
