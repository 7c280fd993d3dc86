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
it). The CLI's choices, the server, the benchmarks and the tests read it; adding a backend is one
:func:`register_backend` call with a runner class (and an exporter if it needs a new format).
Registered: ``eager``, ``torchscript``, ``onnx`` and ``onnx-int8`` (the dynamically quantised graphs).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from torch import Tensor

from zoo.errors import BackendError, MissingFileError
from zoo.export.common import cache_root, exports_root, read_manifest, weights_sha256
from zoo.files import sha256_file

State = tuple[Tensor, ...]


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise BackendError("the onnx backends need onnxruntime: pip install 'alstm-zoo[export]'") from None
    return onnxruntime


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def session_options(threads: int | None = None):
    """ONNX Runtime settings for this machine: one intra-op thread per core, no inter-op parallelism,
    and no spin-waiting (spinning threads would steal the few cores from the caller between runs)."""
    ort = _onnxruntime()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or cpu_cores()
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return opts


class OnnxRunner:
    """Runs the exported sequence graph for ``forward`` and the step graph for ``step`` in ONNX Runtime."""

    backend = "onnx"

    def __init__(self, directory: str | os.PathLike, int8: bool = False, threads: int | None = None) -> None:
        from zoo.export.onnx_graphs import out_name

        ort = _onnxruntime()

        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None or manifest.get("format") != "onnx":
            raise MissingFileError(f"{self.directory}: no ONNX export (missing or unreadable export.json)")
        files = manifest["files"]
        seq_key, step_key = ("sequence_int8", "step_int8") if int8 else ("sequence", "step")
        if seq_key not in files or step_key not in files:
            raise MissingFileError(f"{self.directory}: no {'int8 ' if int8 else ''}graphs in the export")
        self.manifest = manifest
        self.int8 = int8
        self.backend = "onnx-int8" if int8 else "onnx"
        self.state_names: list[str] = manifest["state_names"]
        self.state_shapes: list[list[int]] = manifest["state_shapes"]
        self.vocab_size: int = manifest["vocab_size"]
        self._outs = ["logits", *map(out_name, self.state_names)]
        opts = session_options(threads)
        providers = ["CPUExecutionProvider"]
        self.sequence = ort.InferenceSession(str(self.directory / files[seq_key]), opts, providers=providers)
        self.step_session = ort.InferenceSession(str(self.directory / files[step_key]), opts, providers=providers)

    def init_state(self, batch_size: int, device: Any = None) -> State:
        return tuple(torch.zeros(batch_size, *shape) for shape in self.state_shapes)

    def _feed(self, first: str, tokens: Tensor, state: State) -> dict[str, np.ndarray]:
        feed = {first: np.ascontiguousarray(tokens.detach().cpu().numpy(), dtype=np.int64)}
        for name, s in zip(self.state_names, state, strict=True):
            feed[name] = np.ascontiguousarray(s.detach().cpu().numpy(), dtype=np.float32)
        return feed

    def forward(self, tokens: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """``tokens [B, T]`` -> ``(logits [B, T, V], state)`` through the Scan graph."""
        if state is None:
            state = self.init_state(tokens.shape[0])
        if tokens.shape[1] == 0:
            return torch.zeros(tokens.shape[0], 0, self.vocab_size), tuple(state)
        out = self.sequence.run(self._outs, self._feed("tokens", tokens, state))
        return torch.from_numpy(out[0]), tuple(torch.from_numpy(o) for o in out[1:])

    __call__ = forward

    def step(self, token: Tensor, state: State) -> tuple[Tensor, State]:
        """``token [B]`` -> ``(logits [B, V], state)`` through the step graph."""
        out = self.step_session.run(self._outs, self._feed("token", token, state))
        return torch.from_numpy(out[0]), tuple(torch.from_numpy(o) for o in out[1:])


class TorchScriptRunner:
    """Runs the exported TorchScript module (``forward`` loop over the traced step; ``step``)."""

    backend = "torchscript"

    def __init__(self, directory: str | os.PathLike) -> None:
        from zoo.export.torchscript import load_torchscript

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


# -- the registry --------------------------------------------------------------------------------------------
def _export_torchscript(model: Any, directory: Path, sha256: str) -> None:
    from zoo.export.torchscript import export_torchscript

    export_torchscript(model, directory, sha256)


def _export_onnx(model: Any, directory: Path, sha256: str) -> None:
    from zoo.export.onnx_graphs import export_onnx

    export_onnx(model, directory, sha256)


def _export_onnx_int8(model: Any, directory: Path, sha256: str) -> None:
    from zoo.export.onnx_graphs import export_onnx

    export_onnx(model, directory, sha256, quantize="int8")


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
    #: Loading its files can run code (TorchScript: see :mod:`zoo.export.torchscript`): then only an export made on this
    #: machine (the exports folder, the export cache) is used, never one that came with a checkpoint or a Hub
    #: snapshot. ONNX graphs are data: a shipped one is used when every file matches its manifest's sha256.
    loads_code: bool = False


BACKENDS: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> BackendSpec:
    BACKENDS[spec.name] = spec
    return spec


def backend_names(servable_only: bool = False) -> list[str]:
    return [n for n, s in BACKENDS.items() if s.servable or not servable_only]


def get_backend(name: str) -> BackendSpec:
    try:
        return BACKENDS[name]
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}") from None


register_backend(BackendSpec("eager", None, "PyTorch, the model itself (fp32, or bf16 autocast)"))
register_backend(BackendSpec("torchscript", "torchscript", "the traced TorchScript module", TorchScriptRunner,
                             _export_torchscript, ("module",), servable=False, loads_code=True))
register_backend(BackendSpec("onnx", "onnx", "ONNX Runtime: a Scan graph for sequences, a step graph",
                             lambda d: OnnxRunner(d), _export_onnx, ("sequence", "step"), "onnxruntime"))
register_backend(BackendSpec("onnx-int8", "onnx", "ONNX Runtime with dynamically quantised int8 weights",
                             lambda d: OnnxRunner(d, int8=True), _export_onnx_int8, ("sequence_int8", "step_int8"),
                             "onnxruntime"))


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
    if spec.requires == "onnxruntime":
        _onnxruntime()
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
    if spec.requires == "onnxruntime":
        _onnxruntime()  # (a missing runtime is its own error, not a damaged file)
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
