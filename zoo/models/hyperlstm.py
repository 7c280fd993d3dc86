"""HyperLSTM (Ha, Dai & Le, "HyperNetworks", ICLR 2017), following the author's code (hardmaru/supercell).

A small "hyper" LSTM reads ``[x_t; h_{t-1}]`` and, at every step, emits the weight scaling vectors
``d`` and dynamic biases ``beta`` of the main LSTM (paper appendix A.2.2, Eqs. 10-13; the
memory-efficient version that scales the rows of ``W_x`` / ``W_h`` instead of generating them)::

    (h^_t, c^_t) = HyperCell([x_t; h_{t-1}], (h^_{t-1}, c^_{t-1}))                        # Eq. 10
    z_y  = W^y_zw h^_t + b^y_zw,   d_y = W^y_alpha z_y      y in {ix,jx,fx,ox, ih,jh,fh,oh}  # Eqs. 11-12
    zb_g = W^g_zb h^_t,            beta_g = W^g_beta zb_g   g in {i,j,f,o}
    pre_g = d_gx * (W_x x_t)_g + d_gh * (W_h h_{t-1})_g + b_g + beta_g                      # Eq. 12
    [LN per gate];  c_t = sig(f + forget_bias) c_{t-1} + sig(i) drop(tanh(j))             # Eq. 13
    h_t = sig(o) tanh([LN] c_t)

Notes on faithfulness (against Ha et al. 2017, section 3.2 and appendix A.2.2, and its reference code):

* ``z`` uses the *current* hyper state ``h^_t`` (the paper writes ``h^_{t-1}``; both reference
  implementations use ``h^_t``).
* Gate order is supercell's ``(i, j, f, o)``, ``j`` being the candidate; the forget bias is added
  inside the sigmoid at run time, never stored.
* Initialisation is supercell's table (section 2.2): ``W_zw = 0``, ``b_zw = 1``, ``W_alpha = 0.1/N_z``
  (so ``d = 0.1`` exactly at init, the recurrent-batch-norm trick), ``W_zb ~ N(0, 0.01)``,
  ``W_beta = 0``; ``W_xh`` Glorot uniform, ``W_hh`` orthogonal per gate block, bias 0; LN gamma 1,
  beta 0, eps 1e-3. The paper text says orthogonal for ``W_x`` too; we follow the code.
* The 8 scaling blocks and 4 bias blocks keep separate parameters but are stored stacked
  (``[8, N_z, N_h^]`` etc.) so that all ``z`` come from one matmul and all ``d`` from one batched
  matmul, instead of 12 small kernels per step.
* Recurrent dropout is "without memory loss" (Semeniuta et al. 2016): a fresh mask at every step on
  ``tanh(j)`` only, in training only. ``dropout_hidden`` is an extra AWD-style variational mask
  drawn once per forward call (not in the paper; for the word-level recipes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.models._hyper_fast import hyper_forward
from zoo.models.base import RecurrentStack, State, locked_mask

#: supercell gate order: input, candidate ("j"), forget, output.
GATES = ("i", "j", "f", "o")
#: the 8 weight-scaling blocks: the x-side blocks of W_xh, then the h-side blocks of W_hh.
SCALE_BLOCKS = tuple(f"{g}x" for g in GATES) + tuple(f"{g}h" for g in GATES)
LN_EPS = 1e-3  # supercell's layer-norm epsilon


class LSTMCell(nn.Module):
    """supercell's LSTM cell; used as the hyper cell and as the core of :class:`HyperLSTMCell`.

    Why not ``nn.LSTMCell``: the reference differs in init (Glorot ``W_xh``, per-gate orthogonal
    ``W_hh``, zero bias), a run-time forget bias, optional per-gate layer norm (LN on the gates and
    on ``c`` before the output ``tanh``) and per-step dropout on the candidate.
    """

    def __init__(self, input_size: int, hidden_size: int, use_layer_norm: bool = False,
                 recurrent_dropout: float = 0.0, forget_bias: float = 1.0) -> None:
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.use_layer_norm = use_layer_norm
        self.recurrent_dropout = recurrent_dropout
        self.forget_bias = forget_bias
        self.weight_xh = nn.Parameter(torch.empty(4 * hidden_size, input_size))   # rows: i, j, f, o
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(4 * hidden_size))
        if use_layer_norm:
            self.ln_gamma = nn.Parameter(torch.ones(4 * hidden_size))    # "ln_all": one LN per gate
            self.ln_beta = nn.Parameter(torch.zeros(4 * hidden_size))
            self.ln_c_gamma = nn.Parameter(torch.ones(hidden_size))      # "ln_c"
            self.ln_c_beta = nn.Parameter(torch.zeros(hidden_size))
        self._init_lstm_weights()

    def _init_lstm_weights(self) -> None:
        # TF's get_variable default (Glorot uniform over the whole [in, 4H] matrix) for W_xh.
        nn.init.xavier_uniform_(self.weight_xh)
        # Orthogonal per gate block: four separate H x H orthogonal matrices, not one 4H x H matrix.
        blocks = self.weight_hh.data.view(4, self.hidden_size, self.hidden_size)
        for k in range(4):
            nn.init.orthogonal_(blocks[k])
        nn.init.zeros_(self.bias)

    def cell_update(self, pre: Tensor, c: Tensor, train_dropout: bool) -> tuple[Tensor, Tensor]:
        """Gate pre-activations ``pre [B, 4, H]`` and ``c_{t-1}`` -> ``(h_t, c_t)`` (paper Eq. 13)."""
        if self.use_layer_norm:  # statistics per gate over its H units, after the bias (supercell)
            pre = F.layer_norm(pre, pre.shape[-1:], eps=LN_EPS)
            pre = pre * self.ln_gamma.view(4, -1) + self.ln_beta.view(4, -1)
        i, j, f, o = pre.unbind(1)
        g = torch.tanh(j)
        if train_dropout and self.recurrent_dropout > 0:
            # Semeniuta et al.: drop the candidate only (no memory loss), a fresh mask every step.
            # The mask is drawn explicitly (what F.dropout does on CPU) rather than by F.dropout, whose
            # fused CUDA kernel consumes the RNG differently: the fast path draws the same masks on any device.
            p = self.recurrent_dropout
            g = g * torch.empty_like(g).bernoulli_(1 - p).div_(1 - p)
        c = torch.sigmoid(f + self.forget_bias) * c + torch.sigmoid(i) * g
        c_out = c
        if self.use_layer_norm:  # the stored c is not normalised, only what feeds the output tanh
            c_out = F.layer_norm(c, c.shape[-1:], self.ln_c_gamma, self.ln_c_beta, eps=LN_EPS)
        h = torch.sigmoid(o) * torch.tanh(c_out)
        return h, c

    def forward(self, x: Tensor, h: Tensor, c: Tensor, train_dropout: bool = False) -> tuple[Tensor, Tensor]:
        pre = F.linear(x, self.weight_xh) + F.linear(h, self.weight_hh) + self.bias
        return self.cell_update(pre.view(-1, 4, self.hidden_size), c, train_dropout)


class HyperLSTMCell(LSTMCell):
    """One HyperLSTM layer: a main LSTM whose rows are scaled and biases shifted by a hyper LSTM.

    Parameters of the hypernetwork (``N_z = hyper_embedding_size``, ``N_h^ = hyper_size``):
    ``hyper_zw_weight [8, N_z, N_h^]``, ``hyper_zw_bias [8, N_z]``, ``hyper_alpha [8, H, N_z]`` (scaling
    path, blocks in :data:`SCALE_BLOCKS` order) and ``hyper_zb_weight [4, N_z, N_h^]``,
    ``hyper_beta [4, H, N_z]`` (bias path, :data:`GATES` order). Slice ``k`` of each is block ``k``'s
    own matrix.
    """

    def __init__(self, input_size: int, hidden_size: int, hyper_size: int = 128, hyper_embedding_size: int = 4,
                 use_layer_norm: bool = False, recurrent_dropout: float = 0.0,
                 hyper_recurrent_dropout: float = 0.0, forget_bias: float = 1.0) -> None:
        super().__init__(input_size, hidden_size, use_layer_norm, recurrent_dropout, forget_bias)
        self.hyper_size = hyper_size
        self.hyper_embedding_size = n_z = hyper_embedding_size
        # The hyper cell is the same LSTM class; supercell builds it with its default forget bias 1.0.
        self.hyper = LSTMCell(input_size + hidden_size, hyper_size, use_layer_norm, hyper_recurrent_dropout)
        self.hyper_zw_weight = nn.Parameter(torch.zeros(8, n_z, hyper_size))
        self.hyper_zw_bias = nn.Parameter(torch.ones(8, n_z))
        self.hyper_alpha = nn.Parameter(torch.full((8, hidden_size, n_z), 0.1 / n_z))
        self.hyper_zb_weight = nn.Parameter(torch.empty(4, n_z, hyper_size))
        self.hyper_beta = nn.Parameter(torch.zeros(4, hidden_size, n_z))
        nn.init.normal_(self.hyper_zb_weight, 0.0, 0.01)

    def hyper_signals(self, h_hat: Tensor) -> tuple[Tensor, Tensor]:
        """Scaling vectors ``d [B, 8, H]`` and dynamic biases ``beta [B, 4, H]`` from ``h^_t`` (Eqs. 11-12)."""
        bsz, n_z = h_hat.shape[0], self.hyper_embedding_size
        z = F.linear(h_hat, self.hyper_zw_weight.flatten(0, 1), self.hyper_zw_bias.flatten())  # all 8 z_y
        d = torch.einsum("byz,yhz->byh", z.view(bsz, 8, n_z), self.hyper_alpha)              # all 8 d_y
        zb = F.linear(h_hat, self.hyper_zb_weight.flatten(0, 1))
        beta = torch.einsum("byz,yhz->byh", zb.view(bsz, 4, n_z), self.hyper_beta)
        return d, beta

    def forward(self, x: Tensor, h: Tensor, c: Tensor, h_hat: Tensor, c_hat: Tensor,  # type: ignore[override]
                train_dropout: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One step of the supercell HyperLSTM: returns ``(h_t, c_t, h^_t, c^_t)``."""
        h_hat, c_hat = self.hyper(torch.cat([x, h], dim=1), h_hat, c_hat, train_dropout)  # Eq. 10
        d, beta = self.hyper_signals(h_hat)  # from the current h^_t, as in supercell
        n_h = self.hidden_size
        wx = F.linear(x, self.weight_xh).view(-1, 4, n_h)
        wh = F.linear(h, self.weight_hh).view(-1, 4, n_h)
        pre = d[:, :4] * wx + d[:, 4:] * wh + self.bias.view(4, n_h) + beta
        h, c = self.cell_update(pre, c, train_dropout)
        return h, c, h_hat, c_hat


class HyperLSTMMasks(NamedTuple):
    """Dropout masks of one forward call; its presence also switches on the per-step candidate dropout."""

    recurrent: list[Tensor | None]  # per layer, on h_{t-1} where it enters the cell (not on the stored state)
    between: list[Tensor | None]    # per layer but the last, on the output fed to the next layer


class HyperLSTMStack(RecurrentStack):
    """``num_layers`` HyperLSTM layers: ``input_size -> hidden_size -> ... -> output_size``.

    Each layer has its own hyper cell. State per layer ``l``: ``(h_l, c_l, h_hat_l, c_hat_l)``.

    Args:
        hidden_size: size of every layer but the last (the last is ``output_size``).
        hyper_size: hyper LSTM size ``N_h^`` (paper char-PTB: 128).
        hyper_embedding_size: ``N_z`` (paper char-PTB: 4; supercell default 16).
        use_layer_norm: LN on the gates and on ``c``, in both the main and the hyper cell.
        recurrent_dropout: per-step dropout on the main candidate ``tanh(j)`` (paper: 0.1).
        hyper_recurrent_dropout: the same inside the hyper cell ("not in paper", for large hyper cells).
        dropout_hidden: variational dropout, one mask per forward call, on the recurrent ``h_{t-1}``
            input of every layer and on the output of every layer but the last (not in the paper).
        forget_bias: added to the forget gate pre-activation at run time.
    """

    def __init__(self, input_size: int, output_size: int, hidden_size: int = 1000, num_layers: int = 1,
                 hyper_size: int = 128, hyper_embedding_size: int = 4, use_layer_norm: bool = False,
                 recurrent_dropout: float = 0.0, hyper_recurrent_dropout: float = 0.0,
                 dropout_hidden: float = 0.0, forget_bias: float = 1.0) -> None:
        super().__init__(input_size, output_size)
        if num_layers < 1:
            raise ValueError("num_layers must be >= 1")
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.hyper_size = hyper_size
        self.recurrent_dropout = recurrent_dropout
        self.hyper_recurrent_dropout = hyper_recurrent_dropout
        self.dropout_hidden = dropout_hidden
        self.sizes = [hidden_size] * (num_layers - 1) + [output_size]
        ins = [input_size] + self.sizes[:-1]
        self.layers = nn.ModuleList(
            HyperLSTMCell(n_in, n_h, hyper_size, hyper_embedding_size, use_layer_norm, recurrent_dropout,
                          hyper_recurrent_dropout, forget_bias)
            for n_in, n_h in zip(ins, self.sizes, strict=True)
        )

    def init_state(self, batch_size: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> State:
        ref = self.layers[0].weight_xh
        device, dtype = device or ref.device, dtype or ref.dtype
        state: list[Tensor] = []
        for n_h in self.sizes:
            for size in (n_h, n_h, self.hyper_size, self.hyper_size):
                state.append(torch.zeros(batch_size, size, device=device, dtype=dtype))
        return tuple(state)

    def state_names(self) -> list[str]:
        return [f"{k}{layer}" for layer in range(self.num_layers) for k in ("h", "c", "h_hat", "c_hat")]

    def draw_masks(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> HyperLSTMMasks | None:
        if self.dropout_hidden <= 0 and self.recurrent_dropout <= 0 and self.hyper_recurrent_dropout <= 0:
            return None
        p = self.dropout_hidden
        return HyperLSTMMasks(
            recurrent=[locked_mask(batch_size, n_h, p, device, dtype) for n_h in self.sizes],
            between=[locked_mask(batch_size, n_h, p, device, dtype) for n_h in self.sizes[:-1]],
        )

    def fast_path(self, x: Tensor):
        """:func:`zoo.models._hyper_fast.hyper_forward` (layer-major, hoisted input projections, one autograd node);
        the reference loop for low-precision dtypes."""
        return hyper_forward if x.dtype in (torch.float32, torch.float64) else None

    def step_with_masks(self, x: Tensor, state: State, masks: object) -> tuple[Tensor, State]:
        assert masks is None or isinstance(masks, HyperLSTMMasks)
        # Per-step candidate dropout needs fresh randomness, so it is tied to training-with-masks:
        # ``step`` (masks=None) and eval mode stay deterministic.
        train_dropout = masks is not None and self.training
        new_state: list[Tensor] = []
        inp = x
        for layer, cell in enumerate(self.layers):
            h, c, h_hat, c_hat = state[4 * layer: 4 * layer + 4]
            if masks is not None and masks.recurrent[layer] is not None:
                h = h * masks.recurrent[layer]
            h, c, h_hat, c_hat = cell(inp, h, c, h_hat, c_hat, train_dropout)
            new_state += [h, c, h_hat, c_hat]
            inp = h
            if masks is not None and layer < self.num_layers - 1 and masks.between[layer] is not None:
                inp = h * masks.between[layer]
        return h, tuple(new_state)

    def adaptation_signals(self, state: State) -> dict[str, Tensor]:
        """Per layer: the 8 scaling vectors ``d_y`` and 4 dynamic biases ``beta_g`` implied by ``h^``."""
        signals: dict[str, Tensor] = {}
        for layer, cell in enumerate(self.layers):
            d, beta = cell.hyper_signals(state[4 * layer + 2])
            for k, name in enumerate(SCALE_BLOCKS):
                signals[f"layer{layer}.d_{name}"] = d[:, k]
            for k, gate in enumerate(GATES):
                signals[f"layer{layer}.beta_{gate}"] = beta[:, k]
        return signals
