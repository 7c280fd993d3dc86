"""The aLSTM fast path's training side (:mod:`zoo.models._alstm_fast`): the forward that stores what the
backward needs, the hand-written backward, and the autograd node that joins them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from zoo.models import _gemm as gemm
from zoo.models._alstm_plan import _Buffers, _Plan, _Weights
from zoo.models._fused import lstm_cell_backward, lstm_cell_forward, lstm_gates_into
from zoo.models.base import State


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
