"""p-norm gated GRU (Pham, Tran, Phung & Venkatesh, "Faster Training of Very Deep Networks Via p-Norm
Gates", ICPR 2016, arXiv 1608.03639).

The GRU's update rule ``h_t = alpha1 * h~_t + alpha2 * h_{t-1}`` (paper Eq. 2) ties the two gates by
``alpha1 + alpha2 = 1``. The paper relaxes this to ``(alpha1^p + alpha2^p)^(1/p) = 1`` (Eq. 4), so
for ``p > 1`` the cell lets more of the old state through when the candidate gate opens, which the
paper reports trains faster (p = 3 was best on character-level language modelling)::

    alpha1 = sig(W_z x_t + U_z h_{t-1} + b_z)                 # update gate: weight on the candidate
    r_t    = sig(W_r x_t + U_r h_{t-1} + b_r)                 # reset gate
    h~_t   = tanh(W_h x_t + U_h (r_t * h_{t-1}) + b_h)        # candidate, reset *before* U_h (Cho v3)
    alpha2 = (1 - alpha1^p)^(1/p)                             # Eq. 4
    h_t    = alpha1 * h~_t + alpha2 * h_{t-1}                 # Eq. 2

``p = 1`` is exactly the standard GRU (``alpha2 = 1 - alpha1``). Note the update gate here weights
the *candidate*, the opposite of PyTorch's ``nn.GRU`` ``z``; and PyTorch/cuDNN apply the reset
gate after ``U_h`` (``r * (U_h h + b_hn)``), so ``nn.GRU`` weights do not carry over.

No reference implementation exists; the formula matches Apple MPS ``MPSGRUDescriptor.gatePnormValue``
(Pham et al., the p-norm gates paper, section II; the equations are restated in this module's docstring).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.models._gru_fast import gru_forward
from zoo.models._pnorm_gates import PNORM_EPS, pnorm_gates  # noqa: F401 (part of this module's API)
from zoo.models.base import RecurrentStack, State, locked_mask


class PNormGRUCell(nn.Module):
    """One p-norm GRU layer.

    Weights use the row layout ``[out, in]`` with the three gates stacked in the order
    (update ``z``, reset ``r``, candidate ``h``): ``weight_ih [3H, in]``, ``weight_hh [3H, H]`` and a
    single ``bias [3H]`` (the paper's one bias per gate, not cuDNN's two). Init is PyTorch's GRU
    default, ``U(-1/sqrt(H), 1/sqrt(H))`` for every weight and bias: the paper gives none.
    """

    def __init__(self, input_size: int, hidden_size: int, p: float = 1.0) -> None:
        super().__init__()
        if p <= 0:
            raise ValueError("p must be > 0")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.p = float(p)
        self.weight_ih = nn.Parameter(torch.empty(3 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.empty(3 * hidden_size))
        bound = 1.0 / math.sqrt(hidden_size)
        for w in (self.weight_ih, self.weight_hh, self.bias):
            nn.init.uniform_(w, -bound, bound)

    def forward(self, x: Tensor, h: Tensor, h_mask: Tensor | None = None) -> Tensor:
        """One step: ``x [B, in]``, ``h_{t-1} [B, H]`` -> ``h_t [B, H]``.

        ``h_mask`` (variational dropout) applies where ``h_{t-1}`` enters the matmuls, not to the
        carry term ``alpha2 * h_{t-1}``, so dropout never erases memory (Semeniuta et al. 2016).
        """
        n_h = self.hidden_size
        h_in = h if h_mask is None else h * h_mask
        gx = F.linear(x, self.weight_ih, self.bias)            # W x + b for all three gates at once
        gh = F.linear(h_in, self.weight_hh[: 2 * n_h])         # U_z h and U_r h together
        a_z = gx[:, :n_h] + gh[:, :n_h]
        r = torch.sigmoid(gx[:, n_h: 2 * n_h] + gh[:, n_h:])
        # U_h must act on r * h, so it cannot join the matmul above (Cho et al. v3 convention).
        cand = torch.tanh(gx[:, 2 * n_h:] + F.linear(r * h_in, self.weight_hh[2 * n_h:]))
        alpha1, alpha2 = pnorm_gates(a_z, self.p)
        return alpha1 * cand + alpha2 * h


class PNormGRUMasks(NamedTuple):
    """Variational dropout masks of one forward call."""

    recurrent: list[Tensor | None]  # per layer, on h_{t-1} where it enters the matmuls
    between: list[Tensor | None]    # per layer but the last, on the output fed to the next layer


class PNormGRUStack(RecurrentStack):
    """``num_layers`` p-norm GRU layers: ``input_size -> hidden_size -> ... -> output_size``.

    State per layer ``l``: ``(h_l,)``.

    Args:
        hidden_size: size of every layer but the last (the paper's char-level GRU used 400).
        p: the gate norm; 1 is the standard GRU, the paper's best was 3.
        dropout_hidden: variational dropout, one mask per forward call, on the recurrent ``h_{t-1}``
            input of every layer and on the output of every layer but the last (training only).
    """

    def __init__(self, input_size: int, output_size: int, hidden_size: int = 400, num_layers: int = 2,
                 p: float = 1.0, dropout_hidden: float = 0.0) -> None:
        super().__init__(input_size, output_size)
        if num_layers < 1:
            raise ValueError("num_layers must be >= 1")
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.p = float(p)
        self.dropout_hidden = dropout_hidden
        self.sizes = [hidden_size] * (num_layers - 1) + [output_size]
        ins = [input_size] + self.sizes[:-1]
        self.layers = nn.ModuleList(PNormGRUCell(n_in, n_h, p) for n_in, n_h in zip(ins, self.sizes, strict=True))

    def init_state(self, batch_size: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> State:
        ref = self.layers[0].weight_ih
        device, dtype = device or ref.device, dtype or ref.dtype
        return tuple(torch.zeros(batch_size, n_h, device=device, dtype=dtype) for n_h in self.sizes)

    def state_names(self) -> list[str]:
        return [f"h{layer}" for layer in range(self.num_layers)]

    def draw_masks(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> PNormGRUMasks | None:
        if self.dropout_hidden <= 0:
            return None
        p = self.dropout_hidden
        return PNormGRUMasks(
            recurrent=[locked_mask(batch_size, n_h, p, device, dtype) for n_h in self.sizes],
            between=[locked_mask(batch_size, n_h, p, device, dtype) for n_h in self.sizes[:-1]],
        )

    def fast_path(self, x: Tensor):
        """:func:`zoo.models._gru_fast.gru_forward` (layer-major, hoisted input projections, one autograd node);
        the reference loop for low-precision dtypes."""
        return gru_forward if x.dtype in (torch.float32, torch.float64) else None

    def step_with_masks(self, x: Tensor, state: State, masks: object) -> tuple[Tensor, State]:
        assert masks is None or isinstance(masks, PNormGRUMasks)
        new_state: list[Tensor] = []
        inp = x
        for layer, cell in enumerate(self.layers):
            h = cell(inp, state[layer], masks.recurrent[layer] if masks is not None else None)
            new_state.append(h)
            inp = h
            if masks is not None and layer < self.num_layers - 1 and masks.between[layer] is not None:
                inp = h * masks.between[layer]
        return h, tuple(new_state)
