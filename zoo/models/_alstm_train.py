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
    return _ForwardPass(plan, x, state, weights).run()


class _ForwardPass:
    """One segment's forward: the buffers it fills (:class:`_Buffers`, kept for the backward) and its steps."""

    def __init__(self, plan: _Plan, x: Tensor, state: State, weights: list[_Weights]) -> None:
        self.plan, self.x, self.weights = plan, x, weights
        self.B, self.T = x.shape[0], x.shape[1]
        self.bufs = _Buffers(plan, self.B, self.T, x)
        self.out = x.new_empty(self.B, self.T, plan.layers[-1].nh)
        self.top = plan.L - 1
        self._load_state(state)

    def _load_state(self, state: State) -> None:
        """The initial state into the V buffers / cell buffers, and the input sequence into layer 0's V."""
        plan, bufs, n_per = self.plan, self.bufs, self.plan.per_layer
        for l, lp in enumerate(plan.layers):
            V0 = bufs.V[l][0]
            V0[:, lp.cols["h"]].copy_(state[l * n_per])
            bufs.C[l][0].copy_(state[l * n_per + 1])
            if lp.recurrent:
                V0[:, lp.cols["z"]].copy_(state[l * n_per + 2])
                bufs.ZC[l][0].copy_(state[l * n_per + 3])
        if plan.wrap:
            bufs.V[0][0][:, plan.layers[0].cols["zb"]].copy_(state[self.top * n_per + 2])
        bufs.V[0][:self.T, :, plan.layers[0].cols["x"]].copy_(self.x.transpose(0, 1))

    def run(self) -> tuple[Tensor, State, _Buffers]:
        plan, T = self.plan, self.T
        if plan.layer_major:
            for l in range(plan.L):
                self.hoist(l)
                for t in range(T):
                    self.step(l, t)
        else:
            self.hoist(0)
            for t in range(T):
                for l in range(plan.L):
                    self.step(l, t)
        new_state: list[Tensor] = []
        for l, lp in enumerate(plan.layers):
            VT = self.bufs.V[l][T]
            new_state += [VT[:, lp.cols["h"]].clone(), self.bufs.C[l][T].clone()]
            if lp.recurrent:
                new_state += [VT[:, lp.cols["z"]].clone(), self.bufs.ZC[l][T].clone()]
        return self.out, tuple(new_state), self.bufs

    def hoist(self, l: int) -> None:
        """The GEMMs of layer ``l`` over all steps at once, where its inputs are known in advance."""
        lp, w, bufs, T, B = self.plan.layers[l], self.weights[l], self.bufs, self.T, self.B
        Vf = bufs.V[l][:T].reshape(T * B, lp.K)
        if lp.k0:
            bufs.AX[l] = gemm.addmm(w.ba, Vf[:, :lp.k0], w.wv[:, :lp.k0].t()).view(T, B, lp.na)
        if lp.hoist_gi:
            gemm.mm(Vf[:, lp.cols["x"]], w.w_ih.t(), out=bufs.G[l][0].view(T * B, -1))

    def step(self, l: int, t: int) -> None:
        pi = self._adapt(l, t)
        h_next = self._cell(l, t, pi)
        self._hand_on(l, t, h_next)

    def _adapt(self, l: int, t: int) -> Tensor:
        """1. the adaptation model -> the dropped z; 2. the policy: tanh(W_pi z) = 2 sigmoid(2 W_pi z) - 1."""
        lp, w, bufs = self.plan.layers[l], self.weights[l], self.bufs
        mask_z = self.plan.masks[l][1]
        Vt, nz = bufs.V[l][t], lp.nz
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
        pi = bufs.PI[l][t]
        gemm.addmm(w.zero, zd, w.wp.t(), beta=0, alpha=2.0, out=pi)
        pi.sigmoid_().mul_(2.0).sub_(1.0)
        return pi

    def _cell(self, l: int, t: int, pi: Tensor) -> Tensor:
        """3. the adaptive LSTM cell; returns the dropped h (the next step's V column)."""
        lp, w, bufs = self.plan.layers[l], self.weights[l], self.bufs
        mask_h = self.plan.masks[l][0]
        V, G, nh = bufs.V[l], bufs.G[l], lp.nh
        Vt = V[t]
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
        h = self.out[:, t] if l == self.top else h_next
        lstm_cell_forward(act, bufs.C[l][t], nh, bufs.C[l][t + 1], bufs.TC[l][t], h)
        if l == self.top:
            torch.mul(h, mask_h, out=h_next) if mask_h is not None else h_next.copy_(h)
        elif mask_h is not None:
            h_next.mul_(mask_h)
        return h_next

    def _hand_on(self, l: int, t: int, h_next: Tensor) -> None:
        """4. the dropped h and z into the V columns that read them (next step, layer above, wrap-around)."""
        plan, bufs, lp = self.plan, self.bufs, self.plan.layers[l]
        zd = bufs.ZD[l][t]
        if lp.recurrent:
            bufs.V[l][t + 1][:, lp.cols["z"]].copy_(zd)
        if l < self.top:
            up = plan.layers[l + 1]
            bufs.V[l + 1][t][:, up.cols["x"]].copy_(h_next)
            if up.nzb:
                bufs.V[l + 1][t][:, up.cols["zb"]].copy_(zd)
        elif plan.wrap:
            bufs.V[0][t + 1][:, plan.layers[0].cols["zb"]].copy_(zd)


def _backward(plan: _Plan, bufs: _Buffers, weights: list[_Weights], x: Tensor, d_out: Tensor | None,
              d_state: list[Tensor | None]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Gradients w.r.t. the input sequence, the initial state (flat) and the parameters (flat)."""
    return _BackwardPass(plan, bufs, weights, x, d_out, d_state).run()


class _BackwardPass:
    """One segment's backward, steps in reverse: the per-step gradient buffers, and the gradients carried from
    step to step (``carry``) and handed down from a layer to the one below (``ext_h``, ``ext_z``)."""

    def __init__(self, plan: _Plan, bufs: _Buffers, weights: list[_Weights], x: Tensor, d_out: Tensor | None,
                 d_state: list[Tensor | None]) -> None:
        self.plan, self.bufs, self.weights, self.d_out = plan, bufs, weights, d_out
        B, T = self.B, self.T = x.shape[0], x.shape[1]
        top = self.top = plan.L - 1
        zeros, empty, layers = x.new_zeros, x.new_empty, plan.layers
        # gradients arriving from the layer above (the x and zb columns of its V), per step
        self.ext_h = [zeros(T, B, lp.nh) if l < top else None for l, lp in enumerate(layers)]
        self.ext_z = [zeros(T, B, lp.nz) if (l < top and layers[l + 1].nzb) or (l == top and plan.wrap) else None
                      for l, lp in enumerate(layers)]
        self.DA = [empty(T, B, lp.na) for lp in layers]              # d adaptation pre-activation
        self.DP = [empty(T, B, lp.P) for lp in layers]               # d policy pre-activation
        self.DG = [empty(3, T, B, 4 * lp.nh) for lp in layers]       # d gi, d gh, d bias
        # main-cell part of d x, kept for the batched d x of hoisted layers (IO policy)
        self.DXM = [empty(T, B, lp.nx) if lp.io and (l == 0 or plan.layer_major) else None
                    for l, lp in enumerate(layers)]
        n_per = plan.per_layer
        self.carry: list[dict[str, Tensor | None]] = []
        for l, lp in enumerate(layers):
            ds = d_state[l * n_per:(l + 1) * n_per]
            self.carry.append({"h": ds[0], "c": ds[1], "z": ds[2] if lp.recurrent else None,
                               "zc": ds[3] if lp.recurrent else None})
        self.d_x: Tensor | None = None
        self.d_zb0_first: Tensor | None = None   # layer 0's d zb at t = 0 (wrap-around: d of the initial top z)
        self.d_gates = [empty(B, 4 * lp.nh) for lp in layers]
        self.zeros = zeros

    def run(self) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        plan, T = self.plan, self.T
        if plan.layer_major:
            for l in reversed(range(plan.L)):
                for t in reversed(range(T)):
                    self.step(l, t)
                self.finish_layer(l)
        else:
            for t in reversed(range(T)):
                for l in reversed(range(plan.L)):
                    self.step(l, t)
            self.finish_layer(0)
        assert self.d_x is not None
        return self.d_x.transpose(0, 1), self.initial_state_grads(), self.param_grads()

    def step(self, l: int, t: int) -> None:
        dh = self._d_h(l, t)
        dh_main, dx_main = self._cell(l, t, dh)
        dV = self._adapt(l, t)
        self._hand_down(l, t, dV, dh_main, dx_main)

    def _d_h(self, l: int, t: int) -> Tensor:
        """The gradient w.r.t. the dropped h_t (own next step + layer above), then through the mask."""
        mask_h, cr = self.plan.masks[l][0], self.carry[l]
        dhd = cr["h"]
        if self.ext_h[l] is not None:
            dhd = self.ext_h[l][t] if dhd is None else dhd + self.ext_h[l][t]
        dh = None
        if dhd is not None:
            dh = dhd * mask_h if mask_h is not None else dhd
        if l == self.top and self.d_out is not None:
            dh = self.d_out[:, t] if dh is None else dh + self.d_out[:, t]
        if dh is None:
            dh = self.zeros(self.B, self.plan.layers[l].nh)
        return dh

    def _cell(self, l: int, t: int, dh: Tensor) -> tuple[Tensor, Tensor | None]:
        """The main cell's backward: d gates, d policy, d of its GEMMs' inputs; returns (d h, d x) of this step
        (d x only where the layer below needs it now)."""
        lp, w, bufs, cr = self.plan.layers[l], self.weights[l], self.bufs, self.carry[l]
        nh, DG = lp.nh, self.DG[l]
        dG = self.d_gates[l]
        cr["c"] = lstm_cell_backward(bufs.ACT[l][t], bufs.C[l][t], bufs.TC[l][t], dh, cr["c"], nh, dG,
                                     doubled=False)
        pi, dP, G = bufs.PI[l][t], self.DP[l][t], bufs.G[l]
        torch.mul(dG, G[0, t], out=dP[:, lp.pi_ih])
        torch.mul(dG, G[1, t], out=dP[:, lp.pi_hh])
        torch.mul(dG, pi[:, lp.pi_ih], out=DG[0, t])
        torch.mul(dG, pi[:, lp.pi_hh], out=DG[1, t])
        if lp.ab:
            torch.mul(dG, w.bias, out=dP[:, lp.pi_b])
            torch.mul(dG, pi[:, lp.pi_b], out=DG[2, t])
        else:
            DG[2, t].copy_(dG)
        dx_main = None
        if lp.io:
            du = torch.cat((gemm.mm(DG[0, t], w.w_ih), gemm.mm(DG[1, t], w.w_hh)), 1)
            torch.mul(du, bufs.V[l][t][:, lp.xh], out=dP[:, :lp.nx + nh])
            dxh = du.mul_(pi[:, :lp.nx + nh])
            dx_main, dh_main = dxh[:, :lp.nx], dxh[:, lp.nx:]
            if self.DXM[l] is not None:
                self.DXM[l][t].copy_(dx_main)
        else:
            dh_main = gemm.mm(DG[1, t], w.w_hh)
            if l > 0 and not self.plan.layer_major:     # interleaved upper layer: the layer below needs it now
                dx_main = gemm.mm(DG[0, t], w.w_ih)
        dP.mul_(1.0 - pi * pi)
        return dh_main, dx_main

    def _adapt(self, l: int, t: int) -> Tensor:
        """The adaptation model's backward; returns d of the V columns from k0 on."""
        lp, w, bufs, cr = self.plan.layers[l], self.weights[l], self.bufs, self.carry[l]
        mask_z = self.plan.masks[l][1]
        dz = gemm.mm(self.DP[l][t], w.wp)
        if cr["z"] is not None:
            dz += cr["z"]
        if self.ext_z[l] is not None:
            dz += self.ext_z[l][t]
        if mask_z is not None:
            dz.mul_(mask_z)
        dA = self.DA[l][t]
        if lp.recurrent:
            cr["zc"] = lstm_cell_backward(bufs.A[l][t], bufs.ZC[l][t], bufs.TZC[l][t], dz, cr["zc"], lp.nz, dA,
                                          doubled=True)
        else:
            torch.mul(dz, bufs.A[l][t] > 0, out=dA)
        return gemm.mm(dA, w.wv[:, lp.k0:])   # [B, K - k0]

    def _hand_down(self, l: int, t: int, dV: Tensor, dh_main: Tensor, dx_main: Tensor | None) -> None:
        """Carry d h and d z to the previous step; in the interleaved order, hand d x and d zb to the layer
        below (or, for layer 0 with the wrap-around, to the top layer's previous step)."""
        lp, cr = self.plan.layers[l], self.carry[l]
        k0 = lp.k0

        def col(name: str) -> Tensor:
            s = lp.cols[name]
            return dV[:, s.start - k0:s.stop - k0]

        cr["h"] = col("h") + dh_main
        cr["z"] = col("z") if lp.recurrent else None
        if self.plan.layer_major:
            return
        if l > 0:   # interleaved: the layer below needs d x and d zb of this step now
            self.ext_h[l - 1][t].copy_(col("x") + dx_main)
            if lp.nzb:
                self.ext_z[l - 1][t].copy_(col("zb"))
        elif lp.nzb:   # layer 0 with the wrap-around: d zb is the gradient of the top z of step t-1
            if t > 0:
                self.ext_z[self.top][t - 1].copy_(col("zb"))
            else:
                self.d_zb0_first = col("zb").clone()

    def finish_layer(self, l: int) -> None:
        """Batched gradients of the hoisted columns (d x, d zb) of layer ``l`` over all steps."""
        lp, w, T, B = self.plan.layers[l], self.weights[l], self.T, self.B
        d_hoisted = gemm.mm(self.DA[l].view(T * B, -1), w.wv[:, :lp.k0]).view(T, B, lp.k0)
        dx = d_hoisted[:, :, lp.cols["x"]]
        if lp.io:
            dx = dx + self.DXM[l]
        else:
            dx = dx + gemm.mm(self.DG[l][0].view(T * B, -1), w.w_ih).view(T, B, lp.nx)
        if l == 0:
            self.d_x = dx
        else:
            self.ext_h[l - 1].copy_(dx)
            if lp.nzb:
                self.ext_z[l - 1].copy_(d_hoisted[:, :, lp.cols["zb"]])

    def initial_state_grads(self) -> list[Tensor]:
        d_state0: list[Tensor] = []
        for l, lp in enumerate(self.plan.layers):
            cr = self.carry[l]
            d_state0 += [cr["h"], cr["c"]]
            if lp.recurrent:
                dz0 = cr["z"]
                if l == self.top and self.d_zb0_first is not None:
                    dz0 = dz0 + self.d_zb0_first
                d_state0 += [dz0, cr["zc"]]
        return d_state0

    def param_grads(self) -> list[Tensor]:
        """The weight gradients: one GEMM each over all T * B rows."""
        T, B, bufs = self.T, self.B, self.bufs
        d_params: list[Tensor] = []
        for l, lp in enumerate(self.plan.layers):
            dA = self.DA[l].view(T * B, -1)
            Vf = bufs.V[l][:T].reshape(T * B, lp.K)
            zd = bufs.ZD[l].view(T * B, lp.nz)
            if lp.io:
                U = bufs.U[l].view(T * B, -1)
                x_in, h_in = U[:, :lp.nx], U[:, lp.nx:]
            else:
                x_in, h_in = Vf[:, lp.cols["x"]], Vf[:, lp.cols["h"]]
            dG = self.DG[l].view(3, T * B, -1)
            d_params += lp.param_grads(gemm.mm(dA.t(), Vf), dA.sum(0), gemm.mm(self.DP[l].view(T * B, -1).t(), zd),
                                       gemm.mm(dG[0].t(), x_in), gemm.mm(dG[1].t(), h_in), dG[2].sum(0))
        return d_params


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
