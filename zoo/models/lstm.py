"""LSTM baseline on PyTorch's fused LSTM kernel, with the AWD-LSTM regularisers.

Covers both baselines of the zoo: Zaremba et al. (2014) with ``init_range`` and no dropout, and
AWD-LSTM (Merity et al., 2018) with weight drop on the hidden-to-hidden matrix and locked
dropout between layers (embedding dropout, input/output locked dropout and AR/TAR live in
:class:`zoo.lm.LanguageModel`). Each layer is its own single-layer LSTM, as in AWD-LSTM, so that
layer sizes can differ (the last layer matches a tied embedding) and weight drop can act per layer.

The layer runs through ``torch.lstm`` (the op behind ``nn.LSTM``) with explicit weights: this is
how weight drop is applied without the deprecated re-registration trick of the AWD code, and it
keeps the fused kernel for both the sequence and the single-step path.

The kernel's own ``train`` flag is not the module's mode: it is on whenever autograd records (and in training).
cuDNN runs an RNN in inference mode when that flag is off and then refuses its backward ("cudnn RNN backward can
only be called in training mode"), while dynamic evaluation, its gradient statistics and a transformers loss in
``eval()`` take gradients of a model in eval mode. The flag only selects the kernel's dropout (0 here: dropout is
the module's, by its mode) and whether cuDNN keeps what its backward needs, so the numbers are the same either
way (bit-identical on the CPU); without autograd (scoring, generation, exports) the kernel runs in inference mode.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.models.base import RecurrentStack, State, locked_mask

#: shapes (steps, batch, input, hidden) for which oneDNN could not build its bfloat16 LSTM primitive
_NO_BF16_PRIMITIVE: set[tuple[int, ...]] = set()


def _fused_lstm(x: Tensor, h: Tensor, c: Tensor, weights: list[Tensor], train: bool) -> tuple[Tensor, ...]:
    """``torch.lstm`` for one layer; under CPU bf16 autocast, float32 where oneDNN lacks the bf16 primitive.

    Without AVX-512 (the CI machine is AVX2-only) oneDNN refuses its bfloat16 LSTM for some shapes and not
    others ("could not create a primitive descriptor"; (2, 2, 8, 5) builds, (3, 2, 8, 5) does not), so no
    probe can tell in advance: the call is tried, and a refused shape runs, then and afterwards, with autocast
    off, that is in float32 (the layer's input, state and weights are float32 under autocast; the decoder
    and every other GEMM still take bf16). No graph is recorded by a call that raised, so training is exact.
    """
    args = (x, (h.unsqueeze(0), c.unsqueeze(0)), weights, True, 1, 0.0, train, False, True)
    if x.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return torch.lstm(*args)
    shape = (*x.shape, h.shape[-1])
    if shape not in _NO_BF16_PRIMITIVE:
        try:
            return torch.lstm(*args)
        except RuntimeError as err:
            if "primitive descriptor" not in str(err):
                raise
            _NO_BF16_PRIMITIVE.add(shape)
    with torch.autocast("cpu", enabled=False):
        return torch.lstm(*args)


class LSTMStack(RecurrentStack):
    """``num_layers`` LSTM layers: ``input_size -> hidden_size -> ... -> output_size``.

    Args:
        hidden_size: size of every layer but the last.
        num_layers: number of layers.
        dropout_hidden: locked (variational) dropout on the output of every layer but the last
            (AWD ``dropouth``).
        weight_drop: DropConnect rate on each ``weight_hh`` (AWD ``wdrop``), one mask per forward call.
        init_range: if set, every weight and bias is ``U(-r, r)`` (Zaremba et al.); otherwise the
            PyTorch default ``U(-1/sqrt(H), 1/sqrt(H))`` (AWD-LSTM).
    """

    def __init__(self, input_size: int, output_size: int, hidden_size: int = 200, num_layers: int = 2,
                 dropout_hidden: float = 0.0, weight_drop: float = 0.0, init_range: float | None = None):
        super().__init__(input_size, output_size)
        if num_layers < 1:
            raise ValueError("num_layers must be >= 1")
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.dropout_hidden = dropout_hidden
        self.weight_drop = weight_drop
        self.sizes = [hidden_size] * (num_layers - 1) + [output_size]
        ins = [input_size] + self.sizes[:-1]
        for layer, (n_in, n_h) in enumerate(zip(ins, self.sizes, strict=True)):
            self.register_parameter(f"weight_ih_l{layer}", nn.Parameter(torch.empty(4 * n_h, n_in)))
            self.register_parameter(f"weight_hh_l{layer}", nn.Parameter(torch.empty(4 * n_h, n_h)))
            self.register_parameter(f"bias_ih_l{layer}", nn.Parameter(torch.empty(4 * n_h)))
            self.register_parameter(f"bias_hh_l{layer}", nn.Parameter(torch.empty(4 * n_h)))
            bound = init_range if init_range is not None else 1.0 / math.sqrt(n_h)
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                nn.init.uniform_(getattr(self, f"{name}_l{layer}"), -bound, bound)

    def layer_weights(self, layer: int) -> list[Tensor]:
        w_hh = getattr(self, f"weight_hh_l{layer}")
        if self.training and self.weight_drop > 0:
            w_hh = F.dropout(w_hh, self.weight_drop, training=True)
        return [getattr(self, f"weight_ih_l{layer}"), w_hh,
                getattr(self, f"bias_ih_l{layer}"), getattr(self, f"bias_hh_l{layer}")]

    def init_state(self, batch_size: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> State:
        dtype = dtype or self.weight_ih_l0.dtype
        device = device or self.weight_ih_l0.device
        return tuple(torch.zeros(batch_size, n_h, device=device, dtype=dtype)
                     for n_h in self.sizes for _ in range(2))

    def state_names(self) -> list[str]:
        return [f"{k}{layer}" for layer in range(self.num_layers) for k in ("h", "c")]

    def _run(self, x: Tensor, state: State, train_masks: bool) -> tuple[Tensor, State]:
        # Under bf16 autocast (precision = "bf16") torch.lstm runs the fused kernel in bfloat16 and returns
        # bfloat16 outputs and states; the output and the state carried to the next segment are widened back to
        # the input's dtype here, so everything outside the kernel (dropout, AR/TAR, the carried state) is fp32.
        dtype = x.dtype
        new_state: list[Tensor] = []
        for layer in range(self.num_layers):
            h, c = state[2 * layer], state[2 * layer + 1]
            x, h, c = _fused_lstm(x, h, c, self.layer_weights(layer), self.training or torch.is_grad_enabled())
            new_state += [h.squeeze(0), c.squeeze(0)]
            if train_masks and layer < self.num_layers - 1:
                mask = locked_mask(x.shape[0], x.shape[-1], self.dropout_hidden, x.device, x.dtype)
                if mask is not None:
                    x = x * mask.unsqueeze(1)
        return x.to(dtype), tuple(s.to(dtype) for s in new_state)

    def forward(self, x: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        if state is None:
            state = self.init_state(x.shape[0], x.device, x.dtype)
        return self._run(x, state, self.training)

    def step_with_masks(self, x: Tensor, state: State, masks: object) -> tuple[Tensor, State]:
        out, state = self._run(x.unsqueeze(1), state, False)
        return out.squeeze(1), state
