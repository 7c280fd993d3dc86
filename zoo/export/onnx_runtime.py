"""ONNX Runtime's side of the ``onnx`` format: the runner of an export folder (the ``onnx`` and ``onnx-int8``
backends, :mod:`zoo.backends`) and the session settings every caller uses (``exports/README.md``).

Kept apart from :mod:`zoo.export.onnx_graphs` (the exporter, which needs torch's ONNX exporter and ``onnx``): running
an export needs only ``onnxruntime`` and numpy (and torch for the tensors the zoo's callers pass).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from zoo.errors import BackendError, MissingFileError
from zoo.export.common import read_manifest

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

