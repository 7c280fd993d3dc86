"""The aLSTM fast path's plan (:mod:`zoo.models._alstm_fast`): per-layer shapes and weight slices, the
derived (scaled, transposed) weights and the per-step buffers shared by the training and inference paths."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zoo.models import _gemm as gemm
from zoo.models._fused import double_rows


class _Layer:
    """Static plan of one layer: sizes, column layout of ``V`` and which columns are hoisted."""

    def __init__(self, layer: Any, has_zb: bool, layer_major: bool, first: bool) -> None:
        self.mod = layer
        self.nx, self.nh, self.nz = layer.input_size, layer.hidden_size, layer.adapt_size
        self.recurrent, self.io, self.ab = layer.recurrent, layer.input_adaptation, layer.adaptive_bias
        self.nzb = self.nz if has_zb else 0
        blocks = ["zb", "x", "h", "z"] if layer_major else ["x", "h", "zb", "z"]
        size = {"x": self.nx, "h": self.nh, "zb": self.nzb, "z": self.nz if self.recurrent else 0}
        self.cols: dict[str, slice] = {}
        k = 0
        for name in blocks:
            self.cols[name] = slice(k, k + size[name])
            k += size[name]
        self.K = k
        # hoisted leading columns: [zb | x] when layer-major, x for layer 0 when interleaved
        self.k0 = (self.nzb + self.nx) if layer_major else (self.nx if first else 0)
        self.xh = slice(self.cols["x"].start, self.cols["h"].stop)
        self.hoist_gi = (not self.io) and (layer_major or first)
        self.na = 4 * self.nz if self.recurrent else self.nz
        n_pi = self.nx + self.nh if self.io else 0
        self.pi_ih = slice(n_pi, n_pi + 4 * self.nh)
        self.pi_hh = slice(n_pi + 4 * self.nh, n_pi + 8 * self.nh)
        self.pi_b = slice(n_pi + 8 * self.nh, n_pi + 12 * self.nh)
        self.P = n_pi + (12 if self.ab else 8) * self.nh
        self.pi_sizes = layer.pi_sizes

    # -- parameters -------------------------------------------------------------------------------------
    def params(self) -> list[Tensor]:
        m = self.mod
        adapt = [m.adapt.weight_ih, m.adapt.weight_hh, m.adapt.bias_ih, m.adapt.bias_hh] if self.recurrent \
            else [m.adapt.weight, m.adapt.bias]
        return adapt + [m.project.weight, m.weight_ih, m.weight_hh, m.bias]

    def weights(self, p: list[Tensor]) -> _Weights:
        """The per-call derived weights (see :class:`_Weights`) from this layer's parameters."""
        if self.recurrent:
            w_ih, w_hh = p[0], p[1]
            src = {"x": w_ih[:, :self.nx], "h": w_ih[:, self.nx:self.nx + self.nh],
                   "zb": w_ih[:, self.nx + self.nh:], "z": w_hh}
            ba = p[2] + p[3]
        else:
            src = {"x": p[0][:, :self.nx], "h": p[0][:, self.nx:]}
            ba = p[1]
        order = sorted((s.start, name) for name, s in self.cols.items() if s.stop > s.start)
        wv = torch.cat([src[name] for _, name in order], 1)
        nz = self.nz
        if self.recurrent:
            wv, ba = double_rows(wv, 2 * nz, 3 * nz), double_rows(ba, 2 * nz, 3 * nz)
        w = p[-4:]
        return _Weights(wv, ba, w[0], w[1], w[2], w[3], ba.new_zeros(()))

    def param_grads(self, d_wv: Tensor, d_ba: Tensor, d_wp: Tensor, d_wih: Tensor, d_whh: Tensor,
                    d_bias: Tensor) -> list[Tensor]:
        """Gradients in :meth:`params` order from those of the derived weights (undoing the doubled rows
        and the column reordering of :meth:`weights`)."""
        c, nz = self.cols, self.nz
        if self.recurrent:
            d_wv[2 * nz:3 * nz] *= 2
            d_ba[2 * nz:3 * nz] *= 2
            d_ih = torch.cat([d_wv[:, c["x"]], d_wv[:, c["h"]], d_wv[:, c["zb"]]], 1)
            adapt = [d_ih, d_wv[:, c["z"]].contiguous(), d_ba, d_ba.clone()]
        else:
            adapt = [torch.cat([d_wv[:, c["x"]], d_wv[:, c["h"]]], 1), d_ba]
        return adapt + [d_wp, d_wih, d_whh, d_bias]


class _Weights:
    """Derived weights of one layer for one call.

    ``wv [n_a, K]`` / ``ba``: the adaptation model's input and recurrent weights concatenated in ``V``
    column order, with the two biases summed and (LSTM models) the g rows doubled (see
    :mod:`zoo.models._fused`); a small copy, made once per call. ``wp = W_pi`` (the policy's tanh is
    ``2 sigmoid(2a) - 1``, the 2 applied as the GEMM's ``alpha``, against the 0-d ``zero``);
    ``w_ih, w_hh, bias``: the parameters themselves.
    """

    def __init__(self, wv: Tensor, ba: Tensor, wp: Tensor, w_ih: Tensor, w_hh: Tensor, bias: Tensor,
                 zero: Tensor) -> None:
        self.wv, self.ba, self.wp, self.zero = wv, ba, wp, zero
        self.w_ih, self.w_hh, self.bias = w_ih, w_hh, bias


class _Plan:
    """Everything a forward call needs besides tensors: the layer plans, masks and the state layout."""

    def __init__(self, stack: Any, masks: list | None) -> None:
        self.L = stack.num_layers
        self.wrap = stack._wraparound
        self.layer_major = not self.wrap
        rhn = stack.adaptation_model == "lstm_rhn"
        self.layers = [_Layer(layer, rhn and self.L > 1 and (l > 0 or self.wrap), self.layer_major, l == 0)
                       for l, layer in enumerate(stack.layers)]
        self.per_layer = stack._per_layer
        self.masks = masks if masks is not None else [(None, None)] * self.L
        self.gemm_dtype: torch.dtype | None = None   # set per call: the GEMMs' precision (zoo.models._gemm)
        self.n_params = [len(lp.params()) for lp in self.layers]

    def params(self) -> list[Tensor]:
        return [p for lp in self.layers for p in lp.params()]


class _Buffers:
    """Per-layer, per-step storage of the training forward: everything the backward reads."""

    def __init__(self, plan: _Plan, B: int, T: int, like: Tensor) -> None:
        def new(*shape: int) -> Tensor:
            return like.new_empty(shape)

        self.V, self.AX, self.A, self.ZC, self.TZC, self.ZD = [], [], [], [], [], []
        self.PI, self.U, self.G, self.ACT, self.C, self.TC = [], [], [], [], [], []
        for lp in plan.layers:
            self.V.append(new(T + 1, B, lp.K))
            self.AX.append(None)
            self.A.append(new(T, B, lp.na))                     # adapt activations (recurrent) or relu z
            self.ZC.append(new(T + 1, B, lp.nz) if lp.recurrent else None)   # index 0: initial state
            self.TZC.append(new(T, B, lp.nz) if lp.recurrent else None)
            self.ZD.append(new(T, B, lp.nz))
            self.PI.append(new(T, B, lp.P))
            self.U.append(new(T, B, lp.nx + lp.nh) if lp.io else None)
            self.G.append(new(2, T, B, 4 * lp.nh))                # gi, gh
            self.ACT.append(new(T, B, 4 * lp.nh))
            self.C.append(new(T + 1, B, lp.nh))                   # index 0: initial state
            self.TC.append(new(T, B, lp.nh))


def derived_weights(plan: _Plan, params: list[Tensor]) -> list[_Weights]:
    """Per-layer :class:`_Weights` for one call (detached: the backward is written by hand)."""
    out, off = [], 0
    with torch.no_grad():
        for lp, n in zip(plan.layers, plan.n_params, strict=True):
            w = lp.weights([p.detach() for p in params[off:off + n]])
            w.wv, w.wp, w.w_ih, w.w_hh = (gemm.lowp(t) for t in (w.wv, w.wp, w.w_ih, w.w_hh))
            out.append(w)
            off += n
    return out
