"""Fast sequence path of :class:`zoo.models.hyperlstm.HyperLSTMStack`: one autograd node per forward call.

Layers run layer-major (no state flows down the stack), so everything a layer computes from its input
sequence is hoisted out of the time loop as one GEMM over ``T * B`` rows: the main ``W_x x`` (the
HyperLSTM scales it on the output side only, ``d_x * (W_x x)``) and the x-columns of the hyper cell's
input projection. Per step remain: one GEMM for the hyper cell (``[h; h^_{t-1}]`` against its h- and
recurrent weights, concatenated), one for ``z`` (all 12 embeddings of the 8 scaling and 4 bias blocks),
one batched GEMM for ``d`` and ``beta`` (``[12, B, N_z] x [12, N_z, H]``, with the static bias folded
into the 4 beta slots) and the main ``W_h h``. The hand-written backward does the transposed GEMMs per
step and batches every weight and input gradient over the segment. Gate tensors are kept gate-major
(``[4, B, n]``) so that each gate is a contiguous ``[B, n]`` block.

In eval mode on the CPU (float32) the no-grad forward runs the same loop compiled
(``csrc/hyper_infer.cpp``, built once by :mod:`zoo.models._compiled`), else :func:`_forward` without storage.

Every GEMM goes through :mod:`zoo.models._gemm`: float32 by default, bfloat16 when the call is entered
under bf16 autocast (``precision = "bf16"``), with everything else kept in float32.

Layer norm (optional) uses ``native_layer_norm`` and its backward; the per-step candidate dropout uses
masks drawn up front in the reference's order (step-major, hyper cell before main cell), so the RNG
stream, and therefore the result, equals :meth:`RecurrentStack.forward_reference`. The run-time forget
bias is folded into the bias (or the LN beta) of the forget block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from zoo.models import _compiled
from zoo.models import _gemm as gemm
from zoo.models._fused import needs_autograd, tanh_into
from zoo.models.base import State

LN_EPS = 1e-3


class _CellSpec:
    """One supercell LSTM (main or hyper): size, LN parameters (forget bias folded in), dropout rate."""

    def __init__(self, n: int, ln: tuple[Tensor, Tensor, Tensor, Tensor] | None, p_drop: float) -> None:
        self.n, self.p_drop = n, p_drop
        self.ln = ln   # (gamma4 [4,1,n], beta4_eff [4,1,n], gamma_c [n], beta_c [n]) or None


class _LayerW:
    """Derived weights of one layer for one call."""

    def __init__(self, cell: Any, p: list[Tensor], nin: int) -> None:
        n, nh, nz = cell.hidden_size, cell.hyper_size, cell.hyper_embedding_size
        ln = cell.use_layer_norm
        k = 7 if ln else 3
        main, hyper, net = p[:k], p[k:2 * k], p[2 * k:]
        self.w_xh, self.w_hh = main[0], main[1]
        fb, fb_hat = cell.forget_bias, cell.hyper.forget_bias
        bias = main[2].clone()
        b_hat = hyper[2].clone()
        if ln:
            beta4 = main[4].clone().view(4, 1, n)
            beta4[2] += fb
            self.main = _CellSpec(n, (main[3].view(4, 1, n), beta4, main[5], main[6]), cell.recurrent_dropout)
            beta4h = hyper[4].clone().view(4, 1, nh)
            beta4h[2] += fb_hat
            self.hyper = _CellSpec(nh, (hyper[3].view(4, 1, nh), beta4h, hyper[5], hyper[6]),
                                   cell.hyper.recurrent_dropout)
        else:
            bias.view(4, n)[2] += fb
            b_hat.view(4, nh)[2] += fb_hat
            self.main = _CellSpec(n, None, cell.recurrent_dropout)
            self.hyper = _CellSpec(nh, None, cell.hyper.recurrent_dropout)
        self.whx = hyper[0][:, :nin]                                       # hyper x-columns (hoisted)
        self.wh = torch.cat((hyper[0][:, nin:], hyper[1]), 1)              # [4nh, n + nh]: [h; h^] columns
        self.b_hat = b_hat
        zw, zw_b, alpha, zb, beta = net
        self.zw = torch.cat((zw.flatten(0, 1), zb.flatten(0, 1)), 0)       # [12 nz, nh]
        self.zw_b = torch.cat((zw_b.flatten(), zw_b.new_zeros(4 * nz)))
        self.ab = torch.cat((alpha, beta), 0).transpose(1, 2).contiguous()  # [12, nz, n]
        self.c12 = bias.new_zeros(12, 1, n)                                # the static bias in the beta slots
        self.c12[8:] = bias.view(4, 1, n)
        self.n, self.nh, self.nz, self.nin, self.k = n, nh, nz, nin, k
        # GEMM-only weights in the call's GEMM dtype (unchanged in float32; see zoo.models._gemm)
        self.w_xh, self.w_hh, self.whx, self.wh, self.zw, self.ab = (
            gemm.lowp(t) for t in (self.w_xh, self.w_hh, self.whx, self.wh, self.zw, self.ab))


def _supercell_fwd(pre4: Tensor, c_prev: Tensor, spec: _CellSpec, mask: Tensor | None, act: Tensor,
                   c_out: Tensor, tc: Tensor, h_out: Tensor) -> tuple | None:
    """supercell ``cell_update`` on gate-major pre-activations ``pre4 [4, B, n]`` (forget bias folded in).

    Writes gate activations (slot 1 = ``tanh(j)``, undropped) into ``act``, ``c`` into ``c_out``,
    ``tanh([LN] c)`` into ``tc`` and ``h`` into ``h_out``; returns the LN statistics for the backward.
    """
    stats = None
    y = pre4
    if spec.ln is not None:
        gamma4, beta4, gc, bc = spec.ln
        xhat, mean, rstd = torch.native_layer_norm(pre4, [spec.n], None, None, LN_EPS)
        y = torch.addcmul(beta4, xhat, gamma4)
    torch.sigmoid(y, out=act)
    g = tanh_into(y[1], act[1])
    if mask is not None:
        g = g * mask
    torch.mul(act[2], c_prev, out=c_out)
    c_out.addcmul_(act[0], g)
    if spec.ln is not None:
        c_ln, c_mean, c_rstd = torch.native_layer_norm(c_out, [spec.n], gc, bc, LN_EPS)
        tanh_into(c_ln, tc)
        stats = (pre4.contiguous(), xhat, mean, rstd, c_mean, c_rstd)
    else:
        tanh_into(c_out, tc)
    torch.mul(act[3], tc, out=h_out)
    return stats


def _supercell_bwd(act: Tensor, c_prev: Tensor, c: Tensor, tc: Tensor, spec: _CellSpec, mask: Tensor | None,
                   stats: tuple | None, dh: Tensor, dc: Tensor | None, d_ln: list[Tensor] | None,
                   d_pre4: Tensor) -> Tensor:
    """Backward of :func:`_supercell_fwd`: writes ``d pre4`` and returns ``d c_prev``; accumulates the LN
    parameter gradients into ``d_ln`` (``[d gamma4, d beta4, d gamma_c, d beta_c]``)."""
    i, g, f, o = act[0], act[1], act[2], act[3]
    dy = d_pre4                                   # first d of the post-LN gates, then d of pre4
    torch.mul(dh, tc, out=dy[3])
    dy[3].mul_(o - o * o)
    d_c = dh * o
    d_c.sub_(d_c * tc * tc)                       # d of [LN] c
    if stats is not None:
        _, _, _, _, c_mean, c_rstd = stats
        d_c, d_gc, d_bc = torch.ops.aten.native_layer_norm_backward(d_c, c, [spec.n], c_mean, c_rstd, spec.ln[2],
                                                                     spec.ln[3], [True, True, True])
        d_ln[2] += d_gc
        d_ln[3] += d_bc
    if dc is not None:
        d_c += dc
    gd = g * mask if mask is not None else g
    torch.mul(d_c, c_prev, out=dy[2])
    dy[2].mul_(f - f * f)
    torch.mul(d_c, gd, out=dy[0])
    dy[0].mul_(i - i * i)
    torch.mul(d_c, i, out=dy[1])
    if mask is not None:
        dy[1].mul_(mask)
    dy[1].mul_(1.0 - g * g)
    if stats is not None:
        pre4, xhat, mean, rstd, _, _ = stats
        d_ln[0] += (dy * xhat).sum(1, keepdim=True)
        d_ln[1] += dy.sum(1, keepdim=True)
        d_in = torch.ops.aten.native_layer_norm_backward(dy * spec.ln[0], pre4, [spec.n], mean, rstd, None, None,
                                                         [True, False, False])[0]
        d_pre4.copy_(d_in)
    return d_c.mul_(f)


def _draw_step_masks(plan: _Plan, B: int, T: int, like: Tensor) -> tuple[list, list]:
    """Per-step candidate-dropout masks in the reference's RNG order (step-major, hyper then main)."""
    main: list[list[Tensor | None]] = [[None] * T for _ in range(plan.L)]
    hyper: list[list[Tensor | None]] = [[None] * T for _ in range(plan.L)]
    if not plan.train_dropout:
        return main, hyper
    for t in range(T):
        for l, cell in enumerate(plan.cells):
            for store, p, n in ((hyper, cell.hyper.recurrent_dropout, cell.hyper_size),
                                (main, cell.recurrent_dropout, cell.hidden_size)):
                if p > 0:   # F.dropout: empty_like(g).bernoulli_(1 - p).div_(1 - p)
                    store[l][t] = like.new_empty(B, n).bernoulli_(1 - p).div_(1 - p)
    return main, hyper


class _Plan:
    def __init__(self, stack: Any, masks: Any, training: bool) -> None:
        self.L = stack.num_layers
        self.cells = list(stack.layers)
        self.sizes = list(stack.sizes)
        self.ins = [stack.input_size] + self.sizes[:-1]
        self.rec = list(masks.recurrent) if masks is not None else [None] * self.L
        self.between = list(masks.between) + [None] if masks is not None else [None] * self.L
        self.train_dropout = masks is not None and training
        self.gemm_dtype: torch.dtype | None = None   # set per call: the GEMMs' precision (zoo.models._gemm)

    def layer_params(self, l: int) -> list[Tensor]:
        c = self.cells[l]
        ln = ["ln_gamma", "ln_beta", "ln_c_gamma", "ln_c_beta"] if c.use_layer_norm else []
        main = [getattr(c, k) for k in ["weight_xh", "weight_hh", "bias", *ln]]
        hyper = [getattr(c.hyper, k) for k in ["weight_xh", "weight_hh", "bias", *ln]]
        return main + hyper + [c.hyper_zw_weight, c.hyper_zw_bias, c.hyper_alpha, c.hyper_zb_weight, c.hyper_beta]

    def params(self) -> list[Tensor]:
        return [p for l in range(self.L) for p in self.layer_params(l)]


def _derived(plan: _Plan) -> list[_LayerW]:
    with torch.no_grad():
        return [_LayerW(c, [p.detach() for p in plan.layer_params(l)], plan.ins[l]) for l, c in enumerate(plan.cells)]


def _forward(plan: _Plan, x: Tensor, state: State, weights: list[_LayerW], store: bool
             ) -> tuple[Tensor, State, list[dict]]:
    B, T = x.shape[0], x.shape[1]
    m_main, m_hyper = _draw_step_masks(plan, B, T, x)
    inp = x.transpose(0, 1)                              # [T, B, n_in], time-major
    new_state: list[Tensor] = []
    saved: list[dict] = []
    for l in range(plan.L):
        w = weights[l]
        n, nh, nz = w.n, w.nh, w.nz
        R = T if store else 1
        Xf = inp.reshape(T * B, -1)
        WX = gemm.mm(Xf, w.w_xh.t()).view(T, B, 4 * n)                 # hoisted main W_x x
        HX = gemm.addmm(w.b_hat, Xf, w.whx.t()).view(T, B, 4 * nh)      # hoisted hyper x-part + bias
        new = x.new_empty
        H, C, CH = new(T + 1, B, n), new(T + 1, B, n), new(T + 1, B, nh)
        V = new(T + 1, B, n + nh)                                        # [h_m | h^_{t-1}] per step
        H[0], C[0] = state[4 * l], state[4 * l + 1]
        V[0, :, n:], CH[0] = state[4 * l + 2], state[4 * l + 3]
        ACTH, TCH = new(R, 4, B, nh), new(R, B, nh)
        Z, S, WH = new(R, B, 12 * nz), new(R, 12, B, n), new(R, B, 4 * n)
        ACT, TC = new(R, 4, B, n), new(R, B, n)
        st_h: list = [None] * T
        st_m: list = [None] * T
        mask = plan.rec[l]
        for t in range(T):
            i = t if store else 0
            Vt = V[t]
            if mask is not None:
                torch.mul(H[t], mask, out=Vt[:, :n])
            else:
                Vt[:, :n].copy_(H[t])
            # hyper cell (Eq. 10)
            pre_h = gemm.addmm(HX[t], Vt, w.wh.t()).view(B, 4, nh).transpose(0, 1)
            st_h[t] = _supercell_fwd(pre_h, CH[t], w.hyper, m_hyper[l][t], ACTH[i], CH[t + 1], TCH[i],
                                     V[t + 1][:, n:])
            # z, then d and beta (with the static bias) for the 12 blocks (Eqs. 11-12)
            z = gemm.addmm(w.zw_b, V[t + 1][:, n:], w.zw.t(), out=Z[i])
            s = gemm.baddbmm(w.c12, z.view(B, 12, nz).transpose(0, 1), w.ab, out=S[i])
            wh = gemm.mm(Vt[:, :n], w.w_hh.t(), out=WH[i])
            pre = s[:4] * WX[t].view(B, 4, n).transpose(0, 1)
            pre.addcmul_(s[4:8], wh.view(B, 4, n).transpose(0, 1))
            pre += s[8:]
            st_m[t] = _supercell_fwd(pre, C[t], w.main, m_main[l][t], ACT[i], C[t + 1], TC[i], H[t + 1])
        new_state += [H[T].clone(), C[T].clone(), V[T, :, n:].clone(), CH[T].clone()]
        if store:
            saved.append(dict(X=inp, H=H, C=C, CH=CH, V=V, ACTH=ACTH, TCH=TCH, Z=Z, S=S, WH=WH, ACT=ACT, TC=TC,
                              WX=WX, st_h=st_h, st_m=st_m, m_main=m_main[l], m_hyper=m_hyper[l]))
        inp = H[1:] if plan.between[l] is None else H[1:] * plan.between[l]
    return H[1:].transpose(0, 1).contiguous(), tuple(new_state), saved


def _backward(plan: _Plan, saved: list[dict], weights: list[_LayerW], d_out: Tensor | None,
              d_state: list[Tensor | None], B: int, T: int) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    d_params: list[list[Tensor]] = [[] for _ in range(plan.L)]
    d_state0: list[Tensor] = []
    d_above = d_out.transpose(0, 1) if d_out is not None else None     # [T, B, n]
    for l in reversed(range(plan.L)):
        w, sv = weights[l], saved[l]
        n, nh, nz = w.n, w.nh, w.nz
        mask = plan.rec[l]
        H, C, CH, V = sv["H"], sv["C"], sv["CH"], sv["V"]
        zeros = H.new_zeros
        DPH = H.new_empty(T, B, 4 * nh)         # d hyper pre-activation
        DZ = H.new_empty(T, B, 12 * nz)         # d z
        DS = H.new_empty(12, T, B, n)           # d of the 12 d/beta slots
        DWX, DWH = H.new_empty(T, B, 4 * n), H.new_empty(T, B, 4 * n)
        d_ln_m = [zeros(4, 1, n), zeros(4, 1, n), zeros(n), zeros(n)] if w.main.ln is not None else None
        d_ln_h = [zeros(4, 1, nh), zeros(4, 1, nh), zeros(nh), zeros(nh)] if w.hyper.ln is not None else None
        dpre = H.new_empty(4, B, n)
        dpre_h = H.new_empty(4, B, nh)
        dh, dc, dhh, dch = d_state[4 * l:4 * l + 4]
        for t in reversed(range(T)):
            if d_above is not None:
                dh = d_above[t] if dh is None else dh + d_above[t]
            if dh is None:
                dh = zeros(B, n)
            dc = _supercell_bwd(sv["ACT"][t], C[t], C[t + 1], sv["TC"][t], w.main, sv["m_main"][t], sv["st_m"][t],
                                dh, dc, d_ln_m, dpre)
            s = sv["S"][t]
            ds = DS[:, t]
            torch.mul(dpre, sv["WX"][t].view(B, 4, n).transpose(0, 1), out=ds[:4])
            torch.mul(dpre, sv["WH"][t].view(B, 4, n).transpose(0, 1), out=ds[4:8])
            ds[8:].copy_(dpre)
            torch.mul(dpre, s[:4], out=DWX[t].view(B, 4, n).transpose(0, 1))
            torch.mul(dpre, s[4:8], out=DWH[t].view(B, 4, n).transpose(0, 1))
            d_hm = gemm.mm(DWH[t], w.w_hh)
            dz = DZ[t]
            dz.view(B, 12, nz).transpose(0, 1).copy_(gemm.bmm(ds, w.ab.transpose(1, 2)))
            d_hhat = gemm.mm(dz, w.zw)
            if dhh is not None:
                d_hhat += dhh
            dch = _supercell_bwd(sv["ACTH"][t], CH[t], CH[t + 1], sv["TCH"][t], w.hyper, sv["m_hyper"][t],
                                 sv["st_h"][t], d_hhat, dch, d_ln_h, dpre_h)
            DPH[t].view(B, 4, nh).transpose(0, 1).copy_(dpre_h)
            dv = gemm.mm(DPH[t], w.wh)
            d_hm += dv[:, :n]
            dhh = dv[:, n:]
            dh = d_hm.mul_(mask) if mask is not None else d_hm
        d_state0[0:0] = [dh, dc, dhh, dch]
        # batched gradients over the segment
        X = sv["X"].reshape(T * B, -1)
        dph, dwx, dwh = DPH.view(T * B, -1), DWX.view(T * B, -1), DWH.view(T * B, -1)
        Vf = V[:T].reshape(T * B, n + nh)
        d_wh = gemm.mm(dph.t(), Vf)
        main = [gemm.mm(dwx.t(), X), gemm.mm(dwh.t(), Vf[:, :n]), DS[8:].sum((1, 2)).flatten()]
        hyper = [torch.cat((gemm.mm(dph.t(), X), d_wh[:, :n]), 1), d_wh[:, n:].contiguous(), dph.sum(0)]
        if d_ln_m is not None:
            main += [d_ln_m[0].flatten(), d_ln_m[1].flatten(), d_ln_m[2], d_ln_m[3]]
            hyper += [d_ln_h[0].flatten(), d_ln_h[1].flatten(), d_ln_h[2], d_ln_h[3]]
        dz_all = DZ.view(T * B, 12 * nz)
        d_zw_all = gemm.mm(dz_all.t(), V[1:].reshape(T * B, n + nh)[:, n:])           # [12 nz, nh]
        z_all = sv["Z"].view(T, B, 12, nz).permute(2, 0, 1, 3).reshape(12, T * B, nz)
        d_ab = gemm.bmm(DS.view(12, T * B, n).transpose(1, 2), z_all)       # [12, n, nz]
        net = [d_zw_all[:8 * nz].view(8, nz, nh), dz_all[:, :8 * nz].sum(0).view(8, nz), d_ab[:8],
               d_zw_all[8 * nz:].view(4, nz, nh), d_ab[8:]]
        d_params[l] = main + hyper + net
        d_x = gemm.mm(dwx, w.w_xh).add_(gemm.mm(dph, w.whx)).view(T, B, -1)
        if l > 0 and plan.between[l - 1] is not None:
            d_x = d_x * plan.between[l - 1]
        d_above = d_x
    return d_above.transpose(0, 1), d_state0, [d for dl in d_params for d in dl]


class HyperSequence(torch.autograd.Function):
    """``apply(plan, weights, x, *state, *params) -> (out, *new_state)`` with the hand-written backward."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, weights: list, x: Tensor, *flat: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        n_state = 4 * plan.L
        state = tuple(s.detach() for s in flat[:n_state])
        out, new_state, saved = _forward(plan, x.detach(), state, weights, store=True)
        ctx.plan, ctx.weights, ctx.saved_bufs = plan, weights, saved
        ctx.save_for_backward(x, *flat[n_state:])
        return (out, *new_state)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor | None, *d_state: Tensor | None) -> tuple[Tensor | None, ...]:
        x = ctx.saved_tensors[0]
        with gemm.compute(ctx.plan.gemm_dtype, x.device.type):
            d_x, d_state0, d_params = _backward(ctx.plan, ctx.saved_bufs, ctx.weights, d_out, list(d_state),
                                                x.shape[0], x.shape[1])
        return (None, None, d_x, *d_state0, *d_params)


def hyper_forward(stack: Any, x: Tensor, state: State) -> tuple[Tensor, State]:
    """Fast ``HyperLSTMStack.forward`` (same masks, same RNG draws as :meth:`forward_reference`)."""
    masks = stack.draw_masks(x.shape[0], x.device, x.dtype) if stack.training else None
    plan = _Plan(stack, masks, stack.training)
    plan.gemm_dtype = gemm.autocast_dtype(x)   # bfloat16 GEMMs under autocast (see zoo.models._gemm)
    params = plan.params()
    with gemm.compute(plan.gemm_dtype, x.device.type):
        if needs_autograd(x, state, params):
            weights = _derived(plan)
            res = HyperSequence.apply(plan, weights, x, *state, *params)
            return res[0], tuple(res[1:])
        with torch.no_grad():
            if (not stack.training and x.device.type == "cpu" and x.dtype == torch.float32
                    and plan.gemm_dtype is None):
                ext = _compiled.get("hyper_infer")
                if ext is not None:
                    cfg, flat_w = _compiled.cached_weights(stack, params, lambda: _compiled_weights(plan))
                    res = ext.hyper_infer(x, list(state), flat_w, cfg)
                    return res[0], tuple(res[1:])
            out, new_state, _ = _forward(plan, x, state, _derived(plan), store=False)
    return out, new_state


def _compiled_weights(plan: _Plan) -> tuple[list[int], list[Tensor]]:
    """The eval-mode C++ loop's sizes and weights, in the order ``csrc/hyper_infer.cpp`` lists them."""
    cfg: list[int] = []
    flat_w: list[Tensor] = []
    for w in _derived(plan):
        ln = w.main.ln is not None
        cfg += [w.nin, w.n, w.nh, w.nz, int(ln)]
        flat_w += [w.w_xh.detach(), w.w_hh.detach().t().contiguous(), w.whx.contiguous(), w.wh.t().contiguous(),
                   w.b_hat, w.zw.t().contiguous(), w.zw_b, w.ab, w.c12.contiguous()]
        for spec in (w.main, w.hyper):
            if spec.ln is None:
                flat_w.append(w.b_hat.new_empty(0))
            else:
                g4, b4, gc, bc = spec.ln
                flat_w.append(torch.cat((g4.reshape(4, -1), b4.reshape(4, -1), gc.view(1, -1), bc.view(1, -1)))
                              .detach().contiguous())
    return cfg, flat_w
