"""The p-norm gates of Pham et al. (alpha1^p + alpha2^p = 1), shared by the model and its fused kernel.

Its own module so that :mod:`zoo.models.pnorm_gru` and :mod:`zoo.models._gru_fast` both import it from below
instead of from each other.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

#: alpha1^p is clamped to at most ``1 - PNORM_EPS``. Why: d alpha2 / d alpha1 -> -inf as alpha1 -> 1,
#: and a saturated gate (alpha1 == 1.0 in floating point) would give log(0). In log space the
#: gradient w.r.t. the pre-activation stays bounded, so only this last step needs the clamp. The
#: price is a floor alpha2 >= PNORM_EPS^(1/p) (1e-6 for p = 2, 1e-3 for p = 4), reached only when
#: sigma(a)^p is within 1e-12 of 1; beyond it the gradient through alpha2 is zero.
PNORM_EPS = 1e-12


def pnorm_gates(a: Tensor, p: float) -> tuple[Tensor, Tensor]:
    """``(alpha1, alpha2)`` for update-gate pre-activations ``a``, with ``alpha1^p + alpha2^p = 1``.

    For ``p == 1`` this is the plain GRU formula, bit for bit. Otherwise it is computed in log space:
    ``log alpha1 = -softplus(-a)`` and ``log alpha2 = log(1 - alpha1^p) / p`` with
    ``log(1 - e^u) = log(-expm1(u))``, which stays accurate when ``alpha1^p`` is close to 1 (where
    ``log1p(-exp(u))`` would lose all digits), so forward and backward stay finite for saturated gates.
    """
    if p == 1.0:
        alpha1 = torch.sigmoid(a)
        return alpha1, 1.0 - alpha1
    dtype = a.dtype
    if dtype in (torch.float16, torch.bfloat16):  # 1/PNORM_EPS and the log-space terms need float32 range
        a = a.float()
    log_a1p = -p * F.softplus(-a)                              # p * log(alpha1) = log(alpha1^p) <= 0
    log_a1p = torch.clamp(log_a1p, max=math.log1p(-PNORM_EPS))  # alpha1^p <= 1 - eps
    alpha2 = torch.exp(torch.log(-torch.expm1(log_a1p)) / p)   # (1 - alpha1^p)^(1/p)
    return torch.sigmoid(a).to(dtype), alpha2.to(dtype)
