"""The aLSTM fast path's inference side (:mod:`zoo.models._alstm_fast`): no autograd, nothing stored, as few
kernel launches per step as possible; on the CPU in float32 the same loop runs compiled (``csrc/alstm_infer.cpp``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zoo.models import _compiled
from zoo.models import _gemm as gemm
from zoo.models._alstm_plan import _Plan, _Weights, derived_weights
from zoo.models._fused import tanh
from zoo.models.base import State


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
    return _InferPass(plan, x, state, weights).run()


class _InferPass:
    """One segment of :func:`_infer`: the running state per layer (``hs``, ``cs``, ``zs``, ``zcs``) and the
    steps that update it in place."""

    def __init__(self, plan: _Plan, x: Tensor, state: State, weights: list[_Weights]) -> None:
        self.plan, self.x, self.weights = plan, x, weights
        self.B, self.T = x.shape[0], x.shape[1]
        n_per, self.top = plan.per_layer, plan.L - 1
        self.hs = [state[l * n_per] for l in range(plan.L)]
        self.cs = [state[l * n_per + 1] for l in range(plan.L)]
        self.zs = [state[l * n_per + 2] if lp.recurrent else None for l, lp in enumerate(plan.layers)]
        self.zcs = [state[l * n_per + 3] if lp.recurrent else None for l, lp in enumerate(plan.layers)]
        self.out = x.new_empty(self.B, self.T, plan.layers[-1].nh)

    def run(self) -> tuple[Tensor, State]:
        plan, xs = self.plan, self.x.transpose(0, 1)
        if plan.layer_major:
            self._layer_major(xs)
        else:
            ax0, gi0 = self.hoist(0, xs, None)
            for t in range(self.T):
                for l in range(plan.L):
                    if l == 0:
                        self.step(0, t, xs[t], self.zs[self.top], ax0, gi0)
                    else:
                        self.step(l, t, self.hs[l - 1], self.zs[l - 1], None, None)
        new_state: list[Tensor] = []
        for l, lp in enumerate(plan.layers):
            new_state += [self.hs[l], self.cs[l]] + ([self.zs[l], self.zcs[l]] if lp.recurrent else [])
        return self.out, tuple(new_state)

    def _layer_major(self, xs: Tensor) -> None:
        """Each layer over the whole segment before the next (no wrap-around): its inputs are then known."""
        T, B, top = self.T, self.B, self.top
        seq, zseq = xs, None
        for l, lp in enumerate(self.plan.layers):
            ax, gi_all = self.hoist(l, seq, zseq)
            nxt = self.plan.layers[l + 1] if l < top else None
            hseq = self.x.new_empty(T, B, lp.nh) if nxt is not None else None
            zseq_next = self.x.new_empty(T, B, lp.nz) if (nxt is not None and nxt.nzb) else None
            for t in range(T):
                self.step(l, t, seq[t], None, ax, gi_all)
                if hseq is not None:
                    hseq[t] = self.hs[l]
                if zseq_next is not None:
                    zseq_next[t] = self.zs[l]
            seq, zseq = hseq, zseq_next

    def hoist(self, l: int, seq: Tensor, zseq: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        lp, w, T, B = self.plan.layers[l], self.weights[l], self.T, self.B
        flat = seq.reshape(T * B, -1)
        ax = gi = None
        if lp.k0:
            inp = torch.cat((zseq.reshape(T * B, -1), flat), 1) if (self.plan.layer_major and lp.nzb) else flat
            ax = gemm.addmm(w.ba, inp, w.wv[:, :lp.k0].t()).view(T, B, lp.na)
        if lp.hoist_gi:
            gi = gemm.mm(flat, w.w_ih.t()).view(T, B, -1)
        return ax, gi

    def step(self, l: int, t: int, x_t: Tensor, zb_t: Tensor | None, ax: Tensor | None,
             gi_all: Tensor | None) -> None:
        pis = self._adapt(l, t, x_t, zb_t, ax)
        self._cell(l, t, x_t, pis, gi_all)

    def _adapt(self, l: int, t: int, x_t: Tensor, zb_t: Tensor | None, ax: Tensor | None) -> tuple[Tensor, ...]:
        """The adaptation model's step (z into ``zs``) and the policy, split into its parts."""
        lp, w, plan = self.plan.layers[l], self.weights[l], self.plan
        mask_z = plan.masks[l][1]
        h = self.hs[l]
        parts = [x_t, h] if lp.k0 == 0 else [h]
        if lp.nzb and not plan.layer_major:
            parts.append(zb_t)
        if lp.recurrent:
            parts.append(self.zs[l])
        v = torch.cat(parts, 1)
        a = gemm.addmm(ax[t] if ax is not None else w.ba, v, w.wv[:, lp.k0:].t())
        if lp.recurrent:
            i, f, g, o = a.sigmoid_().chunk(4, 1)            # g arrives doubled: tanh(g) = 2 s_g - 1
            zc = f * self.zcs[l]
            zc.addcmul_(i, g, value=2.0).sub_(i)
            self.zcs[l] = zc
            z = o * tanh(zc)
        else:
            z = a.clamp_min_(0.0)
        if mask_z is not None:
            z = z * mask_z
        self.zs[l] = z
        pi = gemm.addmm(w.zero, z, w.wp.t(), beta=0, alpha=2.0).sigmoid_().mul_(2.0).sub_(1.0)
        return pi.split(lp.pi_sizes, 1)

    def _cell(self, l: int, t: int, x_t: Tensor, pis: tuple[Tensor, ...], gi_all: Tensor | None) -> None:
        """The adaptive LSTM cell's step (h into ``hs``, c into ``cs``; the top layer's h into ``out``)."""
        lp, w = self.plan.layers[l], self.weights[l]
        mask_h = self.plan.masks[l][0]
        h = self.hs[l]
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
        c = f * self.cs[l]
        c.addcmul_(i, g)
        self.cs[l] = c
        h = torch.mul(o, tanh(c), out=self.out[:, t] if l == self.top else None)
        self.hs[l] = h * mask_h if mask_h is not None else h
