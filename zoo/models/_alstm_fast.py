"""Fast sequence path of :class:`zoo.models.alstm.ALSTMStack`: one autograd node per forward call.

Why: the plain loop over ``step_with_masks`` records ~40 autograd nodes per layer and step, and its
backward accumulates every weight gradient once per step (a ``[4n_h, B] x [B, n]`` outer-product GEMM
that reads and writes the whole weight matrix ``T`` times). Here the forward runs the same arithmetic
without autograd into preallocated per-step buffers, and a hand-written backward walks the steps in
reverse, doing only the data-dependent GEMMs inside the loop; every weight gradient is then ONE GEMM
over all ``T * B`` rows, and every time-independent input projection is hoisted out of the loop:

* layer 0 reads the known input sequence: the ``x`` columns of its adaptation LSTM's input projection
  (and, with ``policy="output"``, the main ``W_ih x``) are one GEMM over the whole segment;
* without the layer-0 wrap-around (``layer0_wraparound=False``, ``"lstm"`` / ``"feedforward"`` models,
  one layer) nothing flows from the top layer back to layer 0, so layers run layer-major and every
  layer hoists its ``[z_below; x]`` columns the same way. With the wrap-around, layers interleave per
  step (as the reference must).

Two entry points: :class:`ALSTMSequence` (the autograd node, whenever a gradient is needed) and
:func:`_infer` (no autograd: nothing stored, as few kernel launches per step as possible, for scoring).
On the CPU in float32, inference runs :func:`_infer` compiled (``csrc/alstm_infer.cpp``, built once by
:mod:`zoo.models._compiled`): the same loop with its elementwise work in plain C++ loops, which at
scoring batch sizes removes most of the per-op dispatch cost; without a compiler :func:`_infer` runs.
Every large ``tanh`` is computed as ``2 sigmoid(2a) - 1`` (:mod:`zoo.models._fused` explains why: ``tanh``
is ~7x slower here): for the policy the 2 is the GEMM's ``alpha``, for the adaptation LSTM it is folded
into its (small) weight rows, exactly in both cases.

Every GEMM goes through :mod:`zoo.models._gemm`: float32 by default, bfloat16 when the call is entered
under bf16 autocast (``precision = "bf16"``), with everything else kept in float32.

The math is exactly :meth:`ALSTMLayer.forward`; only the order of independent operations differs, so
results agree with the reference loop to float rounding (checked by ``tests/test_fast_paths.py``).

Layout of the adaptation-model input ``V_t`` of a layer (a ``[B, K]`` row of a ``[T+1, B, K]`` buffer,
row ``t`` holding the inputs of step ``t``, row ``t+1`` receiving this step's dropped ``h`` and ``z``):
``[x | h | zb | z]`` when interleaved, ``[zb | x | h | z]`` when layer-major, so that the hoisted
columns lead and ``[x | h]`` stay adjacent (one multiply with ``[pi_x | pi_h]``).

The code is in three modules, read in this order: ``_alstm_plan`` (shapes, derived weights, buffers),
``_alstm_train`` (forward with storage, backward, the autograd node) and ``_alstm_infer`` (the inference loop
and its compiled twin); this module picks between them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zoo.models import _compiled
from zoo.models import _gemm as gemm
from zoo.models._alstm_infer import _infer, _infer_compiled
from zoo.models._alstm_plan import _Plan, derived_weights
from zoo.models._alstm_train import ALSTMSequence
from zoo.models._fused import needs_autograd
from zoo.models.base import State


def alstm_forward(stack: Any, x: Tensor, state: State) -> tuple[Tensor, State]:
    """Fast ``ALSTMStack.forward`` (same masks, same RNG draws as :meth:`forward_reference`)."""
    B = x.shape[0]
    masks = stack.draw_masks(B, x.device, x.dtype) if stack.training else None
    plan = _Plan(stack, masks)
    plan.gemm_dtype = gemm.autocast_dtype(x)   # bfloat16 GEMMs under autocast (see zoo.models._gemm)
    params = plan.params()
    with gemm.compute(plan.gemm_dtype, x.device.type):
        if needs_autograd(x, state, params):
            weights = derived_weights(plan, params)
            res = ALSTMSequence.apply(plan, weights, x, *state, *params)
            return res[0], tuple(res[1:])
        with torch.no_grad():
            if x.device.type == "cpu" and x.dtype == torch.float32 and plan.gemm_dtype is None:
                ext = _compiled.get("alstm_infer")
                if ext is not None:
                    return _infer_compiled(ext, stack, plan, x, state, params)
            return _infer(plan, x, state, derived_weights(plan, params))
