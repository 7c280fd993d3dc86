"""The training loss fused with the decoder: ``cross_entropy(h @ W^T + b, y)`` a block of rows at a time.

Why: at the zoo's sizes the decoder is the largest GEMM of a training step (PTB: ``[1400, 256] x [256, 10000]``
per batch; WikiText-2: ``x [256, 33278]``, ~75% of a step's time on one core) and its loss touches the
``[rows, vocab]`` logits several times (GEMM out, log-softmax, its backward, the two backward GEMMs in).
Materialised whole in float32, those logits (56 MB for PTB, 186 MB for WikiText-2) stream through memory each
time. Here a block of ``CHUNK`` rows is decoded, soft-maxed and turned into its gradient
``(softmax - onehot) / n`` while it is still in cache, and only the gradients w.r.t. ``h``, ``W`` and ``b`` are
kept for the backward, which just scales them by the incoming gradient. Same arithmetic as
``F.cross_entropy(F.linear(h, W, b), y, ignore_index=...)`` up to float summation order (tested to 1e-5).

The softmax takes one exponential per logit: ``exp(z - max)`` in place, its row sum gives both the
log-sum-exp (the loss) and the normaliser (the gradient).

Precision: the GEMMs go through :mod:`zoo.models._gemm` (bf16 under bf16 autocast), while the logits, the
log-sum-exp, the loss and the softmax stay float32 (better than autocast's own bf16 logits). The two backward
GEMMs differ by precision:

* **float32**: per block, ``dh`` into its rows and ``dW += block^T h`` accumulated in place (``addmm_``).
* **bf16**: the block's gradient is written once, in bf16, into a ``[rows, vocab]`` buffer (what the backward
  GEMMs would cast it to anyway), and after the last block ``dh = G W`` and ``dW = G^T h`` are two whole-batch
  bf16 GEMMs. Per block that saves casting the gradient twice (once transposed), a ``[vocab, E]`` float32
  product and its addition into ``dW``: for WikiText-2, eleven 34 MB products per step. Measured
  (``benchmarks/fused_loss.py``, one core): the decoder + loss in 0.73x the time of the per-block version at
  the WikiText-2 tier's shape, 0.81x at the PTB tier's. The buffer holds half of the float32 logits' bytes
  (93 MB at WikiText-2's 1400 x 33,278).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from zoo.models import _gemm as gemm

#: Vocabulary entries decoded at a time by :func:`linear_target_logprobs` (evaluation, float32): on one core, 512
#: to 4096 were within 5% of each other at [700, 256] x [256, 33278], each ~1.5x the whole-vocabulary GEMM's speed
#: (process CPU time, interleaved, while two training runs held the cores).
EVAL_BLOCK = 1024
#: ... and only when a call's logits would be at least this many floats (8 MB): smaller ones stay in cache and the
#: whole GEMM is as fast or faster (measured fused: 700 rows of PTB's 10,000 words in 0.94x the time, 70 rows in
#: 1.06x; 70 rows of WikiText-2's 33,278 in 0.79-0.83x, 700 in 0.58-0.68x; benchmarks/results/eval_speed.md).
EVAL_MIN_LOGITS = 1 << 21

#: Rows decoded at a time: 128 x 10k float32 logits (5 MB) stay in cache; measured fastest of 128-1400 with the
#: per-block backward GEMMs (kept: the block's passes are the same, and 17 MB at 33k words is still L3-sized).
CHUNK = 128


def _softmax_grad_(z: Tensor, yc: Tensor, kc: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Turn the logits block ``z [C, V]`` (float32, in place) into ``exp(z - max)`` with the target entries
    lowered by the row sum, and return ``(row_scale [C, 1], loss_sum)`` such that
    ``z * row_scale`` is d(mean loss)/d(logits) (0 on ignored rows) and ``loss_sum`` the block's summed loss."""
    rows = torch.arange(z.shape[0], device=z.device)
    m = z.amax(1, keepdim=True)
    zy = z[rows, yc]
    z.sub_(m).exp_()
    s = z.sum(1)
    loss_sum = ((m.squeeze(1) + s.log() - zy) * kc).sum(dtype=torch.float64)
    z[rows, yc] -= s                                   # softmax - onehot, times s
    return (kc.to(z.dtype) / (n * s))[:, None], loss_sum


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, b: Tensor | None, y: Tensor, ignore_index: int,  # type: ignore[override]
                dtype: torch.dtype | None) -> Tensor:
        with gemm.compute(dtype, h.device.type):
            n_rows, n_vocab = h.shape[0], w.shape[0]
            keep = y != ignore_index
            n = int(keep.sum())
            total = torch.zeros((), dtype=torch.float64, device=h.device)
            gb = torch.zeros_like(b) if b is not None else None
            if not n:
                gh, gw = torch.zeros_like(h), torch.zeros_like(w)
            else:
                bias = b if b is not None else h.new_zeros(())
                low = gemm.current()
                wl, hl = gemm.lowp(w), gemm.lowp(h)
                z_buf = torch.empty((min(CHUNK, n_rows), n_vocab), dtype=torch.float32, device=h.device)
                if low is None:
                    gh, gw = torch.empty_like(h), torch.zeros_like(w)
                else:
                    grad = torch.empty((n_rows, n_vocab), dtype=low, device=h.device)
                for s in range(0, n_rows, CHUNK):
                    hc, yc, kc = hl[s:s + CHUNK], y[s:s + CHUNK], keep[s:s + CHUNK]
                    yc = yc.masked_fill(~kc, 0)
                    z = z_buf[:hc.shape[0]]
                    gemm.addmm(bias, hc, wl.t(), out=z)                          # logits [C, V], float32
                    scale, loss_sum = _softmax_grad_(z, yc, kc, n)
                    total += loss_sum
                    if gb is not None:
                        gb.add_(torch.mv(z.t(), scale.squeeze(1)))
                    if low is None:
                        z.mul_(scale)
                        torch.mm(z, w, out=gh[s:s + CHUNK])
                        gw.addmm_(z.t(), hc)
                    else:
                        torch.mul(z, scale, out=grad[s:s + CHUNK])             # rounded once, to bf16
                if low is not None:
                    gh = torch.mm(grad, wl).float()
                    gw = torch.mm(grad.t(), hl).float()
                    del grad
        ctx.save_for_backward(gh, gw, *([gb] if gb is not None else []))
        ctx.has_bias = gb is not None
        return (total / max(n, 1)).to(h.dtype)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        gb = saved[2] * g if ctx.has_bias else None
        return saved[0] * g, saved[1] * g, gb, None, None, None


def linear_cross_entropy(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                         ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of ``h [N, E] @ weight.T + bias`` against ``target [N]`` over the targets that are not
    ``ignore_index``, without keeping the float32 logits (see the module docstring)."""
    return _LinearCrossEntropy.apply(h, weight, bias, target, ignore_index, gemm.autocast_dtype(h))


def linear_target_logprobs(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                           block: int = EVAL_BLOCK) -> Tensor:
    """``log_softmax(h @ weight.T + bias)[n, target[n]]`` for each row ``n`` (float32), without the logits.

    Why: scoring and validation need only each target's log-probability, but decoding first writes all the
    ``[N, vocab]`` float32 logits (93 MB for 700 rows of WikiText-2's vocabulary) and the log-softmax reads them
    again; on one CPU core the whole-vocabulary GEMM also runs at about two-thirds of the speed of the same GEMM
    in vocabulary blocks. Here each block of ``block`` words is decoded into a buffer that stays in cache and
    folded into a running log-sum-exp (the row's max so far and its sum of ``exp(z - max)``); the target's logit
    is read from its block before the exponential, so it is one of the terms of the sum and a log-probability
    is never above 0. Same numbers as the decode-then-log-softmax path up to float summation order (tested to
    1e-5). No gradient: evaluation only. Targets outside ``[0, vocab)`` (padding) give values to be masked.
    """
    n, vocab = h.shape[0], weight.shape[0]
    y = target.clamp(0, vocab - 1)
    run_max = h.new_full((n,), -math.inf)
    run_sum = h.new_zeros(n)
    z_y = h.new_zeros(n)
    buf = h.new_empty(n, min(block, vocab))
    for start in range(0, vocab, block):
        stop = min(start + block, vocab)
        z = buf[:, :stop - start]
        if bias is not None:
            torch.addmm(bias[start:stop], h, weight[start:stop].t(), out=z)
        else:
            torch.mm(h, weight[start:stop].t(), out=z)
        rows = ((y >= start) & (y < stop)).nonzero().squeeze(1)
        z_y[rows] = z[rows, y[rows] - start]
        new_max = torch.maximum(run_max, z.amax(1))
        run_sum.mul_((run_max - new_max).exp_()).add_(z.sub_(new_max[:, None]).exp_().sum(1))
        run_max = new_max
    return z_y - run_max - run_sum.log()


def logits_target_logprobs(logits: Tensor, target: Tensor) -> Tensor:
    """``log_softmax(logits)`` (in float32) at each ``target`` (same shape as ``logits`` less its last dimension):
    the unfused path, for logits already decoded. Targets outside the vocabulary (padding) give values to mask."""
    target = target.to(logits.device).clamp(0, logits.shape[-1] - 1)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, target[..., None]).squeeze(-1)
