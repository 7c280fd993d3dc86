"""Fast sequence path of :class:`zoo.models.pnorm_gru.PNormGRUStack`: one autograd node per forward call.

Layers run layer-major (nothing flows from an upper layer back down), so each layer's input projection
``W x + b`` for all three gates is ONE GEMM over the whole segment; inside the time loop remain only
the two recurrent GEMMs of the cell (``U_{z,r} h`` and ``U_h (r * h)``, which cannot be merged because
the second needs ``r``). The hand-written backward does the two transposed GEMMs per step and batches
every weight gradient and the input gradient into one GEMM over ``T * B`` rows.

Every GEMM goes through :mod:`zoo.models._gemm`: float32 by default, bfloat16 when the call is entered
under bf16 autocast (``precision = "bf16"``), with everything else kept in float32.

The candidate ``tanh`` is ``2 sigmoid(2a) - 1`` with the factor 2 folded into the candidate rows of the
weights (exact; see :mod:`zoo.models._fused`). The p-norm gates reuse
:func:`zoo.models.pnorm_gru.pnorm_gates` for the forward; their derivative is written out below.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from zoo.models import _gemm as gemm
from zoo.models._fused import needs_autograd, tanh_into
from zoo.models._pnorm_gates import PNORM_EPS, pnorm_gates
from zoo.models.base import State


def _gates(a: Tensor, p: float) -> tuple[Tensor, Tensor]:
    return pnorm_gates(a, p)


def _d_alpha2(a: Tensor, alpha1: Tensor, alpha2: Tensor, p: float) -> Tensor:
    """``d alpha2 / d a`` of :func:`zoo.models.pnorm_gru.pnorm_gates` (zero where its clamp is active)."""
    if p == 1.0:
        return alpha1 * (alpha1 - 1.0)
    u = -p * torch.nn.functional.softplus(-a)            # log(alpha1^p), before the clamp
    limit = math.log1p(-PNORM_EPS)
    eu = torch.exp(torch.clamp(u, max=limit))            # alpha1^p
    # alpha2 = (1 - e^u)^(1/p):  d alpha2 / du = -alpha2 e^u / (p (1 - e^u));  du/da = p sigmoid(-a)
    d = alpha2 * eu / torch.expm1(torch.clamp(u, max=limit)) * torch.sigmoid(-a)
    return d.masked_fill_(u > limit, 0.0)


class _Plan:
    def __init__(self, stack: Any, masks: Any) -> None:
        self.L = stack.num_layers
        self.p = stack.p
        self.sizes = list(stack.sizes)
        self.ins = [stack.input_size] + self.sizes[:-1]
        self.rec = list(masks.recurrent) if masks is not None else [None] * self.L
        self.between = list(masks.between) + [None] if masks is not None else [None] * self.L
        self.cells = list(stack.layers)
        self.gemm_dtype: torch.dtype | None = None   # set per call: the GEMMs' precision (zoo.models._gemm)

    def params(self) -> list[Tensor]:
        return [t for c in self.cells for t in (c.weight_ih, c.weight_hh, c.bias)]


def _weights(plan: _Plan, params: list[Tensor]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per layer ``(W_ih, W_hh, b)``, detached (the backward is written by hand)."""
    return [(gemm.lowp(params[3 * l].detach()), gemm.lowp(params[3 * l + 1].detach()), params[3 * l + 2].detach())
            for l in range(plan.L)]


def _forward(plan: _Plan, x: Tensor, state: State, weights: list, store: bool) -> tuple[Tensor, State, dict]:
    B, T = x.shape[0], x.shape[1]
    saved: dict[str, list] = {k: [] for k in ("X", "H", "HIN", "R", "RH", "CAND", "A", "A1", "A2")}
    inp = x.transpose(0, 1)          # [T, B, n_in], time-major
    new_state = []
    for l, n in enumerate(plan.sizes):
        w_ih, w_hh, b = weights[l]
        mask = plan.rec[l]
        gx = gemm.addmm(b, inp.reshape(T * B, -1), w_ih.t()).view(T, B, 3 * n)   # hoisted: W x + b
        H = x.new_empty(T + 1, B, n)
        H[0] = state[l]
        ring = 1 if not store else T
        HIN = x.new_empty(T, B, n) if (store and mask is not None) else None
        R, RH, CAND = (x.new_empty(ring, B, n) for _ in range(3))
        A1, A2 = x.new_empty(ring, B, n), x.new_empty(ring, B, n)
        AZ = x.new_empty(T, B, n) if (store and plan.p != 1.0) else None
        w_zr, w_h = w_hh[:2 * n], w_hh[2 * n:]
        for t in range(T):
            i = t if store else 0
            h = H[t]
            h_in = h if mask is None else torch.mul(h, mask, out=HIN[t] if HIN is not None else None)
            gh = gemm.mm(h_in, w_zr.t())
            gh += gx[t, :, :2 * n]
            r = torch.sigmoid(gh[:, n:], out=R[i])
            rh = torch.mul(r, h_in, out=RH[i])
            pre = gemm.addmm(gx[t, :, 2 * n:], rh, w_h.t())
            cand = tanh_into(pre, CAND[i])
            a_z = gh[:, :n]
            if AZ is not None:
                AZ[t].copy_(a_z)
            a1, a2 = _gates(a_z, plan.p)
            A1[i].copy_(a1)
            A2[i].copy_(a2)
            torch.mul(a2, h, out=H[t + 1]).addcmul_(a1, cand)
        new_state.append(H[T].clone())
        if store:
            for k, v in zip(("X", "H", "HIN", "R", "RH", "CAND", "A", "A1", "A2"),
                            (inp, H, HIN, R, RH, CAND, AZ, A1, A2), strict=True):
                saved[k].append(v)
        inp = H[1:] if plan.between[l] is None else H[1:] * plan.between[l]
    out = saved["H"][-1][1:].transpose(0, 1) if store else H[1:].transpose(0, 1)
    return out.contiguous(), tuple(new_state), saved


def _backward(plan: _Plan, saved: dict, weights: list, d_out: Tensor | None, d_state: list[Tensor | None],
              B: int, T: int) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    d_params: list[Tensor] = [None] * (3 * plan.L)  # type: ignore[list-item]
    d_state0: list[Tensor] = [None] * plan.L  # type: ignore[list-item]
    d_above = d_out.transpose(0, 1) if d_out is not None else None   # [T, B, n]: d of this layer's output
    for l in reversed(range(plan.L)):
        n = plan.sizes[l]
        w_ih, w_hh, _ = weights[l]
        w_zr, w_h = w_hh[:2 * n], w_hh[2 * n:]
        mask = plan.rec[l]
        H, HIN, R, RH, CAND = (saved[k][l] for k in ("H", "HIN", "R", "RH", "CAND"))
        A, A1, A2 = saved["A"][l], saved["A1"][l], saved["A2"][l]
        DGX = H.new_empty(T, B, 3 * n)
        dh = d_state[l]
        for t in reversed(range(T)):
            if d_above is not None:
                dh = d_above[t] if dh is None else dh + d_above[t]
            if dh is None:
                dh = H.new_zeros(B, n)
            h, a1, a2, cand, r = H[t], A1[t], A2[t], CAND[t], R[t]
            h_in = h if mask is None else HIN[t]
            d_a1 = dh * cand
            d_cand = dh * a1
            dgx = DGX[t]
            # update gate: alpha1 = sigmoid(a), alpha2 = alpha2(a)
            torch.mul(d_a1, a1 * (1.0 - a1), out=dgx[:, :n])
            d_a2 = dh * h   # h_t = alpha1 * cand + alpha2 * h_{t-1}
            d_a2 *= _d_alpha2(A[t], a1, a2, plan.p) if A is not None else a1 * (a1 - 1.0)
            dgx[:, :n] += d_a2
            # candidate: d pre = d cand * (1 - cand^2)
            torch.mul(d_cand, 1.0 - cand * cand, out=dgx[:, 2 * n:])
            d_rh = gemm.mm(dgx[:, 2 * n:], w_h)
            torch.mul(d_rh * h_in, r * (1.0 - r), out=dgx[:, n:2 * n])
            d_hin = gemm.mm(dgx[:, :2 * n], w_zr)
            d_hin.addcmul_(d_rh, r)
            if mask is not None:
                d_hin.mul_(mask)
            dh = d_hin.addcmul_(dh, a2)
        d_state0[l] = dh
        dg = DGX.view(T * B, -1)
        X = saved["X"][l].reshape(T * B, -1)
        h_in_all = (HIN if mask is not None else H[:T]).reshape(T * B, n)
        d_wih = gemm.mm(dg.t(), X)
        d_whh = torch.cat((gemm.mm(dg[:, :2 * n].t(), h_in_all), gemm.mm(dg[:, 2 * n:].t(), RH.view(T * B, n))), 0)
        d_b = dg.sum(0)
        d_params[3 * l:3 * l + 3] = [d_wih, d_whh, d_b]
        d_x = gemm.mm(dg, w_ih).view(T, B, -1)
        if l > 0 and plan.between[l - 1] is not None:
            d_x = d_x * plan.between[l - 1]
        d_above = d_x
    return d_above.transpose(0, 1), d_state0, d_params


class GRUSequence(torch.autograd.Function):
    """``apply(plan, weights, x, *state, *params) -> (out, *new_state)`` with the hand-written backward."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, weights: list, x: Tensor, *flat: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        state = tuple(s.detach() for s in flat[:plan.L])
        out, new_state, saved = _forward(plan, x.detach(), state, weights, store=True)
        ctx.plan, ctx.weights, ctx.saved = plan, weights, saved
        ctx.save_for_backward(x, *flat[plan.L:])
        return (out, *new_state)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor | None, *d_state: Tensor | None) -> tuple[Tensor | None, ...]:
        x = ctx.saved_tensors[0]
        with gemm.compute(ctx.plan.gemm_dtype, x.device.type):
            d_x, d_state0, d_params = _backward(ctx.plan, ctx.saved, ctx.weights, d_out, list(d_state),
                                                x.shape[0], x.shape[1])
        return (None, None, d_x, *d_state0, *d_params)


def gru_forward(stack: Any, x: Tensor, state: State) -> tuple[Tensor, State]:
    """Fast ``PNormGRUStack.forward`` (same masks, same RNG draws as :meth:`forward_reference`)."""
    masks = stack.draw_masks(x.shape[0], x.device, x.dtype) if stack.training else None
    plan = _Plan(stack, masks)
    plan.gemm_dtype = gemm.autocast_dtype(x)   # bfloat16 GEMMs under autocast (see zoo.models._gemm)
    params = plan.params()
    with gemm.compute(plan.gemm_dtype, x.device.type):
        weights = _weights(plan, params)
        if needs_autograd(x, state, params):
            res = GRUSequence.apply(plan, weights, x, *state, *params)
            return res[0], tuple(res[1:])
        with torch.no_grad():
            out, new_state, _ = _forward(plan, x, state, weights, store=False)
    return out, new_state
