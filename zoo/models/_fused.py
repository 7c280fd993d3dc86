"""Shared pieces of the fast sequence paths (``_alstm_fast``, ``_hyper_fast``, ``_gru_fast``).

Why a sigmoid instead of ``tanh``: on this CPU build ``torch.tanh`` (SLEEF, 1-ulp) costs about seven
times ``torch.sigmoid`` per element, and the adaptive cells apply it to their largest per-step tensors
(the aLSTM policy ``tanh(W_pi z)`` is ``[B, 14 n_h]``). ``tanh(a) = 2 sigmoid(2a) - 1`` exactly, and the
factor 2 is folded into the weight rows that produce ``a``: scaling by a power of two is exact in
floating point, so the only difference from ``torch.tanh`` is the rounding of the final ``2 s - 1``
(absolute error below 2.5e-7 in float32, far inside the 1e-5 the tests demand).

LSTM gates with "doubled g rows" (used where the weight is small enough to copy once per call, the
aLSTM's adaptation LSTM): the pre-activation of the candidate block ``g`` (rows ``2n:3n`` of a
``[4n, ...]`` weight, PyTorch gate order i, f, g, o) arrives doubled, so ONE ``sigmoid`` over all four
blocks gives ``i, f, o`` and ``s_g`` with ``tanh(g) = 2 s_g - 1``. The backward then returns gradients
w.r.t. the *scaled* pre-activation (the g block carries ``tanh'(g) / 2``) and the weight gradients of the
g rows are doubled at the end (:func:`double_rows`), which again is exact. For the large main weights,
copying them every call would cost more than it saves, so there ``doubled=False``: the g block goes
through :func:`tanh_into` instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Below this many elements ``torch.tanh`` is cheaper than the 4 kernel launches of the sigmoid form.
TANH_VIA_SIGMOID_MIN = 8192


def needs_autograd(x: Tensor, state: tuple[Tensor, ...], params: list[Tensor]) -> bool:
    """Whether a fast path must record its autograd node, or may run the storage-free inference loop."""
    return torch.is_grad_enabled() and (x.requires_grad or any(s.requires_grad for s in state)
                                        or any(p.requires_grad for p in params))


def double_rows(w: Tensor, start: int, stop: int) -> Tensor:
    """A copy of ``w`` with rows ``start:stop`` multiplied by 2 (exact)."""
    w = w.clone()
    w[start:stop] *= 2
    return w


def tanh_into(x: Tensor, out: Tensor) -> Tensor:
    """``out = tanh(x)``, via ``2 sigmoid(2x) - 1`` for large tensors (see the module docstring)."""
    if x.numel() < TANH_VIA_SIGMOID_MIN:
        return torch.tanh(x, out=out)
    torch.mul(x, 2.0, out=out)
    return out.sigmoid_().mul_(2.0).sub_(1.0)


def tanh(x: Tensor) -> Tensor:
    """``tanh(x)`` as a new tensor, via the sigmoid form for large tensors."""
    if x.numel() < TANH_VIA_SIGMOID_MIN:
        return torch.tanh(x)
    return (x * 2.0).sigmoid_().mul_(2.0).sub_(1.0)


def lstm_gates_into(pre: Tensor, n: int, out: Tensor, doubled: bool) -> Tensor:
    """``[sig(i), sig(f), tanh(g), sig(o)]`` into ``out``; ``doubled``: the g block of ``pre`` is ``2 g``."""
    torch.sigmoid(pre, out=out)
    if doubled:
        out[:, 2 * n:3 * n].mul_(2.0).sub_(1.0)
    else:
        tanh_into(pre[:, 2 * n:3 * n], out[:, 2 * n:3 * n])
    return out


def lstm_cell_forward(act: Tensor, c_prev: Tensor, n: int, c_out: Tensor, tc_out: Tensor,
                      h_out: Tensor) -> None:
    """``c = f c_prev + i g``, ``tc = tanh(c)``, ``h = o tc`` written into the given buffers."""
    torch.mul(act[:, n:2 * n], c_prev, out=c_out)
    c_out.addcmul_(act[:, :n], act[:, 2 * n:3 * n])
    tanh_into(c_out, tc_out)
    torch.mul(act[:, 3 * n:], tc_out, out=h_out)


def lstm_cell_backward(act: Tensor, c_prev: Tensor, tc: Tensor, dh: Tensor, dc: Tensor | None, n: int,
                       d_pre: Tensor, doubled: bool) -> Tensor:
    """Backward of :func:`lstm_cell_forward` + :func:`lstm_gates_into`.

    Writes the gradient w.r.t. the pre-activation (g block doubled if ``doubled``) into ``d_pre`` and
    returns ``d c_prev``. ``dc`` is the gradient of ``c`` arriving from later steps (``None``: zero).
    """
    i, f, g, o = act[:, :n], act[:, n:2 * n], act[:, 2 * n:3 * n], act[:, 3 * n:]
    dc_tot = dh * o
    dc_tot.sub_(dc_tot * tc * tc)
    if dc is not None:
        dc_tot += dc
    torch.mul(dc_tot, g, out=d_pre[:, :n])
    torch.mul(dc_tot, c_prev, out=d_pre[:, n:2 * n])
    torch.mul(dc_tot, i, out=d_pre[:, 2 * n:3 * n])
    torch.mul(dh, tc, out=d_pre[:, 3 * n:])
    dsig = act - act * act                                  # sigmoid' for i, f, o
    torch.mul(g, g, out=dsig[:, 2 * n:3 * n])               # tanh'(g) = 1 - g^2, halved when doubled
    dsig[:, 2 * n:3 * n].sub_(1.0).mul_(-0.5 if doubled else -1.0)
    d_pre.mul_(dsig)
    return dc_tot.mul_(f)

