"""The one interface every recurrent architecture in the zoo implements.

Why a single protocol: the language-model wrapper, scoring, generation, checkpoints, the ONNX and
TorchScript exports, TorchServe and the Gradio demo all drive a model through these four calls
and nothing else, so adding an architecture never touches them.

Conventions (all architectures):

* Tensors are batch-first: a sequence input is ``[B, T, input_size]``, a step input ``[B, input_size]``.
* The recurrent state is a flat ``tuple`` of tensors, each with the batch on dim 0. A flat tuple
  of plain tensors is what exporters, TorchScript and batch slicing all handle without special cases;
  :meth:`RecurrentStack.state_names` names its entries (used for ONNX input/output names).
* ``forward`` draws the dropout masks of one forward call (one BPTT segment) and applies them in
  training mode; ``step`` is the inference path and never applies dropout.
* The output is the last layer's *undropped* hidden sequence, ``[B, T, output_size]``; output
  dropout and the decoder belong to :class:`zoo.lm.LanguageModel`.

Fast paths: the aLSTM, HyperLSTM and p-norm GRU override ``forward`` with a fused sequence path (one
autograd node per call with a hand-written backward, time-independent matmuls hoisted out of the time
loop) that agrees with ``forward_reference`` to float32 rounding, gradients included
(``tests/test_fast_paths.py``). It is the default for training and inference. For debugging, the plain
reference loop is selected by the environment variable ``ZOO_REFERENCE_CELLS=1`` (read at import) or
at run time by :func:`use_reference` (``zoo.models.base.use_reference(True)``), or for a block by the
:func:`reference_cells` context manager. Under ``torch.jit`` tracing/scripting and ``torch.compile`` /
``torch.export`` the reference loop is always used, so exporters see plain tensor ops.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

State = tuple[Tensor, ...]

_REFERENCE = os.environ.get("ZOO_REFERENCE_CELLS", "").strip().lower() not in ("", "0", "false", "no")


def use_reference(flag: bool = True) -> None:
    """Select the plain reference loop (``True``) or the fast sequence paths (``False``) process-wide."""
    global _REFERENCE
    _REFERENCE = bool(flag)


def reference_enabled() -> bool:
    """Whether the reference loop is selected (``ZOO_REFERENCE_CELLS=1`` or :func:`use_reference`)."""
    return _REFERENCE


@contextlib.contextmanager
def reference_cells(flag: bool = True) -> Iterator[None]:
    """Context manager form of :func:`use_reference`; restores the previous choice on exit."""
    previous = _REFERENCE
    use_reference(flag)
    try:
        yield
    finally:
        use_reference(previous)


def fast_path_allowed(x: Tensor) -> bool:
    """True when a stack may take its fast path: not switched off, not being traced, scripted,
    compiled or exported (those need the plain ops), and a non-empty sequence."""
    if _REFERENCE or torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    return x.dim() == 3 and x.shape[1] > 0


class RecurrentStack(nn.Module):
    """Base class for a stack of recurrent layers mapping ``input_size`` to ``output_size``.

    Subclasses implement :meth:`init_state`, :meth:`step_with_masks` and :meth:`draw_masks`; the
    default :meth:`forward` is the plain reference loop over :meth:`step_with_masks`, or the fused
    function a subclass returns from :meth:`fast_path`, which must agree with the reference loop
    (``forward_reference``) to float32 tolerance, gradients included.
    """

    input_size: int
    output_size: int

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.input_size = int(input_size)
        self.output_size = int(output_size)

    # -- state ------------------------------------------------------------------------------------
    def init_state(self, batch_size: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> State:
        """Zero state for ``batch_size`` sequences."""
        raise NotImplementedError

    def state_names(self) -> list[str]:
        """One name per state tensor, stable across versions (used for export I/O names)."""
        raise NotImplementedError

    # -- dropout ----------------------------------------------------------------------------------
    def draw_masks(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> object:
        """Dropout masks for one forward call in training mode; ``None`` means no dropout."""
        return None

    # -- computation ------------------------------------------------------------------------------
    def step_with_masks(self, x: Tensor, state: State, masks: object) -> tuple[Tensor, State]:
        """One time step: ``x [B, input_size]`` -> ``(out [B, output_size], new_state)``."""
        raise NotImplementedError

    def step(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """One inference step with explicit state (no dropout)."""
        return self.step_with_masks(x, state, None)

    def forward_reference(self, x: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """Plain time loop over :meth:`step_with_masks`: the readable reference implementation."""
        bsz = x.shape[0]
        if state is None:
            state = self.init_state(bsz, x.device, x.dtype)
        masks = self.draw_masks(bsz, x.device, x.dtype) if self.training else None
        outs = []
        for t in range(x.shape[1]):
            out, state = self.step_with_masks(x[:, t], state, masks)
            outs.append(out)
        return torch.stack(outs, dim=1), state

    def fast_path(self, x: Tensor) -> Callable[[RecurrentStack, Tensor, State], tuple[Tensor, State]] | None:
        """The architecture's fused sequence function ``f(stack, x, state)`` when it applies to ``x``, else
        ``None`` (the reference loop runs). Overridden by the stacks that have one (see the module docstring)."""
        return None

    def forward(self, x: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """Sequence forward: ``x [B, T, input_size]`` -> ``(out [B, T, output_size], state)``, on the fast
        path when the stack has one and it is allowed here (:func:`fast_path_allowed`), else the reference."""
        fast = self.fast_path(x) if fast_path_allowed(x) else None
        if fast is None:
            return self.forward_reference(x, state)
        if state is None:
            state = self.init_state(x.shape[0], x.device, x.dtype)
        return fast(self, x, state)

    # -- introspection (the demo's "adaptation at work" view) ------------------------------------------
    def adaptation_signals(self, state: State) -> dict[str, Tensor]:
        """Adaptation vectors implied by a state, per layer, each ``[B, n]``.

        Architectures without input-dependent weights return ``{}``. The demo plots the
        step-to-step change of these vectors; nothing else depends on them.
        """
        return {}


def locked_mask(batch_size: int, size: int, p: float, device: torch.device, dtype: torch.dtype) -> Tensor | None:
    """A variational dropout mask ``[B, size]`` scaled by ``1/(1-p)``, or ``None`` when ``p == 0``."""
    if p <= 0:
        return None
    return torch.empty(batch_size, size, device=device, dtype=dtype).bernoulli_(1 - p) / (1 - p)
