"""The training loss fused with the decoder: ``cross_entropy(h @ W^T + b, y)`` a block of rows at a time.

Why: at the zoo's sizes the decoder is the largest GEMM of a training step (PTB: ``[1400, 256] x [256, 10000]``
per batch) and its loss touches the ``[rows, vocab]`` logits four times (GEMM out, log-softmax, its backward, the
two backward GEMMs in). Materialised whole, those logits (56 MB for PTB, 186 MB for WikiText-2) stream through
memory each time; the decoder and its loss are ~45% of an LSTM step's and ~30% of an aLSTM step's profile on one
core. What blocking buys in speed depends on how busy the memory system is: from about even on a quiet machine
to ~1.1x with the other core training too (``benchmarks/precision.py``, "fused decoder + loss"); it always saves
the logits' memory, and under bf16 it keeps them float32. Here a block of
``CHUNK`` rows is decoded, soft-maxed, turned into its gradient ``(softmax - onehot) / n`` and pushed through
both backward GEMMs while it is still in cache, and only the gradients w.r.t. ``h``, ``W`` and ``b`` are kept
for the backward, which just scales them by the incoming gradient. Same arithmetic as
``F.cross_entropy(F.linear(h, W, b), y, ignore_index=...)`` up to float summation order (tested to 1e-5).

Precision: the GEMMs go through :mod:`zoo.models._gemm` (bf16 under bf16 autocast), while the logits, the
log-sum-exp and the loss stay float32 (better than autocast's own bf16 logits).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zoo.models import _gemm as gemm

#: Rows decoded at a time: 128 x 10k float32 logits (5 MB) stay in cache; measured fastest of 128-1400.
CHUNK = 128


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, b: Tensor | None, y: Tensor, ignore_index: int,  # type: ignore[override]
                dtype: torch.dtype | None) -> Tensor:
        with gemm.compute(dtype, h.device.type):
            n_rows = h.shape[0]
            keep = y != ignore_index
            n = int(keep.sum())
            gh, gw = torch.zeros_like(h), torch.zeros_like(w)
            gb = torch.zeros_like(b) if b is not None else None
            total = torch.zeros((), dtype=torch.float64, device=h.device)
            if n:
                wl = gemm.lowp(w)
                bias = b if b is not None else h.new_zeros(())
                for s in range(0, n_rows, CHUNK):
                    hc, yc, kc = h[s:s + CHUNK], y[s:s + CHUNK], keep[s:s + CHUNK]
                    yc = yc.masked_fill(~kc, 0)
                    z = gemm.addmm(bias, hc, wl.t())                       # logits [C, V], float32
                    lse = torch.logsumexp(z, 1)
                    total += ((lse - z.gather(1, yc[:, None]).squeeze(1)) * kc).sum(dtype=torch.float64)
                    z.sub_(lse[:, None]).exp_()                            # softmax, in place
                    z[torch.arange(z.shape[0], device=z.device), yc] -= 1.0
                    z.mul_((kc.to(z.dtype) / n)[:, None])                  # d mean-loss / d logits (0: ignored)
                    gemm.mm(z, wl, out=gh[s:s + CHUNK])
                    gw.add_(gemm.mm(z.t(), hc))
                    if gb is not None:
                        gb.add_(z.sum(0))
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
    ``ignore_index``, without keeping the logits (see the module docstring)."""
    return _LinearCrossEntropy.apply(h, weight, bias, target, ignore_index, gemm.autocast_dtype(h))
