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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from zoo.models import _compiled
from zoo.models import _gemm as gemm
from zoo.models._fused import double_rows, lstm_cell_backward, lstm_cell_forward, lstm_gates_into, needs_autograd, tanh
from zoo.models.base import State


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


def _forward(plan: _Plan, x: Tensor, state: State, weights: list[_Weights]) -> tuple[Tensor, State, _Buffers]:
    """Run the whole segment, storing what the backward needs; returns ``(out [B, T, n_out], new_state,
    buffers)``."""
    B, T = x.shape[0], x.shape[1]
    bufs = _Buffers(plan, B, T, x)
    n_per, L, top = plan.per_layer, plan.L, plan.L - 1
    out = x.new_empty(B, T, plan.layers[-1].nh)
    # initial state into the V buffers / cell buffers
    for l, lp in enumerate(plan.layers):
        V0 = bufs.V[l][0]
        V0[:, lp.cols["h"]].copy_(state[l * n_per])
        bufs.C[l][0].copy_(state[l * n_per + 1])
        if lp.recurrent:
            V0[:, lp.cols["z"]].copy_(state[l * n_per + 2])
            bufs.ZC[l][0].copy_(state[l * n_per + 3])
    if plan.wrap:
        bufs.V[0][0][:, plan.layers[0].cols["zb"]].copy_(state[top * n_per + 2])
    bufs.V[0][:T, :, plan.layers[0].cols["x"]].copy_(x.transpose(0, 1))

    def hoist(l: int) -> None:
        lp, w = plan.layers[l], weights[l]
        Vf = bufs.V[l][:T].reshape(T * B, lp.K)
        if lp.k0:
            bufs.AX[l] = gemm.addmm(w.ba, Vf[:, :lp.k0], w.wv[:, :lp.k0].t()).view(T, B, lp.na)
        if lp.hoist_gi:
            gemm.mm(Vf[:, lp.cols["x"]], w.w_ih.t(), out=bufs.G[l][0].view(T * B, -1))

    def step(l: int, t: int) -> None:
        lp, w = plan.layers[l], weights[l]
        mask_h, mask_z = plan.masks[l]
        V = bufs.V[l]
        Vt = V[t]
        nz, nh = lp.nz, lp.nh
        # 1. adaptation model -> dropped z
        if lp.k0:
            a = gemm.addmm(bufs.AX[l][t], Vt[:, lp.k0:], w.wv[:, lp.k0:].t())
        else:
            a = gemm.addmm(w.ba, Vt, w.wv.t())
        zd = bufs.ZD[l][t]
        if lp.recurrent:
            act = lstm_gates_into(a, nz, bufs.A[l][t], doubled=True)
            lstm_cell_forward(act, bufs.ZC[l][t], nz, bufs.ZC[l][t + 1], bufs.TZC[l][t], zd)
        else:
            torch.clamp(a, min=0, out=bufs.A[l][t])     # relu
            zd.copy_(bufs.A[l][t])
        if mask_z is not None:
            zd.mul_(mask_z)
        # 2. the policy: tanh(W_pi z) = 2 sigmoid(2 W_pi z) - 1
        pi = bufs.PI[l][t]
        gemm.addmm(w.zero, zd, w.wp.t(), beta=0, alpha=2.0, out=pi)
        pi.sigmoid_().mul_(2.0).sub_(1.0)
        # 3. adaptive LSTM cell
        G = bufs.G[l]
        if lp.io:
            u = torch.mul(Vt[:, lp.xh], pi[:, :lp.nx + nh], out=bufs.U[l][t])
            x_in, h_in = u[:, :lp.nx], u[:, lp.nx:]
        else:
            x_in, h_in = Vt[:, lp.cols["x"]], Vt[:, lp.cols["h"]]
        if not lp.hoist_gi:
            gemm.mm(x_in, w.w_ih.t(), out=G[0, t])
        gemm.mm(h_in, w.w_hh.t(), out=G[1, t])
        gates = G[1, t] * pi[:, lp.pi_hh]
        gates.addcmul_(G[0, t], pi[:, lp.pi_ih])
        if lp.ab:
            gates.addcmul_(w.bias, pi[:, lp.pi_b])
        else:
            gates += w.bias
        act = lstm_gates_into(gates, nh, bufs.ACT[l][t], doubled=False)
        h_next = V[t + 1][:, lp.cols["h"]]
        h = out[:, t] if l == top else h_next
        lstm_cell_forward(act, bufs.C[l][t], nh, bufs.C[l][t + 1], bufs.TC[l][t], h)
        if l == top:
            torch.mul(h, mask_h, out=h_next) if mask_h is not None else h_next.copy_(h)
        elif mask_h is not None:
            h_next.mul_(mask_h)
        # 4. hand the dropped h and z on
        if lp.recurrent:
            V[t + 1][:, lp.cols["z"]].copy_(zd)
        if l < top:
            up = plan.layers[l + 1]
            bufs.V[l + 1][t][:, up.cols["x"]].copy_(h_next)
            if up.nzb:
                bufs.V[l + 1][t][:, up.cols["zb"]].copy_(zd)
        elif plan.wrap:
            bufs.V[0][t + 1][:, plan.layers[0].cols["zb"]].copy_(zd)

    if plan.layer_major:
        for l in range(L):
            hoist(l)
            for t in range(T):
                step(l, t)
    else:
        hoist(0)
        for t in range(T):
            for l in range(L):
                step(l, t)

    new_state: list[Tensor] = []
    for l, lp in enumerate(plan.layers):
        VT = bufs.V[l][T]
        new_state += [VT[:, lp.cols["h"]].clone(), bufs.C[l][T].clone()]
        if lp.recurrent:
            new_state += [VT[:, lp.cols["z"]].clone(), bufs.ZC[l][T].clone()]
    return out, tuple(new_state), bufs


def _backward(plan: _Plan, bufs: _Buffers, weights: list[_Weights], x: Tensor, d_out: Tensor | None,
              d_state: list[Tensor | None]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Gradients w.r.t. the input sequence, the initial state (flat) and the parameters (flat)."""
    B, T = x.shape[0], x.shape[1]
    L, n_per, top = plan.L, plan.per_layer, plan.L - 1
    zeros = x.new_zeros
    # gradients arriving from the layer above (the x and zb columns of its V), per step
    ext_h = [zeros(T, B, lp.nh) if l < top else None for l, lp in enumerate(plan.layers)]
    ext_z = [zeros(T, B, lp.nz) if (l < top and plan.layers[l + 1].nzb) or (l == top and plan.wrap) else None
             for l, lp in enumerate(plan.layers)]
    DA = [x.new_empty(T, B, lp.na) for lp in plan.layers]              # d adaptation pre-activation
    DP = [x.new_empty(T, B, lp.P) for lp in plan.layers]               # d policy pre-activation
    DG = [x.new_empty(3, T, B, 4 * lp.nh) for lp in plan.layers]       # d gi, d gh, d bias
    # main-cell part of d x, kept for the batched d x of hoisted layers (IO policy)
    DXM = [x.new_empty(T, B, lp.nx) if lp.io and (l == 0 or plan.layer_major) else None
           for l, lp in enumerate(plan.layers)]
    carry: list[dict[str, Tensor | None]] = []
    for l, lp in enumerate(plan.layers):
        ds = d_state[l * n_per:(l + 1) * n_per]
        carry.append({"h": ds[0], "c": ds[1], "z": ds[2] if lp.recurrent else None,
                      "zc": ds[3] if lp.recurrent else None})
    d_x: Tensor | None = None
    d_zb0_first: Tensor | None = None   # layer 0's d zb at t = 0 (wrap-around: d of the initial top z)
    d_gates = [x.new_empty(B, 4 * lp.nh) for lp in plan.layers]

    def step(l: int, t: int) -> None:
        nonlocal d_zb0_first
        lp, w = plan.layers[l], weights[l]
        mask_h, mask_z = plan.masks[l]
        cr = carry[l]
        nz, nh = lp.nz, lp.nh
        Vt = bufs.V[l][t]
        # gradient w.r.t. the dropped h_t (own next step + layer above), then through the mask
        dhd = cr["h"]
        if ext_h[l] is not None:
            dhd = ext_h[l][t] if dhd is None else dhd + ext_h[l][t]
        dh = None
        if dhd is not None:
            dh = dhd * mask_h if mask_h is not None else dhd
        if l == top and d_out is not None:
            dh = d_out[:, t] if dh is None else dh + d_out[:, t]
        if dh is None:
            dh = zeros(B, nh)
        # main cell
        dG = d_gates[l]
        cr["c"] = lstm_cell_backward(bufs.ACT[l][t], bufs.C[l][t], bufs.TC[l][t], dh, cr["c"], nh, dG,
                                     doubled=False)
        pi = bufs.PI[l][t]
        dP = DP[l][t]
        G = bufs.G[l]
        torch.mul(dG, G[0, t], out=dP[:, lp.pi_ih])
        torch.mul(dG, G[1, t], out=dP[:, lp.pi_hh])
        torch.mul(dG, pi[:, lp.pi_ih], out=DG[l][0, t])
        torch.mul(dG, pi[:, lp.pi_hh], out=DG[l][1, t])
        if lp.ab:
            torch.mul(dG, w.bias, out=dP[:, lp.pi_b])
            torch.mul(dG, pi[:, lp.pi_b], out=DG[l][2, t])
        else:
            DG[l][2, t].copy_(dG)
        dx_main = None
        if lp.io:
            du = torch.cat((gemm.mm(DG[l][0, t], w.w_ih), gemm.mm(DG[l][1, t], w.w_hh)), 1)
            torch.mul(du, Vt[:, lp.xh], out=dP[:, :lp.nx + nh])
            dxh = du.mul_(pi[:, :lp.nx + nh])
            dx_main, dh_main = dxh[:, :lp.nx], dxh[:, lp.nx:]
            if DXM[l] is not None:
                DXM[l][t].copy_(dx_main)
        else:
            dh_main = gemm.mm(DG[l][1, t], w.w_hh)
            if l > 0 and not plan.layer_major:     # interleaved upper layer: the layer below needs it now
                dx_main = gemm.mm(DG[l][0, t], w.w_ih)
        dP.mul_(1.0 - pi * pi)
        dz = gemm.mm(dP, w.wp)
        if cr["z"] is not None:
            dz += cr["z"]
        if ext_z[l] is not None:
            dz += ext_z[l][t]
        if mask_z is not None:
            dz.mul_(mask_z)
        # adaptation model
        dA = DA[l][t]
        if lp.recurrent:
            cr["zc"] = lstm_cell_backward(bufs.A[l][t], bufs.ZC[l][t], bufs.TZC[l][t], dz, cr["zc"], nz, dA,
                                          doubled=True)
        else:
            torch.mul(dz, bufs.A[l][t] > 0, out=dA)
        k0 = lp.k0
        dVr = gemm.mm(dA, w.wv[:, k0:])   # [B, K - k0]: d of the V columns from k0 on

        def col(name: str) -> Tensor:
            s = lp.cols[name]
            return dVr[:, s.start - k0:s.stop - k0]

        cr["h"] = col("h") + dh_main
        cr["z"] = col("z") if lp.recurrent else None
        if plan.layer_major:
            return
        if l > 0:   # interleaved: the layer below needs d x and d zb of this step now
            ext_h[l - 1][t].copy_(col("x") + dx_main)
            if lp.nzb:
                ext_z[l - 1][t].copy_(col("zb"))
        elif lp.nzb:   # layer 0 with the wrap-around: d zb is the gradient of the top z of step t-1
            if t > 0:
                ext_z[top][t - 1].copy_(col("zb"))
            else:
                d_zb0_first = col("zb").clone()

    def finish_layer(l: int) -> None:
        """Batched gradients of the hoisted columns (d x, d zb) of layer ``l`` over all steps."""
        nonlocal d_x
        lp, w = plan.layers[l], weights[l]
        d_hoisted = gemm.mm(DA[l].view(T * B, -1), w.wv[:, :lp.k0]).view(T, B, lp.k0)
        dx = d_hoisted[:, :, lp.cols["x"]]
        if lp.io:
            dx = dx + DXM[l]
        else:
            dx = dx + gemm.mm(DG[l][0].view(T * B, -1), w.w_ih).view(T, B, lp.nx)
        if l == 0:
            d_x = dx
        else:
            ext_h[l - 1].copy_(dx)
            if lp.nzb:
                ext_z[l - 1].copy_(d_hoisted[:, :, lp.cols["zb"]])

    if plan.layer_major:
        for l in reversed(range(L)):
            for t in reversed(range(T)):
                step(l, t)
            finish_layer(l)
    else:
        for t in reversed(range(T)):
            for l in reversed(range(L)):
                step(l, t)
        finish_layer(0)
    assert d_x is not None

    # initial-state gradients
    d_state0: list[Tensor] = []
    for l, lp in enumerate(plan.layers):
        cr = carry[l]
        d_state0 += [cr["h"], cr["c"]]
        if lp.recurrent:
            dz0 = cr["z"]
            if l == top and d_zb0_first is not None:
                dz0 = dz0 + d_zb0_first
            d_state0 += [dz0, cr["zc"]]
    # weight gradients: one GEMM each over all T * B rows
    d_params: list[Tensor] = []
    for l, lp in enumerate(plan.layers):
        dA = DA[l].view(T * B, -1)
        Vf = bufs.V[l][:T].reshape(T * B, lp.K)
        zd = bufs.ZD[l].view(T * B, lp.nz)
        if lp.io:
            U = bufs.U[l].view(T * B, -1)
            x_in, h_in = U[:, :lp.nx], U[:, lp.nx:]
        else:
            x_in, h_in = Vf[:, lp.cols["x"]], Vf[:, lp.cols["h"]]
        dG = DG[l].view(3, T * B, -1)
        d_params += lp.param_grads(gemm.mm(dA.t(), Vf), dA.sum(0), gemm.mm(DP[l].view(T * B, -1).t(), zd),
                                   gemm.mm(dG[0].t(), x_in), gemm.mm(dG[1].t(), h_in), dG[2].sum(0))
    return d_x.transpose(0, 1), d_state0, d_params


class ALSTMSequence(torch.autograd.Function):
    """``apply(plan, weights, x, *state, *params) -> (out, *new_state)`` with the hand-written backward."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, weights: list[_Weights], x: Tensor,  # type: ignore[override]
                *flat: Tensor) -> tuple[Tensor, ...]:
        n_state = plan.L * plan.per_layer
        state, params = flat[:n_state], flat[n_state:]
        out, new_state, bufs = _forward(plan, x.detach(), tuple(s.detach() for s in state), weights)
        ctx.plan, ctx.bufs, ctx.weights = plan, bufs, weights
        ctx.save_for_backward(x, *params)
        return (out, *new_state)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor | None, *d_state: Tensor | None) -> tuple[Tensor | None, ...]:
        x = ctx.saved_tensors[0]   # (the access also checks that no parameter was modified in place)
        with gemm.compute(ctx.plan.gemm_dtype, x.device.type):
            d_x, d_state0, d_params = _backward(ctx.plan, ctx.bufs, ctx.weights, x, d_out, list(d_state))
        return (None, None, d_x, *d_state0, *d_params)


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


def _compiled_weights(plan: _Plan, params: list[Tensor]) -> tuple[list[int], list[Tensor]]:
    """The C++ loop's per-layer sizes and weights (transposed, contiguous), in its argument order."""
    cfg: list[int] = []
    flat_w: list[Tensor] = []
    for lp, w in zip(plan.layers, derived_weights(plan, params), strict=True):
        cfg += [lp.nx, lp.nh, lp.nz, lp.nzb, lp.k0, lp.K, int(lp.recurrent), int(lp.io), int(lp.ab),
                int(lp.hoist_gi), lp.P]
        flat_w += [w.wv, w.wv[:, lp.k0:].t().contiguous(), w.ba, w.wp.t().contiguous(), w.w_ih.t().contiguous(),
                   w.w_hh.t().contiguous(), w.bias.detach()]
    return cfg, flat_w


def _infer_compiled(ext: Any, stack: Any, plan: _Plan, x: Tensor, state: State,
                    params: list[Tensor]) -> tuple[Tensor, State]:
    """:func:`_infer` in C++ (``zoo/models/csrc/alstm_infer.cpp``): the same loop and arithmetic."""
    cfg, flat_w = _compiled.cached_weights(stack, params, lambda: _compiled_weights(plan, params))
    empty = x.new_empty(0)
    flat_m = [m if m is not None else empty for pair in plan.masks for m in pair]
    res = ext.alstm_infer(x, list(state), flat_w, flat_m, cfg, plan.layer_major, plan.per_layer)
    return res[0], tuple(res[1:])


def _infer(plan: _Plan, x: Tensor, state: State, weights: list[_Weights]) -> tuple[Tensor, State]:
    """The forward without autograd bookkeeping: the same arithmetic as :func:`_forward` (hoisting
    included) with as few kernel launches and Python steps per time step as possible, and no storage
    for a backward. Used for scoring and generation warm-up, where the small batches make per-op
    overhead, not FLOPs, the cost."""
    B, T = x.shape[0], x.shape[1]
    n_per, L, top = plan.per_layer, plan.L, plan.L - 1
    hs = [state[l * n_per] for l in range(L)]
    cs = [state[l * n_per + 1] for l in range(L)]
    zs = [state[l * n_per + 2] if lp.recurrent else None for l, lp in enumerate(plan.layers)]
    zcs = [state[l * n_per + 3] if lp.recurrent else None for l, lp in enumerate(plan.layers)]
    out = x.new_empty(B, T, plan.layers[-1].nh)

    def hoist(l: int, seq: Tensor, zseq: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        lp, w = plan.layers[l], weights[l]
        flat = seq.reshape(T * B, -1)
        ax = gi = None
        if lp.k0:
            inp = torch.cat((zseq.reshape(T * B, -1), flat), 1) if (plan.layer_major and lp.nzb) else flat
            ax = gemm.addmm(w.ba, inp, w.wv[:, :lp.k0].t()).view(T, B, lp.na)
        if lp.hoist_gi:
            gi = gemm.mm(flat, w.w_ih.t()).view(T, B, -1)
        return ax, gi

    def step(l: int, t: int, x_t: Tensor, zb_t: Tensor | None, ax: Tensor | None, gi_all: Tensor | None) -> None:
        lp, w = plan.layers[l], weights[l]
        mask_h, mask_z = plan.masks[l]
        h = hs[l]
        parts = [x_t, h] if lp.k0 == 0 else [h]
        if lp.nzb and not plan.layer_major:
            parts.append(zb_t)
        if lp.recurrent:
            parts.append(zs[l])
        v = torch.cat(parts, 1)
        a = gemm.addmm(ax[t] if ax is not None else w.ba, v, w.wv[:, lp.k0:].t())
        if lp.recurrent:
            i, f, g, o = a.sigmoid_().chunk(4, 1)            # g arrives doubled: tanh(g) = 2 s_g - 1
            zc = f * zcs[l]
            zc.addcmul_(i, g, value=2.0).sub_(i)
            zcs[l] = zc
            z = o * tanh(zc)
        else:
            z = a.clamp_min_(0.0)
        if mask_z is not None:
            z = z * mask_z
        zs[l] = z
        pi = gemm.addmm(w.zero, z, w.wp.t(), beta=0, alpha=2.0).sigmoid_().mul_(2.0).sub_(1.0)
        pis = pi.split(lp.pi_sizes, 1)
        if lp.io:
            gi = gemm.mm(x_t * pis[0], w.w_ih.t())
            gates = gemm.mm(h * pis[1], w.w_hh.t())
            pis = pis[2:]
        else:
            gi = gi_all[t] if gi_all is not None else gemm.mm(x_t, w.w_ih.t())
            gates = gemm.mm(h, w.w_hh.t())
        gates.mul_(pis[1]).addcmul_(gi, pis[0])
        if lp.ab:
            gates.addcmul_(w.bias, pis[2])
        else:
            gates += w.bias
        nh = lp.nh
        g = tanh(gates[:, 2 * nh:3 * nh])
        i, f, _, o = gates.sigmoid_().chunk(4, 1)
        c = f * cs[l]
        c.addcmul_(i, g)
        cs[l] = c
        h = torch.mul(o, tanh(c), out=out[:, t] if l == top else None)
        hs[l] = h * mask_h if mask_h is not None else h

    xs = x.transpose(0, 1)
    if plan.layer_major:
        seq, zseq = xs, None
        for l, lp in enumerate(plan.layers):
            ax, gi_all = hoist(l, seq, zseq)
            nxt = plan.layers[l + 1] if l < top else None
            hseq = x.new_empty(T, B, lp.nh) if nxt is not None else None
            zseq_next = x.new_empty(T, B, lp.nz) if (nxt is not None and nxt.nzb) else None
            for t in range(T):
                step(l, t, seq[t], None, ax, gi_all)
                if hseq is not None:
                    hseq[t] = hs[l]
                if zseq_next is not None:
                    zseq_next[t] = zs[l]
            seq, zseq = hseq, zseq_next
    else:
        ax0, gi0 = hoist(0, xs, None)
        for t in range(T):
            for l in range(L):
                if l == 0:
                    step(0, t, xs[t], zs[top], ax0, gi0)
                else:
                    step(l, t, hs[l - 1], zs[l - 1], None, None)
    new_state: list[Tensor] = []
    for l, lp in enumerate(plan.layers):
        new_state += [hs[l], cs[l]] + ([zs[l], zcs[l]] if lp.recurrent else [])
    return out, tuple(new_state)
