"""The training step as CUDA graphs: one captured per BPTT length, replayed instead of launched op by op.

Why: at the papers' batch (20) a recurrent update is, per layer and time step, a few small GEMMs and a dozen
elementwise kernels, forward and backward; on a GPU the eager step is bound by the host launching those
kernels, not by the GPU running them. A graph replays the whole update (forward, loss, backward, clipping,
optimiser) with one launch.

What is captured is :meth:`zoo.training.Trainer.update`, the very code the eager step runs (so the two cannot
drift apart), reading the batch from static input tensors and the carried state from buffers that every graph
shares; the graph's last kernels copy the new state into those buffers, so the state flows from replay to
replay as it does eagerly. The learning rate of each graph is baked in at capture (scaled by ``seq_len /
bptt`` as the eager step scales it), so a new lr or a new optimiser (NT-ASGD's switch) drops every graph and
they are captured again as lengths recur.

Lengths: variable BPTT draws ``seq_len`` from N(bptt, 5) (N(bptt/2, 5) one time in twenty), so a PTB run sees
about 60 lengths; each is captured the first time it is drawn and replayed ever after (no padding: a padded
step would not be the reference's step). Each graph keeps its own memory pool (the activations of one step).

Randomness: dropout draws from the CUDA generator, which PyTorch advances by each replay's offset, so each
replay draws fresh masks and a checkpoint's CUDA RNG state still resumes the stream, but the masks are not the
ones the eager step would draw; the parity test therefore compares eager and captured updates with dropout
off (``tests/test_train.py``).

Limits, checked when the trainer is built: a CUDA device, the stream mode, one process (no torchrun). The
trainer builds Adam and ASGD with ``capturable`` for it (plain SGD keeps no step counter and needs nothing).
The first ``warmup`` updates of a process run eagerly on the capture stream: they create the optimiser's state and
the libraries' handles, which must exist before a capture.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from zoo.errors import ConfigError, DeviceError


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor
    y: torch.Tensor
    loss: torch.Tensor


class CapturedSteps:
    """Replays :meth:`Trainer.update` from CUDA graphs, one per sequence length; see the module docstring."""

    def __init__(self, trainer: Any, warmup: int = 3) -> None:
        if trainer.device.type != "cuda":
            raise DeviceError(f"cuda_graphs needs a CUDA device (this run is on {trainer.device.type})")
        if trainer.sentence_mode:
            raise ConfigError("cuda_graphs captures the stream mode's step (mode = 'sentences' runs eagerly)")
        if trainer.world > 1:
            raise ConfigError("cuda_graphs runs in one process (not under torchrun)")
        self.trainer, self.warmup = trainer, warmup
        self.graphs: dict[int, _Graph] = {}
        self.captures = 0                 # how many graphs were captured (recaptures included)
        self.capture_seconds = 0.0
        self._warm = 0
        self._key: tuple[float, int] | None = None
        self._stream = torch.cuda.Stream(trainer.device)
        self._state: tuple[torch.Tensor, ...] | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor, seq_len: int) -> float:
        """One update on ``x -> y``; the trainer's ``state`` is read (``None``: zeros) and replaced."""
        t = self.trainer
        key = (float(t.lr), id(t.optimizer))
        if key != self._key:
            self.graphs.clear()
            self._key = key
        self._load_state(t.state)
        if self._warm < self.warmup:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                loss, new = t.update(x, y, seq_len, self._state)
                self._store(new)
            torch.cuda.current_stream().wait_stream(self._stream)
            self._warm += 1
            t.state = self._state
            return float(loss)
        g = self.graphs.get(seq_len) or self._capture(x, y, seq_len)
        g.x.copy_(x)
        g.y.copy_(y)
        g.graph.replay()
        t.state = self._state
        return float(g.loss)

    # -- internals -----------------------------------------------------------------------------------------
    def _load_state(self, state: tuple[torch.Tensor, ...] | None) -> None:
        """Bring the carried state into the shared buffers (zeros at an epoch's start; a resumed run's state)."""
        if self._state is None:
            B = self.trainer.train_data.shape[1]
            self._state = tuple(s.detach().clone() for s in self.trainer.model.init_state(B, self.trainer.device))
        if state is None:
            for b in self._state:
                b.zero_()
        elif state is not self._state:
            for b, s in zip(self._state, state, strict=True):
                b.copy_(s.detach())

    def _store(self, new: tuple[torch.Tensor, ...]) -> None:
        for b, s in zip(self._state, new, strict=True):
            b.copy_(s.detach())

    def _capture(self, x: torch.Tensor, y: torch.Tensor, seq_len: int) -> _Graph:
        t0 = time.perf_counter()
        sx, sy = x.detach().clone().contiguous(), y.detach().clone().contiguous()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.trainer.device)
        with torch.cuda.graph(graph, stream=self._stream):
            loss, new = self.trainer.update(sx, sy, seq_len, self._state, capturing=True)
            self._store(new)
        g = _Graph(graph, sx, sy, loss)
        self.graphs[seq_len] = g
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
        return g
