"""Inference on CUDA with CUDA graphs: the single-token step and the batch-1 scoring chunk, replayed.

Why: generating one token, or scoring a 70-token chunk at batch 1, is per layer and step a few tiny GEMMs and a
dozen elementwise kernels; on a GPU the host launching them, not the GPU running them, sets the pace (the CPU's
C++ loops, :mod:`zoo.models._compiled`, do not apply there). A graph replays the whole call with one launch, as
:mod:`zoo.training.captured_step` does for the training step; the kernels are the eager call's own, so the
numbers are the eager call's (to float rounding, should cuBLAS pick another algorithm on the capture stream).

What is captured: :meth:`LanguageModel.step` (a token ``[B]``) and :meth:`LanguageModel.target_logprobs` at batch
1 (``[1, T]``), and dynamic evaluation's segment (forward, backward and the weights' update: :mod:`zoo.dynamic`),
one graph per shape, captured the *second* time a shape is seen (a shape seen once, a prompt's
or a text's last chunk, stays eager: a capture costs more than it saves). Batched scoring is bound by the GPU's
arithmetic, not by launches, and runs eagerly; so does any other call with autograd on.

State: each graph reads the state from one flat buffer and writes its output and the new state into another;
each call copies its state in (one kernel when the state came from a graph: :class:`FlatState`), replays, and
returns a *clone* of the output buffer, so a returned state stays valid however calls interleave (the server and
the demo step several generations in turn). A shape whose capture fails (an operation a graph cannot hold) is
noted in :attr:`GraphRunner.failures` with a warning and runs eagerly from then on: slower, never wrong.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

#: the most graphs a runner keeps (each holds its own static buffers; the memory pool is shared)
MAX_GRAPHS = 16


class FlatState(tuple):
    """A state tuple whose tensors are views of one flat tensor (``flat``): copied back in with one kernel."""

    flat: Tensor


def _views(flat: Tensor, shapes: list[torch.Size]) -> FlatState:
    views, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[offset:offset + n].view(shape))
        offset += n
    state = FlatState(views)
    state.flat = flat
    return state


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]
    state_in: FlatState
    out: Tensor                 # [output numel + state numel], written by the graph
    out_shape: torch.Size
    state_shapes: list[torch.Size]

    def run(self, inputs: tuple[Tensor, ...], state: tuple[Tensor, ...]) -> tuple[Tensor, FlatState]:
        for static, x in zip(self.inputs, inputs, strict=True):
            static.copy_(x)
        flat = getattr(state, "flat", None)
        if flat is not None and flat.numel() == self.state_in.flat.numel():
            self.state_in.flat.copy_(flat)
        else:
            for static, s in zip(self.state_in, state, strict=True):
                static.copy_(s)
        self.graph.replay()
        out = self.out.clone()
        n = math.prod(self.out_shape)
        return out[:n].view(self.out_shape), _views(out[n:], self.state_shapes)


class CapturedCalls:
    """Calls ``fn(*inputs, state) -> (output, state)`` on one CUDA device, each shape replayed from its own CUDA
    graph from its second call on (module docstring): what :class:`GraphRunner` and dynamic evaluation's segment
    step (:func:`zoo.dynamic.dynamic_logprobs`) share. ``fn`` may write tensors in place (an optimiser step):
    the replay writes them again, as the eager call would."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device (not {device})")
        self.device = device
        self._graphs: dict[tuple, _Graph | None] = {}
        self._seen: Counter[tuple] = Counter()
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None
        self.captures = 0
        self.failures: list[str] = []

    def __call__(self, kind: str, fn: Callable, inputs: tuple[Tensor, ...], state: tuple[Tensor, ...]):
        key = (kind, *(tuple(x.shape) for x in inputs), *(tuple(s.shape) for s in state))
        with self._lock:
            if key not in self._graphs:
                self._seen[key] += 1
                if self._seen[key] < 2 or len(self._graphs) >= MAX_GRAPHS:
                    return fn(*inputs, state)
                return self._capture(key, fn, inputs, state)
            graph = self._graphs[key]
            return fn(*inputs, state) if graph is None else graph.run(inputs, state)

    def _capture(self, key: tuple, fn: Callable, inputs: tuple[Tensor, ...], state: tuple[Tensor, ...]):
        """Answer this call eagerly on the capture stream (the warm-up a capture needs), then capture ``key``."""
        self._stream = self._stream or torch.cuda.Stream(self.device)
        static_inputs = tuple(x.to(self.device).clone() for x in inputs)
        shapes = [s.shape for s in state]
        state_in = _views(torch.cat([s.detach().reshape(-1) for s in state]), shapes)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            out, new = fn(*static_inputs, state_in)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        for t in (out, *new):  # (made on the capture stream, read on the caller's)
            t.record_stream(current)
        if any(s.dtype != out.dtype for s in new) or [s.shape for s in new] != shapes:
            self._fail(key, "the state's dtypes or shapes differ from the output's")
            return out, new
        flat_out = torch.empty(out.numel() + sum(s.numel() for s in new), dtype=out.dtype, device=self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize(self.device)
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
                o, n = fn(*static_inputs, state_in)
                torch.cat([o.detach().reshape(-1), *[s.detach().reshape(-1) for s in n]], out=flat_out)
        except Exception as e:  # noqa: BLE001 (an op a graph cannot hold: this shape runs eagerly, see docstring)
            self._fail(key, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            return out, new
        self._pool = graph.pool()
        self._graphs[key] = _Graph(graph, static_inputs, state_in, flat_out, out.shape, shapes)
        self.captures += 1
        return out, new

    def _fail(self, key: tuple, reason: str) -> None:
        self._graphs[key] = None
        self.failures.append(f"{key}: {reason}")
        warnings.warn(f"zoo: CUDA graph capture of {key[0]} {key[1:]} failed ({reason}); it runs eagerly",
                      RuntimeWarning, stacklevel=4)


class GraphRunner:
    """The eager model's runner on CUDA, with :meth:`step` and batch-1 :meth:`target_logprobs` from CUDA graphs
    (module docstring). ``init_state``, ``forward`` and everything with autograd are the model's own calls."""

    def __init__(self, lm: torch.nn.Module) -> None:
        self.lm = lm
        self.device = lm.decoder.weight.device
        self.calls = CapturedCalls(self.device)

    @property
    def captures(self) -> int:
        return self.calls.captures

    @property
    def failures(self) -> list[str]:
        return self.calls.failures

    def init_state(self, batch_size: int, device: torch.device | None = None) -> tuple[Tensor, ...]:
        return self.lm.init_state(batch_size, device)

    def forward(self, tokens: Tensor, state: tuple[Tensor, ...] | None = None):
        return self.lm(tokens, state)

    __call__ = forward

    def step(self, token: Tensor, state: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        if torch.is_grad_enabled() or self.lm.training:
            return self.lm.step(token, state)
        return self.calls("step", self.lm.step, (token,), state)

    def target_logprobs(self, tokens: Tensor, targets: Tensor, state: tuple[Tensor, ...] | None = None):
        if tokens.shape[0] != 1 or state is None or torch.is_grad_enabled() or self.lm.training:
            return self.lm.target_logprobs(tokens, targets, state)
        return self.calls("score", self.lm.target_logprobs, (tokens, targets), state)
