"""The GEMMs of the fast sequence paths, in the compute precision of the call (float32 or bfloat16).

Why a module of its own: the fused paths (``_alstm_fast``, ``_hyper_fast``, ``_gru_fast``) are written
against preallocated float32 buffers with ``out=`` GEMMs and a hand-written backward, none of which
``torch.autocast`` can rewrite (autocast skips ``out=`` ops and does not reach a custom backward reliably).
So the paths call these functions instead of ``torch.mm`` & co., and the precision is chosen once per call:

* **float32** (the default; no autocast): each function is exactly the ``torch`` op it wraps, so results are
  bit-identical to calling the op directly.
* **low precision** (the fast path is entered under ``torch.autocast(device, dtype=torch.bfloat16)``, which is
  what ``precision = "bf16"`` sets up, see :mod:`zoo.precision`): both GEMM operands are cast to bfloat16, the
  product is computed by the bf16 kernel (oneDNN / cuBLAS accumulate in float32) and its bf16 result is
  widened into the float32 output. Everything else stays float32: bias additions, gate nonlinearities, the
  cell and hidden states carried between steps, the buffers the backward reads, the weight gradients handed to
  the optimiser. Weights are cast once per call (:func:`lowp`), activations per GEMM (or once, with
  :func:`lowp`, where one activation feeds several GEMMs).

The choice is made by :func:`autocast_dtype` on entry and pinned for the forward and the backward of the call
with :func:`compute` (which also switches autocast off inside, so that nothing but these functions changes
precision).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

_local = threading.local()


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The low-precision GEMM dtype a fast path entered with ``x`` should use: autocast's dtype when autocast is
    on for ``x``'s device and ``x`` is float32, else ``None`` (plain float32)."""
    dev = x.device.type
    if x.dtype != torch.float32 or not torch.is_autocast_enabled(dev):
        return None
    dt = torch.get_autocast_dtype(dev)
    return dt if dt in (torch.bfloat16, torch.float16) else None


def current() -> torch.dtype | None:
    """The GEMM dtype of the innermost :func:`compute` block (``None``: float32)."""
    return getattr(_local, "dtype", None)


@contextlib.contextmanager
def compute(dtype: torch.dtype | None, device_type: str) -> Iterator[None]:
    """Run a fast path's body with its GEMMs in ``dtype`` (``None``: float32) and autocast off."""
    previous = current()
    _local.dtype = dtype
    try:
        if dtype is None and not torch.is_autocast_enabled(device_type):
            yield
        else:
            with torch.autocast(device_type, enabled=False):
                yield
    finally:
        _local.dtype = previous


def lowp(w: Tensor) -> Tensor:
    """``w`` in the current GEMM dtype (a weight, or an activation that feeds several GEMMs: cast once per call);
    unchanged in float32."""
    dt = current()
    return w if dt is None or w.dtype == dt else w.to(dt)


def _c(t: Tensor, dt: torch.dtype) -> Tensor:
    return t if t.dtype == dt else t.to(dt)


def mm(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``a @ b`` (2-D), float32 out."""
    dt = current()
    if dt is None:
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    r = torch.mm(_c(a, dt), _c(b, dt))
    return r.float() if out is None else out.copy_(r)


def addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta: float = 1.0, alpha: float = 1.0,
          out: Tensor | None = None) -> Tensor:
    """``beta * bias + alpha * (a @ b)``, float32 out (the bias is added in float32)."""
    dt = current()
    if dt is None:
        if out is None:
            return torch.addmm(bias, a, b, beta=beta, alpha=alpha)
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=out)
    r = torch.mm(_c(a, dt), _c(b, dt))
    if out is None:
        out = torch.empty(r.shape, dtype=torch.float32, device=r.device)
    if beta == 0:
        return torch.mul(r, alpha, out=out)
    bias = bias if beta == 1 else bias * beta
    return torch.add(bias, r, alpha=alpha, out=out)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """Batched ``a @ b``, float32 out."""
    dt = current()
    if dt is None:
        return torch.bmm(a, b)
    return torch.bmm(_c(a, dt), _c(b, dt)).float()


def baddbmm(bias: Tensor, a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """``bias + a @ b`` (batched) into the float32 ``out``."""
    dt = current()
    if dt is None:
        return torch.baddbmm(bias, a, b, out=out)
    return torch.add(bias, torch.bmm(_c(a, dt), _c(b, dt)), out=out)
